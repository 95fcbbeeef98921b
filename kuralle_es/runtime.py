"""``Runtime``: opens a turn (address, lease), drives it, closes it.

A turn is one call of ``Runtime.run``. It addresses a run fail-closed,
takes the run's lease with a compare-and-set save, drives the run's flow
through the journal, and closes the run (finished, paused or errored) with
the lease released, in one more save.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING
from uuid import uuid4

from .agents import Agent
from .domain import Run
from .errors import (
    FlowNotFoundError,
    KuralleError,
    RunNotFoundError,
)
from .flows import Flow
from .handle import TurnHandle
from .journal import utcnow
from .models import (
    RunState,
    SignalDelivery,
    StepRecord,
)
from .store import RunStore
from .turn import TurnRequest, drive_turn

if TYPE_CHECKING:
    from .views import RunViews

__all__ = ["Runtime"]


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

    @functools.cached_property
    def views(self) -> RunViews:
        """Queries over the runs of this runtime's store (made on first use)."""
        from .views import RunViews

        return RunViews(self.store)

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
        request = TurnRequest(
            session_id=session_id,
            input=input,
            kind=kind,
            flow_name=flow_name,
            run_id=run_id,
            signal_delivery=signal_delivery,
            idempotency_key=idempotency_key,
        )
        return TurnHandle(lambda sink: drive_turn(self, request, sink))

    # ----------------------------------------------------------------- reads
    async def get_run(self, run_id: str, session_id: str) -> RunState | None:
        """The run's state, or None when it is unknown or of another session."""
        run = await self._load(run_id, session_id)
        return run.to_state() if run is not None else None

    async def get_steps(self, run_id: str, session_id: str) -> list[StepRecord]:
        """The run's journal; empty when the run is unknown or of another session
        (like ``get_run``'s None: a read never says whether a foreign run exists)."""
        run = await self._load(run_id, session_id)
        return run.step_records() if run is not None else []

    async def _load(self, run_id: str, session_id: str) -> Run | None:
        run = await asyncio.to_thread(self.store.load, run_id)
        if run is None or run.session_id != session_id:
            return None
        return run

    async def resolve_drift(self, run_id: str, session_id: str, recovery: str) -> RunState:
        """Settle a run whose flow changed: ``restart`` re-pins the flow's current
        definition and restarts it from its start node (the next ``run`` drives
        it), ``abandon`` marks the run ``aborted``."""
        if recovery not in ("restart", "abandon"):
            msg = f"recovery must be 'restart' or 'abandon', got {recovery!r}"
            raise ValueError(msg)
        run = await self._load(run_id, session_id)
        if run is None or run.active_flow is None:
            raise RunNotFoundError(run_id, session_id)
        run.require_lease_free(self.holder, utcnow())
        if recovery == "restart":
            _, flow = self.flow(run.active_flow)
            run.repin_flow(flow.name, flow.digest, flow.start)
        else:
            run.abort("flow-drift: abandoned")
        await asyncio.to_thread(self.store.save_run, run)
        return run.to_state()

    # ----------------------------------------------------------- definitions
    def default_agent(self) -> Agent:
        """The agent a new conversation starts with: the first one given."""
        if not self.agents:
            msg = "this runtime has no agents; pass agents=[define_agent(...)] to Runtime"
            raise KuralleError(msg)
        return next(iter(self.agents.values()))

    def agent(self, agent_id: str | None) -> Agent:
        if agent_id is None or agent_id not in self.agents:
            msg = (
                f"unknown agent {agent_id!r}; the runtime has {sorted(self.agents)!r}. "
                "Pass every agent a run may hand off to in Runtime(agents=[...])"
            )
            raise KuralleError(msg)
        return self.agents[agent_id]

    def flow(self, name: str) -> tuple[Agent, Flow]:
        try:
            return self._flows[name]
        except KeyError:
            raise FlowNotFoundError(name, list(self._flows)) from None
