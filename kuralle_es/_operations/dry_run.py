"""Stand-ins that let a recorded run be driven without executing anything (internal).

``replay_check`` (would today's code resume a live run?) and ``replay_with``
(what would new code or a new model do on a recorded run?) both drive runs
through the ordinary turn machinery with every tool replaced by a stub: the
journal serves what it recorded, and a call it does not hold reaches the
stub, which stops the replay there. ``WouldExecute`` is a ``Crash`` (the
process dying at that point), so no tool wrapper, ``except Exception`` or
``gather`` of node code can swallow it and go on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from .._crash import Crash
from .._definitions.llm import ModelRequest, ModelResponse
from .._definitions.tools import Tool, define_tool

__all__ = ["AnyArgs", "AnyTools", "StubModel", "WouldExecute", "forbidden", "stubbed"]


class WouldExecute(Crash):
    """The replay reached an effect the journal does not hold: stop, nothing ran."""


class AnyArgs(BaseModel):
    """Arguments of a tool the replay was not given: whatever the node passes."""

    model_config = ConfigDict(extra="allow")


async def forbidden(args: BaseModel) -> Any:
    raise WouldExecute


def stubbed(tools: Mapping[str, Tool[Any]]) -> dict[str, Tool[Any]]:
    """``tools`` with every execution replaced by ``forbidden`` (nothing else changes:
    names, input models, policies and keys stay as the code defines them)."""
    return {
        name: dataclasses.replace(tool, execute=forbidden, wants_call=False, timeout=None)
        for name, tool in tools.items()
    }


class StubModel:
    """A model that answers nothing: a recorded turn replays, a new one stops the replay."""

    def __init__(self, model_id: str) -> None:
        self._id = model_id

    @property
    def id(self) -> str:
        return self._id

    async def respond(self, request: ModelRequest) -> ModelResponse:
        raise WouldExecute


class AnyTools(dict[str, Tool[Any]]):
    """Every tool name a node asks for, as a stub (a replay given no agents)."""

    def get(self, name: str, default: Any = None) -> Tool[Any]:
        if name not in self:
            self[name] = define_tool(name, "", AnyArgs, forbidden)
        return self[name]
