"""One turn of a run: address -> prepare -> lease -> drive -> close.

Refusals (unknown run, signal mismatch, drift, held lease, ...) are raised
before the first save, so a refused turn writes nothing. The first save is
compare-and-set and carries the lease together with whatever opened the turn
(a new run, a new user message, an accepted delivery).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any
from uuid import UUID, uuid4, uuid5

from . import signals
from .agent_loop import agent_turn
from .agents import Agent
from .domain import Run, new_run
from .driver import drive_flow
from .errors import (
    FlowDriftError,
    RunNotFoundError,
    SignalMismatchError,
    StaleWriteError,
    SuspendError,
    error_fields,
)
from .flows import End, Flow, Handoff
from .handle import TurnSink
from .journal import Journal, utcnow
from .keys import canonical_json, logical_run_id
from .models import Message, SignalDelivery, StepError, StreamPart, TurnResult

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["TurnRequest", "conversation_run_id", "drive_turn", "result_of"]

#: Namespace of conversation run ids (one run per session).
CONVERSATION_NAMESPACE = UUID("5d0c3a51-3f7e-4d43-a0a8-1f4a8c6f9e27")


def conversation_run_id(session_id: str) -> UUID:
    return uuid5(CONVERSATION_NAMESPACE, session_id)


def flow_run_id(session_id: str, flow_name: str, idempotency_key: str | None) -> UUID:
    """A fresh id for a new flow run; derived from the inbound idempotency key when
    there is one, so that a retried start finds (or races to create) the same run."""
    if idempotency_key is None:
        return uuid4()
    return uuid5(CONVERSATION_NAMESPACE, canonical_json([session_id, flow_name, idempotency_key]))


@dataclass(frozen=True)
class TurnRequest:
    session_id: str
    input: str | None
    kind: str | None
    flow_name: str | None
    run_id: str | None
    signal_delivery: SignalDelivery | None
    idempotency_key: str | None
    from_sweeper: bool = False


class _Opening(Enum):
    """What the turn's first save carries besides the lease."""

    NEW_RUN = "new run"
    NEW_EPOCH = "new user turn"
    INPUT = "input for a collect node"
    DELIVERY = "signal delivery"
    MESSAGE = "user message to a conversation inside a flow"
    RESUME = "resume"


def result_of(run: Run, output: Any = None) -> TurnResult:
    state = run.to_state()
    return TurnResult(
        run_id=run.run_id,
        status=state.status,
        output=output if output is not None else run.output,
        waiting_for=state.waiting_for,
    )


async def drive_turn(runtime: Runtime, request: TurnRequest, sink: TurnSink) -> TurnResult:
    return await _Turn(runtime, request, sink).drive()


class _Turn:
    def __init__(self, runtime: Runtime, request: TurnRequest, sink: TurnSink) -> None:
        self.runtime = runtime
        self.request = request
        self.sink = sink
        self.last_text: str | None = None

    def emit(self, part: StreamPart) -> None:
        if part.type == "text" and part.text:
            self.last_text = part.text
        self.sink.emit(part)

    # ------------------------------------------------------------------ turn
    async def drive(self) -> TurnResult:
        request = self.request
        run, fresh = await self._address()
        if request.idempotency_key and request.idempotency_key in run.turn_keys:
            earlier = TurnResult.model_validate(run.turn_keys[request.idempotency_key])
            return self._noop(run, earlier)
        key = request.idempotency_key
        if key and key == run.turn_key and run.status == "running" and not fresh:
            # The turn this key started is still in flight (or was cut off, for
            # recovery to finish): a retry must not start it a second time.
            return self._noop(run, result_of(run))
        opening, payload = self._prepare(run, fresh)
        if opening is None:
            return self._noop(run, result_of(run))
        pinned = self._flow_to_enter(run, opening)
        agent, flow = self._definitions(run) if pinned is None else pinned
        run.require_lease_free(self.runtime.holder, utcnow())
        journal = Journal(
            self.runtime.store, run, holder=self.runtime.holder, lease_ttl=self.runtime.lease_ttl
        )
        try:
            await self._open(journal, opening, payload, pinned[1] if pinned else None)
        except StaleWriteError:
            if fresh and request.idempotency_key is not None:
                # Two identical starts raced: the winner's run is the run.
                latest = await asyncio.to_thread(self.runtime.store.load, run.run_id)
                if latest is not None and latest.session_id == request.session_id:
                    return self._noop(latest, result_of(latest))
            if request.signal_delivery is not None:
                # Two identical deliveries raced: the winner's is the delivery.
                latest = await asyncio.to_thread(self.runtime.store.load, run.run_id)
                if latest is not None and request.signal_delivery.signal_id in latest.signal_ids:
                    return self._noop(latest, result_of(latest))
            raise
        self.sink.opened(run.run_id)
        try:
            transition, state = await self._run(journal, agent, flow)
        except SuspendError as suspended:
            return await self._close_paused(journal, suspended)
        except StaleWriteError:
            raise
        except Exception as exc:
            await self._close_errored(journal, exc)
            raise
        return await self._close_finished(journal, transition, state)

    async def _run(
        self, journal: Journal, agent: Agent, flow: Flow | None
    ) -> tuple[End | Handoff, dict[str, Any]]:
        """Drive the run: its flow's nodes, or else its agent's loop."""
        if flow is not None:
            return await drive_flow(journal, flow, agent, self.emit)
        run = journal.run
        journal.begin_visit(logical_run_id(run.run_id, run.epoch), run.callsite_base)
        try:
            self.last_text = await agent_turn(
                journal, agent, self.emit, self.runtime.max_tool_concurrency
            )
        finally:
            await journal.settle()
        return End(None), dict(run.state)

    def _noop(self, run: Run, result: TurnResult) -> TurnResult:
        self.sink.opened(run.run_id)
        return result

    # ------------------------------------------------------------ addressing
    async def _address(self) -> tuple[Run, bool]:
        """The run this turn is for, and whether it is new (not stored yet)."""
        request = self.request
        runtime = self.runtime
        if request.run_id is not None:
            run = await runtime._load(request.run_id, request.session_id)
            if run is None:
                raise RunNotFoundError(request.run_id, request.session_id)
            return run, False
        if request.signal_delivery is not None:
            return await self._find_waiting(request.signal_delivery), False
        if request.kind == "flow":
            if not request.flow_name:
                msg = "kind='flow' needs flow_name, the name of one of the agents' flows"
                raise ValueError(msg)
            agent, flow = runtime.flow(request.flow_name)
            minted = flow_run_id(request.session_id, flow.name, request.idempotency_key)
            if request.idempotency_key is not None:
                # A retried start (same key) finds the run the first one made.
                existing = await asyncio.to_thread(runtime.store.load, str(minted))
                if existing is not None and existing.session_id == request.session_id:
                    return existing, False
            run = new_run(minted, request.session_id, "flow", agent.id, flow.name, flow.digest)
            return run, True
        if request.kind not in (None, "conversation"):
            msg = f"kind must be 'conversation' or 'flow', got {request.kind!r}"
            raise ValueError(msg)
        run_id = str(conversation_run_id(request.session_id))
        existing = await asyncio.to_thread(runtime.store.load, run_id)
        if existing is not None:
            if existing.session_id != request.session_id:
                raise RunNotFoundError(run_id, request.session_id)
            return existing, False
        agent = runtime.default_agent()
        run = new_run(
            conversation_run_id(request.session_id),
            request.session_id,
            "conversation",
            agent.id,
            None,
            None,
        )
        return run, True

    async def _find_waiting(self, delivery: SignalDelivery) -> Run:
        """The session's run a delivery without ``run_id`` is for."""
        store = self.runtime.store
        session_id = self.request.session_id
        run_ids = await asyncio.to_thread(store.session_run_ids, session_id)
        matches: list[Run] = []
        for run_id in run_ids:
            run = await asyncio.to_thread(store.load, run_id)
            if run is None:
                continue
            if delivery.signal_id in run.signal_ids:
                return run  # a retry of a delivery already made: a no-op there
            waiting = run.waiting_for
            if (
                run.status == "paused"
                and waiting is not None
                and waiting["name"] == delivery.name
                and delivery.request_id in (None, waiting["request_id"])
            ):
                matches.append(run)
        if len(matches) == 1:
            return matches[0]
        if not matches:
            wanted = f" with request_id {delivery.request_id!r}" if delivery.request_id else ""
            msg = f"no run of session {session_id!r} waits for signal {delivery.name!r}{wanted}"
        else:
            msg = (
                f"{len(matches)} runs of session {session_id!r} wait for signal "
                f"{delivery.name!r}; pass run_id to say which"
            )
        raise SignalMismatchError("", msg)

    # ------------------------------------------------------------- preparing
    def _prepare(self, run: Run, fresh: bool) -> tuple[_Opening | None, Any]:
        """What this turn does to the run (None: nothing, return its state)."""
        request = self.request
        if fresh:
            return _Opening.NEW_RUN, None
        delivery = request.signal_delivery
        if delivery is not None:
            payload = signals.check(run, delivery, utcnow(), from_sweeper=request.from_sweeper)
            if payload is signals.Duplicate.DELIVERED:
                return None, None
            return _Opening.DELIVERY, payload
        if request.input is not None:
            waiting = run.waiting_for
            if run.status == "paused" and waiting is not None and waiting["kind"] == "input":
                return _Opening.INPUT, None
            if run.status == "paused" and waiting is not None:
                raise SignalMismatchError(
                    run.run_id,
                    f"run {run.run_id} waits for {waiting['name']!r}, not for input; "
                    "deliver that signal first",
                )
            if run.kind == "conversation" and run.status != "aborted":
                # A conversation inside a flow keeps the flow's epoch (its keys);
                # outside one, a fresh user turn is a fresh epoch.
                if run.active_flow is not None:
                    return _Opening.MESSAGE, None
                return _Opening.NEW_EPOCH, None
            if run.status in ("finished", "aborted"):
                return None, None
            raise SignalMismatchError(
                run.run_id, f"run {run.run_id} is {run.status} and is not waiting for input"
            )
        if run.status in ("finished", "aborted", "paused"):
            return None, None  # a paused run moves only on a delivery or input
        return _Opening.RESUME, None

    def _flow_to_enter(self, run: Run, opening: _Opening) -> tuple[Agent, Flow] | None:
        """The flow a conversation's new turn enters (``flow_name`` without a run id)."""
        request = self.request
        if (
            run.kind == "conversation"
            and request.flow_name
            and request.run_id is None
            and opening in (_Opening.NEW_RUN, _Opening.NEW_EPOCH)
        ):
            return self.runtime.flow(request.flow_name)
        return None

    def _definitions(self, run: Run) -> tuple[Agent, Flow | None]:
        """The agent (and flow, for a run in a flow) that drive this run."""
        if run.active_flow is None:
            return self.runtime.agent(run.active_agent), None
        agent, flow = self.runtime.flow(run.active_flow)
        if run.flow_digest != flow.digest:
            raise FlowDriftError(run.run_id, run.flow_digest, flow.digest)
        return agent, flow

    # --------------------------------------------------------------- opening
    async def _open(
        self, journal: Journal, opening: _Opening, payload: Any, enter: Flow | None
    ) -> None:
        """The turn's first save: the lease, with what opens the turn."""
        request = self.request
        run = journal.run
        message = Message(role="user", content=request.input) if request.input else None
        run.take_lease(self.runtime.holder, utcnow() + journal.lease_ttl)
        if opening is _Opening.NEW_RUN:
            run.start_turn(0, message, request.idempotency_key)
            if run.active_flow is not None:
                _, flow = self.runtime.flow(run.active_flow)
                run.enter_node(flow.name, flow.start, {}, 0)
            if enter is not None:
                run.repin_flow(enter.name, enter.digest, enter.start)
            await asyncio.to_thread(self.runtime.store.create_run, run)
        elif opening is _Opening.NEW_EPOCH:
            run.start_turn(run.epoch + 1, message, request.idempotency_key)
            if enter is not None:
                run.repin_flow(enter.name, enter.digest, enter.start)
            await journal.persist()
        elif opening is _Opening.MESSAGE:
            assert message is not None
            run.append_message(message)
            run.resume()
            await journal.persist()
        elif opening is _Opening.INPUT:
            assert message is not None
            run.accept_input(message)
            await journal.persist()
        elif opening is _Opening.DELIVERY:
            assert request.signal_delivery is not None
            await signals.accept(journal, request.signal_delivery, payload)
        else:
            run.resume()
            await journal.persist()

    # --------------------------------------------------------------- closing
    async def _close_finished(
        self, journal: Journal, transition: End | Handoff, state: dict[str, Any]
    ) -> TurnResult:
        run = journal.run
        agent = transition.to if isinstance(transition, Handoff) else run.active_agent
        outcome = transition.reason
        output = self.last_text if self.last_text is not None else outcome
        run.finish(
            outcome,
            output,
            agent,
            state,
        )
        return await self._close(journal, StreamPart(type="finished"))

    async def _close_paused(self, journal: Journal, suspended: SuspendError) -> TurnResult:
        journal.run.pause(suspended.waiting_for, suspended._private)
        return await self._close(
            journal, StreamPart(type="paused", waiting_for=suspended.waiting_for)
        )

    async def _close_errored(self, journal: Journal, exc: Exception) -> None:
        error = StepError(type=type(exc).__name__, message=str(exc), data=error_fields(exc))
        journal.run.fail(error)
        # The node's error is what the caller needs to see, even if this close loses a race.
        with contextlib.suppress(StaleWriteError):
            await self._close(journal, StreamPart(type="error", error=error))

    async def _close(self, journal: Journal, part: StreamPart) -> TurnResult:
        run = journal.run
        run.release_lease()
        result = result_of(run, self.last_text if run.status == "paused" else None)
        if self.request.idempotency_key:
            run.record_turn(self.request.idempotency_key, result.model_dump(mode="json"))
        await journal.persist()
        self.sink.emit(part.model_copy(update={"data": result.model_dump(mode="json")}))
        return result
