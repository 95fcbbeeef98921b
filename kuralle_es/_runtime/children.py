"""Child runs: a run that starts another run and waits for it (internal).

A child is a flow run (``ctx.child``, ``flow_tool``) or a user turn of an
agent's conversation (an agent delegating to another from inside a tool,
``LoopTurn.child``: docs/pydantic-ai.md). Its start is one step of its
parent (kind ``child``, named after the child's flow or agent), journaled
through the writer like a tool call: its intent is
saved first, and the child's run id derives from that step's idempotency key,
so a replay, an in-doubt re-execution after a crash, or two workers racing
find the one child (creating a run is compare-and-set on its id). Executing
the step creates the child and drives its first turn right here, nested in
the parent's turn, to its first pause or its end; the parent's lease is kept
meanwhile by the heartbeat, as for any effect.

The parent then waits (a second slot of the same callsite, ``Lane.CHILD``,
or its own callsite for ``ctx.wait_child``): a child that already ended is
recorded at once (a step of kind ``child`` named ``__child`` whose result is
how it ended); else the parent pauses on a wait of kind ``child`` that no
operator can answer. The child's end is delivered to its parent, once per
wait, by whoever sees both:

- the process that ended the child, within that call (``follow_up``, from
  the child turn's close, and ``notify_parent`` after a cancel);
- the parent's own turn, right after it paused, should the child have ended
  meanwhile in another process (``follow_up``);
- the recovery sweep, where the process that ended the child died before
  it told the parent (``recover_orphaned_runs`` over ``RunViews.child_waits``).

Each delivery is a compare-and-set turn of the parent (``ChildEnded``) that
accepts only the wait it is for, so the ones that lose are no-ops.

Why a context variable: starting a child drives another turn, which needs
the runtime's definitions and store (``TurnEnv``) and the turn driver. A turn
sets them for its own task while it drives (``driving``), and every effect of
the turn, in the node or in the agent loop, and in the tasks of a ``gather``
batch, which copy the context, finds them there, without the writer, the
context and the agent loop each carrying a runtime they do not otherwise need.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID, uuid5

from pydantic import BaseModel

from .._definitions.agents import Agent
from .._definitions.flow_input import FlowInput, flow_input
from .._definitions.flows import Flow
from .._definitions.tools import Tool
from .._journal.leases import Lease
from .._journal.run import ParentLink, Run
from .._journal.sites import Effect, Lane, Site, step_key
from .._journal.wait import CHILD
from ..errors import (
    ChildRunError,
    InvalidArgumentError,
    InvalidToolArgsError,
    RunNotFoundError,
)
from ..shapes import SignalDelivery, StepError, TurnResult
from .handle import TurnSink
from .input_checks import check_id
from .observability import LOGGER_NAME, log_event
from .step_results import decode
from .suspensions import WaitRequest, suspend
from .turn_calls import (
    Command,
    Opening,
    Recover,
    TurnEnv,
    load_run,
    new_flow_run,
    require_current_flow,
)
from .writer import UNJOURNALED, RunWriter

__all__ = [
    "ChildEnded",
    "ChildRequest",
    "ChildRuns",
    "StartChild",
    "child_request",
    "conversation_request",
    "driving",
    "follow_up",
    "notify_parent",
    "run_flow_tool",
    "start_child",
    "wait_child",
]

logger = logging.getLogger(LOGGER_NAME)

#: Namespace of child run ids: ``uuid5`` of the key of the step that starts the child.
CHILDREN_NAMESPACE = UUID("0b6f1c7e-5a0d-4c4e-9a57-2f3c8d1e6b90")
#: The statuses in which a child has ended, for its parent.
ENDED = ("finished", "error", "aborted")

DriveTurn = Callable[[TurnEnv, Command, TurnSink], Awaitable[TurnResult]]


@dataclass(frozen=True)
class ChildRuns:
    """What starting and watching child runs needs: the runtime's turn env and the
    turn driver (``turn.drive_turn``, handed down: this module is below it)."""

    env: TurnEnv
    drive: DriveTurn

    async def turn(self, command: Command) -> TurnResult:
        """Drive one turn of ``command`` here (its stream parts go nowhere)."""
        return await self.drive(self.env, command, TurnSink())

    async def quietly(self, command: Command) -> TurnResult | None:
        """``turn``, for a turn that is someone else's business if it fails: a refusal
        (another holder drives the run, the run moved on) or the run's own error
        (recorded on it) is logged, never raised into the turn that asked."""
        try:
            return await self.turn(command)
        except Exception as exc:
            logger.debug("child run hand-over %s skipped: %r", type(command).__name__, exc)
            return None

    async def launch(self, child_run_id: str, request: ChildRequest, parent: ParentLink) -> None:
        """Create the child run (unless it exists) and drive its first turn here.

        What that turn raises is the child's own business (its node's error is
        recorded on it; another worker may be driving it) once the child exists;
        a child that could not be created fails the parent's step.
        """
        try:
            await self.turn(StartChild(request.session_id, child_run_id, request, parent))
        except Exception as exc:
            if await self.env.store.load_async(child_run_id) is None:
                raise
            logger.debug("the first turn of child run %s raised %r", child_run_id, exc)


_RUNS: ContextVar[ChildRuns | None] = ContextVar("kuralle_es_child_runs", default=None)


@contextlib.contextmanager
def driving(runs: ChildRuns) -> Iterator[None]:
    """Let the effects of the turn driven inside this block start child runs."""
    token = _RUNS.set(runs)
    try:
        yield
    finally:
        _RUNS.reset(token)


def _runs() -> ChildRuns:
    runs = _RUNS.get()
    if runs is None:
        msg = (
            "a child run is started by a run's turn (ctx.child, ctx.start_child, a flow_tool "
            "call driven by Runtime.run); this code runs outside one"
        )
        raise InvalidArgumentError(msg)
    return runs


# ------------------------------------------------------------------ requests
@dataclass(frozen=True)
class ChildRequest:
    """A child run asked for, checked before its step takes a callsite: a run of
    ``flow``, or (``flow`` None) a conversation whose one user turn ``agent``
    answers."""

    agent: Agent
    flow: Flow | None
    start: FlowInput
    session_id: str

    @property
    def name(self) -> str:
        """The start step's name: the child's flow, or the agent it converses with."""
        return self.flow.name if self.flow is not None else self.agent.id

    def args(self) -> dict[str, Any]:
        """What the start step journals (and keys) besides the child's id."""
        given = self.start.data if self.start.data is not None else self.start.text
        return {"input": given, "session_id": self.session_id}


def child_request(
    flow_name: str, input: Any, session_id: str | None, parent_session: str
) -> ChildRequest:
    """A start of flow ``flow_name`` with ``input`` (validated as any flow start is:
    ``InvalidArgumentError`` naming the fields), in ``session_id`` or the parent's
    session; ``FlowNotFoundError`` for a flow the runtime does not have."""
    agent, flow = _runs().env.registry.flow(flow_name)
    session = parent_session if session_id is None else check_id(session_id, "session_id")
    return ChildRequest(agent, flow, flow_input(flow, input), session)


def conversation_request(
    agent_id: str, prompt: str, session_id: str | None, parent_session: str
) -> ChildRequest:
    """A conversation child: one user turn, ``prompt``, answered by agent ``agent_id``
    (its own loop, or the built-in one), in ``session_id`` or the parent's
    session. ``InvalidArgumentError`` for an agent the runtime does not have or
    a prompt that is not a non-empty string."""
    agent = _runs().env.registry.agent(agent_id)
    if not isinstance(prompt, str) or not prompt.strip():
        msg = f"a child conversation needs a prompt (a non-empty string), got {prompt!r}"
        raise InvalidArgumentError(msg)
    session = parent_session if session_id is None else check_id(session_id, "session_id")
    return ChildRequest(agent, None, FlowInput(prompt), session)


def _outcome(child: Run) -> dict[str, Any] | None:
    """How ``child`` ended, as its parent records it; None while it has not. A
    cancelled conversation child (a conversation's cancel ends its turn
    ``finished``) is ``aborted`` for its parent: it gave no answer."""
    if child.status not in ENDED:
        return None
    status = child.status
    if child.kind == "conversation" and child.cancelled:
        status = "aborted"
    return {
        "run_id": child.run_id,
        "status": status,
        "output": child.output if status == "finished" else None,
        "error": child.error,
        "outcome": child.outcome,
    }


def _result(outcome: dict[str, Any]) -> Any:
    """The child's output, or ``ChildRunError`` for a child that did not finish."""
    if outcome["status"] == "finished":
        return outcome.get("output")
    error = outcome.get("error")
    raise ChildRunError(
        str(outcome["run_id"]),
        str(outcome["status"]),
        StepError.model_validate(error) if error else None,
        outcome=outcome.get("outcome"),
    )


# --------------------------------------------------------------- the steps
async def start_child(writer: RunWriter, site: Site, request: ChildRequest) -> str:
    """The step at ``site`` that starts the child run once; returns its id.

    Replayed, the step returns the recorded id and starts nothing. Executed
    (again, if a crash left it in doubt), it creates the child, unless it
    exists, and drives the child's first turn here. A failure to create it
    is not frozen: the step stays in doubt and the next pass tries again.
    """
    args = request.args()
    child_run_id = str(uuid5(CHILDREN_NAMESPACE, step_key(site, "child", request.name, args)))
    effect = Effect(site, "child", request.name, {**args, "run_id": child_run_id})

    async def execute() -> dict[str, str]:
        step = writer.peek(effect)
        assert step is not None, "the start step's intent is saved before it executes"
        parent = ParentLink(writer.run_id, writer.session_id, step["index"])
        await _runs().launch(child_run_id, request, parent)
        return {"run_id": child_run_id}

    recorded = await writer.effect(effect, execute=execute, attempts=UNJOURNALED)
    return str(recorded["run_id"])


def _wait_effect(site: Site, child_run_id: str) -> Effect:
    return Effect(site, "child", CHILD, {"child_run_id": child_run_id})


async def wait_child(writer: RunWriter, site: Site, child_run_id: str) -> Any:
    """The child's output once it ended (``ChildRunError`` if it errored or was
    aborted), recorded at ``site``; until then the turn suspends on a ``child`` wait."""
    effect = _wait_effect(site, child_run_id)
    step = writer.recorded(effect)
    if step is not None and step["status"] == "finished":
        return _result(decode(step))
    runs = _RUNS.get()
    child = await runs.env.store.load_async(child_run_id) if runs is not None else None
    ended = _outcome(child) if child is not None else None
    if ended is None:
        title = f"child run {child_run_id}"
        suspend(writer, site, "child", WaitRequest(CHILD, title, child_run_id=child_run_id))
    return _result(await writer.record_value(effect, make=lambda: ended))


async def run_flow_tool(writer: RunWriter, site: Site, tool: Tool[Any], args: BaseModel) -> Any:
    """A ``flow_tool`` call at ``site``: its child run started and waited for; the
    child's output is the call's result. The args are the child's input (its
    flow's ``input`` model validates them; a flow without one gets their JSON)."""
    agent, flow = _runs().env.registry.flow(str(tool.child_flow))
    given: Any = args.model_dump(mode="json") if flow.input is not None else args.model_dump_json()
    try:
        start = flow_input(flow, given)
    except InvalidArgumentError as refused:
        raise InvalidToolArgsError(tool.name, str(refused)) from None
    request = ChildRequest(agent, flow, start, writer.session_id)
    child_run_id = await start_child(writer, site, request)
    return await wait_child(writer, site.in_lane(Lane.CHILD), child_run_id)


# ----------------------------------------------------------------- commands
@dataclass(frozen=True)
class StartChild(Command):
    """A parent's step starts its child: the child run made (its id derived from the
    step's key) and its first turn driven; an existing child is left to whoever
    drives it, or recovered if its worker is gone."""

    session_id: str
    run_id: str
    asked: ChildRequest
    parent: ParentLink
    idempotency_key: str | None = None

    async def address(self, env: TurnEnv) -> tuple[Run, bool]:
        existing = await env.store.load_async(self.run_id)
        if existing is not None:
            return existing, False
        parent = await env.store.load_async(self.parent.run_id)
        if parent is not None and parent.status == "aborted":
            msg = (
                f"run {self.parent.run_id} was stopped ({parent.outcome}) while it started a "
                "child run; the child was not started"
            )
            raise InvalidArgumentError(msg)
        agent, flow = self.asked.agent, self.asked.flow
        if flow is None:  # a conversation: the agent answers its one user turn
            made = Run(UUID(self.run_id), self.session_id, "conversation", agent.id, None, None)
            return made, True
        run = Run(
            UUID(self.run_id), self.session_id, "flow", agent.id, flow.name, flow.digest,
            flow.version,
        )  # fmt: skip
        return run, True

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        if fresh:
            return new_flow_run(self.asked.start, None, self.parent)
        return Recover(run.session_id, self.run_id).prepare(run, fresh, env, held)

    def won_elsewhere(self, latest: Run, fresh: bool, lease: Lease | None) -> bool:
        # Another worker made the same child first (the same derived id): it is the child.
        return fresh

    def log_fields(self) -> dict[str, str | None]:
        return {"parent": self.parent.run_id, "child_flow": self.asked.name}


@dataclass
class _ChildEnd(Opening):
    """The parent's opening: how its child ended, accepted for the wait it stands on
    and recorded at that wait's site, where the waiting call finds it."""

    signal_id: str
    child_run_id: str
    outcome: dict[str, Any]

    async def open(self, writer: RunWriter, env: TurnEnv) -> None:
        wait = writer.waiting
        assert wait is not None, "ChildEnded opens a parent that waits for its child"
        delivery = SignalDelivery(signal_id=self.signal_id, name=CHILD, payload=self.outcome)
        writer.accept_signal(delivery, self.outcome)
        site = Site(wait.logical_run, wait.callsite, wait.lane)
        outcome = self.outcome
        await writer.record_value(_wait_effect(site, self.child_run_id), make=lambda: outcome)


@dataclass
class ChildEnded(Command):
    """Child run ``child_run_id`` ended: its parent ``run_id``, if it is paused waiting
    for it, records how and goes on, to its next pause or its end. A no-op for a
    parent that waits for something else (or not yet): it will find the child
    ended when it gets to its wait."""

    session_id: str
    run_id: str
    child_run_id: str
    idempotency_key: str | None = None
    _outcome: dict[str, Any] | None = field(default=None, init=False, repr=False)

    async def address(self, env: TurnEnv) -> tuple[Run, bool]:
        run = await load_run(env.store, self.run_id, self.session_id)
        if run is None:
            raise RunNotFoundError(self.run_id, self.session_id)
        child = await env.store.load_async(self.child_run_id)
        self._outcome = _outcome(child) if child is not None else None
        return run, False

    def _signal_id(self, run: Run) -> str | None:
        """The delivery's id: one per wait (a parent may wait for one child twice)."""
        wait = run.waiting
        if run.status != "paused" or wait is None or wait.kind != "child":
            return None
        if wait.child_run_id != self.child_run_id:
            return None
        return f"child:{self.child_run_id}:{wait.request_id}"

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        signal_id = self._signal_id(run)
        if signal_id is None or self._outcome is None:
            return None
        require_current_flow(run, env.registry)
        return _ChildEnd(signal_id, self.child_run_id, self._outcome)

    def won_elsewhere(self, latest: Run, fresh: bool, lease: Lease | None) -> bool:
        # Another process handed the parent the same end first: the parent moved on.
        return self._signal_id(latest) is None

    def log_fields(self) -> dict[str, str | None]:
        return {"child_run_id": self.child_run_id}


async def notify_parent(runs: ChildRuns, child: Run) -> TurnResult | None:
    """Hand an ended child's end to its parent (if it has one), within this call."""
    parent = child.parent_link
    if parent is None or child.status not in ENDED:
        return None
    return await runs.quietly(ChildEnded(parent.session_id, parent.run_id, child.run_id))


async def follow_up(runs: ChildRuns, writer: RunWriter, result: TurnResult) -> TurnResult | None:
    """After a turn closed its run: a child that ended hands its end to its parent;
    a parent that paused for a child that has meanwhile ended (in another process,
    which found the parent still running) takes the end itself. Returns the
    result of the parent's turn in that second case."""
    if result.status in ENDED:
        parent = writer.parent_link
        if parent is not None:
            command = ChildEnded(parent.session_id, parent.run_id, result.run_id)
            await runs.quietly(command)
        return None
    wait = writer.waiting
    if result.status != "paused" or wait is None or wait.kind != "child" or not wait.child_run_id:
        return None
    child = await runs.env.store.load_async(wait.child_run_id)
    if child is None or child.status not in ENDED:
        return None
    log_event("child ended meanwhile", result.run_id, child_run_id=wait.child_run_id)
    return await runs.quietly(ChildEnded(writer.session_id, result.run_id, wait.child_run_id))
