"""The definitions a runtime runs: its agents, their flows, and signal schemas (internal).

Turns look agents and flows up here; they never need the ``Runtime`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from .agents import Agent
from .errors import FlowNotFoundError, InvalidArgumentError
from .flows import Flow
from .waits import Schemas

__all__ = ["Registry"]


class Registry:
    """Agents by id, flows by name (each with the agent that defines it)."""

    def __init__(self, agents: Sequence[Agent]) -> None:
        self.agents: dict[str, Agent] = {}
        self._flows: dict[str, tuple[Agent, Flow]] = {}
        #: Payload schemas of ``ctx.signal`` this runtime has seen suspend.
        self.schemas = Schemas()
        for agent in agents:
            if agent.id in self.agents:
                msg = f"two agents share the id {agent.id!r}; give each agent its own id"
                raise InvalidArgumentError(msg)
            self.agents[agent.id] = agent
            for flow in agent.flows.values():
                self._flows.setdefault(flow.name, (agent, flow))

    def default_agent(self) -> Agent:
        """The agent a new conversation starts with: the first one given."""
        if not self.agents:
            msg = "this runtime has no agents; pass agents=[define_agent(...)] to Runtime"
            raise InvalidArgumentError(msg)
        return next(iter(self.agents.values()))

    def agent(self, agent_id: str | None) -> Agent:
        if agent_id is None or agent_id not in self.agents:
            msg = (
                f"unknown agent {agent_id!r}; the runtime has {sorted(self.agents)!r}. "
                "Pass every agent a run may hand off to in Runtime(agents=[...])"
            )
            raise InvalidArgumentError(msg)
        return self.agents[agent_id]

    def flow(self, name: str) -> tuple[Agent, Flow]:
        """The flow called ``name`` and its agent, or ``FlowNotFoundError``."""
        try:
            return self._flows[name]
        except KeyError:
            raise FlowNotFoundError(name, list(self._flows)) from None
