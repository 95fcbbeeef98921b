"""What a recorded run was given from outside, in order, to re-drive it (internal).

``replay_with`` re-drives a run from its first turn, so it needs what came
from outside the run, in the order it came: the first message (and the flow
a conversation entered with it), input to ``collect`` waits, deliveries to
approvals and signals, messages sent to it, a conversation's later user turns,
the re-drive of an errored run, the budget a call gave the run, and a stop from outside (a
cancel, a migration, an abandon). Everything else the run did (its steps,
its own messages, node entries, waits, ends) the re-drive does again itself.
Reading the stored events is one dispatch over the catalogue, so a new
stored event must say here whether it is given from outside.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .._journal import catalogue as stored
from .._journal.wait import IN_DOUBT
from ..shapes import SignalDelivery

__all__ = ["Given", "Recording", "read_recording"]


@dataclass
class Given:
    """One thing the run was given from outside, at a turn's opening."""

    kind: Literal["start", "turn", "input", "delivery", "resume", "abort", "message"]
    text: str | None = None
    #: The flow a conversation's turn entered (``runtime.run(..., flow_name=)``).
    flow: str | None = None
    #: The outcome a stop from outside gave the run (``abort``).
    outcome: str | None = None
    delivery: SignalDelivery | None = None
    #: The budget the call gave the run (``runtime.run(..., budget=)``), as stored.
    budget: dict[str, Any] | None = None
    #: A message sent to the run (``runtime.send``): ``message_id``, ``name``,
    #: ``payload``, ``actor``.
    mail: dict[str, Any] | None = None


@dataclass
class Recording:
    """A recorded run's origin and what it was given, oldest first."""

    kind: str = "flow"
    agent: str | None = None
    flow: str | None = None
    forked: bool = False
    #: The digest (and version label) each flow was first pinned to in the run.
    pins: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    given: deque[Given] = field(default_factory=deque)
    #: Whether the latest opening has started no step yet (a pin then belongs to it).
    opening: bool = False
    #: A budget a call gave the run, saved before the opening it belongs to.
    budget: dict[str, Any] | None = None
    #: How many durable sleeps of the run were woken.
    wakes: int = 0

    @property
    def start(self) -> Given:
        return self.given[0] if self.given else Given("start")


def _text(message: Mapping[str, Any] | None) -> str | None:
    content = None if message is None else message.get("content")
    return content if isinstance(content, str) else None


def _given(recording: Recording, given: Given) -> None:
    given.budget, recording.budget = recording.budget, None
    recording.given.append(given)
    recording.opening = True


def _created(r: Recording, e: stored.RunCreated) -> None:
    r.kind, r.agent, r.flow = e.kind, e.agent, e.flow
    if e.flow is not None and e.flow_digest is not None:
        r.pins.setdefault(e.flow, (e.flow_digest, e.flow_version))


def _forked(r: Recording, e: stored.Forked) -> None:
    r.forked = True


def _turn_started(r: Recording, e: stored.TurnStarted) -> None:
    _given(r, Given("start" if not r.given else "turn", _text(e.message)))


def _flow_pinned(r: Recording, e: stored.FlowPinned) -> None:
    r.pins.setdefault(e.flow, (e.flow_digest, e.flow_version))
    if r.opening and r.given and r.given[-1].kind in ("start", "turn"):
        r.given[-1].flow = e.flow  # a conversation's turn that entered a flow


def _message_appended(r: Recording, e: stored.MessageAppended) -> None:
    if e.message.get("role") == "user":  # only a turn's opening appends a user's message
        _given(r, Given("turn", _text(e.message)))


def _input_accepted(r: Recording, e: stored.InputAccepted) -> None:
    _given(r, Given("input", _text(e.message)))


def _delivered(r: Recording, e: stored.DeliveryAccepted) -> None:
    if e.name == IN_DOUBT:
        return  # a crash's question: a re-drive, which does not crash, is never asked it
    delivery = SignalDelivery(signal_id=e.signal_id, name=e.name, payload=e.payload, actor=e.actor)
    _given(r, Given("delivery", delivery=delivery))


def _mail(r: Recording, e: stored.MailReceived) -> None:
    mail = {"message_id": e.message_id, "name": e.name, "payload": e.payload, "actor": e.actor}
    r.given.append(Given("message", mail=mail))  # not a turn's opening: no budget of its own


def _resumed(r: Recording, e: stored.Resumed) -> None:
    _given(r, Given("resume"))


def _budget_set(r: Recording, e: stored.BudgetSet) -> None:
    r.budget = e.budget  # saved before the opening of the call that gave it


def _aborted(r: Recording, e: stored.Aborted) -> None:
    _given(r, Given("abort", outcome=e.reason))


def _woken(r: Recording, e: stored.TimerFired) -> None:
    r.wakes += 1  # the re-drive wakes its own sleeps; this bounds how many


def _step_intended(r: Recording, e: stored.StepIntended) -> None:
    r.opening = False


_READ: Mapping[type[stored.Event], Callable[[Recording, Any], None] | None] = stored.dispatch(
    "replay",
    {
        stored.RunCreated: _created,
        stored.Forked: _forked,
        stored.TurnStarted: _turn_started,
        stored.FlowPinned: _flow_pinned,
        stored.MessageAppended: _message_appended,
        stored.InputAccepted: _input_accepted,
        stored.DeliveryAccepted: _delivered,
        stored.Resumed: _resumed,
        stored.BudgetSet: _budget_set,
        stored.Aborted: _aborted,
        stored.TimerFired: _woken,
        stored.StepIntended: _step_intended,
        stored.MailReceived: _mail,
    },
    skipped=(
        # Done again by the re-drive itself (its own steps, messages, waits, ends).
        stored.NodeEntered,
        stored.StepSucceeded,
        stored.StepErrored,
        stored.AttemptFailed,
        stored.RetryAllowed,
        stored.AttemptStarted,
        stored.Paused,
        stored.Finished,
        stored.Errored,
        # A takeover, a raise: what the re-drive's own turns and deliveries do.
        stored.Recovered,
        stored.BudgetRaised,
        # A message waking a receive: what the re-drive's own send does.
        stored.MailDelivered,
        # A child's link to its parent, a typed flow's input (its start's first
        # message holds the input as JSON, which the re-drive's start gives again).
        stored.ParentLinked,
        stored.FlowInputGiven,
        # Whose data the run holds: nothing its code decides on (the scratch copy
        # is never sealed under a subject's key).
        stored.SubjectAssigned,
        # Bookkeeping: nothing the run was given to decide on.
        stored.Migrated,
        stored.TurnRecorded,
        stored.InboundKeyRecorded,
        stored.LeaseTaken,
        stored.LeaseReleased,
    ),
)


def read_recording(events: Sequence[Any]) -> Recording:
    """The recording of a run, from its stored events (oldest first)."""
    recording = Recording()
    for event in events:
        handler = _READ.get(type(event))
        if handler is not None:
            handler(recording, event)
    return recording
