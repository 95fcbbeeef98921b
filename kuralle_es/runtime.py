"""``Runtime``: opens a turn (address, lease), drives it, closes it.

A turn is one call of ``Runtime.run``. It addresses a run fail-closed,
takes the run's lease with a compare-and-set save, drives the run's flow
through the journal, and closes the run (finished, paused or errored) with
the lease released, in one more save.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from uuid import uuid4

from . import signals
from .agents import Agent
from .domain import Run, new_run
from .driver import drive_flow
from .errors import (
    FlowDriftError,
    FlowNotFoundError,
    KuralleError,
    LeaseHeldError,
    RunNotFoundError,
    SignalMismatchError,
    StaleWriteError,
    SuspendError,
    error_fields,
)
from .flows import End, Flow, Handoff
from .handle import TurnHandle, TurnSink
from .journal import Journal, utcnow
from .models import (
    Message,
    RunState,
    SignalDelivery,
    StepError,
    StepRecord,
    StreamPart,
    TurnResult,
)
from .store import RunStore

__all__ = ["Runtime"]


@dataclass(frozen=True)
class _TurnRequest:
    session_id: str
    input: str | None
    kind: str | None
    flow_name: str | None
    run_id: str | None
    signal_delivery: SignalDelivery | None
    idempotency_key: str | None
    from_sweeper: bool = False


def _default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid4().hex[:8]}"


class Runtime:
    """Runs agents and flows durably over a ``RunStore``."""

    def __init__(
        self,
        agents: Sequence[Agent] = (),
        store: RunStore | None = None,
        lease_ttl: float = 30.0,
        holder: str | None = None,
        max_tool_concurrency: int = 8,
    ) -> None:
        if lease_ttl <= 0:
            msg = f"lease_ttl must be a positive number of seconds, got {lease_ttl}"
            raise ValueError(msg)
        self._owns_store = store is None
        self.store = store if store is not None else RunStore()
        self.lease_ttl = lease_ttl
        self.holder = holder or _default_holder()
        self.max_tool_concurrency = max_tool_concurrency
        self.agents: dict[str, Agent] = {}
        self._flows: dict[str, tuple[Agent, Flow]] = {}
        for agent in agents:
            if agent.id in self.agents:
                msg = f"two agents share the id {agent.id!r}"
                raise ValueError(msg)
            self.agents[agent.id] = agent
            for flow in agent.flows.values():
                self._flows.setdefault(flow.name, (agent, flow))

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
        input: str | None = None,
        kind: str | None = None,
        flow_name: str | None = None,
        run_id: str | None = None,
        signal_delivery: SignalDelivery | None = None,
        idempotency_key: str | None = None,
    ) -> TurnHandle:
        """Start a turn; returns its handle at once (errors surface through it)."""
        request = _TurnRequest(
            session_id=session_id,
            input=input,
            kind=kind,
            flow_name=flow_name,
            run_id=run_id,
            signal_delivery=signal_delivery,
            idempotency_key=idempotency_key,
        )
        return TurnHandle(lambda sink: _Turn(self, request, sink).drive())

    # ----------------------------------------------------------------- reads
    async def get_run(self, run_id: str, session_id: str) -> RunState | None:
        """The run's state, or None when it is unknown or of another session."""
        run = await self._load(run_id, session_id)
        return run.to_state() if run is not None else None

    async def get_steps(self, run_id: str, session_id: str) -> list[StepRecord]:
        """The run's journal; ``RunNotFoundError`` when unknown or of another session."""
        run = await self._load(run_id, session_id)
        if run is None:
            raise RunNotFoundError(run_id, session_id)
        return run.step_records()

    async def _load(self, run_id: str, session_id: str) -> Run | None:
        run = await asyncio.to_thread(self.store.load, run_id)
        if run is None or run.session_id != session_id:
            return None
        return run

    # ----------------------------------------------------------- definitions
    def flow(self, name: str) -> tuple[Agent, Flow]:
        try:
            return self._flows[name]
        except KeyError:
            raise FlowNotFoundError(name, list(self._flows)) from None


class _Turn:
    """One turn: open (address, lease) -> drive -> close."""

    def __init__(self, runtime: Runtime, request: _TurnRequest, sink: TurnSink) -> None:
        self.runtime = runtime
        self.request = request
        self.sink = sink

    async def drive(self) -> TurnResult:
        request = self.request
        run, fresh = await self._address()
        if request.idempotency_key and request.idempotency_key in run.turn_keys:
            return self._noop(
                run, TurnResult.model_validate(run.turn_keys[request.idempotency_key])
            )
        delivery = request.signal_delivery
        payload: Any = None
        if delivery is not None:
            payload = signals.check(run, delivery, utcnow(), from_sweeper=request.from_sweeper)
            if payload is signals.Duplicate.DELIVERED:
                return self._noop(run, _result_of(run))
        elif run.status in ("finished", "aborted", "paused"):
            # Nothing to do: a paused run moves only on a delivery.
            return self._noop(run, _result_of(run))
        agent, flow = self._flow_of(run)
        self._check_lease(run)
        journal = Journal(
            self.runtime.store, run, holder=self.runtime.holder, lease_ttl=self.runtime.lease_ttl
        )
        run.take_lease(self.runtime.holder, utcnow() + journal.lease_ttl)
        try:
            if fresh:
                await asyncio.to_thread(self.runtime.store.create_run, run)
            elif delivery is not None:
                await signals.accept(journal, delivery, payload)
            else:
                await journal.persist()
        except StaleWriteError:
            if delivery is not None:
                # Two identical deliveries raced: the winner's is the delivery.
                latest = await asyncio.to_thread(self.runtime.store.load, run.run_id)
                if latest is not None and delivery.signal_id in latest.signal_ids:
                    return self._noop(latest, _result_of(latest))
            raise
        self.sink.opened(run.run_id)
        try:
            transition, state = await drive_flow(journal, flow, agent, self.sink.emit)
        except SuspendError as suspended:
            return await self._close_paused(journal, suspended)
        except StaleWriteError:
            raise
        except Exception as exc:
            await self._close_errored(journal, exc)
            raise
        return await self._close_finished(journal, transition, state)

    def _noop(self, run: Run, result: TurnResult) -> TurnResult:
        self.sink.opened(run.run_id)
        return result

    # ------------------------------------------------------------ addressing
    async def _address(self) -> tuple[Run, bool]:
        """The run this turn is for, and whether it is new (not yet stored)."""
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
            run = new_run(uuid4(), request.session_id, "flow", agent.id, flow.name, flow.digest)
            message = Message(role="user", content=request.input) if request.input else None
            run.start_turn(0, message, request.idempotency_key)
            run.enter_node(flow.name, flow.start, {}, 0)
            return run, True
        msg = (
            "conversation runs (no run_id, kind other than 'flow') need the agent loop, "
            "which this version does not have yet; start a flow run with kind='flow'"
        )
        raise NotImplementedError(msg)

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
            msg = (
                f"no run of session {session_id!r} waits for signal {delivery.name!r}"
                f"{' with request_id ' + repr(delivery.request_id) if delivery.request_id else ''}"
            )
        else:
            msg = (
                f"{len(matches)} runs of session {session_id!r} wait for signal "
                f"{delivery.name!r}; pass run_id to say which"
            )
        raise SignalMismatchError("", msg)

    def _flow_of(self, run: Run) -> tuple[Agent, Flow]:
        if run.active_flow is None:
            msg = f"run {run.run_id} has no active flow to drive"
            raise KuralleError(msg)
        agent, flow = self.runtime.flow(run.active_flow)
        if run.flow_digest != flow.digest:
            raise FlowDriftError(run.run_id, run.flow_digest, flow.digest)
        return agent, flow

    def _check_lease(self, run: Run) -> None:
        holder = run.lease_holder
        expires = run.lease_expires_at
        if (
            holder is not None
            and expires is not None
            and holder != self.runtime.holder
            and run.lease_is_live(utcnow())
        ):
            raise LeaseHeldError(run.run_id, holder, expires)

    # --------------------------------------------------------------- closing
    async def _close_finished(
        self, journal: Journal, transition: End | Handoff, state: dict[str, Any]
    ) -> TurnResult:
        run = journal.run
        agent = transition.to if isinstance(transition, Handoff) else run.active_agent
        outcome = transition.reason
        run.finish(outcome, outcome, agent, state)
        return await self._close(journal, StreamPart(type="finished"))

    async def _close_paused(self, journal: Journal, suspended: SuspendError) -> TurnResult:
        run = journal.run
        run.pause(suspended.waiting_for, suspended._private)
        return await self._close(
            journal, StreamPart(type="paused", waiting_for=suspended.waiting_for)
        )

    async def _close_errored(self, journal: Journal, exc: Exception) -> None:
        run = journal.run
        error = StepError(type=type(exc).__name__, message=str(exc), data=error_fields(exc))
        run.fail(error)
        # The node's error is what the caller needs to see, even if this close loses a race.
        with contextlib.suppress(StaleWriteError):
            await self._close(journal, StreamPart(type="error", error=error))

    async def _close(self, journal: Journal, part: StreamPart) -> TurnResult:
        run = journal.run
        run.release_lease()
        result = _result_of(run)
        if self.request.idempotency_key:
            run.record_turn(self.request.idempotency_key, result.model_dump(mode="json"))
        await journal.persist()
        self.sink.emit(part.model_copy(update={"data": result.model_dump(mode="json")}))
        return result


def _result_of(run: Run) -> TurnResult:
    state = run.to_state()
    return TurnResult(
        run_id=run.run_id,
        status=state.status,
        output=run.output,
        waiting_for=state.waiting_for,
    )
