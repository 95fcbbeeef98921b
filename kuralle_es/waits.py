"""Waits: how a run suspends for a human or an outside system, and how a
delivery to a paused run is checked and accepted (internal).

Suspending raises ``SuspendError`` carrying a typed ``Wait``; the turn
catches it, pauses the run and ends cleanly. Re-suspending on the same wait
keeps its ``request_id`` and deadline, so a supervisor's pending link stays
valid. A delivery is checked in the order README.md gives (duplicate, match,
deadline, payload); every refusal raises before anything is written.
Acceptance only triggers events; the turn saves them with its lease in one
compare-and-set, so of two racing identical deliveries exactly one is stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Any, NoReturn
from uuid import uuid4

from eventsourcing.utils import get_topic, resolve_topic
from pydantic import BaseModel, ValidationError

from .cursor import Site
from .domain import CANCELLED, Run
from .errors import (
    InvalidArgumentError,
    InvalidSignalError,
    KuralleError,
    SignalMismatchError,
)
from .journal import Journal, utcnow
from .keys import canonical_json, plain_json_problem, sha256_hex
from .models import ApprovalDecision, FrozenOperation, SignalDelivery
from .tools import encode_json
from .usage import Budget
from .waiting import Wait

__all__ = [
    "APPROVAL",
    "APPROVAL_LANE",
    "BUDGET",
    "BUDGET_LANE",
    "DEADLINE_DENY",
    "INPUT",
    "IN_DOUBT",
    "TIMER",
    "Duplicate",
    "Schemas",
    "accept",
    "approval_decision",
    "check",
    "frozen_operation",
    "is_deadline_deny",
    "suspend",
    "validate_payload",
]

APPROVAL = "__approval"
#: The approval a run waits for before a model call past its budget.
BUDGET = "__budget"
IN_DOUBT = "__in_doubt"
INPUT = "__input"
#: The wait of a run paused on a durable sleep (``ctx.sleep``); nothing is delivered to it.
TIMER = "__timer"
#: The journal lane of a tool's approval (beside the tool's own step).
APPROVAL_LANE = "!approval"
#: The journal lane of a budget approval (beside the model step it lets start).
BUDGET_LANE = "!budget"
#: What the deadline sweeper delivers to a wait whose deadline passed.
DEADLINE_DENY: dict[str, Any] = {
    "approved": False,
    "denied": True,
    "by": "deadline",
    "reason": "deadline-expired",
}


class Schemas:
    """Payload schemas of ``ctx.signal`` seen by one runtime, by topic.

    A delivery validates against the class the run suspended with, even one
    defined where ``resolve_topic`` can't reach (inside a function).
    """

    def __init__(self) -> None:
        self._by_topic: dict[str, type[BaseModel]] = {}

    def remember(self, schema: type[BaseModel]) -> str:
        topic = get_topic(schema)
        self._by_topic[topic] = schema
        return topic

    def find(self, topic: str | None) -> type[BaseModel] | None:
        """The schema of ``topic``, or None when it can be found neither here nor by import."""
        if not topic:
            return None
        schema = self._by_topic.get(topic)
        if schema is not None:
            return schema
        try:
            resolved = resolve_topic(topic)
        except Exception:
            # Not importable here: ctx.signal validates on re-execution instead.
            return None
        if isinstance(resolved, type) and issubclass(resolved, BaseModel):
            return resolved
        return None


def frozen_operation(tool_name: str, args: Any) -> FrozenOperation:
    return FrozenOperation(
        tool_name=tool_name, args=args, args_hash=sha256_hex(canonical_json(args))
    )


def _absolute(deadline: datetime | timedelta | float | None) -> datetime | None:
    if deadline is None:
        return None
    if isinstance(deadline, datetime):
        if deadline.tzinfo is None:
            msg = "deadline must be timezone-aware (e.g. datetime.now(UTC) + timedelta(...))"
            raise InvalidArgumentError(msg)
        return deadline.astimezone(UTC)
    if isinstance(deadline, timedelta):
        return utcnow() + deadline
    return utcnow() + timedelta(seconds=float(deadline))


def suspend(
    journal: Journal,
    site: Site,
    *,
    name: str,
    kind: str,
    title: str | None = None,
    description: str | None = None,
    deadline: datetime | timedelta | float | None = None,
    operation: FrozenOperation | None = None,
    step_index: int | None = None,
    schema: type[BaseModel] | None = None,
    schemas: Schemas | None = None,
) -> NoReturn:
    """Stop the turn until ``name`` is delivered for this site.

    The journal keeps the turn's first suspension: node code that catches
    this ``SuspendError`` and goes on gets it again at its next effect.
    """
    current = journal.waiting
    if current is not None and current.is_at(site.logical_run, site.callsite, name, site.lane):
        request_id = current.request_id
        absolute = current.deadline or _absolute(deadline)
    else:
        request_id = uuid4().hex
        absolute = _absolute(deadline)
    topic = None
    if schema is not None:
        topic = (schemas or Schemas()).remember(schema)
    wait = Wait(
        name=name,
        callsite=site.callsite,
        kind=kind,
        request_id=request_id,
        logical_run=site.logical_run,
        title=title,
        description=description,
        deadline=absolute,
        operation=operation,
        lane=site.lane,
        step_index=step_index,
        schema_topic=topic,
    )
    journal.suspend(wait)


def is_deadline_deny(payload: Any) -> bool:
    return isinstance(payload, Mapping) and dict(payload) == DEADLINE_DENY


def approval_decision(payload: Any) -> ApprovalDecision:
    """``ctx.approve()``'s answer, built from a validated approval payload."""
    data = dict(payload)
    return ApprovalDecision(
        approved=bool(data.pop("approved")),
        by=data.pop("by", None),
        reason=data.pop("reason", None),
        data=data,
    )


def validate_payload(wait: Wait, payload: Any, schemas: Schemas, *, from_sweeper: bool) -> Any:
    """The payload as it will be journaled, or ``InvalidSignalError`` naming the problem."""
    name = wait.name
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json")
    problem = plain_json_problem(payload)
    if problem is not None:
        msg = (
            f"the payload of signal {name!r} {problem}; send plain JSON data "
            "(string keys, finite numbers, valid Unicode)"
        )
        raise InvalidSignalError(name, msg)
    try:
        encode_json(payload, f"the payload of signal {name!r}")
    except (TypeError, KuralleError) as e:
        raise InvalidSignalError(name, f"{e}; send a JSON payload within the size bound") from None
    if from_sweeper:
        return payload
    if name == APPROVAL:
        _check_approval(payload)
    elif name == BUDGET:
        _check_approval(payload, BUDGET)
        _check_raise_to(payload.get("raise_to"))
    elif name == IN_DOUBT:
        _check_in_doubt(payload)
    else:
        schema = schemas.find(wait.schema_topic)
        if schema is not None:
            try:
                schema.model_validate(payload)
            except ValidationError as e:
                msg = (
                    f"payload of signal {name!r} fails {schema.__name__}: "
                    f"{e.errors(include_url=False)}; send a payload matching the schema"
                )
                raise InvalidSignalError(name, msg) from None
    return payload


def _check_approval(payload: Any, name: str = APPROVAL) -> None:
    if not isinstance(payload, Mapping) or not isinstance(payload.get("approved"), bool):
        msg = (
            f"an approval payload must be a mapping with a boolean 'approved' "
            f"(optional 'by', 'reason'), got {payload!r}"
        )
        raise InvalidSignalError(name, msg)
    for field in ("by", "reason"):
        value = payload.get(field)
        if value is not None and not isinstance(value, str):
            msg = f"approval field {field!r} must be a string or absent, got {value!r}"
            raise InvalidSignalError(name, msg)


def _check_raise_to(raise_to: Any) -> None:
    """A budget approval's ``raise_to``: absent, or new values of ``Budget`` limits."""
    if raise_to is None:
        return
    limits = set(Budget.model_fields) - {"on_exceed"}
    problem = None
    if not isinstance(raise_to, Mapping) or not raise_to:
        problem = f"must be a non-empty mapping of {sorted(limits)}"
    elif not set(raise_to) <= limits:
        problem = f"may only raise {sorted(limits)}, got {sorted(raise_to)}"
    else:
        try:
            Budget.model_validate(dict(raise_to))
        except ValidationError as e:
            problem = f"is not valid: {e.errors(include_url=False)}"
    if problem is not None:
        msg = f"the approval's 'raise_to' {problem}; e.g. {{'max_total_tokens': 20000}}"
        raise InvalidSignalError(BUDGET, msg)


def _check_in_doubt(payload: Any) -> None:
    action = payload.get("action") if isinstance(payload, Mapping) else None
    if action not in ("retry", "resolve", "fail"):
        msg = (
            "an in-doubt answer must be {'action': 'retry'}, "
            "{'action': 'resolve', 'result': ...} or {'action': 'fail', 'message': ...}; "
            f"got {payload!r}"
        )
        raise InvalidSignalError(IN_DOUBT, msg)
    if action == "resolve" and "result" not in payload:
        msg = "an in-doubt 'resolve' answer needs the 'result' to record"
        raise InvalidSignalError(IN_DOUBT, msg)


class Duplicate(Enum):
    """A delivery whose ``signal_id`` the run already has: a no-op."""

    DELIVERED = "delivered"


def is_duplicate(run: Run, delivery: SignalDelivery) -> bool:
    """Whether the run already has this delivery (its ``signal_id``): a no-op."""
    if not isinstance(delivery.signal_id, str) or not delivery.signal_id.strip():
        raise InvalidSignalError(
            delivery.name, "signal_id must be a non-empty string; give each delivery a stable id"
        )
    return delivery.signal_id in run.signal_ids


def _state_of(run: Run) -> str:
    """The run's status, with why it was aborted (a refusal says so clearly)."""
    if run.outcome and (run.status == "aborted" or run.outcome.startswith(CANCELLED)):
        return f"{run.status} ({run.outcome})"
    return run.status


def check(
    run: Run,
    delivery: SignalDelivery,
    now: datetime,
    schemas: Schemas,
    *,
    from_sweeper: bool = False,
) -> Any:
    """The payload to journal, ``Duplicate.DELIVERED``, or a refusal."""
    if is_duplicate(run, delivery):
        return Duplicate.DELIVERED
    wait = run.waiting
    if run.status != "paused" or wait is None:
        raise SignalMismatchError(
            run.run_id,
            f"run {run.run_id} is {_state_of(run)} and waits for no signal; "
            f"signal {delivery.name!r} was not delivered",
        )
    if wait.kind == "timer":
        until = wait.deadline.isoformat() if wait.deadline is not None else "its wake time"
        raise SignalMismatchError(
            run.run_id,
            f"run {run.run_id} sleeps on a durable timer until {until} and takes no "
            f"delivery; signal {delivery.name!r} was not delivered (fire_timers wakes it)",
        )
    if wait.kind == "input":
        raise SignalMismatchError(
            run.run_id,
            f"run {run.run_id} waits for input at a collect node, which is sent as text "
            f"(runtime.run(..., input=...)), not as a signal; signal {delivery.name!r} "
            "was not delivered",
        )
    if not _names_match(delivery.name, wait):
        raise SignalMismatchError(
            run.run_id,
            f"run {run.run_id} waits for {wait.name!r}, not {delivery.name!r}; "
            "deliver the signal it waits for",
        )
    if delivery.request_id is not None and delivery.request_id != wait.request_id:
        raise SignalMismatchError(
            run.run_id,
            f"request_id {delivery.request_id!r} does not match the pending request "
            f"{wait.request_id!r} of run {run.run_id}; read waiting_for again",
        )
    if wait.deadline is not None and not from_sweeper and now > wait.deadline:
        raise SignalMismatchError(
            run.run_id,
            f"signal {delivery.name!r} to run {run.run_id} expired before delivery "
            f"(deadline {wait.deadline.isoformat()}); the deadline sweeper will deny it",
        )
    return validate_payload(wait, delivery.payload, schemas, from_sweeper=from_sweeper)


def _names_match(name: str, wait: Wait) -> bool:
    """Whether a delivery named ``name`` is for ``wait``: its own name, or
    ``__approval`` for any approval (a budget's ``__budget`` too), so every way
    of approving (Python, CLI, dashboard, HTTP) answers every approval."""
    return name == wait.name or (name == APPROVAL and wait.kind == "approval")


def waits_for(run: Run, delivery: SignalDelivery) -> bool:
    """Whether a paused run's wait matches this delivery's name and request id."""
    wait = run.waiting
    return (
        run.status == "paused"
        and wait is not None
        and _names_match(delivery.name, wait)
        and delivery.request_id in (None, wait.request_id)
    )


async def accept(journal: Journal, run: Run, delivery: SignalDelivery, payload: Any) -> None:
    """Journal an accepted delivery: the payload and actor, and the wait's step.

    The wait's step is journaled through the funnel at the site that
    suspended, so re-executing the node finds the payload there.
    """
    wait = run.waiting
    assert wait is not None, "check() accepts deliveries to paused runs only"
    run.accept_signal(delivery.signal_id, delivery.name, payload, delivery.actor)
    if wait.name == IN_DOUBT and wait.step_index is not None:
        answer = dict(payload)
        if "action" not in answer:  # the deadline sweeper's deny
            answer = {"action": "fail", "message": str(answer.get("reason", "denied"))}
        journal.answer_in_doubt(wait.step_index, answer)
        await journal.persist()
        return
    if wait.name == BUDGET and payload.get("approved") and payload.get("raise_to"):
        run.raise_budget(dict(payload["raise_to"]))
    site = Site(wait.logical_run, wait.callsite, wait.lane)
    operation = wait.operation.model_dump(mode="json") if wait.operation else None
    await journal.record_value(
        site,
        kind=wait.kind,
        name=wait.name,
        key=site.key(wait.name),
        args={"operation": operation} if wait.lane == APPROVAL_LANE else None,
        make=lambda: payload,
    )
