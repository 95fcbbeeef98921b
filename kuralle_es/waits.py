"""Waits: how a run suspends for a human or an outside system, and what a
delivered payload must look like for each kind of wait.

Suspending raises ``SuspendError``; the turn catches it, pauses the run and
ends cleanly. Re-suspending on the same wait keeps its ``request_id`` and
deadline, so a supervisor's pending link stays valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn
from uuid import uuid4

from eventsourcing.utils import get_topic, resolve_topic
from pydantic import BaseModel, ValidationError

from .errors import InvalidSignalError, KuralleError, SuspendError
from .journal import Journal, utcnow
from .keys import canonical_json, sha256_hex
from .models import ApprovalDecision, FrozenOperation, WaitingFor
from .tools import encode_json

__all__ = [
    "APPROVAL",
    "APPROVAL_LANE",
    "DEADLINE_DENY",
    "INPUT",
    "IN_DOUBT",
    "approval_decision",
    "frozen_operation",
    "is_deadline_deny",
    "suspend",
    "validate_payload",
]

APPROVAL = "__approval"
IN_DOUBT = "__in_doubt"
INPUT = "__input"
#: The journal lane of a tool's approval (beside the tool's own step).
APPROVAL_LANE = "!approval"
#: What the deadline sweeper delivers to a wait whose deadline passed.
DEADLINE_DENY: dict[str, Any] = {
    "approved": False,
    "denied": True,
    "by": "deadline",
    "reason": "deadline-expired",
}

# Schemas of ``ctx.signal`` seen in this process, by topic: lets a delivery
# validate against a model class defined where ``resolve_topic`` can't reach.
_schemas: dict[str, type[BaseModel]] = {}


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
            raise ValueError(msg)
        return deadline.astimezone(UTC)
    if isinstance(deadline, timedelta):
        return utcnow() + deadline
    return utcnow() + timedelta(seconds=float(deadline))


def suspend(
    journal: Journal,
    *,
    callsite: int,
    name: str,
    kind: str,
    title: str | None = None,
    description: str | None = None,
    deadline: datetime | timedelta | float | None = None,
    operation: FrozenOperation | None = None,
    lane: str = "",
    step_index: int | None = None,
    schema: type[BaseModel] | None = None,
) -> NoReturn:
    """Stop the turn until ``name`` is delivered for this callsite."""
    current = journal.run.waiting_for or {}
    same_wait = (
        current.get("name") == name
        and current.get("callsite") == callsite
        and current.get("logical_run") == journal.logical_run
        and current.get("lane", "") == lane
    )
    if same_wait:
        request_id = str(current["request_id"])
        kept = current.get("deadline")
        absolute = datetime.fromisoformat(kept) if kept else _absolute(deadline)
    else:
        request_id = uuid4().hex
        absolute = _absolute(deadline)
    waiting_for = WaitingFor(
        name=name,
        callsite=callsite,
        title=title,
        description=description,
        deadline=absolute,
        request_id=request_id,
        kind=kind,
        operation=operation,
    )
    private: dict[str, Any] = {"logical_run": journal.logical_run, "lane": lane}
    if step_index is not None:
        private["step_index"] = step_index
    if schema is not None:
        topic = get_topic(schema)
        _schemas[topic] = schema
        private["schema_topic"] = topic
    raise SuspendError(waiting_for, private)


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


def _schema_of(waiting: Mapping[str, Any]) -> type[BaseModel] | None:
    topic = waiting.get("schema_topic")
    if not topic:
        return None
    schema = _schemas.get(topic)
    if schema is None:
        try:
            resolved = resolve_topic(topic)
        except Exception:
            # Not importable here: ctx.signal validates on re-execution instead.
            return None
        if isinstance(resolved, type) and issubclass(resolved, BaseModel):
            schema = resolved
    return schema


def validate_payload(waiting: Mapping[str, Any], payload: Any, *, from_sweeper: bool) -> Any:
    """The payload as it will be journaled, or ``InvalidSignalError`` naming the problem."""
    name = str(waiting["name"])
    try:
        encode_json(payload, f"the payload of signal {name!r}")
    except (TypeError, KuralleError) as e:
        raise InvalidSignalError(name, f"{e}; send a JSON payload within the size bound") from None
    if from_sweeper:
        return payload
    if name == APPROVAL:
        _check_approval(payload)
    elif name == IN_DOUBT:
        _check_in_doubt(payload)
    else:
        schema = _schema_of(waiting)
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


def _check_approval(payload: Any) -> None:
    if not isinstance(payload, Mapping) or not isinstance(payload.get("approved"), bool):
        msg = (
            f"an approval payload must be a mapping with a boolean 'approved' "
            f"(optional 'by', 'reason'), got {payload!r}"
        )
        raise InvalidSignalError(APPROVAL, msg)
    for field in ("by", "reason"):
        value = payload.get(field)
        if value is not None and not isinstance(value, str):
            msg = f"approval field {field!r} must be a string or absent, got {value!r}"
            raise InvalidSignalError(APPROVAL, msg)


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
