"""Agents: an id, instructions, a model, tools and flows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgumentError
from .flows import Flow
from .tools import Tool

__all__ = ["Agent", "define_agent"]


@dataclass(frozen=True)
class Agent:
    """What ``define_agent`` returns: an id, instructions, a model, tools and flows."""

    id: str
    instructions: str
    model: Any
    tools: dict[str, Tool[Any]]
    flows: dict[str, Flow]


def define_agent(
    id: str,
    instructions: str,
    model: Any,
    tools: Sequence[Tool[Any]] | Mapping[str, Tool[Any]] = (),
    flows: Sequence[Flow] = (),
) -> Agent:
    """An agent: instructions, a ``Model``, its tools and flows.

    ``tools`` is a list of ``Tool`` or a mapping of name to ``Tool``. Raises
    ``InvalidArgumentError`` on two tools or flows with one name.
    """
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
    for flow in flows:
        if flow.name in flows_by_name:
            msg = f"agent {id!r}: two flows are named {flow.name!r}"
            raise InvalidArgumentError(msg)
        flows_by_name[flow.name] = flow
    return Agent(id=id, instructions=instructions, model=model, tools=by_name, flows=flows_by_name)
