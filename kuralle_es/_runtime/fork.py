"""Forking a run at a step: what the fork's journal starts with (internal).

A fork is a new flow run that stands exactly where the original stood just
before its step ``at_step`` started. ``plan_fork`` reads the original's
stored events up to that point and decides, per event, what the fork's
journal gets:

- node entries (with their callsite bases and state bags), messages and the
  opening user message are copied as they are, so the fork has the
  original's messages and state bag at that point, and a ``collect`` node
  that already asked for input (and got it) is not asked again;
- steps before ``at_step`` are copied with their recorded results, their
  logical run rewritten to the fork's (its id, and the flow's *current*
  digest), and their idempotency key recomputed from that logical run, so
  they replay without executing and a step after ``at_step`` gets a key of
  the fork's own. A tool whose ``idempotency_key=`` override chose the key
  keeps it: that key is a business identity, not a position in a run;
- input accepted by a ``collect`` node becomes a plain user message;
- a budget the run was given or raised is copied (the fork spends under it);
- messages that arrived in the mailbox are copied (the copied receives took
  the same ones, and the fork's own receives find those left unread);
- waits, deliveries, leases, turn records and the run's end are not copied:
  a delivered payload lives on in its step, and the fork has its own leases
  and its own end.

What happens to each stored event is one dispatch over the catalogue
(``_WALK``), so a new stored event must say whether a fork copies it. The
fork's logical runs are derived from the history walked so far (the epoch,
the flow and the digest pinned at each point), never parsed out of ids.

The turn then drives the fork like a resumed run: the active node
re-executes from its start under the current flow definition, replaying the
copied steps (a mismatch raises ``NonDeterminismError``) and executing afresh
from ``at_step``. Waits are re-created by that re-execution: forking at an
approval step makes the fork wait for a new approval. One wait cannot be
re-created so: a ``collect`` node that parked for input has already moved to
fresh callsites, so re-entering it would ask the model again. A fork whose
point is such a pending input wait (only possible at ``at_step ==
len(steps)``) stands on that wait instead (a fresh ``request_id``) and is not
driven until input arrives.

Why not replay from the start node: a flow visit's callsites depend on the
node entries the original recorded (a ``collect`` node re-entered after
input counts from a new base), which only the recorded history knows; a
fresh start would replay the first (empty) extraction and ask for input
again instead of reaching the step to fork at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from .._journal import catalogue as stored
from .._journal.keys import logical_run_id
from .._journal.sites import Lane, Site, step_key
from .._journal.wait import Wait
from ..errors import InvalidArgumentError
from ..redaction import Redacted

__all__ = ["ForkPlan", "plan_fork"]

#: The fields every stored event has; the rest is what a copy carries.
_BASE_FIELDS = frozenset({"originator_id", "originator_version", "timestamp"})


@dataclass(frozen=True)
class _Copy:
    """One event of the original, as the fork's journal gets it."""

    event_class: type[stored.Event]
    fields: dict[str, Any]


@dataclass(frozen=True)
class ForkPlan:
    """What a fork's journal starts with, decided before anything is written."""

    from_run_id: str
    at_step: int
    #: The node the fork stands at (where driving re-enters).
    node: str
    copies: tuple[_Copy, ...]
    #: A pending input wait the fork stands on (not driven until input arrives).
    wait: Wait | None


def _fields(event: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(event).items() if k not in _BASE_FIELDS}


@dataclass
class _Walk:
    """The fold of the original's history up to the fork point, and the fork's copies."""

    original_id: str
    fork_id: str
    #: The digest pinned where the fork stands, and the flow's current one.
    pinned: str | None
    digest: str
    version: str | None
    epoch: int = 0
    flow: str | None = None
    at_digest: str | None = None
    copies: list[_Copy] = dataclasses.field(default_factory=list)
    status: dict[int, str] = dataclasses.field(default_factory=dict)
    node: str | None = None
    pending_input: Wait | None = None

    def copy(self, event: Any, **changes: Any) -> None:
        self.copies.append(_Copy(type(event), _fields(event) | changes))

    def digest_of(self, pinned: str | None) -> str | None:
        """Steps of the digest pinned at the fork point replay under the current
        one; steps of an older pin (before a drift restart) stay dead history."""
        return self.digest if pinned == self.pinned else pinned

    def logical_runs(self) -> tuple[str, str]:
        """The original's logical run where the walk stands, and the fork's."""
        flow, digest = self.flow, self.at_digest
        if flow is None:
            return logical_run_id(self.original_id, self.epoch), logical_run_id(
                self.fork_id, self.epoch
            )
        return (
            logical_run_id(self.original_id, self.epoch, flow, digest),
            logical_run_id(self.fork_id, self.epoch, flow, self.digest_of(digest)),
        )


# One handler per stored event: what the fork's journal gets of it.
def _created(w: _Walk, e: stored.RunCreated) -> None:
    w.flow, w.at_digest = e.flow, e.flow_digest


def _step_intended(w: _Walk, e: stored.StepIntended) -> None:
    if isinstance(e.args, Redacted):
        msg = (
            f"cannot fork run {e.originator_id}: its subject was erased, so its recorded "
            "steps cannot be replayed (docs/privacy.md)"
        )
        raise InvalidArgumentError(msg)
    original, fork = w.logical_runs()
    w.status[e.index] = "running"
    fields = _fields(e)
    lane = Lane(e.lane)
    if e.logical_run == original:
        fields["logical_run"] = fork
        recorded = step_key(Site(original, e.callsite, lane), e.kind, e.name, e.args)
        if recorded == e.key:  # else a tool's idempotency_key override chose it: it stays
            fields["key"] = step_key(Site(fork, e.callsite, lane), e.kind, e.name, e.args)
    w.copies.append(_Copy(stored.StepIntended, fields))


def _settled(w: _Walk, e: stored.StepSucceeded | stored.StepErrored) -> None:
    w.status[e.index] = "finished"
    w.copy(e)


def _attempt_started(w: _Walk, e: stored.AttemptStarted) -> None:
    w.status[e.index] = "running"
    w.copy(e)


def _copied(w: _Walk, e: Any) -> None:
    w.copy(e)


def _turn_started(w: _Walk, e: stored.TurnStarted) -> None:
    w.epoch = e.epoch
    w.copy(e, idempotency_key=None)


def _node_entered(w: _Walk, e: stored.NodeEntered) -> None:
    w.node = e.node
    w.flow = e.flow
    w.copy(e)


def _flow_pinned(w: _Walk, e: stored.FlowPinned) -> None:
    w.node, w.flow, w.at_digest = e.node, e.flow, e.flow_digest
    pinned_here = e.flow_digest == w.pinned
    w.copy(
        e,
        flow_digest=w.digest_of(e.flow_digest),
        flow_version=w.version if pinned_here else e.flow_version,
    )


def _input_accepted(w: _Walk, e: stored.InputAccepted) -> None:
    w.pending_input = None
    w.copies.append(_Copy(stored.MessageAppended, {"message": e.message}))


def _paused(w: _Walk, e: stored.Paused) -> None:
    wait = Wait.from_json(e.waiting_for)
    if wait.kind != "input":
        w.pending_input = None
        return
    # The same wait, in the fork's logical run (with a fresh request id).
    _, fork = w.logical_runs()
    w.pending_input = wait.model_copy(update={"logical_run": fork, "request_id": uuid4().hex})


def _delivered(w: _Walk, e: stored.DeliveryAccepted) -> None:
    w.pending_input = None


_WALK: Mapping[type[stored.Event], Callable[[_Walk, Any], None] | None] = stored.dispatch(
    "fork",
    {
        stored.RunCreated: _created,
        stored.StepIntended: _step_intended,
        stored.StepSucceeded: _settled,
        stored.StepErrored: _settled,
        stored.AttemptStarted: _attempt_started,
        stored.AttemptFailed: _copied,
        stored.RetryAllowed: _copied,
        stored.TurnStarted: _turn_started,
        stored.NodeEntered: _node_entered,
        stored.FlowPinned: _flow_pinned,
        stored.MessageAppended: _copied,
        stored.InputAccepted: _input_accepted,
        stored.Paused: _paused,
        stored.DeliveryAccepted: _delivered,
        stored.FlowInputGiven: _copied,  # the fork's ctx.input is the original's
        stored.BudgetSet: _copied,
        stored.BudgetRaised: _copied,
        # The fork's mailbox is the original's there: its copied receives took
        # the same messages, and a receive it re-executes finds the rest.
        stored.MailReceived: _copied,
    },
    skipped=(
        stored.InboundKeyRecorded,
        stored.Forked,  # the fork records its own origin
        stored.ParentLinked,  # a fork is a run of its own, nobody's child
        stored.SubjectAssigned,  # the fork belongs to the original's subject, its own event
        stored.TimerFired,
        stored.MailDelivered,  # a wake, like a timer's: the fork's receive waits afresh
        stored.Resumed,
        stored.Recovered,
        stored.Finished,
        stored.Errored,
        stored.Aborted,
        stored.Migrated,
        stored.TurnRecorded,
        stored.LeaseTaken,
        stored.LeaseReleased,
    ),
)


def _walk(events: Sequence[Any], walk: _Walk) -> _Walk:
    for event in events:
        handler = _WALK.get(type(event))
        if handler is not None:
            handler(walk, event)
    return walk


def _pinned_at(events: Sequence[Any]) -> str | None:
    pinned: str | None = events[0].flow_digest
    for event in events:
        if isinstance(event, stored.FlowPinned):
            pinned = event.flow_digest
    return pinned


def _refuse_unsettled(walk: _Walk, run_id: str, at_step: int) -> None:
    """A fork point needs every earlier step settled (none left in doubt)."""
    running = sorted(i for i, s in walk.status.items() if s == "running")
    if running:
        msg = (
            f"cannot fork run {run_id} at step {at_step}: step {running[0]} was still running "
            f"there (its result in doubt, or the point inside a parallel batch); fork at step "
            f"{running[0]} or earlier"
        )
        raise InvalidArgumentError(msg)


def _refuse_inside_batch(starts: Sequence[stored.StepIntended], at_step: int, run_id: str) -> None:
    """A fork point is never a step of a parallel batch other than its first: the
    batch is recorded on each intent, so every backend refuses the same points."""
    if at_step >= len(starts) or starts[at_step].batch is None:
        return
    step = starts[at_step]
    earlier = [
        s.index
        for s in starts[:at_step]
        if (s.logical_run, s.batch) == (step.logical_run, step.batch)
        and s.callsite != step.callsite
    ]
    if not earlier:
        return
    first = earlier[0]
    msg = (
        f"cannot fork run {run_id} at step {at_step}: it is inside a parallel batch (one "
        f"gather of effects, or one model turn's parallel tool calls) that starts at step "
        f"{first}; fork at step {first}, or after the batch"
    )
    raise InvalidArgumentError(msg)


def plan_fork(
    events: Sequence[Any], at_step: int, fork_id: str, digest: str, version: str | None = None
) -> ForkPlan:
    """The fork of the run whose stored ``events`` these are, at ``at_step``.

    ``digest`` is the flow's current digest (``version`` its label). Refuses
    (``InvalidArgumentError``) a conversation run, an ``at_step`` out of
    ``0..len(steps)``, and a point inside a parallel batch or after a step
    left in doubt.
    """
    created = events[0]
    run_id = str(created.originator_id)
    if created.kind != "flow":
        msg = f"run {run_id} is a {created.kind} run; only flow runs fork"
        raise InvalidArgumentError(msg)
    starts = [i for i, e in enumerate(events) if isinstance(e, stored.StepIntended)]
    step_count = len(starts)
    if isinstance(at_step, bool) or not isinstance(at_step, int) or not 0 <= at_step <= step_count:
        msg = (
            f"at_step must be a step index from 0 to {step_count} (the run's step count), "
            f"got {at_step!r}"
        )
        raise InvalidArgumentError(msg)
    _refuse_inside_batch([events[i] for i in starts], at_step, run_id)
    cut = starts[at_step] if at_step < step_count else len(events)
    prefix = events[:cut]
    walk = _walk(prefix, _Walk(run_id, fork_id, _pinned_at(prefix), digest, version))
    _refuse_unsettled(walk, run_id, at_step)
    if walk.node is None:
        msg = f"run {run_id} never entered a node of its flow; start a new run instead"
        raise InvalidArgumentError(msg)
    return ForkPlan(run_id, at_step, walk.node, tuple(walk.copies), walk.pending_input)
