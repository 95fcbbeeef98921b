"""Every event a run store holds: the one catalogue of stored events (internal).

Each class is declared once, here. Its stored ``TOPIC`` is its family's
prefix and its name (``kuralle_es:Run.Paused``), set by ``_Stored`` unless
the class declares another: the topics are history, what every store written
by an earlier release holds, so a class keeps its topic when renamed or moved
(it then declares the old one) and a topic is never reused. Every class
stores ``class_version`` 1, inherited, until its stored shape changes: then
it declares its own higher version and an upcaster (``upcast_vN_vN+1``, a
static method that rewrites the older stored state in place), so runs stored
by earlier releases keep loading (docs/concepts.md, "Stored runs survive
upgrades"). ``tests/test_catalogue.py`` pins every topic and version stored
so far.

The classes hold data only. Every reader of the journal is an exhaustive
dispatch over ``RUN_EVENTS``: the aggregate's fold (``run``), the views
(``views.fold``), the public events (``events.translate``), the timeline
(``views.timeline``), fork (``_runtime.fork``), the re-drive of a recording
(``_operations.recording``) and the crash kit (``testing``) each handle or
explicitly skip every class, and
``tests/test_catalogue.py`` names any reader that forgot one.

Class names differ from the public event types of ``kuralle_es.events``
(``StepIntended`` is stored, ``events.StepStarted`` is what followers read).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, ClassVar, TypeVar

from eventsourcing.domain import Aggregate
from eventsourcing.utils import register_topic

from .sites import split_lane
from .spending import usage_kept_clear

__all__ = [
    "MAIL_EVENTS",
    "RESULTS",
    "RUN_EVENTS",
    "SESSION_EVENTS",
    "STARTS",
    "STEP_EVENTS",
    "Aborted",
    "AttemptFailed",
    "AttemptStarted",
    "BudgetRaised",
    "BudgetSet",
    "DeliveryAccepted",
    "Errored",
    "Event",
    "Finished",
    "FlowInputGiven",
    "FlowPinned",
    "Forked",
    "InboundKeyRecorded",
    "InputAccepted",
    "LeaseReleased",
    "LeaseTaken",
    "MailDelivered",
    "MailReceived",
    "MessageAppended",
    "Migrated",
    "NodeEntered",
    "ParentLinked",
    "Paused",
    "Recovered",
    "Resumed",
    "RetryAllowed",
    "RunCreated",
    "RunIndexed",
    "SessionEvent",
    "SessionIndexCreated",
    "StepErrored",
    "StepIntended",
    "StepSucceeded",
    "SubjectAssigned",
    "TimerFired",
    "TurnRecorded",
    "TurnStarted",
    "dispatch",
]


class _Stored(Aggregate.Event):
    """A stored event, of a run or of a session's index: applied by its aggregate's
    one ``fold``."""

    #: The stored topic: history, never changed (see the module's docstring).
    TOPIC: ClassVar[str]
    #: The stored shape's version; a class whose shape changed declares its own.
    class_version: ClassVar[int] = 1
    #: Which of its fields are payload (dotted paths into them): sealed under the
    #: run's subject's key when stored, ``Redacted`` once it is erased; the rest
    #: stays readable (docs/privacy.md). Every class declares its own, even ``()``
    #: (``tests/test_catalogue.py``).
    PAYLOAD: ClassVar[tuple[str, ...]] = ()
    #: What of a payload value stays readable beside it, by path (a function of it).
    PAYLOAD_CLEAR: ClassVar[Mapping[str, Callable[[Any], dict[str, Any] | None]]] = {}
    #: What the topic of each event of a family (a subclass that sets it) begins with.
    _TOPIC_PREFIX: ClassVar[str]

    def __init_subclass__(cls) -> None:
        """An event of a family stores, unless it declares its own ``TOPIC``, its
        family's prefix and its class name."""
        super().__init_subclass__()
        if "_TOPIC_PREFIX" not in vars(cls) and "TOPIC" not in vars(cls):
            cls.TOPIC = cls._TOPIC_PREFIX + cls.__name__

    def apply(self, aggregate: Any) -> None:
        aggregate.fold(self)


class Event(_Stored):
    """A stored event of a run. Its fold is the aggregate's (``Run.fold``)."""

    _TOPIC_PREFIX = "kuralle_es:Run."


class SessionEvent(_Stored):
    """A stored event of a session's index of runs (``SessionRuns.fold``)."""

    _TOPIC_PREFIX = "kuralle_es:SessionRuns."


# ---------------------------------------------------------------- a run's life
class RunCreated(Event, Aggregate.Created):
    """A run began: its session, kind, agent, and the flow it is pinned to.

    v2: ``flow_version``, the label of the pinned flow definition.
    """

    PAYLOAD = ()

    TOPIC = "kuralle_es:Run.Created"
    class_version = 2
    session_id: str
    kind: str
    agent: str | None
    flow: str | None
    flow_digest: str | None
    flow_version: str | None

    @staticmethod
    def upcast_v1_v2(state: dict[str, Any]) -> None:
        """Runs created before flows had versions: pinned to no version."""
        state["flow_version"] = None


class SubjectAssigned(Event):
    """The run's data subject, when it is not its session id (``runtime.run(...,
    subject=)``): whose key seals its payloads, whose erasure redacts them.
    Saved with the run's ``RunCreated``; a run without one belongs to its session."""

    PAYLOAD = ()
    subject: str


class Forked(Event):
    """This run is a fork of ``from_run_id`` at step ``at_step`` (docs/howto/fork.md)."""

    PAYLOAD = ()

    from_run_id: str
    at_step: int


class ParentLinked(Event):
    """This run is a child run, started by step ``step`` of run ``run_id`` (of session
    ``session_id``), which waits for it or will (docs/child-runs.md). Saved with
    the child's creation, so a child never exists without knowing its parent."""

    PAYLOAD = ()

    run_id: str
    session_id: str
    step: int


class FlowInputGiven(Event):
    """The validated input a typed flow was started with (``define_flow(..., input=...)``),
    as JSON data: what node code reads as ``ctx.input``, on every replay and in any
    process. Saved with the run's creation."""

    PAYLOAD = ("input",)

    input: dict[str, Any]


class TurnStarted(Event):
    """A turn began: a fresh epoch for a conversation's new user input."""

    PAYLOAD = ("message.content", "message.tool_calls")

    epoch: int
    message: dict[str, Any] | None
    idempotency_key: str | None


class NodeEntered(Event):
    """The flow moved to ``node`` with ``state``; its effects count from ``callsite_base``."""

    PAYLOAD = ("state",)

    flow: str | None
    node: str | None
    state: dict[str, Any]
    callsite_base: int


class FlowPinned(Event):
    """The run's flow restarts from ``node`` under a new definition.

    v2: ``flow_version``.
    """

    PAYLOAD = ()

    class_version = 2
    flow: str
    flow_digest: str
    node: str
    flow_version: str | None

    @staticmethod
    def upcast_v1_v2(state: dict[str, Any]) -> None:
        """Pins stored before flows had versions: no version."""
        state["flow_version"] = None


class MessageAppended(Event):
    PAYLOAD = ("message.content", "message.tool_calls")
    message: dict[str, Any]


# ------------------------------------------------------------------- steps
class StepIntended(Event):
    """Intent: an effect is about to run at ``callsite`` of ``logical_run``, in
    ``lane``, with ``key``.

    ``batch`` is the callsite of the first effect of the parallel batch this
    one belongs to (one ``gather`` of effects, or one model turn's
    parallel-safe tool calls), or None for an effect requested alone; it is
    recorded when requested, so every backend agrees on it.

    v2: ``batch``, and ``lane`` apart from ``logical_run`` (it was appended to it).
    """

    PAYLOAD = ("args",)

    TOPIC = "kuralle_es:Run.StepStarted"
    class_version = 2
    index: int
    key: str
    kind: str
    name: str
    callsite: int
    logical_run: str
    lane: str
    args: Any
    batch: int | None

    @staticmethod
    def upcast_v1_v2(state: dict[str, Any]) -> None:
        """Intents stored before batches were recorded (not known to be in one),
        with the lane appended to the logical run: split it off."""
        state["batch"] = None
        state["logical_run"], state["lane"] = split_lane(state["logical_run"])


class StepSucceeded(Event):
    """Result: the effect at step ``index`` returned ``result_json``."""

    PAYLOAD = ("result_json",)
    #: A model's reported token usage stays readable: usage and cost outlive erasure.
    PAYLOAD_CLEAR: ClassVar[Mapping[str, Callable[[Any], dict[str, Any] | None]]] = {
        "result_json": usage_kept_clear
    }

    TOPIC = "kuralle_es:Run.StepFinished"
    index: int
    result_json: str


class StepErrored(Event):
    """The effect at step ``index`` failed for good: its error is frozen."""

    PAYLOAD = ("error.message", "error.data")

    TOPIC = "kuralle_es:Run.StepFailed"
    index: int
    error: dict[str, Any]


class AttemptFailed(Event):
    """An attempt failed and the tool's retry policy allows another (same key).

    The step stays ``running`` with this error until the next attempt, due at
    ``retry_at``; a resume then is not in doubt: it waits until ``retry_at``
    and starts that attempt.
    """

    PAYLOAD = ("error.message", "error.data")

    TOPIC = "kuralle_es:Run.StepAttemptFailed"
    index: int
    error: dict[str, Any]
    retry_at: datetime


class RetryAllowed(Event):
    """A human answered an in-doubt step with "retry": execute it again, same key."""

    PAYLOAD = ()

    TOPIC = "kuralle_es:Run.StepRetryAllowed"
    index: int


class AttemptStarted(Event):
    """Step ``index`` is executed again (same key): after a crash left it running,
    after a retried attempt's backoff, or a ``replay=False`` read's next pass.

    Saved before the new attempt, it uses up a human's "retry" answer: if this
    attempt dies too, the next resume asks again.
    """

    PAYLOAD = ()

    TOPIC = "kuralle_es:Run.StepRetried"
    index: int


# ------------------------------------------------------------- waits, ends
class Paused(Event):
    """The run waits for ``waiting_for`` (a ``Wait``'s JSON)."""

    PAYLOAD = ("waiting_for.title", "waiting_for.description", "waiting_for.operation.args")

    waiting_for: dict[str, Any]


class InputAccepted(Event):
    """New user input for a run that waited for it (a ``collect`` node)."""

    PAYLOAD = ("message.content", "message.tool_calls")

    message: dict[str, Any]


class DeliveryAccepted(Event):
    """A delivered signal (an approval too) passed every check; the run may re-execute."""

    PAYLOAD = ("payload",)

    TOPIC = "kuralle_es:Run.SignalAccepted"
    signal_id: str
    name: str
    payload: Any
    actor: str | None


class TimerFired(Event):
    """A durable sleep's wake time came: a sweeper wakes the run paused on it."""

    PAYLOAD = ()

    request_id: str


class Resumed(Event):
    """A run that had failed is driven again (after a fix or a transient fault)."""

    PAYLOAD = ()


class Recovered(Event):
    """A worker takes over a running run from ``previous_holder``, whose lease
    expired mid-turn: saved in the compare-and-set opening of the new turn, so
    a stale writer's next save fails."""

    PAYLOAD = ()

    previous_holder: str | None


class Finished(Event):
    PAYLOAD = ("output", "state")
    outcome: str | None
    output: Any
    agent: str | None
    state: dict[str, Any]


class Errored(Event):
    PAYLOAD = ("error.message", "error.data")
    error: dict[str, Any]


class Aborted(Event):
    PAYLOAD = ()
    reason: str


class Migrated(Event):
    """The run was forked at ``at_step`` onto the flow's newest definition as run
    ``to_run_id`` (``runtime.migrate``); saved with its ``Aborted``."""

    PAYLOAD = ()

    to_run_id: str
    at_step: int


class TurnRecorded(Event):
    """The result of a turn started with an inbound idempotency key."""

    PAYLOAD = (
        "result.output",
        "result.waiting_for.title",
        "result.waiting_for.description",
        "result.waiting_for.operation.args",
    )

    idempotency_key: str
    result: dict[str, Any]


class InboundKeyRecorded(Event):
    """A call made with an inbound idempotency key opened a turn of this run:
    the key, and the digest of what it asked (its request), so a retry is
    answered from the run whatever became of that turn (a crash, a recovery by
    another worker) and the same key with another request is refused."""

    PAYLOAD = ()

    idempotency_key: str
    request: str


class BudgetSet(Event):
    """The budget a caller gave this run (``runtime.run(..., budget=)``)."""

    PAYLOAD = ()

    budget: dict[str, Any] | None


class BudgetRaised(Event):
    """A human approved spending past the budget and raised these limits."""

    PAYLOAD = ()

    raise_to: dict[str, Any]


class LeaseTaken(Event):
    """Stored by releases before 0.2, when a lease was an event; no longer written.

    A lease is now a record apart from the journal (``leases``). Runs stored
    earlier still hold these, and the fold still reads them.
    """

    PAYLOAD = ()

    holder: str
    expires_at: datetime


class LeaseReleased(Event):
    """Stored by releases before 0.2 (see ``LeaseTaken``); no longer written."""

    PAYLOAD = ()


# ------------------------------------------------------------------ mailbox
class MailReceived(Event):
    """A message (``runtime.send``) arrived in the run's mailbox, whatever the run
    was doing; ``ctx.receive(name)`` takes it later, oldest first. Not a chat
    message (``MessageAppended``). Appended by the sender alone, so a turn that
    drives the run meanwhile takes it into its own next save (docs/messages.md)."""

    PAYLOAD = ("payload",)

    message_id: str
    name: str
    payload: Any
    actor: str | None


class MailDelivered(Event):
    """A message arrived for the ``receive`` the run waited in (its wait's
    ``request_id``): the run runs again, and the receive takes its message."""

    PAYLOAD = ()

    request_id: str
    message_id: str


# ----------------------------------------------------------- session index
class SessionIndexCreated(SessionEvent, Aggregate.Created):
    PAYLOAD = ()
    TOPIC = "kuralle_es:SessionRuns.Created"
    session_id: str


class RunIndexed(SessionEvent):
    PAYLOAD = ()
    TOPIC = "kuralle_es:SessionRuns.RunAdded"
    run_id: str


#: The events of one step (each names it by ``index``).
STEP_EVENTS = (
    StepIntended,
    StepSucceeded,
    StepErrored,
    AttemptFailed,
    RetryAllowed,
    AttemptStarted,
)
#: Every stored event class of a run, in the order a run first meets them.
RUN_EVENTS: tuple[type[Event], ...] = (
    RunCreated,
    SubjectAssigned,
    Forked,
    ParentLinked,
    FlowInputGiven,
    TurnStarted,
    NodeEntered,
    FlowPinned,
    MessageAppended,
    *STEP_EVENTS,
    Paused,
    InputAccepted,
    DeliveryAccepted,
    TimerFired,
    Resumed,
    Recovered,
    Finished,
    Errored,
    Aborted,
    Migrated,
    TurnRecorded,
    BudgetSet,
    BudgetRaised,
    LeaseTaken,
    LeaseReleased,
    InboundKeyRecorded,
    MailReceived,
    MailDelivered,
)
#: The events a sender appends to a run without its lease: a turn driving the
#: run meanwhile takes them into its own state instead of losing its save.
MAIL_EVENTS: tuple[type[Event], ...] = (MailReceived,)
#: Every stored event class of a session's index.
SESSION_EVENTS: tuple[type[SessionEvent], ...] = (SessionIndexCreated, RunIndexed)
# Events declared outside an aggregate class are not registered by
# ``eventsourcing``: their explicit topics are registered here, once.
_ALL: tuple[type[Event] | type[SessionEvent], ...] = (*RUN_EVENTS, *SESSION_EVENTS)
for _event_class in _ALL:
    register_topic(_event_class.TOPIC, _event_class)

#: The events that start an execution of a step (an intent boundary).
STARTS: tuple[type[Event], ...] = (StepIntended, AttemptStarted)
#: The events that settle a step (a result or a frozen error).
RESULTS: tuple[type[Event], ...] = (StepSucceeded, StepErrored)


_H = TypeVar("_H")


def dispatch(
    reader: str,
    handlers: Mapping[type[Event], _H],
    skipped: Iterable[type[Event]] = (),
) -> dict[type[Event], _H | None]:
    """A reader's dispatch table over the whole catalogue: ``handlers`` for the
    events it reads, None for the ones it ``skipped`` on purpose.

    Raises ``TypeError`` when an event of ``RUN_EVENTS`` is neither handled nor
    skipped, or both, so a reader that forgot a new event fails at import, and
    the catalogue test names it.
    """
    skips = frozenset(skipped)
    handled = frozenset(handlers)
    missing = [c.__name__ for c in RUN_EVENTS if c not in handled | skips]
    both = [c.__name__ for c in handled & skips]
    unknown = [c.__name__ for c in (handled | skips) - frozenset(RUN_EVENTS)]
    if missing or both or unknown:
        msg = (
            f"the {reader} reader must handle or skip every stored event once: "
            f"missing {missing}, both {both}, not in the catalogue {unknown}"
        )
        raise TypeError(msg)
    table: dict[type[Event], _H | None] = {c: handlers.get(c) for c in RUN_EVENTS}
    return table
