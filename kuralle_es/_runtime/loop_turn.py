"""The journaled turn an agent's own loop drives (internal; docs/pydantic-ai.md).

``JournaledLoopTurn`` is the runtime's side of ``LoopTurn``: it hands the loop the
same machinery the built-in agent loop uses (``model_turn`` for model steps,
``run_tool`` for tool steps, the approval lane of a tool call, the child
runs of ``children``), so a turn driven by another framework's loop is
journaled, budgeted, approved and replayed exactly like one of the built-in
loop (docs/agents.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._definitions.agents import Agent
from .._definitions.llm import Model, ModelRequest, ModelResponse
from .._definitions.tools import Tool
from .._journal.sites import Effect, Lane, Site
from ..shapes import ApprovalDecision, Message, StreamPart
from .children import conversation_request, start_child, wait_child
from .context import TurnBound
from .cursor import Cursor
from .model_calls import assistant_message, model_turn
from .step_results import decode
from .streaming import TurnStream
from .tool_calls import ask_approval, recorded_approval, run_tool
from .writer import RunWriter

__all__ = ["JournaledLoopTurn"]


class JournaledLoopTurn(TurnBound):
    """One user turn of a conversation run whose agent has a ``loop``."""

    def __init__(
        self,
        writer: RunWriter,
        cursor: Cursor,
        agent: Agent,
        emit: TurnStream,
    ) -> None:
        super().__init__(writer, cursor, emit)
        self._agent = agent
        self._stream = emit

    def messages(self) -> list[Message]:
        return self._writer.messages()

    def append_message(self, message: Message) -> None:
        self._writer.append_message(message)

    def emit(self, part: StreamPart) -> None:
        self._emit(part)

    async def model(
        self, model: Model, request: ModelRequest, messages: Sequence[Message] = ()
    ) -> ModelResponse:
        writer = self._writer

        def on_new(response: ModelResponse) -> None:
            # Saved with the response, so a replay neither loses nor repeats them.
            for message in messages:
                writer.append_message(message)
            writer.append_message(assistant_message(response))

        return await model_turn(
            writer,
            self._cursor,
            model,
            request,
            on_new,
            budget=self._agent.budget,
            stream=self._stream,
        )

    def reserve(self, n: int) -> list[int]:
        return self._cursor.reserve(n)

    async def given(self, name: str, value: Any) -> Any:
        writer, cursor = self._writer, self._cursor
        site = cursor.site(cursor.next)
        step = writer.peek(Effect(site, "value", name))
        if step is not None and step["status"] == "finished":
            cursor.take()
            return decode(step)
        if value is None or writer.holds(site):
            return None
        site = cursor.take()
        return await writer.record_value(Effect(site, "value", name), make=lambda: value)

    async def approval(
        self, callsite: int, tool_name: str, args: Any, description: str | None = None
    ) -> ApprovalDecision:
        site = self._cursor.site(callsite)
        recorded = recorded_approval(self._writer, site)
        if recorded is None:
            ask_approval(self._writer, site, tool_name, args, description)
        return recorded[0]

    async def tool(
        self, tool: Tool[Any], args: Any, callsite: int, tool_call_id: str | None = None
    ) -> Any:
        site = self._cursor.site(callsite)
        return await run_tool(
            self._writer, site, tool, tool.validate(args), self._emit, tool_call_id
        )

    async def child(
        self,
        callsite: int,
        ordinal: int,
        agent_id: str,
        prompt: str,
        session_id: str | None = None,
    ) -> tuple[str, Any]:
        site = _inside(self._cursor.site(callsite), ordinal)
        request = conversation_request(agent_id, prompt, session_id, self.session_id)
        child_run_id = await start_child(self._writer, site, request)
        reply = await wait_child(self._writer, site.in_lane(Lane.CHILD), child_run_id)
        return child_run_id, reply


def _inside(site: Site, ordinal: int) -> Site:
    """The journal slot of the ``ordinal``-th child that the tool call at ``site``
    starts: a logical run of that call's own, so the call's children keep their
    slots (and keys) whatever else the turn does, on every execution of the call."""
    return Site(f"{site.logical_run}/{site.callsite}", ordinal)
