"""The one place where a run's stored events become view rows (internal).

A projection reads the store's notification log (``source``) and hands each
stored event here, decoded and upcast. ``fold`` turns the current rows of a
run plus one event into the next rows, with an exhaustive dispatch over the
catalogue of stored events (``_HANDLERS``: every event is handled or skipped
on purpose); an event whose topic this version does not know is counted and
shown as nothing. Every backend (memory, SQLite, PostgreSQL) writes what this
module computes, so the views agree with ``Run.to_state()`` on every backend
(``tests/test_views_fold_property.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from .._clock import as_utc
from .._journal import catalogue as stored
from .._journal.sealing import Sealed, sealed_json
from .._journal.spending import result_usage
from ..errors import ProjectionIntegrityError
from ..shapes import WaitingFor
from .source import UnknownEvent

__all__ = [
    "ProjectionIntegrityError",
    "RunRow",
    "StepRow",
    "fold",
    "public_wait",
    "reported_usage",
]

_WAIT_KEYS = frozenset(WaitingFor.model_fields)


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
    ``flow`` it stays set when the run ends, and so does ``node``, the last
    node the run entered. ``outcome`` is the run's as ``RunState`` folds it
    (an ``end`` reason, a cancel's); ``error_type`` the class of the error
    the run is in (cleared when a turn or a resume starts again).
    ``parent_run_id`` and ``parent_step`` say which run (and its step) started
    a child run.
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
    agent: str | None
    flow_version: str | None
    parent_run_id: str | None = None
    parent_step: int | None = None
    node: str | None = None
    outcome: str | None = None
    error_type: str | None = None
    #: The run's data subject: its session id unless it was given another.
    subject: str | None = None

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


def public_wait(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The public ``WaitingFor`` fields of a stored wait, as JSON values.

    A paused event also carries what only the runtime reads back; the view
    keeps the public part only.
    """
    kept = {k: v for k, v in raw.items() if k in _WAIT_KEYS}
    as_json: dict[str, Any] = json.loads(json.dumps(kept, default=_json_default))
    return as_json


def _json_default(value: object) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Sealed):
        return sealed_json(value)  # the view holds a payload as sealed as the event
    return str(value)


def _subject_assigned(
    run: RunRow, e: stored.SubjectAssigned, step: StepLookup
) -> tuple[RunRow, None]:
    return replace(run, subject=e.subject), None


# ---------------------------------------------------------------- the fold
StepLookup = Callable[[int], StepRow | None]
_Handler = Callable[[RunRow, Any, StepLookup], tuple[RunRow, StepRow | None]]


def fold(
    run: RunRow | None, event: stored.Event | UnknownEvent, step: StepLookup
) -> tuple[RunRow, StepRow | None]:
    """The run's next row after ``event``, and the step row it changed (if any).

    ``step(index)`` returns the current row of one of the run's steps.
    Raises ``ProjectionIntegrityError`` if the event does not follow the last
    one applied to this run. An event this version does not know is counted
    (the run's version moves on) but changes nothing shown.
    """
    run_id = str(event.originator_id)
    if run is None:
        if event.originator_version != 1 or not isinstance(event, stored.RunCreated):
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
    handler = _HANDLERS.get(type(event)) if isinstance(event, stored.Event) else None
    if handler is None:
        return run, None
    return handler(run, event, step)


def _created(event: stored.RunCreated) -> RunRow:
    at = as_utc(event.timestamp)
    return RunRow(
        run_id=str(event.originator_id),
        session_id=event.session_id,
        kind=event.kind,
        status="running",
        flow=event.flow,
        active_flow=event.flow,
        active_node=None,
        waiting_for=None,
        lease_holder=None,
        lease_expires_at=None,
        step_count=0,
        created_at=at,
        updated_at=at,
        version=event.originator_version,
        event_count=1,
        agent=event.agent,
        flow_version=event.flow_version,
        subject=event.session_id,
    )


def _set(**changes: Any) -> _Handler:
    """A handler that only sets fields of the run's row."""

    def handler(run: RunRow, event: Any, step: StepLookup) -> tuple[RunRow, None]:
        return replace(run, **changes), None

    return handler


def _node_entered(run: RunRow, e: stored.NodeEntered, step: StepLookup) -> tuple[RunRow, None]:
    return replace(
        run,
        active_flow=e.flow,
        active_node=e.node,
        flow=e.flow or run.flow,
        node=e.node or run.node,
    ), None


def _flow_pinned(run: RunRow, e: stored.FlowPinned, step: StepLookup) -> tuple[RunRow, None]:
    return replace(
        run,
        status="running",
        active_flow=e.flow,
        active_node=e.node,
        flow=e.flow or run.flow,
        flow_version=e.flow_version,
        waiting_for=None,
        node=e.node,
        error_type=None,
    ), None


def _paused(run: RunRow, e: stored.Paused, step: StepLookup) -> tuple[RunRow, None]:
    return replace(run, status="paused", waiting_for=public_wait(e.waiting_for)), None


def _finished(run: RunRow, e: stored.Finished, step: StepLookup) -> tuple[RunRow, None]:
    # The run's agent from now on (a handoff names another), as the aggregate folds it.
    return replace(
        run,
        status="finished",
        active_flow=None,
        active_node=None,
        waiting_for=None,
        agent=e.agent,
        outcome=e.outcome,
    ), None


def _parent_linked(run: RunRow, e: stored.ParentLinked, step: StepLookup) -> tuple[RunRow, None]:
    return replace(run, parent_run_id=e.run_id, parent_step=e.step), None


def _errored(run: RunRow, e: stored.Errored, step: StepLookup) -> tuple[RunRow, None]:
    return replace(run, status="error", error_type=_type_of(e.error)), None


def _aborted(run: RunRow, e: stored.Aborted, step: StepLookup) -> tuple[RunRow, None]:
    return replace(run, status="aborted", waiting_for=None, outcome=e.reason), None


def _lease_taken(run: RunRow, e: stored.LeaseTaken, step: StepLookup) -> tuple[RunRow, None]:
    return replace(run, lease_holder=e.holder, lease_expires_at=as_utc(e.expires_at)), None


def _step_intended(run: RunRow, e: stored.StepIntended, step: StepLookup) -> tuple[RunRow, StepRow]:
    row = StepRow(
        run_id=run.run_id,
        index=e.index,
        kind=e.kind,
        name=e.name,
        status="running",
        started_at=as_utc(e.timestamp),
        agent=run.agent,
    )
    return replace(run, step_count=run.step_count + 1), row


def _on_step(change: Callable[[StepRow, Any], StepRow]) -> _Handler:
    """A handler of an event of one step (named by its ``index``): ``change`` makes the
    step's new row from its current one; a step the lookup does not find is left alone."""

    def handler(run: RunRow, event: Any, step: StepLookup) -> tuple[RunRow, StepRow | None]:
        current = step(event.index)
        return run, None if current is None else change(current, event)

    return handler


def _step_errored(current: StepRow, e: stored.StepErrored) -> StepRow:
    return replace(
        current, status="error", finished_at=as_utc(e.timestamp), error_type=_type_of(e.error)
    )


def _step_succeeded(current: StepRow, e: stored.StepSucceeded) -> StepRow:
    """A step's result; a model step's reported tokens add to what it spent."""
    row = replace(current, status="finished", finished_at=as_utc(e.timestamp), error_type=None)
    reported = reported_usage(e.result_json) if row.kind == "model" else None
    if reported is None:
        return row
    return replace(
        row,
        input_tokens=_plus(row.input_tokens, reported["input_tokens"]),
        output_tokens=_plus(row.output_tokens, reported["output_tokens"]),
        total_tokens=_plus(row.total_tokens, reported["total_tokens"]),
    )


def _type_of(error: Mapping[str, Any]) -> str | None:
    kind = error.get("type")
    return None if kind is None else str(kind)


def reported_usage(result_json: Any) -> dict[str, int | None] | None:
    """The token usage a model step's recorded response reported, normalised (an
    erased response's too: its usage stays readable)."""
    return result_usage(result_json)


def _plus(total: int | None, more: int | None) -> int | None:
    if more is None:
        return total
    return more if total is None else total + more


def _attempt_started(current: StepRow, e: stored.AttemptStarted) -> StepRow:
    """Another attempt of the step: running again (as the aggregate folds it)."""
    return replace(current, attempts=current.attempts + 1, status="running", finished_at=None)


def _attempt_failed(current: StepRow, e: stored.AttemptFailed) -> StepRow:
    """A failed attempt that will be retried: the step runs on, with its last error."""
    return replace(current, error_type=_type_of(e.error))


_HANDLERS: Mapping[type[stored.Event], _Handler | None] = stored.dispatch(
    "views",
    {
        stored.SubjectAssigned: _subject_assigned,
        stored.TurnStarted: _set(status="running", error_type=None),
        stored.NodeEntered: _node_entered,
        stored.ParentLinked: _parent_linked,
        stored.FlowPinned: _flow_pinned,
        stored.StepIntended: _step_intended,
        stored.StepSucceeded: _on_step(_step_succeeded),
        stored.StepErrored: _on_step(_step_errored),
        stored.AttemptStarted: _on_step(_attempt_started),
        stored.AttemptFailed: _on_step(_attempt_failed),
        stored.Paused: _paused,
        stored.InputAccepted: _set(status="running", waiting_for=None),
        stored.DeliveryAccepted: _set(status="running", waiting_for=None),
        stored.TimerFired: _set(status="running", waiting_for=None),
        stored.MailDelivered: _set(status="running", waiting_for=None),
        stored.Resumed: _set(status="running", error_type=None),
        stored.Recovered: _set(status="running"),
        stored.Finished: _finished,
        stored.Errored: _errored,
        stored.Aborted: _aborted,
        stored.LeaseTaken: _lease_taken,
        stored.LeaseReleased: _set(lease_holder=None, lease_expires_at=None),
    },
    skipped=(
        stored.InboundKeyRecorded,
        stored.RunCreated,  # folded by ``_created``, the first event of every run
        stored.Forked,  # where a fork came from is on RunState, not a column of the list
        stored.FlowInputGiven,  # what node code reads, not a column of the list
        stored.MessageAppended,
        stored.RetryAllowed,
        stored.Migrated,  # on RunState (migrated_to); its Aborted is saved with it
        stored.TurnRecorded,
        stored.BudgetSet,
        stored.BudgetRaised,
        stored.MailReceived,  # a message waits in the run's state until a receive takes it
    ),
)
