"""Turn commands: one class per way to open a turn (internal).

Each command finds its run (fail-closed: an unknown or foreign run is
``RunNotFoundError``), decides what opening the run needs, or refuses, and
its opening says what the turn's first save carries besides the lease. A
command that resumes a run in a flow checks the flow's pinned digest first,
before any wait is matched (``FlowDriftError``). Refusals raise before
anything is written.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID, uuid4, uuid5

from pydantic import BaseModel

from .._clock import SYSTEM_CLOCK, Clock
from .._definitions.agents import Agent
from .._definitions.flow_input import FlowInput, flow_input
from .._definitions.flows import Flow
from .._journal.keys import canonical_json, sha256_hex
from .._journal.leases import Lease
from .._journal.run import ParentLink, Run
from .._journal.spending import Prices
from .._journal.store import RunStore
from ..errors import (
    FlowDriftError,
    InvalidArgumentError,
    RunNotFoundError,
    SignalMismatchError,
)
from ..shapes import Message, SignalDelivery
from . import deliveries
from .fork import ForkPlan, plan_fork
from .registry import Registry
from .replay_source import ReplaySource
from .writer import RunWriter

__all__ = [
    "Command",
    "Converse",
    "Deliver",
    "Fork",
    "Input",
    "Opening",
    "Recover",
    "RestartFlow",
    "Resume",
    "ResumeInDoubt",
    "StartFlow",
    "TurnEnv",
    "Wake",
    "conversation_run_id",
    "drifted_run",
    "in_doubt",
    "load_run",
    "new_flow_run",
]

#: Namespace of conversation run ids (one run per session).
CONVERSATION_NAMESPACE = UUID("5d0c3a51-3f7e-4d43-a0a8-1f4a8c6f9e27")


def conversation_run_id(session_id: str) -> UUID:
    return uuid5(CONVERSATION_NAMESPACE, session_id)


def flow_run_id(idempotency_key: str | None) -> UUID:
    """A fresh id for a new flow run; derived from the inbound idempotency key alone
    when there is one, so that a retried start finds (or races to create) the same
    run, and the same key sent with another flow or session finds it too (and is
    refused: docs/guarantees.md, "At the edges")."""
    if idempotency_key is None:
        return uuid4()
    return uuid5(CONVERSATION_NAMESPACE, canonical_json(["flow-start", idempotency_key]))


def _legacy_flow_run_id(session_id: str, flow_name: str, idempotency_key: str) -> UUID:
    """The id releases before inbound keys were folded gave a keyed start (scoped to
    its session and flow): a start retried after an upgrade still finds its run."""
    return uuid5(CONVERSATION_NAMESPACE, canonical_json([session_id, flow_name, idempotency_key]))


@dataclass(frozen=True)
class TurnEnv:
    """What a turn works with: definitions, the store, and the worker's settings."""

    registry: Registry
    store: RunStore
    holder: str
    lease_ttl: float
    max_tool_concurrency: int
    #: A durable sleep up to this many seconds waits inline; a longer one pauses the run.
    inline_sleep_limit: float = 1.0
    #: What 1,000 tokens of each model cost (``Runtime(prices=...)``), for budgets.
    prices: Prices | None = None
    #: What the turn dates by (``Runtime(clock=...)``); a lease is the store's clock's.
    clock: Clock = SYSTEM_CLOCK
    #: Recorded outcomes the turn reuses instead of executing (``replay_with`` only).
    source: ReplaySource | None = None


async def load_run(
    store: RunStore, run_id: str, session_id: str, *, history: bool = False
) -> Run | None:
    """The run, or None when it is unknown or of another session; with ``history``,
    folded with every step it journaled (``RunStore.load_history``)."""
    run = await store.load_async(run_id, history=history)
    if run is None or run.session_id != session_id:
        return None
    return run


async def _addressed(env: TurnEnv, run_id: str, session_id: str) -> Run:
    run = await load_run(env.store, run_id, session_id)
    if run is None:
        raise RunNotFoundError(run_id, session_id)
    return run


def _is_live_in_flow(run: Run) -> bool:
    return run.active_flow is not None and run.status not in ("finished", "aborted")


def require_current_flow(run: Run, registry: Registry) -> None:
    """Refuse a live run pinned to a flow digest that no version of its flow has now."""
    if run.active_flow is None or not _is_live_in_flow(run):
        return
    _, flow = registry.flow(run.active_flow)
    if registry.pinned(run.active_flow, run.flow_digest, run.flow_version) is None:
        raise FlowDriftError(run.run_id, run.flow_digest, flow.digest)


async def drifted_run(env: TurnEnv, run_id: str, session_id: str) -> tuple[Run, Flow]:
    """The run and the current definition of its flow; refused unless it drifted."""
    run = await _addressed(env, run_id, session_id)
    if run.active_flow is not None and _is_live_in_flow(run):
        _, flow = env.registry.flow(run.active_flow)
        if env.registry.pinned(run.active_flow, run.flow_digest, run.flow_version) is None:
            return run, flow
    msg = (
        f"run {run_id!r} has no flow drift to resolve (it is {run.status}"
        f"{', in flow ' + repr(run.active_flow) if run.active_flow else ', in no flow'}"
        f"{' pinned to its current digest' if run.active_flow else ''}); "
        "resolve_drift is only for a run that raised FlowDriftError"
    )
    raise InvalidArgumentError(msg)


# ------------------------------------------------------------------ openings
class Opening:
    """What a turn's first save carries besides the lease: changes it hands the
    run's writer, the one code that changes a run (``apply``), saved with the
    lease by ``open``."""

    #: A flow this opening enters (with its agent), overriding the run's own.
    enters: tuple[Agent, Flow] | None = None
    #: Whether the opening itself records a takeover of the run (a recovery).
    takes_over: bool = False

    async def open(self, writer: RunWriter, env: TurnEnv) -> None:
        """Hand the writer the opening's changes and save them (with the lease)."""
        self.apply(writer, env)
        await writer.saver.persist()

    def apply(self, writer: RunWriter, env: TurnEnv) -> None:
        """The opening's changes, saved by ``open`` (none: only the lease)."""


def _repin(writer: RunWriter, flow: Flow) -> None:
    writer.repin(flow.name, flow.digest, flow.start, flow.version)


def _user_message(text: str | None) -> Message | None:
    return Message(role="user", content=text) if text else None


def new_flow_run(
    start: FlowInput, idempotency_key: str | None, parent: ParentLink | None = None
) -> Opening:
    """The opening of a new flow run started with ``start`` (a child's with its ``parent``)."""
    return _NewRun(_user_message(start.text), idempotency_key, given=start.data, parent=parent)


@dataclass
class _NewRun(Opening):
    message: Message | None
    idempotency_key: str | None
    enters: tuple[Agent, Flow] | None = None
    #: A typed flow's validated input (``ctx.input``), saved with the creation.
    given: dict[str, Any] | None = None
    #: The run that starts this one, for a child run (docs/child-runs.md).
    parent: ParentLink | None = None

    async def open(self, writer: RunWriter, env: TurnEnv) -> None:
        if self.parent is not None:
            writer.link_parent(self.parent)
        if self.given is not None:
            writer.give_input(self.given)
        writer.start_turn(0, self.message, self.idempotency_key)
        if writer.active_flow is not None:
            _, flow = env.registry.run_flow(
                writer.active_flow, writer.flow_digest, writer.flow_version
            )
            writer.enter_node(flow.name, flow.start, {}, 0)
        if self.enters is not None:
            _repin(writer, self.enters[1])
        await writer.saver.create()


@dataclass
class _NewEpoch(Opening):
    """A fresh user turn of a conversation: a new epoch (new keys)."""

    message: Message | None
    idempotency_key: str | None
    enters: tuple[Agent, Flow] | None = None

    def apply(self, writer: RunWriter, env: TurnEnv) -> None:
        writer.start_turn(writer.epoch + 1, self.message, self.idempotency_key)
        if self.enters is not None:
            _repin(writer, self.enters[1])


@dataclass
class _FlowMessage(Opening):
    """A user message to a conversation inside a flow: the flow's epoch (its keys) stays."""

    message: Message

    def apply(self, writer: RunWriter, env: TurnEnv) -> None:
        writer.append_message(self.message)
        writer.resume()


@dataclass
class _AcceptInput(Opening):
    message: Message

    def apply(self, writer: RunWriter, env: TurnEnv) -> None:
        writer.accept_input(self.message)


@dataclass
class _AcceptDelivery(Opening):
    delivery: SignalDelivery
    payload: Any

    async def open(self, writer: RunWriter, env: TurnEnv) -> None:
        await deliveries.accept(writer, self.delivery, self.payload)


@dataclass
class _Repin(Opening):
    """A drifted flow restarts from its start node under its current definition."""

    flow: Flow

    def apply(self, writer: RunWriter, env: TurnEnv) -> None:
        _repin(writer, self.flow)


class _Resume(Opening):
    def apply(self, writer: RunWriter, env: TurnEnv) -> None:
        writer.resume()


@dataclass
class _Recovered(Opening):
    """An orphan taken over: the new lease, and who held the expired one."""

    previous_holder: str | None
    takes_over: bool = True

    def apply(self, writer: RunWriter, env: TurnEnv) -> None:
        writer.take_over(self.previous_holder)


@dataclass
class _TimerFired(Opening):
    """A due durable sleep ends: the run re-executes its node, where the sleep returns."""

    request_id: str

    def apply(self, writer: RunWriter, env: TurnEnv) -> None:
        writer.fire_timer(self.request_id)


def _input_opening(run: Run, text: str, env: TurnEnv) -> Opening | None:
    """What input does to an existing run (drift checked first)."""
    require_current_flow(run, env.registry)
    message = Message(role="user", content=text)
    wait = run.waiting
    if run.status == "paused" and wait is not None:
        if wait.kind == "input":
            return _AcceptInput(message)
        if wait.kind == "child":
            raise SignalMismatchError(
                run.run_id,
                f"run {run.run_id} waits for its child run {wait.child_run_id} to end, not "
                "for input; look at the child run: its end resumes this run",
            )
        raise SignalMismatchError(
            run.run_id,
            f"run {run.run_id} waits for {wait.name!r}, not for input; deliver that signal first",
        )
    if run.kind == "conversation" and run.status != "aborted":
        # A conversation inside a flow keeps the flow's epoch (its keys);
        # outside one, a fresh user turn is a fresh epoch.
        if run.active_flow is not None:
            return _FlowMessage(message)
        return _NewEpoch(_user_message(text), None)
    if run.status in ("finished", "aborted"):
        return None
    raise SignalMismatchError(
        run.run_id, f"run {run.run_id} is {run.status} and is not waiting for input"
    )


def _resume_opening(run: Run, env: TurnEnv) -> Opening | None:
    """What a plain call does to an existing run (drift checked first)."""
    require_current_flow(run, env.registry)
    if run.status in ("finished", "aborted", "paused"):
        return None  # a paused run moves only on a delivery or input
    return _Resume()


# ------------------------------------------------------------------ commands
class Command(ABC):
    """One way to open a turn: its addressing and its opening."""

    session_id: str
    idempotency_key: str | None

    @abstractmethod
    async def address(self, env: TurnEnv) -> tuple[Run, bool]:
        """The run this turn is for, and whether it is new (not stored yet)."""

    @abstractmethod
    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        """The opening this turn needs (None: nothing to do), or a refusal; ``held``
        is the run's lease (not another holder's live one: that was refused)."""

    def already_done(self, run: Run) -> bool:
        """Whether the run already has what this call delivers (a retried
        delivery): a no-op, answered even while another holder drives the run."""
        return False

    def won_elsewhere(self, latest: Run, fresh: bool, lease: Lease | None) -> bool:
        """After losing the opening save: whether the winner did this very turn
        (``lease``: the run's lease now)."""
        return False

    def log_fields(self) -> dict[str, str | None]:
        """What the turn's log line says about this command (never a payload)."""
        return {}

    def request(self) -> Any:
        """What this call asks, as JSON data: the same inbound ``idempotency_key``
        with another request is refused (``IdempotencyConflictError``)."""
        return {"command": type(self).__name__, "session": self.session_id}

    def request_digest(self) -> str:
        return sha256_hex(canonical_json(self.request()))


@dataclass(frozen=True)
class StartFlow(Command):
    """``kind="flow"``: a new flow run (found again by its idempotency key)."""

    session_id: str
    flow_name: str | None
    #: Text, or for a typed flow a mapping, a JSON string or a model instance.
    input: Any
    idempotency_key: str | None
    #: The new run's data subject (None: its session; docs/privacy.md).
    subject: str | None = None

    async def address(self, env: TurnEnv) -> tuple[Run, bool]:
        if not self.flow_name:
            msg = "kind='flow' needs flow_name, the name of one of the agents' flows"
            raise InvalidArgumentError(msg)
        agent, flow = env.registry.flow(self.flow_name)
        flow_input(flow, self.input)  # refused here, before anything is read or written
        key = self.idempotency_key
        minted = flow_run_id(key)
        if key is not None:
            # A retried start (same key) finds the run the first one made, whatever
            # its session (a start with another session or flow is then refused).
            for run_id in (minted, _legacy_flow_run_id(self.session_id, flow.name, key)):
                existing = await env.store.load_async(str(run_id))
                if existing is not None:
                    return existing, False
        run = Run.new(
            minted, self.session_id, "flow", agent.id, flow.name, flow.digest, flow.version,
            subject=self.subject,
        )  # fmt: skip
        return run, True

    def request(self) -> Any:
        given = self.input
        if isinstance(given, BaseModel):
            given = given.model_dump(mode="json")
        return {"start": self.flow_name, "session": self.session_id, "input": given}

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        _, flow = env.registry.flow(str(self.flow_name))
        start = flow_input(flow, self.input)
        if fresh:
            return new_flow_run(start, self.idempotency_key)
        if start.text is not None:
            return _input_opening(run, start.text, env)
        return _resume_opening(run, env)

    def won_elsewhere(self, latest: Run, fresh: bool, lease: Lease | None) -> bool:
        # Two identical starts raced: the winner's run is the run.
        return fresh and self.idempotency_key is not None and latest.session_id == self.session_id


@dataclass(frozen=True)
class Converse(Command):
    """A plain call without ``run_id``: the session's conversation run."""

    session_id: str
    input: str | None
    flow_name: str | None
    idempotency_key: str | None
    #: The agent the conversation is with (None: the runtime's first agent).
    agent_id: str | None = None
    #: A new conversation's data subject (None: its session; docs/privacy.md).
    subject: str | None = None

    async def address(self, env: TurnEnv) -> tuple[Run, bool]:
        run_id = conversation_run_id(self.session_id)
        existing = await env.store.load_async(str(run_id))
        if existing is not None:
            if existing.session_id != self.session_id:
                raise RunNotFoundError(str(run_id), self.session_id)
            self._check_agent(existing)
            return existing, False
        if self.agent_id is not None:
            agent = env.registry.agent(self.agent_id)
        else:
            agent = env.registry.default_agent()
        run = Run.new(
            run_id, self.session_id, "conversation", agent.id, None, None, subject=self.subject
        )
        return run, True

    def request(self) -> Any:
        return {
            "conversation": self.session_id,
            "input": self.input,
            "flow": self.flow_name,
            "agent": self.agent_id,
        }

    def _check_agent(self, run: Run) -> None:
        """Refuse to talk to the session's conversation as another agent than its own."""
        if self.agent_id is None or run.active_agent == self.agent_id:
            return
        msg = (
            f"session {self.session_id!r} has a conversation with agent {run.active_agent!r}, "
            f"not {self.agent_id!r}; use another session id for a conversation with "
            f"{self.agent_id!r}"
        )
        raise InvalidArgumentError(msg)

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        # ``flow_name`` on a plain call enters that flow on a fresh user turn.
        if fresh:
            return _NewRun(_user_message(self.input), self.idempotency_key, self._enters(env))
        if self.input is None:
            return _resume_opening(run, env)
        opening = _input_opening(run, self.input, env)
        if isinstance(opening, _NewEpoch):
            return _NewEpoch(opening.message, self.idempotency_key, self._enters(env))
        return opening

    def _enters(self, env: TurnEnv) -> tuple[Agent, Flow] | None:
        return env.registry.flow(self.flow_name) if self.flow_name else None


@dataclass(frozen=True)
class _ForStoredRun(Command):
    """A command for a run already stored: addressed by its id, in its session."""

    session_id: str
    run_id: str

    async def address(self, env: TurnEnv) -> tuple[Run, bool]:
        return await _addressed(env, self.run_id, self.session_id), False


@dataclass(frozen=True)
class Input(_ForStoredRun):
    """Input to an addressed run: for a ``collect`` wait, or a conversation's next turn."""

    input: str
    idempotency_key: str | None

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        opening = _input_opening(run, self.input, env)
        if isinstance(opening, _NewEpoch):
            return _NewEpoch(opening.message, self.idempotency_key)
        return opening

    def request(self) -> Any:
        return {"input": self.input, "run": self.run_id, "session": self.session_id}


@dataclass(frozen=True)
class Deliver(Command):
    """A signal delivery, to ``run_id`` or to the session's one run waiting for it."""

    session_id: str
    run_id: str | None
    delivery: SignalDelivery
    idempotency_key: str | None
    from_sweeper: bool = False

    async def address(self, env: TurnEnv) -> tuple[Run, bool]:
        if self.run_id is not None:
            return await _addressed(env, self.run_id, self.session_id), False
        return await self._find_waiting(env), False

    async def _find_waiting(self, env: TurnEnv) -> Run:
        """The session's run a delivery without ``run_id`` is for."""
        delivery = self.delivery
        run_ids = await asyncio.to_thread(env.store.session_run_ids, self.session_id)
        matches: list[Run] = []
        for run_id in run_ids:
            run = await env.store.load_async(run_id)
            if run is None:
                continue
            if delivery.signal_id in run.signal_ids:
                return run  # a retry of a delivery already made: a no-op there
            if deliveries.waits_for(run, delivery):
                matches.append(run)
        if len(matches) == 1:
            return matches[0]
        if not matches:
            wanted = f" with request_id {delivery.request_id!r}" if delivery.request_id else ""
            msg = (
                f"no run of session {self.session_id!r} waits for signal {delivery.name!r}{wanted}"
            )
        else:
            msg = (
                f"{len(matches)} runs of session {self.session_id!r} wait for signal "
                f"{delivery.name!r}; pass run_id to say which"
            )
        raise SignalMismatchError("", msg)

    def already_done(self, run: Run) -> bool:
        return deliveries.is_duplicate(run, self.delivery)

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        require_current_flow(run, env.registry)
        now = env.clock.now()
        payload = deliveries.check(
            run, self.delivery, now, env.registry.schemas, from_sweeper=self.from_sweeper
        )
        return _AcceptDelivery(self.delivery, payload)

    def won_elsewhere(self, latest: Run, fresh: bool, lease: Lease | None) -> bool:
        # Two identical deliveries raced: the winner's is the delivery.
        return self.delivery.signal_id in latest.signal_ids

    def log_fields(self) -> dict[str, str | None]:
        delivery = self.delivery
        return {"signal": delivery.name, "signal_id": delivery.signal_id, "actor": delivery.actor}

    def request(self) -> Any:
        delivery = self.delivery
        return {
            "deliver": delivery.name,
            "signal_id": delivery.signal_id,
            "run": self.run_id,
            "session": self.session_id,
        }


@dataclass(frozen=True)
class Resume(_ForStoredRun):
    """A plain call with ``run_id``: drive a running or errored run again."""

    idempotency_key: str | None

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        return _resume_opening(run, env)


def in_doubt(run: Run) -> bool:
    """Whether the run is in ``error`` with its last step left ``running``: the
    effect's outcome was never recorded (a model call that failed), so a resume
    runs it again rather than replaying a frozen error."""
    return run.status == "error" and bool(run.steps) and run.steps[-1]["status"] == "running"


@dataclass(frozen=True)
class ResumeInDoubt(_ForStoredRun):
    """A sweeper re-drives a run in ``error`` whose last step is in doubt.

    A run that is no longer so when it is loaded (resumed by someone else,
    errored again on a frozen error, cancelled) is left alone.
    """

    idempotency_key: str | None = None

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        return _resume_opening(run, env) if in_doubt(run) else None

    def won_elsewhere(self, latest: Run, fresh: bool, lease: Lease | None) -> bool:
        return not in_doubt(latest)


@dataclass(frozen=True)
class Recover(_ForStoredRun):
    """A sweeper drives a ``running`` run whose worker's lease expired (an orphan).

    A run that is no longer an orphan when it is loaded (it finished, paused,
    or its own holder still drives it) is left alone; a live lease of another
    holder is ``LeaseHeldError``, raised by the turn before anything is written.
    """

    idempotency_key: str | None = None

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        if run.status != "running":
            return None
        require_current_flow(run, env.registry)
        if held is not None and held.holder == env.holder and held.live:
            return None  # this worker's own turn still drives it
        return _Recovered(held.holder if held is not None else None)

    def won_elsewhere(self, latest: Run, fresh: bool, lease: Lease | None) -> bool:
        # Another sweeper (or the original worker after all) holds it now.
        return latest.status != "running" or (lease is not None and lease.live)


@dataclass(frozen=True)
class Wake(_ForStoredRun):
    """A sweeper wakes a run paused on a due durable sleep (the wait ``request_id``).

    Compare-and-set like every opening: of two sweepers waking one timer, one
    saves the wake and the other finds the wait gone, a no-op.
    """

    request_id: str
    idempotency_key: str | None = None

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        if not self._sleeping(run):
            return None  # woken already, or never this timer
        require_current_flow(run, env.registry)
        wait = run.waiting
        if wait is not None and wait.deadline is not None and wait.deadline > env.clock.now():
            return None  # not due yet (a view ahead of this clock)
        return _TimerFired(self.request_id)

    def won_elsewhere(self, latest: Run, fresh: bool, lease: Lease | None) -> bool:
        return not self._sleeping(latest)

    def _sleeping(self, run: Run) -> bool:
        wait = run.waiting
        return (
            run.status == "paused"
            and wait is not None
            and wait.kind == "timer"
            and wait.request_id == self.request_id
        )


@dataclass(frozen=True)
class RestartFlow(Command):
    """``resolve_drift(..., "restart")``: re-pin the flow and drive it from its start."""

    session_id: str
    run_id: str
    idempotency_key: str | None = None

    async def address(self, env: TurnEnv) -> tuple[Run, bool]:
        run, _ = await drifted_run(env, self.run_id, self.session_id)
        return run, False

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        _, flow = env.registry.flow(str(run.active_flow))
        return _Repin(flow)


@dataclass
class _ForkOpening(Opening):
    """A fork's journal: the original's history up to the fork point, then its own."""

    plan: ForkPlan

    async def open(self, writer: RunWriter, env: TurnEnv) -> None:
        writer.fork_from(self.plan)
        await writer.saver.create()


@dataclass
class Fork(Command):
    """``runtime.fork``: a new flow run standing where another stood before a step.

    The original is read, never written; every refusal (a conversation run,
    ``at_step`` out of range or inside a parallel batch, a node the current
    flow lacks) is raised while addressing, before anything is saved.
    ``fork_id`` names the fork (``runtime.migrate`` derives it, so a retried or
    racing migration finds the one fork); by default it is fresh.
    """

    session_id: str
    run_id: str
    at_step: int
    into_session: str | None = None
    #: None: a fork takes no inbound key; ``fork_id`` is what a retry finds it by.
    idempotency_key: str | None = field(default=None, init=False)
    fork_id: str | None = None
    _plan: ForkPlan | None = field(default=None, init=False, repr=False)

    async def address(self, env: TurnEnv) -> tuple[Run, bool]:
        original = await _addressed(env, self.run_id, self.session_id)
        if original.kind != "flow":
            msg = f"run {self.run_id} is a {original.kind} run; only flow runs fork"
            raise InvalidArgumentError(msg)
        events: list[Any] = await asyncio.to_thread(env.store.run_events, original.run_id)
        agent, flow = env.registry.flow(str(events[0].flow))
        fork_id = UUID(self.fork_id) if self.fork_id is not None else uuid4()
        self._plan = plan_fork(events, self.at_step, str(fork_id), flow.digest, flow.version)
        if self._plan.node not in flow.nodes:
            msg = (
                f"cannot fork run {self.run_id} at step {self.at_step}: it stood at node "
                f"{self._plan.node!r}, which flow {flow.name!r} no longer has; fork at an "
                "earlier step"
            )
            raise InvalidArgumentError(msg)
        session = self.into_session if self.into_session is not None else self.session_id
        # The fork's copies are the original's data: it belongs to the same subject.
        fork = Run.new(
            fork_id, session, "flow", agent.id, flow.name, flow.digest, flow.version,
            subject=original.data_subject,
        )  # fmt: skip
        return fork, True

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        assert self._plan is not None, "address() plans the fork"
        return _ForkOpening(self._plan)

    def won_elsewhere(self, latest: Run, fresh: bool, lease: Lease | None) -> bool:
        # A named fork another caller made first (two migrations racing): the one fork.
        origin = {"run_id": self.run_id, "at_step": self.at_step}
        return self.fork_id is not None and getattr(latest, "forked_from", None) == origin

    def log_fields(self) -> dict[str, str | None]:
        return {"forked_from": self.run_id, "at_step": str(self.at_step)}
