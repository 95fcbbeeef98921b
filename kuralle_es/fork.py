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
- waits, deliveries, leases, turn records and the run's end are not copied:
  a delivered payload lives on in its step, and the fork has its own leases
  and its own end. Stored events this version does not know are skipped,
  except step events (their class name starts with ``Step``), copied as is.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from .domain import Run
from .errors import InvalidArgumentError
from .keys import idempotency_key
from .waiting import Wait

__all__ = ["ForkPlan", "plan_fork"]

#: The fields every stored event has; the rest is what a copy carries.
_BASE_FIELDS = frozenset({"originator_id", "originator_version", "timestamp"})
#: Length of a flow digest (SHA-256 hex) inside a logical run id.
_DIGEST_LEN = 64


@dataclass(frozen=True)
class _Copy:
    """One event of the original, as the fork's journal gets it."""

    event_class: type[Run.Event]
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

    def apply(self, run: Run) -> None:
        """Trigger the fork's opening events on the new run (saved by the caller)."""
        run.mark_forked(self.from_run_id, self.at_step)
        for copy in self.copies:
            run.copy_event(copy.event_class, copy.fields)
        if self.wait is not None:
            run.pause(self.wait)


def _fields(event: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(event).items() if k not in _BASE_FIELDS}


def _payload(kind: str, name: str, args: Any) -> Any:
    """The key payload of a step (README: Idempotency keys)."""
    if kind == "tool":
        return {"name": name, "args": args}
    if kind == "model":
        purpose = args.get("purpose") if isinstance(args, dict) else None
        return {"model": name, "purpose": purpose}
    if kind in ("now", "uuid", "timer"):
        return kind
    return name  # approval, signal: the signal's name


class _Rekey:
    """Rewrites the original's logical runs and keys to the fork's."""

    def __init__(
        self,
        original_id: str,
        fork_id: str,
        pinned: str | None,
        digest: str,
        version: str | None = None,
    ) -> None:
        self.original_id = original_id
        self.fork_id = fork_id
        self.pinned = pinned
        self.digest = digest
        self.version = version

    def digest_of(self, pinned: str | None) -> str | None:
        """Steps of the digest pinned at the fork point replay under the current one;
        steps of an older pin (before a drift restart) stay dead history."""
        return self.digest if pinned == self.pinned else pinned

    def version_of(self, pinned: str | None, version: str | None) -> str | None:
        """The version label that goes with ``digest_of(pinned)``."""
        return self.version if pinned == self.pinned else version

    def logical_run(self, logical: str) -> tuple[str, str]:
        """The fork's logical run (lane included) and that run without its lane."""
        rest = logical[len(self.original_id) :] if logical.startswith(self.original_id) else ""
        head, at, tail = rest.rpartition("@")
        if not at or len(tail) < _DIGEST_LEN:  # not a flow step: only the run id changes
            return self.fork_id + rest, self.fork_id + rest
        digest, lane = tail[:_DIGEST_LEN], tail[_DIGEST_LEN:]
        bare = f"{self.fork_id}{head}@{self.digest_of(digest)}"
        return bare + lane, bare

    def step(self, event: Run.StepStarted) -> dict[str, Any]:
        fields = _fields(event)
        logical, bare = self.logical_run(event.logical_run)
        original_bare = event.logical_run
        lane_len = len(logical) - len(bare)
        if lane_len:
            original_bare = original_bare[:-lane_len]
        payload = _payload(event.kind, event.name, event.args)
        if idempotency_key(original_bare, event.callsite, payload) == event.key:
            fields["key"] = idempotency_key(bare, event.callsite, payload)
        # else: a tool's idempotency_key override chose the key; it stays.
        fields["logical_run"] = logical
        return fields


@dataclass
class _Walk:
    """The fold of the original's history up to the fork point."""

    copies: list[_Copy] = dataclasses.field(default_factory=list)
    status: dict[int, str] = dataclasses.field(default_factory=dict)
    #: Whether another step was still running when each step started.
    overlapped: dict[int, bool] = dataclasses.field(default_factory=dict)
    node: str | None = None
    pending_input: Wait | None = None

    def copy(self, event: Any, **changes: Any) -> None:
        self.copies.append(_Copy(type(event), _fields(event) | changes))


def _pinned_at(events: Sequence[Any]) -> str | None:
    pinned: str | None = events[0].flow_digest
    for event in events:
        if isinstance(event, Run.FlowPinned):
            pinned = event.flow_digest
    return pinned


def _walk(events: Sequence[Any], rekey: _Rekey) -> _Walk:
    walk = _Walk()
    for event in events[1:]:
        if isinstance(event, Run.StepStarted):
            walk.overlapped[event.index] = "running" in walk.status.values()
            walk.status[event.index] = "running"
            walk.copies.append(_Copy(Run.StepStarted, rekey.step(event)))
        elif isinstance(event, Run.StepFinished | Run.StepFailed):
            walk.status[event.index] = "finished"
            walk.copy(event)
        elif isinstance(event, Run.StepRetried):
            walk.status[event.index] = "running"
            walk.copy(event)
        elif type(event).__name__.startswith("Step"):
            walk.copy(event)
        elif isinstance(event, Run.TurnStarted):
            walk.copy(event, idempotency_key=None)
        elif isinstance(event, Run.NodeEntered):
            walk.node = event.node
            walk.copy(event)
        elif isinstance(event, Run.FlowPinned):
            walk.node = event.node
            walk.copy(
                event,
                flow_digest=rekey.digest_of(event.flow_digest),
                flow_version=rekey.version_of(event.flow_digest, event.flow_version),
            )
        elif isinstance(event, Run.MessageAppended):
            walk.copy(event)
        elif isinstance(event, Run.InputAccepted):
            walk.pending_input = None
            walk.copies.append(_Copy(Run.MessageAppended, {"message": event.message}))
        elif isinstance(event, Run.Paused):
            wait = Wait.from_json(event.waiting_for)
            walk.pending_input = wait if wait.kind == "input" else None
        elif isinstance(event, Run.SignalAccepted):
            walk.pending_input = None
    return walk


def _refuse_unsettled(walk: _Walk, run_id: str, at_step: int, step_count: int) -> None:
    """A fork point needs every earlier step settled: none inside a parallel batch."""
    running = sorted(i for i, s in walk.status.items() if s == "running")
    if not running:
        return
    if at_step == step_count:
        msg = (
            f"cannot fork run {run_id} at step {at_step}: step {running[0]} was still running "
            f"there (its result is in doubt); fork at step {running[0]} or earlier"
        )
        raise InvalidArgumentError(msg)
    batch_start = max((i for i, o in walk.overlapped.items() if not o and i < at_step), default=0)
    msg = (
        f"cannot fork run {run_id} at step {at_step}: it is inside a parallel batch (it started "
        f"while step {running[0]} was still running); fork at step {batch_start}, where the "
        "batch starts, or after the batch"
    )
    raise InvalidArgumentError(msg)


def _refuse_inside_batch(starts: Sequence[Run.StepStarted], at_step: int, run_id: str) -> None:
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
    ``0..len(steps)``, and a point inside a parallel batch.
    """
    created = events[0]
    run_id = str(created.originator_id)
    if created.kind != "flow":
        msg = f"run {run_id} is a {created.kind} run; only flow runs fork"
        raise InvalidArgumentError(msg)
    starts = [i for i, e in enumerate(events) if isinstance(e, Run.StepStarted)]
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
    rekey = _Rekey(run_id, fork_id, _pinned_at(prefix), digest, version)
    walk = _walk(prefix, rekey)
    _refuse_unsettled(walk, run_id, at_step, step_count)
    if walk.node is None:
        msg = f"run {run_id} never entered a node of its flow; start a new run instead"
        raise InvalidArgumentError(msg)
    wait = None
    if walk.pending_input is not None:  # the same wait, in the fork's logical run
        _, logical = rekey.logical_run(walk.pending_input.logical_run)
        wait = dataclasses.replace(walk.pending_input, logical_run=logical, request_id=uuid4().hex)
    return ForkPlan(run_id, at_step, walk.node, tuple(walk.copies), wait)
