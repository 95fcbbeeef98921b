"""``RunContext``: what an ``action`` node sees. Thin wrappers over the funnel."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any
from uuid import uuid4

from pydantic import BaseModel

from .errors import UnknownToolError
from .journal import Journal, utcnow
from .models import StreamPart, ToolCall
from .tools import Tool

__all__ = ["RunContext"]


class RunContext:
    """Durable effects for one node execution of one run."""

    def __init__(
        self,
        journal: Journal,
        tools: Mapping[str, Tool],
        emit: Callable[[StreamPart], None],
    ) -> None:
        self._journal = journal
        self._tools = tools
        self._emit = emit

    @property
    def run_id(self) -> str:
        return self._journal.run.run_id

    @property
    def session_id(self) -> str:
        return self._journal.run.session_id

    # ----------------------------------------------------------------- tools
    def tool(
        self,
        name: str,
        args: Any = None,
        *,
        callsite: int | None = None,
        index: int | None = None,
    ) -> Awaitable[Any]:
        """Run a tool durably. The callsite is reserved now, when called, not when awaited.

        Unknown names and invalid args are refused here, before any callsite
        is taken or anything is journaled.
        """
        tool = self._tools.get(name)
        if tool is None:
            raise UnknownToolError(name, list(self._tools))
        validated = tool.validate(args)
        site = _explicit_site(callsite, index)
        if site is None:
            site = self._journal.reserve(1)[0]
        return self._run_tool(tool, validated, site)

    async def _run_tool(self, tool: Tool, args: BaseModel, callsite: int) -> Any:
        journal = self._journal
        args_json = args.model_dump(mode="json")
        override = tool.idempotency_key(args) if tool.idempotency_key else None
        key = journal.key_for(callsite, {"name": tool.name, "args": args_json}, override)
        call = ToolCall(
            idempotency_key=key,
            run_id=self.run_id,
            session_id=self.session_id,
            tool_name=tool.name,
            callsite=callsite,
        )

        async def execute() -> Any:
            self._emit(StreamPart(type="tool-call", tool_name=tool.name, args=args_json))
            return await tool.invoke(args, call)

        def executed(result: Any) -> None:
            self._emit(StreamPart(type="tool-result", tool_name=tool.name, result=result))

        return await journal.effect(
            callsite=callsite,
            kind="tool",
            name=tool.name,
            key=key,
            args=args_json,
            execute=execute,
            replay=tool.replay,
            on_executed=executed,
        )

    # ---------------------------------------------------------- clock, uuid
    async def now(self) -> datetime:
        """The current UTC time, recorded once and replayed identically."""
        value = await self._simple("now", lambda: utcnow().isoformat())
        return datetime.fromisoformat(value)

    async def uuid(self) -> str:
        """A uuid4 string, recorded once and replayed identically."""
        return str(await self._simple("uuid", lambda: str(uuid4())))

    async def _simple(self, kind: str, make: Callable[[], str]) -> Any:
        journal = self._journal
        callsite = journal.reserve(1)[0]

        async def execute() -> str:
            return make()

        return await journal.effect(
            callsite=callsite,
            kind=kind,
            name=kind,
            key=journal.key_for(callsite, kind),
            args=None,
            execute=execute,
        )

    # ---------------------------------------------------------------- misc
    def emit(self, part: Any) -> None:
        """Send a custom part to the turn's stream (not journaled)."""
        self._emit(StreamPart(type="custom", data=part))

    def reserve_callsites(self, n: int) -> list[int]:
        """Reserve ``n`` ordinals now; pass them as ``callsite=`` to later calls."""
        return self._journal.reserve(n)


def _explicit_site(callsite: int | None, index: int | None) -> int | None:
    if callsite is not None and index is not None and callsite != index:
        msg = f"callsite={callsite} and index={index} disagree; pass one of them"
        raise ValueError(msg)
    return callsite if callsite is not None else index
