"""The definitions a runtime runs: its agents, their flows, and signal schemas (internal).

Turns look agents and flows up here; they never need the ``Runtime`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._definitions.agents import Agent
from .._definitions.flows import Flow, pinned_version, version_key
from .._lookup import known_entry
from ..errors import FlowNotFoundError, InvalidArgumentError
from .suspensions import Schemas

__all__ = ["Registry"]


class Registry:
    """Agents by id, flows by name (each with the agent that defines it).

    A flow may come in several versions (several definitions of one name,
    in one agent's ``flows`` or across agents): ``flow(name)`` is the newest
    (the greatest ``version`` compared naturally, ``version_key``; among equal
    versions the first given), and ``pinned(name, digest)`` the definition a
    run pinned, if this runtime still has it.
    """

    def __init__(self, agents: Sequence[Agent]) -> None:
        self.agents: dict[str, Agent] = {}
        self._flows: dict[str, tuple[Agent, Flow]] = {}
        self._versions: dict[str, list[tuple[Agent, Flow]]] = {}
        #: Payload schemas of ``ctx.signal`` this runtime has seen suspend.
        self.schemas = Schemas()
        for agent in agents:
            if agent.id in self.agents:
                msg = f"two agents share the id {agent.id!r}; give each agent its own id"
                raise InvalidArgumentError(msg)
            self._add_agent(agent)

    def add(self, agent: Agent) -> None:
        """Add an agent after the runtime was made (an integration's, docs/pydantic-ai.md).

        The same definition again is a no-op (each process makes it anew and
        adds it to its runtime); another agent under a taken id is refused.
        """
        known = self.agents.get(agent.id)
        if known is not None:
            if known == agent:
                return
            msg = (
                f"this runtime already has another agent with the id {agent.id!r}; "
                "give each agent its own id"
            )
            raise InvalidArgumentError(msg)
        self._add_agent(agent)

    def _add_agent(self, agent: Agent) -> None:
        self.agents[agent.id] = agent
        for flow in agent.flow_versions or tuple(agent.flows.values()):
            self._add_version(agent, flow)

    def _add_version(self, agent: Agent, flow: Flow) -> None:
        versions = self._versions.setdefault(flow.name, [])
        for _, known in versions:
            if flow.version == known.version and flow.digest == known.digest:
                return  # one definition given twice (two agents sharing it): the first
            if flow.version is not None and flow.version == known.version:
                msg = (
                    f"two definitions of flow {flow.name!r} share version {flow.version!r} "
                    "but differ; give each its own version"
                )
                raise InvalidArgumentError(msg)
        versions.append((agent, flow))
        newest = self._flows.get(flow.name)
        if newest is None or version_key(flow.version) > version_key(newest[1].version):
            self._flows[flow.name] = (agent, flow)

    def default_agent(self) -> Agent:
        """The agent a new conversation starts with: the first one given."""
        if not self.agents:
            msg = "this runtime has no agents; pass agents=[define_agent(...)] to Runtime"
            raise InvalidArgumentError(msg)
        return next(iter(self.agents.values()))

    def agent(self, agent_id: str | None) -> Agent:
        unknown = (
            f"unknown agent {agent_id!r}; the runtime has {sorted(self.agents)!r}. "
            "Pass every agent a run may hand off to in Runtime(agents=[...])"
        )
        return known_entry(self.agents, agent_id, unknown)

    def flow(self, name: str) -> tuple[Agent, Flow]:
        """The newest flow called ``name`` and its agent, or ``FlowNotFoundError``."""
        try:
            return self._flows[name]
        except KeyError:
            raise FlowNotFoundError(name, list(self._flows)) from None

    def pinned(
        self, name: str, digest: str | None, version: str | None = None
    ) -> tuple[Agent, Flow] | None:
        """The definition of flow ``name`` a run pinned to ``digest`` (and labelled
        ``version``) resumes on, or None when this runtime has no such digest.

        Versions whose definitions are identical share a digest; the one with
        the run's own version is taken then, else the newest of them.
        """
        versions = self._versions.get(name, [])
        found = pinned_version([flow for _, flow in versions], digest, version)
        return next(((a, f) for a, f in versions if f is found), None)

    def run_flow(
        self, name: str, digest: str | None, version: str | None = None
    ) -> tuple[Agent, Flow]:
        """The definition a run pinned to ``digest`` is driven on: ``pinned``, or
        the newest when this runtime lacks it (callers check drift first)."""
        return self.pinned(name, digest, version) or self.flow(name)

    def versions(self, name: str) -> list[tuple[Agent, Flow]]:
        """Every definition of flow ``name``, in the order given."""
        return list(self._versions.get(name, ()))
