"""Deliveries to a paused run: checked, in order, then accepted (internal).

A delivery is checked in the order docs/contract.md gives (duplicate, match,
deadline, payload); every refusal raises before anything is written.
Acceptance hands the run's writer the delivery and journals the wait's step
through the writer (``RunWriter.record_value``); the turn saves them with its lease in one
compare-and-set, so of two racing identical deliveries exactly one is
stored. ``approval_delivery`` is an approve or deny as the delivery it is,
so the approval's shape is written once (``Runtime.approve``, the dashboard,
the HTTP API).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any
from uuid import uuid4

from pydantic import BaseModel, ValidationError

from .._definitions.budget import Budget
from .._journal.json_data import encode_json, plain_json_problem
from .._journal.mail import receive_step
from .._journal.run import Run
from .._journal.sites import Effect, Lane, Site
from .._journal.wait import (
    APPROVAL,
    BUDGET,
    IN_DOUBT,
    IN_DOUBT_ACTIONS,
    ApprovalAnswer,
    InDoubtAnswer,
    Wait,
)
from ..errors import InvalidSignalError, KuralleError, SignalMismatchError
from ..shapes import SignalDelivery, StepKind
from .input_checks import check_id
from .suspensions import Schemas
from .writer import RunWriter

__all__ = [
    "EXPIRED",
    "IN_DOUBT_ACTIONS",
    "NO_RESULT",
    "accept",
    "approval_delivery",
    "check",
    "delivery_id",
    "in_doubt_delivery",
    "is_duplicate",
    "journal_payload",
    "take_message",
    "validate_payload",
    "waits_for",
]

#: The key of what a ``receive`` step records when its wait's deadline passed
#: (the deadline sweeper's deny), in place of a message.
EXPIRED = "deadline_expired"
#: ``in_doubt_delivery``'s "no result given" (a resolve may record None).
NO_RESULT: Any = object()


def journal_payload(name: str, payload: Any, what: str = "signal") -> Any:
    """A delivered payload (of a signal, or of a message: ``what``) as the journal
    will hold it: plain JSON within the size bound, a pydantic model dumped; else
    ``InvalidSignalError`` naming the problem."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json")
    problem = plain_json_problem(payload)
    if problem is not None:
        msg = (
            f"the payload of {what} {name!r} {problem}; send plain JSON data "
            "(string keys, finite numbers, valid Unicode)"
        )
        raise InvalidSignalError(name, msg)
    try:
        encode_json(payload, f"the payload of {what} {name!r}")
    except (TypeError, KuralleError) as e:
        raise InvalidSignalError(name, f"{e}; send a JSON payload within the size bound") from None
    return payload


def validate_payload(wait: Wait, payload: Any, schemas: Schemas, *, from_sweeper: bool) -> Any:
    """The payload as it will be journaled, or ``InvalidSignalError`` naming the problem."""
    name = wait.name
    what = "message" if wait.kind == "message" else "signal"
    payload = journal_payload(name, payload, what)
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
                    f"payload of {what} {name!r} fails {schema.__name__}: "
                    f"{e.errors(include_url=False)}; send a payload matching the schema"
                )
                raise InvalidSignalError(name, msg) from None
    return payload


def _check_approval(payload: Any, name: str = APPROVAL) -> None:
    try:
        ApprovalAnswer.model_validate(payload)
    except ValidationError as e:
        where = e.errors()[0]["loc"]
        field = where[0] if where else None
        if field in ("by", "reason"):
            msg = f"approval field {field!r} must be a string or absent, got {payload[field]!r}"
        else:
            msg = (
                f"an approval payload must be a mapping with a boolean 'approved' "
                f"(optional 'by', 'reason'), got {payload!r}"
            )
        raise InvalidSignalError(name, msg) from None


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
    if InDoubtAnswer.of(payload) is None:
        msg = (
            "an in-doubt answer must be {'action': 'retry'}, "
            "{'action': 'resolve', 'result': ...} or {'action': 'fail', 'message': ...}; "
            f"got {payload!r}"
        )
        raise InvalidSignalError(IN_DOUBT, msg)


def is_duplicate(run: Run, delivery: SignalDelivery) -> bool:
    """Whether the run already has this delivery (its ``signal_id``): a no-op."""
    if not isinstance(delivery.signal_id, str) or not delivery.signal_id.strip():
        raise InvalidSignalError(
            delivery.name, "signal_id must be a non-empty string; give each delivery a stable id"
        )
    return delivery.signal_id in run.signal_ids


def _state_of(run: Run) -> str:
    """The run's status, with why it was aborted (a refusal says so clearly)."""
    if run.outcome and (run.status == "aborted" or run.cancelled):
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
    """The payload to journal, or a refusal. (A delivery the run already has is
    a no-op the turn answers before it checks anything: ``is_duplicate``.)"""
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
            f"delivery; signal {delivery.name!r} was not delivered (fire_timers wakes it: "
            "run kuralle-es worker; kuralle-es cancel stops it)",
        )
    if wait.kind == "message" and not from_sweeper:
        raise SignalMismatchError(
            run.run_id,
            f"run {run.run_id} waits in ctx.receive for a message {wait.name!r}, which is "
            f"sent with runtime.send (kuralle-es send), not as a signal; signal "
            f"{delivery.name!r} was not delivered",
        )
    if wait.kind == "child":
        raise SignalMismatchError(
            run.run_id,
            f"run {run.run_id} waits for its child run {wait.child_run_id} to end and takes "
            f"no delivery; signal {delivery.name!r} was not delivered. Look at the child run "
            f"(kuralle-es runs show {wait.child_run_id}): its end resumes this run",
        )
    if wait.kind == "input":
        raise SignalMismatchError(
            run.run_id,
            f"run {run.run_id} waits for input at a collect node, which is sent as text "
            f"(runtime.run(..., input=...), kuralle-es input {run.run_id} TEXT, POST "
            f"/api/runs/{run.run_id}/input), not as a signal; signal {delivery.name!r} "
            "was not delivered",
        )
    if not _names_match(delivery.name, wait):
        raise SignalMismatchError(
            run.run_id,
            f"run {run.run_id} waits for {wait.name!r}, not {delivery.name!r}; "
            f"deliver the signal it waits for{_how_to_answer(run.run_id, wait)}",
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


def _how_to_answer(run_id: str, wait: Wait) -> str:
    """What a refusal adds for the waits the runtime makes itself: how to answer them."""
    if wait.name == IN_DOUBT:
        return (
            f" (a step in doubt: kuralle-es in-doubt {run_id} retry|resolve|fail, POST "
            f"/api/runs/{run_id}/in-doubt, or the signal {IN_DOUBT!r} with "
            "{'action': 'retry'}, {'action': 'resolve', 'result': ...} or "
            "{'action': 'fail', 'message': ...})"
        )
    if wait.kind == "approval":
        return (
            f" (an approval: kuralle-es approve|deny {run_id} --by NAME, POST "
            f"/api/runs/{run_id}/approve or /deny)"
        )
    return ""


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


async def accept(writer: RunWriter, delivery: SignalDelivery, payload: Any) -> None:
    """Journal an accepted delivery: the payload and actor, and the wait's step.

    The wait's step is journaled by the writer at the site that
    suspended, so re-executing the node finds the payload there.
    """
    wait = writer.waiting
    assert wait is not None, "check() accepts deliveries to paused runs only"
    writer.accept_signal(delivery, payload)
    if wait.name == IN_DOUBT and wait.step_index is not None:
        answer = InDoubtAnswer.of(payload)
        if answer is None:  # the deadline sweeper's deny (an approval's shape)
            reason = str(payload.get("reason", "denied"))
            answer = InDoubtAnswer(action="fail", message=reason)
        writer.answer_in_doubt(wait.step_index, answer)
        await writer.saver.persist()
        return
    if wait.name == BUDGET:
        decision = ApprovalAnswer.model_validate(payload)
        if decision.approved and decision.raise_to:
            writer.raise_budget(dict(decision.raise_to))
    site = Site(wait.logical_run, wait.callsite, wait.lane)
    if wait.kind == "message":
        # Only the deadline sweeper delivers to a receive: it records the expiry,
        # which the receive raises as DeadlineExpiredError on every pass.
        deadline = wait.deadline.isoformat() if wait.deadline is not None else None
        expired = {EXPIRED: deadline}
        await writer.record_value(Effect(site, "receive", wait.name), make=lambda: expired)
        return
    operation = wait.operation.model_dump(mode="json") if wait.operation else None
    kind: StepKind = "approval" if wait.kind == "approval" else "signal"
    args: dict[str, Any] | None = {"operation": operation} if wait.lane is Lane.APPROVAL else None
    if args is None and wait.deadline is not None:
        # What a typed wait's DeadlineExpiredError names, the same on every replay.
        args = {"deadline": wait.deadline.isoformat()}
    await writer.record_value(Effect(site, kind, wait.name, args), make=lambda: payload)


async def take_message(writer: RunWriter, site: Site, name: str) -> dict[str, Any] | None:
    """Journal, as the ``receive`` step at ``site``, that the receive of ``name`` took
    the oldest unread message of that name; what it took (``message_id`` and
    ``payload``), or None when the mailbox has none. A replay finds the step, so
    it takes the same message."""
    mail = writer.unread(name)
    if mail is None:
        return None
    args, taken = receive_step(mail)
    result: dict[str, Any] = await writer.record_value(
        Effect(site, "receive", name, args), make=lambda: taken
    )
    return result


def delivery_id(signal_id: str | None) -> str:
    """The ``signal_id`` of an operator's delivery: the one given (checked: an empty
    one is refused, never replaced), or a fresh one for None."""
    if signal_id is None:
        return uuid4().hex
    return check_id(signal_id, "signal_id")


def in_doubt_delivery(
    action: str,
    *,
    by: str,
    result: Any = NO_RESULT,
    message: str | None = None,
    signal_id: str | None = None,
    request_id: str | None = None,
) -> SignalDelivery:
    """The ``__in_doubt`` delivery of a human's answer to a step in doubt, by ``by``
    (the journaled actor): ``retry`` it under its key, ``resolve`` it with the
    ``result`` to record (not executed), or ``fail`` it (``message`` for the node's
    ``ToolExecutionError``). A fresh ``signal_id`` unless one is given. The CLI, the
    HTTP API and the dashboard build their answers here, so the payload's shape is
    written once. An answer that does not fit (another action, a result without
    ``resolve`` or a resolve without one, a message without ``fail``) is
    ``InvalidSignalError``, before anything is written."""
    problem = None
    if action not in IN_DOUBT_ACTIONS:
        problem = f"the answer must be one of {', '.join(IN_DOUBT_ACTIONS)}, got {action!r}"
    elif (action == "resolve") != (result is not NO_RESULT):
        problem = (
            "'resolve' needs the result to record, and only 'resolve' takes one"
            if action == "resolve"
            else f"{action!r} takes no result (only 'resolve' records one)"
        )
    elif message is not None and action != "fail":
        problem = f"{action!r} takes no message (only 'fail' does)"
    if problem is not None:
        raise InvalidSignalError(IN_DOUBT, f"{problem}; docs/howto/in-doubt.md")
    payload: dict[str, Any] = {"action": action}
    if result is not NO_RESULT:
        payload["result"] = result
    if message is not None:
        payload["message"] = message
    by = check_id(by, "by (who answers)")
    return _operator_delivery(IN_DOUBT, payload, by, signal_id, request_id)


def approval_delivery(
    *,
    approved: bool,
    by: str,
    reason: str | None = None,
    signal_id: str | None = None,
    request_id: str | None = None,
    raise_to: dict[str, Any] | None = None,
) -> SignalDelivery:
    """The ``__approval`` delivery of a decision by ``by`` (the journaled actor, a
    required name); a fresh ``signal_id`` unless one is given (give one to make a
    retry a no-op). It answers any approval, a budget's too; ``raise_to`` raises a
    budget's limits."""
    payload: dict[str, Any] = {"approved": approved, "by": check_id(by, "by (who decides)")}
    if reason is not None:
        payload["reason"] = reason
    if raise_to is not None:
        payload["raise_to"] = raise_to
    return _operator_delivery(APPROVAL, payload, by, signal_id, request_id)


def _operator_delivery(
    name: str, payload: dict[str, Any], by: str, signal_id: str | None, request_id: str | None
) -> SignalDelivery:
    """A human's answer to a wait: ``by`` its actor, a fresh ``signal_id`` unless given."""
    return SignalDelivery(
        signal_id=delivery_id(signal_id),
        name=name,
        payload=payload,
        request_id=request_id,
        actor=by,
    )
