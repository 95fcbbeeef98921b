"""Pydantic AI's ``iter`` through ``durable()``: a durable turn driven node by node
(docs/pydantic-ai.md, "Node by node").

The graph runs in the turn's task; each node reaches the caller before it runs,
and a node the caller streams has its journal calls made by the turn. The shop
of ``test_pydantic_ai`` (a whole-response ``FunctionModel``) and the desk of
``test_pydantic_ai_streaming`` (a streaming one) play the model and count their
calls; every resume is made on a fresh ``Runtime`` over a new store object on
the same database, as another process would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic_ai import Agent, CallToolsNode, ModelRequestNode, UserPromptNode
from pydantic_ai.messages import (
    ModelMessage,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel
from pydantic_graph import End
from stream_kit import shown
from test_pydantic_ai import SESSION, Shop, conversation_id, crashing, on
from test_pydantic_ai_streaming import ANSWER, Desk

from kuralle_es import Runtime
from kuralle_es.integrations.pydantic_ai import DurableAgent, DurableAgentRun, durable
from kuralle_es.testing import Crash, CrashPlan

PROMPT = "Please refund my order A1"
#: The shop's turn, approvals off: three requests, two tool calls, the answer.
SHOP_NODES = [
    "UserPromptNode",
    "ModelRequestNode",
    "CallToolsNode",
    "ModelRequestNode",
    "CallToolsNode",
    "ModelRequestNode",
    "CallToolsNode",
    "End",
]


def essence(step: Any) -> tuple[Any, ...]:
    """A step as two runs of one script share it: a model step's text and tool
    calls (its recorded response also holds timestamps and ids), a tool's result."""
    result = step.result
    if step.kind == "model":
        result = (result["content"], result["tool_calls"])
    return (step.kind, step.name, step.status, result)


class StreamingShop(Shop):
    """The shop, its model streaming (``FunctionModel``'s ``stream_function``): the
    same responses, sent as Pydantic AI's stream deltas."""

    def __init__(self, *, approval: bool = True) -> None:
        super().__init__(approval=approval)
        self.agent = Agent(FunctionModel(self.answer, stream_function=self.stream), name="support")
        self.agent.tool_plain(self.lookup_order)
        self.agent.tool_plain(requires_approval=approval)(self.refund_order)

    async def stream(
        self, messages: list[ModelMessage], info: AgentInfo
    ) -> AsyncIterator[str | DeltaToolCalls]:
        for part in self.answer(messages, info).parts:
            if isinstance(part, ToolCallPart):
                args = part.args_as_json_str()
                yield {0: DeltaToolCall(part.tool_name, args, tool_call_id=part.tool_call_id)}
            elif isinstance(part, TextPart):
                yield part.content


async def walk(
    run: DurableAgentRun, *, stream: bool = False, names: list[str] | None = None
) -> tuple[list[str], str]:
    """Every node's type name, in order (kept in ``names`` as they come); with
    ``stream``, each request and tool node streamed through ``node.stream(run.ctx)``,
    and the text its events carried."""
    names = [] if names is None else names
    text = ""
    async for node in run:
        names.append(type(node).__name__)
        if stream and isinstance(node, ModelRequestNode | CallToolsNode):
            async with node.stream(run.ctx) as events:
                async for event in events:
                    if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
                        text += event.part.content
                    elif isinstance(event, PartDeltaEvent) and isinstance(
                        event.delta, TextPartDelta
                    ):
                        text += event.delta.content_delta
    return names, text


async def test_iter_gives_the_nodes_in_order_and_ends_as_run_does(open_store: Any) -> None:
    iterated, ran = Shop(approval=False), Shop(approval=False)
    store = open_store()
    runtime, agent = on(store, iterated)

    async with agent.iter(PROMPT, session_id=SESSION) as run:
        first = await anext(run)
        assert isinstance(first, UserPromptNode)
        names, _ = await walk(run)
    by_run = await on(store, ran)[1].run(PROMPT, session_id="customer-8")

    assert ["UserPromptNode", *names] == SHOP_NODES
    assert run.result is not None
    assert run.result.run_id == await run.run_id()
    assert (run.result.status, run.result.output) == ("finished", by_run.output)
    assert by_run.output == "Refund: refunded 4250"
    steps = await runtime.get_steps(run.result.run_id, SESSION)
    same = await runtime.get_steps(by_run.run_id, "customer-8")
    assert [essence(s) for s in steps] == [essence(s) for s in same]
    assert iterated.model_calls == ran.model_calls == 3
    assert iterated.refunds == [4250]


async def test_a_streamed_node_gives_its_events_and_its_request_is_journaled_once(
    open_store: Any,
) -> None:
    desk = Desk()
    runtime = Runtime([], store=open_store())
    agent = durable(desk.agent, runtime)

    async with agent.iter("Where is A1?", session_id=SESSION) as run:
        names, text = await walk(run, stream=True)

    assert names == [
        "UserPromptNode",
        "ModelRequestNode",
        "CallToolsNode",
        "ModelRequestNode",
        "CallToolsNode",
        "End",
    ]
    assert text == ANSWER
    assert run.result is not None and (run.result.status, run.result.output) == (
        "finished",
        ANSWER,
    )
    assert desk.model_calls == 2
    steps = await runtime.get_steps(run.result.run_id, SESSION)
    assert [(s.kind, s.name) for s in steps] == [
        ("model", "function:whole:stream"),
        ("tool", "lookup_order"),
        ("model", "function:whole:stream"),
    ]
    stored = [part async for part in runtime.stream(run.result.run_id, SESSION)]
    assert shown(stored) == ANSWER


async def crash_then_iterate(open_store: Any, shop: Shop, *, stream: bool) -> list[str]:
    """The worker dies once the first model step is journaled; ``iter`` with the
    run id on a fresh runtime resumes the turn. The nodes the resume gave."""
    dying, reopen = crashing(open_store)
    dying.plan = CrashPlan("after_finalize", nth=1)
    _, agent = on(dying, shop)
    with pytest.raises(Crash):
        async with agent.iter(PROMPT, session_id=SESSION) as run:
            await walk(run, stream=stream)
    dying.plan = None
    assert shop.model_calls == 1

    store = reopen()
    run_id = await conversation_id(store)
    runtime, agent = on(store, shop)
    async with agent.iter(PROMPT, session_id=SESSION, run_id=run_id) as run:
        names, _ = await walk(run, stream=stream)
    assert run.result is not None
    assert (run.result.run_id, run.result.status) == (run_id, "finished")
    assert run.result.output == "Refund: refunded 4250"
    assert shop.model_calls == 3, "the journaled request was replayed, not asked again"
    assert shop.refunds == [4250]
    steps = await runtime.get_steps(run_id, SESSION)
    assert [(s.kind, s.status) for s in steps] == [
        ("model", "finished"),
        ("tool", "finished"),
        ("model", "finished"),
        ("tool", "finished"),
        ("model", "finished"),
    ]
    return names


async def test_iter_after_a_crash_replays_the_journaled_request(open_store: Any) -> None:
    names = await crash_then_iterate(open_store, Shop(approval=False), stream=False)
    assert names == SHOP_NODES


async def test_a_streamed_iter_after_a_crash_replays_the_journaled_request(
    open_store: Any,
) -> None:
    names = await crash_then_iterate(open_store, StreamingShop(approval=False), stream=True)
    assert names == SHOP_NODES


@pytest.mark.parametrize("stream", [False, True], ids=["iterated", "streamed"])
async def test_a_tool_needing_approval_pauses_the_run(open_store: Any, stream: bool) -> None:
    shop = StreamingShop() if stream else Shop()
    runtime, agent = on(open_store(), shop)

    names: list[str] = []
    async with agent.iter(PROMPT, session_id=SESSION) as run:
        await walk(run, stream=stream, names=names)
        # Streamed, the tool node's stream ends with the pause: the block ends here.
        assert not stream, "the pause cut the tool node's stream short"

    assert run.result is not None and run.result.status == "paused"
    assert run.result.output is None
    waiting = run.result.waiting_for
    assert waiting is not None and waiting.operation is not None
    assert waiting.operation.tool_name == "refund_order"
    # The second tool node asked for the approval: the run stopped there.
    assert names == SHOP_NODES[:5]
    assert shop.refunds == [] and shop.model_calls == 2

    done = await runtime.approve(run.result.run_id, SESSION, by="ann")
    assert (done.status, done.output) == ("finished", "Refund: refunded 4250")
    assert shop.refunds == [4250] and shop.model_calls == 3


async def test_leaving_the_block_early_lets_the_turn_finish(open_store: Any) -> None:
    shop = Shop(approval=False)
    agent: DurableAgent = on(open_store(), shop)[1]

    async with agent.iter(PROMPT, session_id=SESSION) as run:
        async for node in run:
            if isinstance(node, ModelRequestNode):
                break

    assert run.result is not None
    assert (run.result.status, run.result.output) == ("finished", "Refund: refunded 4250")
    assert shop.model_calls == 3 and shop.refunds == [4250]
    assert not isinstance(node, End)


async def test_a_retried_keyed_iter_gives_no_node_and_the_first_result(open_store: Any) -> None:
    shop = Shop(approval=False)
    agent = on(open_store(), shop)[1]
    async with agent.iter(PROMPT, session_id=SESSION, idempotency_key="refund-A1") as first:
        names, _ = await walk(first)
    async with agent.iter(PROMPT, session_id=SESSION, idempotency_key="refund-A1") as again:
        retried, _ = await walk(again)

    assert names == SHOP_NODES and retried == []
    assert again.result == first.result and await again.finished() == first.result
    assert shop.model_calls == 3 and shop.refunds == [4250]
