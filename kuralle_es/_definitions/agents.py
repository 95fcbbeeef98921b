"""Agents: an id, instructions, a model, tools and flows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError, InvalidDefinitionError
from .budget import Budget
from .flows import Flow, version_key
from .loops import ConversationLoop
from .tools import Tool

__all__ = ["Agent", "define_agent"]


@dataclass(frozen=True)
class Agent:
    """What ``define_agent`` returns: an id, instructions, a model, tools and flows.

    ``flows`` holds the newest definition of each flow by name;
    ``flow_versions`` every definition given, versions included, in order.
    """

    id: str
    instructions: str
    model: Any
    tools: dict[str, Tool[Any]]
    flows: dict[str, Flow]
    #: The most each of its runs may spend on model calls (docs/usage.md).
    budget: Budget | None = None
    flow_versions: tuple[Flow, ...] = ()
    #: What drives its conversation turns in place of the built-in loop
    #: (docs/pydantic-ai.md); None: the built-in loop (docs/agents.md).
    loop: ConversationLoop | None = None


def define_agent(
    id: str,
    instructions: str,
    model: Any,
    tools: Sequence[Tool[Any]] | Mapping[str, Tool[Any]] = (),
    flows: Sequence[Flow] = (),
    budget: Budget | None = None,
    loop: ConversationLoop | None = None,
) -> Agent:
    """An agent: instructions, a ``Model``, its tools and flows.

    ``tools`` is a list of ``Tool`` or a mapping of name to ``Tool``. ``flows``
    may hold several versions of one flow (``define_flow(..., version=...)``):
    new runs start on the newest, a run resumes on the one it pinned. Raises
    ``InvalidArgumentError`` on two tools with one name, or two flows with one
    name and one version (or none). ``budget`` limits what each of the agent's
    runs spends on model calls (a run's own ``runtime.run(..., budget=)``
    replaces it; docs/usage.md). ``loop`` drives the agent's conversation turns
    in place of the built-in loop: the extension point integrations use to run
    another framework's agent on the journal (docs/pydantic-ai.md).
    """
    if loop is not None and not isinstance(loop, ConversationLoop):
        msg = f"agent {id!r}: loop must have `async def drive(self, turn)`, got {loop!r}"
        raise InvalidDefinitionError(msg)
    if budget is not None and not isinstance(budget, Budget):
        msg = f"agent {id!r}: budget must be a kuralle_es.Budget, got {budget!r}"
        raise InvalidArgumentError(msg)
    if model is not None and not (
        hasattr(model, "id") and callable(getattr(model, "respond", None))
    ):
        msg = (
            f"agent {id!r}: model must have an id and `async def respond(self, request: "
            "ModelRequest) -> ModelResponse | str` (the Model protocol: openai_model(...), "
            "kuralle_es.testing.ScriptedModel, or your own; docs/agents.md), or be None for "
            f"an agent that makes no model turns; got {model!r}"
        )
        raise InvalidDefinitionError(msg)
    if isinstance(tools, Mapping):
        by_name = dict(tools)
        for key, tool in by_name.items():
            if key != tool.name:
                msg = f"agent {id!r}: tools key {key!r} names tool {tool.name!r}; make them equal"
                raise InvalidArgumentError(msg)
    else:
        by_name = {}
        for tool in tools:
            if tool.name in by_name:
                msg = f"agent {id!r}: two tools are named {tool.name!r}"
                raise InvalidArgumentError(msg)
            by_name[tool.name] = tool
    flows_by_name: dict[str, Flow] = {}
    seen: set[tuple[str, str | None]] = set()
    for flow in flows:
        if (flow.name, flow.version) in seen:
            also = f" with version {flow.version!r}" if flow.version is not None else ""
            msg = (
                f"agent {id!r}: two flows are named {flow.name!r}{also}; give each "
                "definition of a flow its own version (define_flow(..., version=...))"
            )
            raise InvalidArgumentError(msg)
        seen.add((flow.name, flow.version))
        newest = flows_by_name.get(flow.name)
        if newest is None or version_key(flow.version) > version_key(newest.version):
            flows_by_name[flow.name] = flow
    return Agent(
        id=id, instructions=instructions, model=model, tools=by_name, flows=flows_by_name,
        budget=budget, flow_versions=tuple(flows), loop=loop,
    )  # fmt: skip
