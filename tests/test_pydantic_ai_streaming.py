"""Pydantic AI's streamed runs made durable: ``run_stream`` and ``event_stream_handler``
through ``durable()`` (docs/streaming.md, docs/pydantic-ai.md).

Pydantic AI's ``FunctionModel`` streams (its ``stream_function`` sends a tool
call, then the answer's text in pieces) and counts its calls. The text reaches
``run_stream``'s ``stream_text`` and the run's stored stream as it is written;
each request is one journaled model step; a handler sees a fresh response's
events live and a replayed one's replayed, and a resume after a crash asks
the model only for what is new.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel
from stream_kit import shown
from test_pydantic_ai import SESSION, conversation_id, crashing

from kuralle_es import Runtime, StreamPart
from kuralle_es.integrations.pydantic_ai import durable
from kuralle_es.testing import Crash, CrashPlan

PIECES = ["Your order A1 ", "shipped on Monday; ", "it arrives ", "tomorrow."]
ANSWER = "".join(PIECES)


class Desk:
    """Looks the order up (a tool call), then answers in pieces."""

    def __init__(self) -> None:
        self.model_calls = 0
        self.agent = Agent(FunctionModel(self.whole, stream_function=self.stream), name="desk")
        self.agent.tool_plain(self.lookup_order)

    def whole(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise AssertionError("a streamed run asks for streams")

    async def stream(
        self, messages: list[ModelMessage], info: AgentInfo
    ) -> AsyncIterator[str | DeltaToolCalls]:
        self.model_calls += 1
        if not any(isinstance(p, ToolReturnPart) for p in messages[-1].parts):
            yield {0: DeltaToolCall("lookup_order", '{"order_id": "A1"}', tool_call_id="c1")}
            return
        for piece in PIECES:
            yield piece

    def lookup_order(self, order_id: str) -> dict[str, Any]:
        """Find an order."""
        return {"order_id": order_id, "shipped": "Monday"}


class Seen:
    """An ``event_stream_handler`` that keeps the model events it is given."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def __call__(self, run_context: Any, events: AsyncIterable[Any]) -> None:
        async for event in events:
            if isinstance(event, PartStartEvent | PartDeltaEvent):
                self.events.append(event)

    def text(self) -> str:
        out = ""
        for event in self.events:
            if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
                out += event.part.content
            elif isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
                out += event.delta.content_delta
        return out

    def tool_calls(self) -> list[str]:
        return [
            e.part.tool_name
            for e in self.events
            if isinstance(e, PartStartEvent) and isinstance(e.part, ToolCallPart)
        ]


async def test_run_stream_gives_the_text_as_it_is_written_and_journals_each_request(
    open_store: Any,
) -> None:
    desk = Desk()
    runtime = Runtime([], store=open_store())
    agent = durable(desk.agent, runtime)

    async with agent.run_stream("Where is A1?", session_id=SESSION) as streamed:
        pieces = [text async for text in streamed.stream_text(delta=True)]
        run_id = await streamed.run_id()
    done = await streamed.result()

    assert pieces == PIECES
    assert (done.status, done.output, done.run_id) == ("finished", ANSWER, run_id)
    steps = await runtime.get_steps(run_id, SESSION)
    assert [(s.kind, s.name) for s in steps] == [
        ("model", "function:whole:stream"),
        ("tool", "lookup_order"),
        ("model", "function:whole:stream"),
    ]
    assert steps[2].result is not None and steps[2].result["content"] == ANSWER
    stored = [part async for part in runtime.stream(run_id, SESSION)]
    assert shown(stored) == ANSWER
    assert {p.step for p in stored if p.type == "text-delta"} == {2}
    assert desk.model_calls == 2


async def test_cumulative_stream_text_ends_with_the_whole_answer(open_store: Any) -> None:
    agent = durable(Desk().agent, Runtime([], store=open_store()))
    async with agent.run_stream("Where is A1?", session_id=SESSION) as streamed:
        texts = [text async for text in streamed.stream_text()]
    assert texts == [ANSWER[: len("".join(PIECES[: n + 1]))] for n in range(len(PIECES))]


async def test_a_handler_sees_fresh_events_live_and_replayed_ones_after_a_crash(
    open_store: Any,
) -> None:
    desk = Desk()
    dying, reopen = crashing(open_store)
    dying.plan = CrashPlan("after_finalize", nth=1)  # the tool call's response is journaled
    first = Seen()
    agent = durable(desk.agent, Runtime([], store=dying, holder="worker-1"))
    try:
        await agent.run("Where is A1?", session_id=SESSION, event_stream_handler=first)
    except Crash:
        pass
    else:
        raise AssertionError("the worker was to die after the first model step")
    dying.plan = None
    assert first.tool_calls() == ["lookup_order"] and desk.model_calls == 1

    store = reopen()
    run_id = await conversation_id(store)
    runtime = Runtime([], store=store, holder="worker-1")
    again = Seen()
    done = await durable(desk.agent, runtime).run(
        "Where is A1?", session_id=SESSION, run_id=run_id, event_stream_handler=again
    )

    assert (done.status, done.output) == ("finished", ANSWER)
    assert desk.model_calls == 2, "the journaled request was replayed, not asked again"
    assert again.tool_calls() == ["lookup_order"], "the replayed response's events, replayed"
    assert again.text() == ANSWER, "the fresh response's events, once"
    stored: list[StreamPart] = [part async for part in runtime.stream(run_id, SESSION)]
    assert shown(stored) == ANSWER
