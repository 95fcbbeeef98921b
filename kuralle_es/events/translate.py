"""The one translation from the ``Run`` aggregate's stored events to public events (internal).

``_RULES`` is the whole mapping, an exhaustive dispatch over the catalogue of
stored events: a stored event class, the public event it becomes, and the
run status it leaves behind; or, skipped on purpose, no public meaning
(leases of old releases, node entries, messages, turn records, a fork's
origin). Each stored event yields at most one public event, so positions
stay unique. A fork opens
like any run (its ``Created`` is a ``RunOpened``), and the steps it copied from
the original are its own ``StepStarted``/``StepFinished`` events.

Some public fields are not on the stored event alone (the session of a run,
the name and key of a step, its attempt count). ``Translator`` keeps that
context per run in a bounded cache; a run it has not seen (a follower that
starts mid-stream, or an evicted entry) is folded from the run's own earlier
stored events first, so a follower starting at any position produces the same
events as one that started at the beginning.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from eventsourcing.persistence import Notification

from .._journal import catalogue as stored
from .._journal.log import RunLog
from ..redaction import Redacted
from .types import (
    EventError,
    EventWaitingFor,
    RunAborted,
    RunErrored,
    RunEvent,
    RunFinished,
    RunOpened,
    RunPaused,
    RunResumed,
    SignalAccepted,
    StepFailed,
    StepFinished,
    StepStarted,
    ValuePublished,
)

__all__ = ["PUBLIC_TOPICS", "Translator"]


@dataclass
class _Step:
    key: str
    kind: str
    name: str
    attempts: int = 1


@dataclass
class _RunContext:
    """What translating a run's next event needs from its past."""

    session_id: str = ""
    status: str = "running"
    steps: dict[int, _Step] = field(default_factory=dict)


#: The fields every public event shares, computed once per stored event.
_Base = dict[str, Any]
_Make = Callable[[Any, _RunContext, _Base], RunEvent | None]


@dataclass(frozen=True)
class _Rule:
    make: _Make
    #: The run's status after this event (None: unchanged).
    status: str | None = None


def _opened(e: stored.RunCreated, ctx: _RunContext, base: _Base) -> RunEvent:
    return RunOpened(**base, kind=e.kind, flow=e.flow)


def _step_started(e: stored.StepIntended, ctx: _RunContext, base: _Base) -> RunEvent | None:
    if e.kind == "publish":
        return None  # a published value is one public event: its ValuePublished
    return StepStarted(**base, index=e.index, key=e.key, kind=e.kind, name=e.name, attempt=1)


def _step_retried(e: stored.AttemptStarted, ctx: _RunContext, base: _Base) -> RunEvent:
    step = ctx.steps[e.index]
    return StepStarted(
        **base,
        index=e.index,
        key=step.key,
        kind=step.kind,
        name=step.name,
        attempt=step.attempts + 1,
    )


def _step_finished(e: stored.StepSucceeded, ctx: _RunContext, base: _Base) -> RunEvent:
    step = ctx.steps[e.index]
    result = e.result_json if isinstance(e.result_json, Redacted) else json.loads(e.result_json)
    if step.kind == "publish":
        return ValuePublished(**base, index=e.index, key=step.name, value=result)
    return StepFinished(**base, index=e.index, name=step.name, result=result)


def _step_failed(e: stored.StepErrored, ctx: _RunContext, base: _Base) -> RunEvent:
    # A stored failure is frozen unless it says otherwise (retries record non-final ones).
    final = bool(getattr(e, "final", True))
    error = EventError.model_validate(e.error)
    return StepFailed(**base, index=e.index, name=ctx.steps[e.index].name, error=error, final=final)


def _attempt_failed(e: stored.AttemptFailed, ctx: _RunContext, base: _Base) -> RunEvent:
    # An attempt the tool's retry policy tries again: not frozen.
    error = EventError.model_validate(e.error)
    return StepFailed(**base, index=e.index, name=ctx.steps[e.index].name, error=error, final=False)


def _paused(e: stored.Paused, ctx: _RunContext, base: _Base) -> RunEvent:
    # The stored wait also holds what only the runtime reads back: keep public keys only.
    public = {k: v for k, v in e.waiting_for.items() if k in EventWaitingFor.model_fields}
    return RunPaused(**base, waiting_for=EventWaitingFor.model_validate(public))


def _signal(e: stored.DeliveryAccepted, ctx: _RunContext, base: _Base) -> RunEvent:
    return SignalAccepted(**base, signal_id=e.signal_id, name=e.name, actor=e.actor)


def _resumed(reason: str) -> _Make:
    def make(e: Any, ctx: _RunContext, base: _Base) -> RunEvent:
        return RunResumed(**base, reason=reason)

    return make


def _turn_started(e: stored.TurnStarted, ctx: _RunContext, base: _Base) -> RunEvent | None:
    # A turn's first epoch opens the run (RunOpened says so); a later one is new user input.
    return RunResumed(**base, reason="input") if e.epoch > 0 else None


def _flow_pinned(e: stored.FlowPinned, ctx: _RunContext, base: _Base) -> RunEvent | None:
    # Pinning while running is part of entering a flow; on a stopped run it is a restart.
    return RunResumed(**base, reason="restart") if ctx.status != "running" else None


def _finished(e: stored.Finished, ctx: _RunContext, base: _Base) -> RunEvent:
    return RunFinished(**base, outcome=e.outcome)


def _errored(e: stored.Errored, ctx: _RunContext, base: _Base) -> RunEvent:
    return RunErrored(**base, error=EventError.model_validate(e.error))


def _aborted(e: stored.Aborted, ctx: _RunContext, base: _Base) -> RunEvent:
    return RunAborted(**base, outcome=e.reason)


#: The translation table over the whole catalogue: a stored event's public event
#: and the run status it leaves (None: no public meaning, skipped).
_RULES: Mapping[type[stored.Event], _Rule | None] = stored.dispatch(
    "public events",
    {
        stored.RunCreated: _Rule(_opened, "running"),
        stored.TurnStarted: _Rule(_turn_started, "running"),
        stored.StepIntended: _Rule(_step_started),
        stored.AttemptStarted: _Rule(_step_retried),
        stored.StepSucceeded: _Rule(_step_finished),
        stored.StepErrored: _Rule(_step_failed),
        stored.AttemptFailed: _Rule(_attempt_failed),
        stored.Paused: _Rule(_paused, "paused"),
        stored.InputAccepted: _Rule(_resumed("input"), "running"),
        stored.DeliveryAccepted: _Rule(_signal, "running"),
        stored.FlowPinned: _Rule(_flow_pinned, "running"),
        stored.Resumed: _Rule(_resumed("error"), "running"),
        stored.TimerFired: _Rule(_resumed("timer"), "running"),
        stored.MailDelivered: _Rule(_resumed("message"), "running"),
        stored.Recovered: _Rule(_resumed("recovery"), "running"),
        stored.Finished: _Rule(_finished, "finished"),
        stored.Errored: _Rule(_errored, "error"),
        stored.Aborted: _Rule(_aborted, "aborted"),
    },
    skipped=(
        stored.InboundKeyRecorded,
        stored.Forked,  # the fork's RunOpened and its copied steps say it
        stored.ParentLinked,  # on RunState (parent); the parent's child step says it
        stored.FlowInputGiven,  # saved with the RunOpened; node code reads it
        stored.SubjectAssigned,  # whose data a run holds is not an event of the run
        stored.NodeEntered,
        stored.MessageAppended,
        stored.RetryAllowed,  # the attempt it allows is a StepStarted
        stored.Migrated,  # saved with the Aborted that is its RunAborted
        stored.TurnRecorded,
        stored.BudgetSet,
        stored.BudgetRaised,
        stored.LeaseTaken,
        stored.LeaseReleased,
        stored.MailReceived,  # its receive is a step (StepStarted, StepFinished) when taken
    ),
)

#: Stored topics worth reading: every other notification is skipped in the query.
PUBLIC_TOPICS: tuple[str, ...] = tuple(
    sorted(cls.TOPIC for cls, rule in _RULES.items() if rule is not None)
)


def _fold(ctx: _RunContext, event: Any, rule: _Rule) -> None:
    """Remember what later events of the run will need."""
    if isinstance(event, stored.RunCreated):
        ctx.session_id = event.session_id
    elif isinstance(event, stored.StepIntended):
        ctx.steps[event.index] = _Step(event.key, event.kind, event.name)
    elif isinstance(event, stored.AttemptStarted):
        ctx.steps[event.index].attempts += 1
    if rule.status is not None:
        ctx.status = rule.status


class Translator:
    """One partition's stored notifications in, public events out; one per follower
    and partition (not thread-safe)."""

    def __init__(self, log: RunLog, cache_size: int = 4096) -> None:
        self._store = log
        self._cache: OrderedDict[UUID, _RunContext] = OrderedDict()
        self._cache_size = cache_size

    def translate(self, notification: Notification) -> RunEvent | None:
        """The public event of one stored notification, or None if it has none."""
        event: Any = self._store.mapper.to_domain_event(notification)
        rule = _RULES.get(type(event))
        if rule is None:
            return None
        ctx = self._context(event.originator_id, event.originator_version)
        session = event.session_id if isinstance(event, stored.RunCreated) else ctx.session_id
        base: _Base = {
            "partition": self._store.partition,
            "position": notification.id,
            "run_id": str(event.originator_id),
            "session_id": session,
            "occurred_at": event.timestamp,
        }
        public = rule.make(event, ctx, base)
        _fold(ctx, event, rule)
        return public

    def _context(self, run_id: UUID, version: int) -> _RunContext:
        ctx = self._cache.get(run_id)
        if ctx is not None:
            self._cache.move_to_end(run_id)
            return ctx
        ctx = _RunContext()
        if version > 1:  # fold the run's earlier events from the store
            self._fold_all(ctx, self._store.events.get(run_id, lte=version - 1))
        self._cache[run_id] = ctx
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return ctx

    @staticmethod
    def _fold_all(ctx: _RunContext, events: Iterable[Any]) -> None:
        for event in events:
            rule = _RULES.get(type(event))
            if rule is not None:
                _fold(ctx, event, rule)
