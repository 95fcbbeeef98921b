"""The agent loop: model -> tool calls -> results -> model, until a reply.

Model-requested tools run through the same tool runner as ``ctx.tool``.
Consecutive parallel-safe calls run together (bounded); any other call runs
alone. Stream parts and tool messages follow the model's order, whatever
order the calls complete in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .._definitions.agents import Agent
from .._definitions.llm import ModelRequest, ModelResponse, ToolCallRequest
from .._definitions.tools import Tool
from .._journal.sites import Site
from ..errors import (
    ChildRunError,
    InvalidToolArgsError,
    ModelResponseError,
    SuspendError,
    ToolApprovalDeniedError,
    ToolExecutionError,
)
from ..shapes import StreamPart
from .cursor import Cursor
from .model_calls import assistant_message, model_call, model_turn, tool_message
from .streaming import TurnStream
from .tool_calls import run_tool
from .writer import RunWriter

__all__ = ["MAX_MODEL_TURNS", "agent_turn", "denied_result"]

#: Model turns one user turn may take before the loop gives up.
MAX_MODEL_TURNS = 24


def denied_result(tool_name: str, denied_by: str | None, reason: str | None) -> dict[str, Any]:
    """What the model reads for a denied tool call (docs/howto/approvals.md)."""
    message = (
        f"The call to {tool_name} was declined"
        f"{' by ' + denied_by if denied_by else ''}{': ' + reason if reason else ''}. "
        "It was not executed. Do not retry it; tell the user instead."
    )
    return {"__denied": True, "toolName": tool_name, "deniedBy": denied_by, "message": message}


@dataclass
class _Planned:
    """One model-requested call, checked before anything runs."""

    request: ToolCallRequest
    site: Site
    tool: Tool[Any] | None
    args: BaseModel | None
    refusal: dict[str, Any] | None

    @property
    def parallel(self) -> bool:
        return (
            self.tool is not None
            and self.args is not None
            and self.tool.is_parallel_safe(self.args)
        )


def _plan(agent: Agent, request: ToolCallRequest, site: Site) -> _Planned:
    tool = agent.tools.get(request.name)
    if tool is None:
        refusal = {
            "error": f"unknown tool {request.name!r}; available tools: {sorted(agent.tools)!r}"
        }
        return _Planned(request, site, None, None, refusal)
    if "__malformed_arguments__" in request.args:
        refusal = {"error": f"the arguments for {tool.name!r} were not valid JSON; send JSON"}
        return _Planned(request, site, tool, None, refusal)
    try:
        args = tool.validate(request.args)
    except InvalidToolArgsError as e:
        return _Planned(request, site, tool, None, {"error": str(e)})
    return _Planned(request, site, tool, args, None)


async def _outcome(writer: RunWriter, call: _Planned) -> Any:
    """The tool result the model reads; SuspendError propagates."""
    if call.refusal is not None or call.tool is None or call.args is None:
        return call.refusal
    try:
        return await run_tool(writer, call.site, call.tool, call.args)
    except ToolApprovalDeniedError as e:
        return denied_result(e.tool_name, e.denied_by, e.reason)
    except ToolExecutionError as e:
        return {"error": f"{e.error_type}: {e.message}"}
    except (ChildRunError, InvalidToolArgsError) as e:  # a flow_tool's child run
        return {"error": f"{type(e).__name__}: {e}"}


def _groups(calls: list[_Planned]) -> list[list[_Planned]]:
    groups: list[list[_Planned]] = []
    for call in calls:
        if call.parallel and groups and groups[-1][0].parallel:
            groups[-1].append(call)
        else:
            groups.append([call])
    return groups


def _next_turn_journaled(writer: RunWriter, cursor: Cursor, agent: Agent) -> bool:
    """Whether a resume finds the model turn after this one journaled: the save
    of that turn carried every tool message of this one (they ride the next
    save), so this turn has nothing left to answer."""
    site = cursor.site(cursor.next)
    model_id = str(agent.model.id)
    return writer.recorded(model_call(site, model_id, "agent")) is not None


async def run_tool_calls(
    writer: RunWriter,
    cursor: Cursor,
    agent: Agent,
    requests: list[ToolCallRequest],
    emit: Callable[[StreamPart], None],
    max_concurrency: int,
) -> None:
    """Run one model turn's tool calls and append their tool messages in order."""
    sites = [cursor.site(callsite) for callsite in cursor.reserve(len(requests))]
    if _next_turn_journaled(writer, cursor, agent):
        return
    # Only this model turn's answers count: tool-call ids repeat across turns
    # (servers number them per response). This turn's assistant message is the
    # last one, on a fresh pass and on a resume alike (a resume of an earlier,
    # fully answered turn stopped above).
    messages = writer.messages()
    last = max(i for i, m in enumerate(messages) if m.role == "assistant")
    answered = {m.tool_call_id for m in messages[last + 1 :] if m.role == "tool"}
    pending = [
        _plan(agent, request, site)
        for request, site in zip(requests, sites, strict=True)
        if request.id not in answered
    ]
    limit = asyncio.Semaphore(max(1, max_concurrency))

    async def bounded(call: _Planned) -> Any:
        async with limit:
            return await _outcome(writer, call)

    for group in _groups(pending):
        if len(group) > 1:  # a parallel batch, recorded as one on its steps
            for call in group:
                call.site = call.site.in_batch(group[0].site.callsite)
        for call in group:
            emit(
                StreamPart(
                    type="tool-call",
                    tool_name=call.request.name,
                    tool_call_id=call.request.id,
                    args=call.request.args,
                )
            )
        # return_exceptions: a suspend in the group lets the others settle first.
        outcomes = await asyncio.gather(*(bounded(c) for c in group), return_exceptions=True)
        # A crash or a cancellation of one call is the cause of whatever the
        # others then met (a broken journal's StaleWriteError): it goes first.
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome
        suspended: SuspendError | None = None
        for call, outcome in zip(group, outcomes, strict=True):
            if isinstance(outcome, SuspendError):
                suspended = suspended or outcome
                continue
            if isinstance(outcome, BaseException):
                raise outcome
            if suspended is not None:
                continue  # keep tool messages in the model's order
            emit(
                StreamPart(
                    type="tool-result",
                    tool_name=call.request.name,
                    tool_call_id=call.request.id,
                    result=outcome,
                )
            )
            writer.append_message(tool_message(call.request.id, call.request.name, outcome))
        if suspended is not None:
            raise suspended


async def agent_turn(
    writer: RunWriter,
    cursor: Cursor,
    agent: Agent,
    emit: TurnStream,
    max_concurrency: int,
) -> str | None:
    """Loop model turns and tool calls until the model replies without tools."""
    schemas = [tool.json_schema() for tool in agent.tools.values()]

    def on_new(response: ModelResponse) -> None:
        writer.append_message(assistant_message(response))

    for _ in range(MAX_MODEL_TURNS):
        request = ModelRequest(
            purpose="agent",
            messages=writer.messages(),
            tools=schemas,
            instructions=agent.instructions,
        )
        response = await model_turn(
            writer, cursor, agent.model, request, on_new, budget=agent.budget, stream=emit
        )
        if not response.tool_calls:
            return response.content
        await run_tool_calls(writer, cursor, agent, response.tool_calls, emit, max_concurrency)
    detail = (
        f"agent {agent.id!r} asked for tools {MAX_MODEL_TURNS} turns in a row without "
        "replying, so the turn was stopped. Check the agent's instructions and tools"
    )
    raise ModelResponseError(str(getattr(agent.model, "id", agent.model)), detail)
