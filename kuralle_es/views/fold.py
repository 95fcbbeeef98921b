"""The one place where a run's stored events become view rows (internal).

A projection reads the store's notification log and hands each stored event
here as a ``RunEvent`` (its topic and decoded fields, never the domain class,
so a renamed class or a topic this version does not know can never stop a
projection). ``fold`` turns the current rows of a run plus one event into the
next rows. Every backend (memory, SQLite, PostgreSQL) writes what this module
computes, so the views agree with ``Run.to_state()`` on every backend.

Adding a view of a new domain event is one entry in ``_HANDLERS``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from ..errors import KuralleError
from ..models import WaitingFor
from ..usage import normalise_usage

__all__ = [
    "RUN_TOPIC_PREFIX",
    "ProjectionIntegrityError",
    "RunEvent",
    "RunRow",
    "StepRow",
    "fold",
    "public_wait",
    "reported_usage",
]

#: Stored topics of the ``Run`` aggregate's events all start with this.
RUN_TOPIC_PREFIX = "kuralle_es:Run."

_WAIT_KEYS = frozenset(WaitingFor.model_fields)


class ProjectionIntegrityError(KuralleError):
    """A run's events reached a view out of order: one was skipped or applied twice.

    The view stops rather than store a wrong row; rebuild it
    (``RunViews.rebuild()`` or ``kuralle-es views rebuild``) and report the bug.
    """

    def __init__(self, run_id: str, expected: int, got: int) -> None:
        self.run_id = run_id
        self.expected = expected
        self.got = got
        super().__init__(
            f"view of run {run_id} expected its event version {expected}, got {got}: "
            "an event was skipped or applied twice; rebuild the views"
        )


@dataclass(frozen=True)
class RunEvent:
    """A stored event, decoded but not resolved to a domain class."""

    notification_id: int
    topic: str
    originator_id: UUID
    originator_version: int
    timestamp: datetime
    data: Mapping[str, Any]

    @property
    def is_run_event(self) -> bool:
        return self.topic.startswith(RUN_TOPIC_PREFIX)


@dataclass(frozen=True)
class RunRow:
    """One run in the view: what ``RunSummary`` shows, plus index columns.

    ``flow`` is the last flow the run was in; unlike ``active_flow`` it stays
    set when the run ends, so a finished run is still found by its flow.
    ``version`` is the last applied event's version and ``event_count`` how
    many events were applied: equal unless an event was skipped or doubled.
    ``agent`` is the run's agent now (``Created``, then each ``Finished``: a
    handoff changes it). ``flow_version`` is the version label of the flow
    definition the run is pinned to (``Created``, ``FlowPinned``); like
    ``flow`` it stays set when the run ends.
    """

    run_id: str
    session_id: str
    kind: str
    status: str
    flow: str | None
    active_flow: str | None
    active_node: str | None
    waiting_for: dict[str, Any] | None
    lease_holder: str | None
    lease_expires_at: datetime | None
    step_count: int
    created_at: datetime
    updated_at: datetime
    version: int
    event_count: int
    agent: str | None = None
    flow_version: str | None = None

    @property
    def wait_kind(self) -> str | None:
        return None if self.waiting_for is None else str(self.waiting_for.get("kind"))

    @property
    def wait_deadline(self) -> datetime | None:
        if self.waiting_for is None or not self.waiting_for.get("deadline"):
            return None
        return as_utc(datetime.fromisoformat(str(self.waiting_for["deadline"])))


@dataclass(frozen=True)
class StepRow:
    """One journal step's timing, for per-tool statistics, and what it spent.

    ``agent`` is the run's agent when the step started; the token counts are
    a model step's reported usage, added up over its finished attempts (None
    while none reported that count).
    """

    run_id: str
    index: int
    kind: str
    name: str
    status: str
    started_at: datetime
    finished_at: datetime | None = None
    attempts: int = 1
    error_type: str | None = None
    agent: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None

    @property
    def duration_ms(self) -> float | None:
        if self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds() * 1000.0


def as_utc(value: datetime) -> datetime:
    """An aware UTC datetime (naive ones are taken as UTC)."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def public_wait(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The public ``WaitingFor`` fields of a stored wait, as JSON values.

    A paused event also carries what only the runtime reads back; the view
    keeps the public part only.
    """
    kept = {k: v for k, v in raw.items() if k in _WAIT_KEYS}
    as_json: dict[str, Any] = json.loads(json.dumps(kept, default=_json_default))
    return as_json


def _json_default(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


# ---------------------------------------------------------------- the fold
StepLookup = Callable[[int], StepRow | None]
_Handler = Callable[[RunRow, RunEvent, StepLookup], tuple[RunRow, StepRow | None]]


def fold(run: RunRow | None, event: RunEvent, step: StepLookup) -> tuple[RunRow, StepRow | None]:
    """The run's next row after ``event``, and the step row it changed (if any).

    ``step(index)`` returns the current row of one of the run's steps.
    Raises ``ProjectionIntegrityError`` if the event does not follow the last
    one applied to this run.
    """
    run_id = str(event.originator_id)
    if run is None:
        if event.originator_version != 1 or not event.topic.endswith(".Created"):
            raise ProjectionIntegrityError(run_id, 1, event.originator_version)
        return _created(event), None
    if event.originator_version != run.version + 1:
        raise ProjectionIntegrityError(run_id, run.version + 1, event.originator_version)
    run = replace(
        run,
        version=event.originator_version,
        event_count=run.event_count + 1,
        updated_at=as_utc(event.timestamp),
    )
    handler = _HANDLERS.get(event.topic[len(RUN_TOPIC_PREFIX) :])
    if handler is None:  # an event this version does not show: counted, not shown
        return run, None
    return handler(run, event, step)


def _created(event: RunEvent) -> RunRow:
    data = event.data
    at = as_utc(event.timestamp)
    return RunRow(
        run_id=str(event.originator_id),
        session_id=str(data.get("session_id")),
        kind=str(data.get("kind")),
        status="running",
        flow=data.get("flow"),
        active_flow=data.get("flow"),
        active_node=None,
        waiting_for=None,
        lease_holder=None,
        lease_expires_at=None,
        step_count=0,
        created_at=at,
        updated_at=at,
        version=event.originator_version,
        event_count=1,
        agent=_agent(data.get("agent")),
        flow_version=data.get("flow_version"),
    )


def _agent(value: Any) -> str | None:
    return None if value is None else str(value)


def _set(**changes: Any) -> _Handler:
    """A handler that only sets fields of the run's row."""

    def handler(run: RunRow, event: RunEvent, step: StepLookup) -> tuple[RunRow, None]:
        return replace(run, **changes), None

    return handler


def _node_entered(run: RunRow, event: RunEvent, step: StepLookup) -> tuple[RunRow, None]:
    flow = event.data.get("flow")
    return replace(
        run, active_flow=flow, active_node=event.data.get("node"), flow=flow or run.flow
    ), None


def _flow_pinned(run: RunRow, event: RunEvent, step: StepLookup) -> tuple[RunRow, None]:
    flow = event.data.get("flow")
    return replace(
        run,
        status="running",
        active_flow=flow,
        active_node=event.data.get("node"),
        flow=flow or run.flow,
        flow_version=event.data.get("flow_version"),
        waiting_for=None,
    ), None


def _paused(run: RunRow, event: RunEvent, step: StepLookup) -> tuple[RunRow, None]:
    raw = event.data.get("waiting_for")
    wait = public_wait(raw) if isinstance(raw, Mapping) else None
    return replace(run, status="paused", waiting_for=wait), None


def _finished(run: RunRow, event: RunEvent, step: StepLookup) -> tuple[RunRow, None]:
    # The run's agent from now on (a handoff names another), as the aggregate folds it.
    agent = _agent(event.data["agent"]) if "agent" in event.data else run.agent
    return replace(
        run, status="finished", active_flow=None, active_node=None, waiting_for=None, agent=agent
    ), None


def _lease_taken(run: RunRow, event: RunEvent, step: StepLookup) -> tuple[RunRow, None]:
    expires = event.data.get("expires_at")
    return replace(
        run,
        lease_holder=event.data.get("holder"),
        lease_expires_at=as_utc(expires) if isinstance(expires, datetime) else None,
    ), None


def _step_started(run: RunRow, event: RunEvent, step: StepLookup) -> tuple[RunRow, StepRow]:
    index = int(event.data["index"])
    row = StepRow(
        run_id=run.run_id,
        index=index,
        kind=str(event.data.get("kind")),
        name=str(event.data.get("name")),
        status="running",
        started_at=as_utc(event.timestamp),
        agent=run.agent,
    )
    return replace(run, step_count=run.step_count + 1), row


def _step_ended(status: str) -> _Handler:
    def handler(run: RunRow, event: RunEvent, step: StepLookup) -> tuple[RunRow, StepRow | None]:
        current = step(int(event.data["index"]))
        if current is None:
            return run, None
        error = event.data.get("error")
        error_type = str(error.get("type")) if isinstance(error, Mapping) else None
        return run, replace(
            current, status=status, finished_at=as_utc(event.timestamp), error_type=error_type
        )

    return handler


_step_ended_ok = _step_ended("finished")


def _step_finished(run: RunRow, event: RunEvent, step: StepLookup) -> tuple[RunRow, StepRow | None]:
    """A step's result; a model step's reported tokens add to what it spent."""
    run, row = _step_ended_ok(run, event, step)
    if row is None or row.kind != "model":
        return run, row
    reported = reported_usage(event.data.get("result_json"))
    if reported is None:
        return run, row
    return run, replace(
        row,
        input_tokens=_plus(row.input_tokens, reported["input_tokens"]),
        output_tokens=_plus(row.output_tokens, reported["output_tokens"]),
        total_tokens=_plus(row.total_tokens, reported["total_tokens"]),
    )


def reported_usage(result_json: Any) -> dict[str, int | None] | None:
    """The token usage a model step's recorded response reported, normalised."""
    if not isinstance(result_json, str):
        return None
    try:
        response = json.loads(result_json)
    except ValueError:
        return None
    return normalise_usage(response.get("usage") if isinstance(response, dict) else None)


def _plus(total: int | None, more: int | None) -> int | None:
    if more is None:
        return total
    return more if total is None else total + more


def _step_retried(run: RunRow, event: RunEvent, step: StepLookup) -> tuple[RunRow, StepRow | None]:
    current = step(int(event.data["index"]))
    if current is None:
        return run, None
    return run, replace(current, attempts=current.attempts + 1)


def _attempt_failed(
    run: RunRow, event: RunEvent, step: StepLookup
) -> tuple[RunRow, StepRow | None]:
    """A failed attempt that will be retried: the step runs on, with its last error."""
    current = step(int(event.data["index"]))
    error = event.data.get("error")
    if current is None or not isinstance(error, Mapping):
        return run, None
    return run, replace(current, error_type=str(error.get("type")))


_HANDLERS: dict[str, _Handler] = {
    "TurnStarted": _set(status="running"),
    "NodeEntered": _node_entered,
    "StepStarted": _step_started,
    "StepFinished": _step_finished,
    "StepFailed": _step_ended("error"),
    "StepRetried": _step_retried,
    "StepAttemptFailed": _attempt_failed,
    "Paused": _paused,
    "InputAccepted": _set(status="running", waiting_for=None),
    "SignalAccepted": _set(status="running", waiting_for=None),
    "FlowPinned": _flow_pinned,
    "Finished": _finished,
    "Errored": _set(status="error"),
    "Resumed": _set(status="running"),
    "TimerFired": _set(status="running", waiting_for=None),
    "Recovered": _set(status="running"),
    "Aborted": _set(status="aborted", waiting_for=None),
    # Where a fork came from is on RunState (runtime.get_run), not a column of the list.
    "Forked": _set(),
    "LeaseTaken": _lease_taken,
    "LeaseReleased": _set(lease_holder=None, lease_expires_at=None),
}
