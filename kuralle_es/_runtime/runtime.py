"""``Runtime`` (API): builds a turn command for each call and runs it through a handle.

A turn is one call of ``Runtime.run``. The command addresses a run
fail-closed, the turn takes the run's lease with a compare-and-set save,
drives the run's flow (or agent loop) through the journal, and closes the
run (finished, paused or errored) with the lease released, in one more save.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any
from uuid import uuid4

from .._clock import Clock, check_clock
from .._definitions.agents import Agent
from .._definitions.budget import Budget
from .._definitions.flows import Flow
from .._durations import positive_seconds
from .._journal.spending import validate_prices
from .._journal.store import RunStore
from ..errors import InvalidArgumentError, RunNotFoundError
from ..shapes import RunState, SignalDelivery, StepRecord, StreamPart, TurnResult
from .cancel import cancel_run
from .children import ChildRuns, notify_parent
from .deliveries import approval_delivery, delivery_id
from .erasure import ErasureReport, erase_subject
from .handle import TurnHandle, TurnSink
from .input_checks import check_turn_args
from .mail_calls import Mail
from .mailbox import published_values, send_message, wait_published
from .migrate import migrate_run
from .registry import Registry
from .retention import ENDED, PruneReport, prune_runs
from .run_changes import Abandon, change_run
from .streaming import stored_parts
from .turn import drive_turn
from .turn_calls import (
    Command,
    Converse,
    Deliver,
    Fork,
    Input,
    RestartFlow,
    Resume,
    StartFlow,
    TurnEnv,
    drifted_run,
    load_run,
)

if TYPE_CHECKING:
    from ..views import RunViews

__all__ = ["Runtime"]

#: What ``resolve_drift`` accepts.
RECOVERIES = ("restart", "abandon")
#: The outcome of a run abandoned after its flow changed.
ABANDONED = "abandoned: flow drift"


def _default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid4().hex[:8]}"


class Runtime:
    """Runs agents and flows durably over a ``RunStore``.

    ``clock`` (an object with ``now() -> datetime``; default this machine's,
    in UTC) is what the runtime dates by, except leases: a test passes
    ``kuralle_es.testing.TestClock()`` and moves time with ``advance``
    (docs/howto/testing.md). ``InvalidArgumentError`` for a clock without ``now``.
    """

    def __init__(
        self,
        agents: Sequence[Agent] = (),
        store: RunStore | None = None,
        lease_ttl: float = 30.0,
        holder: str | None = None,
        max_tool_concurrency: int = 8,
        inline_sleep_limit: float = 1.0,
        prices: Mapping[str, tuple[float, float]] | None = None,
        clock: Clock | None = None,
    ) -> None:
        lease_ttl = positive_seconds(lease_ttl, "lease_ttl")
        inline_sleep_limit = positive_seconds(
            inline_sleep_limit, "inline_sleep_limit", zero_ok=True
        )
        self._registry = Registry(agents)
        self._owns_store = store is None
        self.store = store if store is not None else RunStore()
        self.lease_ttl = lease_ttl
        self.holder = holder or _default_holder()
        self.max_tool_concurrency = max_tool_concurrency
        #: A ``ctx.sleep`` that wakes within this many seconds sleeps inline; a
        #: longer one pauses the run until a sweeper's ``fire_timers`` wakes it.
        self.inline_sleep_limit = inline_sleep_limit
        #: What 1,000 input and output tokens of each model cost (docs/usage.md).
        self.prices = validate_prices(prices)
        #: What the runtime dates by: ``ctx.now()``, wake times, deadlines, retries
        #: and what the sweeps count as due (a lease is the store's clock's).
        self.clock = check_clock(clock)
        self._env = TurnEnv(
            registry=self._registry,
            store=self.store,
            holder=self.holder,
            lease_ttl=self.lease_ttl,
            max_tool_concurrency=max_tool_concurrency,
            inline_sleep_limit=self.inline_sleep_limit,
            prices=self.prices,
            clock=self.clock,
        )

    @property
    def agents(self) -> dict[str, Agent]:
        """The runtime's agents, by id."""
        return self._registry.agents

    @property
    def env(self) -> TurnEnv:
        """What this runtime's turns work with (internal: the sweeps drive turns with it)."""
        return self._env

    @functools.cached_property
    def views(self) -> RunViews:
        """Queries over the runs of this runtime's store (made on first use)."""
        from ..views import RunViews

        return RunViews(self.store, prices=self.prices)

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the store if this runtime opened it from the environment."""
        if self._owns_store:
            self.store.close()

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------- turns
    def run(
        self,
        session_id: str,
        input: Any = None,
        kind: str | None = None,
        flow_name: str | None = None,
        run_id: str | None = None,
        signal_delivery: SignalDelivery | None = None,
        idempotency_key: str | None = None,
        budget: Budget | None = None,
        agent: str | None = None,
        subject: str | None = None,
    ) -> TurnHandle:
        """Start a turn; returns its handle at once (errors surface through it).

        ``budget`` gives the run a budget of its own from this turn on, in place
        of its agent's (docs/usage.md). ``agent`` is the id of the agent a plain
        call's conversation is with (default: the first agent given); the
        session's conversation with another agent is refused
        (``InvalidArgumentError``). ``subject`` is whose data a new run holds
        (default: its session id), the one ``erase_subject`` forgets; it is
        recorded on the run's first call and ignored on later ones
        (docs/privacy.md).

        ``input`` is text, except for the start of a flow defined with
        ``define_flow(..., input=Model)``: a mapping, a JSON string or a ``Model``
        instance, validated against ``Model`` (docs/child-runs.md).
        """
        starts_flow = kind == "flow" and run_id is None and signal_delivery is None

        def command() -> Command:
            # A flow start's typed input is the flow's to check (StartFlow); text is
            # checked here, whoever it is for.
            text = None if starts_flow and not isinstance(input, str) else input
            check_turn_args(session_id, text, idempotency_key, signal_delivery)
            if subject is not None and (not isinstance(subject, str) or not subject):
                msg = f"subject must be a non-empty string or None, got {subject!r}"
                raise InvalidArgumentError(msg)
            if budget is not None and not isinstance(budget, Budget):
                msg = f"budget must be a kuralle_es.Budget, got {budget!r}"
                raise InvalidArgumentError(msg)
            if signal_delivery is not None:
                return Deliver(session_id, run_id, signal_delivery, idempotency_key)
            if run_id is not None:
                if input is not None:
                    return Input(session_id, run_id, input, idempotency_key)
                return Resume(session_id, run_id, idempotency_key)
            if kind == "flow":
                return StartFlow(session_id, flow_name, input, idempotency_key, subject)
            if kind not in (None, "conversation"):
                msg = f"kind must be 'conversation' or 'flow', got {kind!r}"
                raise InvalidArgumentError(msg)
            return Converse(session_id, input, flow_name, idempotency_key, agent, subject)

        async def turn(sink: TurnSink) -> TurnResult:
            return await drive_turn(self._env, command(), sink, budget)

        return TurnHandle(turn)

    # ----------------------------------------------------------------- reads
    async def get_run(self, run_id: str, session_id: str) -> RunState | None:
        """The run's state, or None when it is unknown or of another session."""
        run = await load_run(self.store, run_id, session_id)
        if run is None:
            return None
        return run.to_state(await self.store.lease_async(run_id))

    async def get_steps(self, run_id: str, session_id: str) -> list[StepRecord]:
        """The run's journal; empty when the run is unknown or of another session
        (like ``get_run``'s None: a read never says whether a foreign run exists)."""
        run = await load_run(self.store, run_id, session_id, history=True)
        return run.step_records() if run is not None else []

    def stream(self, run_id: str, session_id: str, after: int = 0) -> AsyncIterator[StreamPart]:
        """The run's stored stream after offset ``after``: the parts its turns sent
        (text deltas, retracts, tool calls, custom parts, each turn's end), each
        with its ``offset``, then the new ones as they are stored, in order.

        Ends once the run is at rest (not running) and every part it stored has
        been given; a run running in another process is followed live (its parts
        are stored in batches, at most every 50 ms). Raises, when iterated,
        ``RunNotFoundError`` for an unknown run or one of another session, and
        ``InvalidArgumentError`` for an ``after`` that is not an int >= 0
        (docs/streaming.md).
        """
        return stored_parts(self.store, run_id, session_id, after)

    # ------------------------------------------------------------------ fork
    async def fork(
        self, run_id: str, session_id: str, at_step: int, *, into_session: str | None = None
    ) -> TurnResult:
        """Fork a flow run at step ``at_step``; the fork's turn result (its errors raised).

        The fork is a new flow run (a fresh id, in ``into_session`` or the
        original's session) standing where the original stood just before
        step ``at_step`` started: the same node entries, messages and state
        bag, and copies of steps ``0 .. at_step - 1`` with their recorded
        results, re-keyed under the fork's own logical run (a tool's
        ``idempotency_key=`` override keeps its key). It is pinned to the
        flow's current digest and driven within this call, like a resumed
        run, to its next pause or its end: the active node re-executes,
        replaying the copies (``NonDeterminismError`` if the code no longer
        matches them) and executing afresh from ``at_step``. The original is
        only read. ``RunState.forked_from`` says where the fork came from.

        ``at_step`` is ``0 .. len(steps)``: 0 re-executes everything from the
        original's first message, ``len(steps)`` replays everything. Refused
        with ``InvalidArgumentError``: a conversation run, ``at_step`` out of
        range or inside a parallel batch; ``RunNotFoundError``: an unknown or
        foreign run; ``FlowNotFoundError``: a flow this runtime does not have.
        A refusal writes nothing.
        """
        if into_session is not None and (not isinstance(into_session, str) or not into_session):
            msg = f"into_session must be a non-empty session id or None, got {into_session!r}"
            raise InvalidArgumentError(msg)
        command = Fork(session_id, run_id, at_step, into_session)
        return await TurnHandle(lambda sink: drive_turn(self._env, command, sink)).result()

    async def migrate(self, run_id: str, session_id: str, at_step: int) -> TurnResult:
        """Move a live flow run onto its flow's newest definition; the fork's turn result.

        Forks the run at step ``at_step`` (exactly ``fork``: steps before it
        replay, the rest executes afresh under the newest definition, within
        this call, to the fork's next pause or its end), then stops the
        original for good: ``aborted`` with outcome ``"migrated: <fork id>"``
        and ``RunState.migrated_to`` set to the fork's id, whoever holds its
        lease. The fork's id is derived from the run's id and ``at_step``, so
        a migration retried after a crash between the fork and the stop (or
        racing another) finds the one fork, drives it on if it was cut off,
        and stops the original: it converges. A fork whose turn raises (its
        replay no longer matches the code: ``NonDeterminismError``) leaves
        the original as it was.

        Refused, writing nothing, where ``fork`` refuses (``InvalidArgumentError``,
        ``RunNotFoundError``), and for a finished or aborted run or one already
        migrated at another step (``InvalidArgumentError``).
        """
        return await migrate_run(self._env, run_id, session_id, at_step)

    # ----------------------------------------------------------------- drift
    async def resolve_drift(self, run_id: str, session_id: str, recovery: str) -> RunState:
        """Settle a run whose flow changed since it started; returns its state after.

        ``"restart"`` re-pins the flow's current definition and drives it from
        its start node, within this call, to its next pause or its end (a turn:
        its errors are raised as from ``handle.result()``). ``"abandon"`` marks
        the run ``aborted`` with outcome ``"abandoned: flow drift"``. A bad
        ``recovery`` or a run without drift is ``InvalidArgumentError``; an
        unknown or foreign run ``RunNotFoundError``; nothing is written then.
        """
        if recovery not in RECOVERIES:
            msg = f"recovery must be 'restart' or 'abandon', got {recovery!r}"
            raise InvalidArgumentError(msg)
        if recovery == "restart":
            await TurnHandle(
                lambda sink: drive_turn(self._env, RestartFlow(session_id, run_id), sink)
            ).result()
            state = await self.get_run(run_id, session_id)
            if state is None:  # pragma: no cover - the turn just saved it
                raise RunNotFoundError(run_id, session_id)
            return state
        await drifted_run(self._env, run_id, session_id)
        run = await change_run(self.store, run_id, session_id, Abandon(self.holder, ABANDONED))
        await notify_parent(ChildRuns(self._env, drive_turn), run)  # a child: its parent goes on
        return run.to_state(await self.store.lease_async(run_id))

    # ------------------------------------------------------ execution control
    async def erase_subject(self, subject: str) -> ErasureReport:
        """Forget one data subject: abort its live runs (outcome ``"erased"``; a turn
        driving one elsewhere stops at its next save), then destroy its data key,
        so that every payload of its runs reads ``Redacted`` from then on, in the
        database and in its backups, while the runs keep their shape (steps,
        kinds, names, keys, timings, statuses, usage). docs/privacy.md."""
        return await erase_subject(self.store, self.views, subject)

    async def prune(
        self,
        ended_before: datetime | str,
        *,
        statuses: Sequence[str] = ENDED,
        keep_usage: bool = True,
    ) -> PruneReport:
        """Delete the runs that ended (``statuses``: among finished, aborted, error)
        before ``ended_before``: their events, snapshots and view rows, in small
        batches; never a running or paused run. With ``keep_usage`` the views keep
        what they spent, so ``views.usage()`` totals do not drop. Followers go on
        across the gap. docs/privacy.md."""
        return await prune_runs(self.store, self.views, ended_before, statuses, keep_usage)

    async def cancel(self, run_id: str, session_id: str, reason: str) -> RunState:
        """Stop a run, whoever holds its lease; returns its state after.

        A flow run becomes ``aborted`` with outcome ``"cancelled: <reason>"``
        and its wait cleared; a conversation run's current turn ends the same
        way but the run stays usable (``finished``; the next user message opens
        a new epoch). A turn driving the run elsewhere loses its next save and
        stops without executing anything further. Cancelling an aborted (or
        already cancelled) run is a no-op; a finished run is refused with
        ``InvalidArgumentError``; an unknown or foreign run is
        ``RunNotFoundError``.

        The run's live child runs are cancelled too, and theirs; a cancelled
        child run's parent, waiting for it, goes on within this call (its
        ``ctx.child`` raises ``ChildRunError``), docs/child-runs.md.
        """
        state = await cancel_run(self.store, run_id, session_id, reason)
        if state.parent is not None:
            cancelled = await self.store.load_async(run_id)
            if cancelled is not None:
                await notify_parent(ChildRuns(self._env, drive_turn), cancelled)
        return state

    async def approve(
        self,
        run_id: str,
        session_id: str,
        *,
        by: str,
        reason: str | None = None,
        signal_id: str | None = None,
        raise_to: dict[str, Any] | None = None,
    ) -> TurnResult:
        """Approve what the run waits for, as ``by``; the turn's result (its errors raised).

        Exactly ``run(..., signal_delivery=...)`` of an ``__approval`` with
        ``actor=by`` and a fresh ``signal_id`` unless one is given (give one to
        make a retry a no-op). It answers any approval, a budget's too, whose
        limits ``raise_to`` raises (``{"max_total_tokens": 20000}``, docs/usage.md).
        """
        delivery = approval_delivery(
            approved=True, by=by, reason=reason, signal_id=signal_id, raise_to=raise_to
        )
        return await self._deliver(run_id, session_id, delivery)

    async def deny(
        self,
        run_id: str,
        session_id: str,
        *,
        by: str,
        reason: str | None = None,
        signal_id: str | None = None,
    ) -> TurnResult:
        """Deny what the run waits for, as ``by``; like ``approve`` with ``approved`` false."""
        delivery = approval_delivery(approved=False, by=by, reason=reason, signal_id=signal_id)
        return await self._deliver(run_id, session_id, delivery)

    async def signal(
        self,
        run_id: str,
        session_id: str,
        name: str,
        payload: Any,
        *,
        signal_id: str | None = None,
        actor: str | None = None,
    ) -> TurnResult:
        """Deliver signal ``name`` with ``payload``; the turn's result (its errors raised).

        Exactly ``run(..., signal_delivery=SignalDelivery(...))`` with a fresh
        ``signal_id`` unless one is given.
        """
        delivery = SignalDelivery(
            signal_id=delivery_id(signal_id), name=name, payload=payload, actor=actor
        )
        return await self._deliver(run_id, session_id, delivery)

    # -------------------------------------------------- messages and values
    async def send(
        self,
        run_id: str,
        session_id: str,
        name: str,
        payload: Any,
        *,
        message_id: str,
        actor: str | None = None,
    ) -> TurnResult:
        """Put a message in the run's mailbox, whatever the run is doing (docs/messages.md).

        A node takes it with ``await ctx.receive(name)``, oldest first. When the
        run is paused in a ``receive`` for ``name``, it is woken and driven on
        within this call, and this returns that turn's ``TurnResult`` (its
        errors raised, as ``signal``'s are); otherwise the message waits in the
        mailbox and this returns the run's ``TurnResult`` as it stands. A
        ``message_id`` the run already got makes the call a no-op (a retry is
        safe). An ended run (finished or aborted) refuses it with
        ``SignalMismatchError``; a payload that is not plain JSON, or that a
        waiting ``receive``'s schema refuses, with ``InvalidSignalError``; an
        unknown or foreign run with ``RunNotFoundError``. A refusal writes nothing.
        """
        mail = Mail(message_id=message_id, name=name, payload=payload, actor=actor)
        return await send_message(self._env, run_id, session_id, mail)

    async def published(self, run_id: str, session_id: str, key: str | None = None) -> Any:
        """What the run published with ``ctx.publish``: the latest value of each key,
        as a dict, or the latest value of ``key`` (None when it published none under
        it). ``RunNotFoundError`` for an unknown or foreign run."""
        return await published_values(self._env, run_id, session_id, key)

    async def wait_published(
        self,
        run_id: str,
        session_id: str,
        key: str,
        timeout: float,  # noqa: ASYNC109 - the contract's name for how long to wait
    ) -> Any:
        """The latest value the run published under ``key``, as soon as there is one.

        Raises ``NotPublishedError`` (a ``KuralleError`` and a ``TimeoutError``)
        when nothing was published under it within ``timeout`` seconds, or at
        once when the run ended without publishing it; ``RunNotFoundError`` for
        an unknown or foreign run.
        """
        return await wait_published(self._env, run_id, session_id, key, timeout)

    async def _deliver(self, run_id: str, session_id: str, delivery: SignalDelivery) -> TurnResult:
        """The operator helpers' one turn: ``run`` with the delivery, its result."""
        return await self.run(session_id, run_id=run_id, signal_delivery=delivery).result()

    # ----------------------------------------------------------- definitions
    def add_agent(self, agent: Agent) -> None:
        """Add an agent to this runtime after it was made, so that it drives (and
        resumes, recovers, approves) that agent's runs like those of the agents
        given to ``Runtime``: what an integration does with the agent it wraps
        (``kuralle_es.integrations.pydantic_ai.durable``, docs/pydantic-ai.md).

        Adding the same definition again is a no-op; another agent under an id
        the runtime has is refused with ``InvalidArgumentError``.
        """
        self._registry.add(agent)

    def default_agent(self) -> Agent:
        """The agent a new conversation starts with: the first one given."""
        return self._registry.default_agent()

    def agent(self, agent_id: str | None) -> Agent:
        """The agent with this id, or ``InvalidArgumentError``."""
        return self._registry.agent(agent_id)

    def flow(self, name: str) -> tuple[Agent, Flow]:
        """The flow called ``name`` with its agent, or ``FlowNotFoundError``."""
        return self._registry.flow(name)
