"""Pydantic AI agents made durable on the journal (docs/pydantic-ai.md).

Pydantic AI's own test models play the model (``FunctionModel`` counts its
calls), the crash kit kills workers at each step boundary, and every resume
is made on a fresh ``Runtime`` over a new store object on the same database,
with the agent wrapped anew by ``durable``: as another process would.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, ModelRetry
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel

from kuralle_es import (
    InvalidArgumentError,
    RunStore,
    Runtime,
    ToolCall,
    recover_orphaned_runs,
)
from kuralle_es.events import RunEvent, follow
from kuralle_es.integrations.pydantic_ai import DurableAgent, durable, tool_call
from kuralle_es.testing import BOUNDARIES, Crash, CrashingStore, CrashPlan, ExactlyOnceLedger

SESSION = "customer-7"
HOLDER = "worker-1"  # a restarted worker keeps its name, so its crashed lease is its own


class Shop:
    """A support agent: looks an order up, refunds it (approval first), replies.

    ``model_calls`` counts the requests that reached the model; ``refunds``
    the refunds that really ran; ``ledger`` is the payment provider, keyed by
    each call's idempotency key.
    """

    def __init__(self, *, approval: bool = True) -> None:
        self.model_calls = 0
        self.refunds: list[int] = []
        self.ledger = ExactlyOnceLedger()
        self.requests: list[list[ModelMessage]] = []
        self.agent = Agent(FunctionModel(self.answer), name="support")
        self.agent.tool_plain(self.lookup_order)
        self.agent.tool_plain(requires_approval=approval)(self.refund_order)

    def answer(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.model_calls += 1
        self.requests.append(messages)
        returns = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
        if not returns:
            call = ToolCallPart("lookup_order", {"order_id": "A1"}, tool_call_id="c1")
            return ModelResponse(parts=[call])
        if returns[0].tool_name == "lookup_order":
            args = {"order_id": "A1", "cents": returns[0].content["total_cents"]}
            return ModelResponse(parts=[ToolCallPart("refund_order", args, tool_call_id="c2")])
        return ModelResponse(parts=[TextPart(f"Refund: {returns[0].content}")])

    def lookup_order(self, order_id: str) -> dict[str, Any]:
        """Find an order."""
        return {"order_id": order_id, "total_cents": 4250}

    def refund_order(self, order_id: str, cents: int) -> str:
        """Refund an order."""
        call = tool_call()
        assert isinstance(call, ToolCall)
        self.ledger.record(call, (order_id, cents))
        self.refunds.append(cents)
        return f"refunded {cents}"


def on(store: RunStore, shop: Shop, **settings: Any) -> tuple[Runtime, DurableAgent]:
    """A runtime over ``store`` with the shop's agent made durable on it."""
    runtime = Runtime([], store=store, holder=settings.pop("holder", HOLDER), **settings)
    return runtime, durable(shop.agent, runtime)


def crashing(open_store: Any) -> tuple[CrashingStore, Callable[[], RunStore]]:
    """A crashing store over the test's database, and how to open it again
    afterwards: a new store object on SQLite and PostgreSQL, the one store in memory."""
    if open_store.backend == "memory":
        store = CrashingStore.memory()
        return store, lambda: store
    if open_store.backend == "sqlite":
        return CrashingStore.sqlite(open_store.target), open_store
    return CrashingStore.postgres(open_store.target), open_store


async def conversation_id(store: RunStore) -> str:
    [summary] = await Runtime([], store=store).views.list_runs(session_id=SESSION)
    return summary.run_id


# ------------------------------------------------------------------- crash
@pytest.mark.parametrize("boundary", BOUNDARIES)
async def test_a_tool_executes_once_across_a_crash(open_store: Any, boundary: str) -> None:
    """The worker dies at ``boundary`` of the refund's tool step (its 4th step:
    model, lookup, model, refund; approvals off); ``run`` with the run id on a
    fresh runtime resumes the cut-off turn, and the refund happens once per key."""
    shop = Shop(approval=False)
    dying, reopen = crashing(open_store)
    dying.plan = CrashPlan(boundary, nth=4)
    _, agent = on(dying, shop)
    with pytest.raises(Crash):
        await agent.run("Please refund my order A1", session_id=SESSION)
    dying.plan = None
    fresh = reopen()
    run_id = await conversation_id(fresh)
    runtime, agent = on(fresh, shop)
    assert (await runtime.get_run(run_id, SESSION)).status == "running"  # type: ignore[union-attr]

    done = await agent.run("Please refund my order A1", session_id=SESSION, run_id=run_id)

    assert (done.status, done.output, done.run_id) == ("finished", "Refund: refunded 4250", run_id)
    shop.ledger.assert_exactly_once()
    assert len(shop.ledger.effects()) == 1
    refund = [s for s in await runtime.get_steps(run_id, SESSION) if s.name == "refund_order"]
    assert [(s.kind, s.status) for s in refund] == [("tool", "finished")]
    # Only a crash after the effect and before its result can make it run again (same key).
    assert len(shop.refunds) == (2 if boundary == "after_execute" else 1)


async def test_recover_orphaned_runs_finishes_a_turn_whose_worker_died(open_store: Any) -> None:
    """A sweeper on another worker takes the orphan over once its lease expired
    and drives the Pydantic AI turn to its end, replaying what was recorded."""
    shop = Shop(approval=False)
    dying, reopen = crashing(open_store)
    dying.plan = CrashPlan("after_finalize", nth=2)  # the lookup is recorded
    _, agent = on(dying, shop, lease_ttl=0.2, holder="dead-worker")
    with pytest.raises(Crash):
        await agent.run("Please refund my order A1", session_id=SESSION)
    dying.plan = None
    calls_before = shop.model_calls
    await asyncio.sleep(0.3)  # the dead worker's lease expires
    runtime, _ = on(reopen(), shop, holder="sweeper")

    recovered = await recover_orphaned_runs(runtime)

    run_id = await conversation_id(runtime.store)
    assert recovered == [run_id]
    state = await runtime.get_run(run_id, SESSION)
    assert state is not None and state.status == "finished"
    assert state.messages[-1].content == "Refund: refunded 4250"
    assert shop.refunds == [4250]
    assert shop.model_calls == calls_before + 2  # the first request was replayed


# ---------------------------------------------------------------- approval
async def test_an_approval_pauses_and_a_fresh_runtime_resumes_it_without_asking_again(
    open_store: Any,
) -> None:
    """The refund pauses on ``__approval`` with the operation frozen; a new
    runtime on a new store object approves it: the refund runs once and only
    the request after it reaches the model (the two before are replayed)."""
    shop = Shop()
    _, agent = on(open_store(), shop)
    paused = await agent.run("Please refund my order A1", session_id=SESSION)

    assert paused.status == "paused" and paused.output is None
    wait = paused.waiting_for
    assert wait is not None and (wait.name, wait.kind) == ("__approval", "approval")
    assert wait.operation is not None
    assert (wait.operation.tool_name, wait.operation.args) == (
        "refund_order",
        {"order_id": "A1", "cents": 4250},
    )
    assert shop.refunds == [] and shop.model_calls == 2

    runtime, _ = on(open_store(), shop, holder="another-process")
    done = await runtime.approve(paused.run_id, SESSION, by="ann")

    assert (done.status, done.output) == ("finished", "Refund: refunded 4250")
    assert shop.refunds == [4250] and shop.model_calls == 3
    steps = await runtime.get_steps(paused.run_id, SESSION)
    assert [(s.kind, s.name) for s in steps] == [
        ("model", "function:answer:"),
        ("tool", "lookup_order"),
        ("model", "function:answer:"),
        ("approval", "__approval"),
        ("tool", "refund_order"),
        ("model", "function:answer:"),
    ]
    assert all(s.attempts == 1 for s in steps)


async def test_a_denied_tool_never_runs_and_the_model_is_told_the_pydantic_ai_way(
    open_store: Any,
) -> None:
    shop = Shop()
    _, agent = on(open_store(), shop)
    paused = await agent.run("Please refund my order A1", session_id=SESSION)
    runtime, _ = on(open_store(), shop, holder="another-process")

    done = await runtime.deny(paused.run_id, SESSION, by="ann", reason="over the limit")

    assert done.status == "finished" and shop.refunds == []
    [denial] = [p for p in shop.requests[-1][-1].parts if isinstance(p, ToolReturnPart)]
    assert denial.outcome == "denied"  # Pydantic AI's ToolDenied
    assert denial.content == "The tool call was denied by ann: over the limit"
    assert done.output == f"Refund: {denial.content}"
    names = [s.name for s in await runtime.get_steps(paused.run_id, SESSION)]
    assert "refund_order" not in names


# ------------------------------------------------------- views and events
async def test_runs_show_in_the_views_the_usage_and_the_event_stream(open_store: Any) -> None:
    shop = Shop(approval=False)
    store = open_store()
    runtime, agent = on(store, shop)
    done = await agent.run("Please refund my order A1", session_id=SESSION)

    [summary] = await runtime.views.list_runs(session_id=SESSION)
    assert (summary.run_id, summary.kind, summary.status) == (
        done.run_id,
        "conversation",
        "finished",
    )
    usage = await runtime.views.usage(run_id=done.run_id)
    assert (usage.model_calls, usage.tool_calls) == (3, 2)
    assert usage.total_tokens is not None and usage.total_tokens > 0
    events = await take_until_finished(store, done.run_id)
    assert [e.type for e in events][:2] == ["RunOpened", "StepStarted"]
    started = [(e.kind, e.name) for e in events if e.type == "StepStarted"]  # type: ignore[attr-defined]
    assert started == [
        ("model", "function:answer:"),
        ("tool", "lookup_order"),
        ("model", "function:answer:"),
        ("tool", "refund_order"),
        ("model", "function:answer:"),
    ]


async def take_until_finished(store: RunStore, run_id: str) -> list[RunEvent]:
    got: list[RunEvent] = []
    stream = follow(store, poll_interval=0.05)
    try:
        while not got or got[-1].type != "RunFinished":
            event = await asyncio.wait_for(anext(stream), 10)
            if event.run_id == run_id:
                got.append(event)
    finally:
        await stream.aclose()
    return got


# ------------------------------------------------------------ conversation
async def test_a_conversation_goes_on_with_the_earlier_turns_as_history() -> None:
    """Each ``run`` is a new user turn of the session's conversation run: the
    model sees the earlier turns, and a tool runs again on a new turn (new keys)."""
    seen: list[list[ModelMessage]] = []

    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(messages)
        if isinstance(messages[-1].parts[-1], ToolReturnPart):
            return ModelResponse(parts=[TextPart(f"{len(messages)} messages so far")])
        return ModelResponse(parts=[ToolCallPart("ping", {"host": "db-1"})])

    agent = Agent(FunctionModel(answer), name="pinger")
    pinged: list[str] = []

    @agent.tool_plain
    def ping(host: str) -> str:
        """Ping a host."""
        pinged.append(host)
        return f"pong {host}"

    runtime = Runtime([], store=RunStore.memory())
    durable_agent = durable(agent, runtime)
    first = await durable_agent.run("ping it", session_id="s")
    second = await durable_agent.run("and again", session_id="s")

    assert first.run_id == second.run_id and second.status == "finished"
    assert (first.output, second.output) == ("3 messages so far", "7 messages so far")
    assert pinged == ["db-1", "db-1"]
    said = [p.content for m in seen[-1] for p in m.parts if isinstance(p, UserPromptPart)]
    assert said == ["ping it", "and again"]
    steps = await runtime.get_steps(first.run_id, "s")
    keys = [s.key for s in steps if s.kind == "tool"]
    assert len(keys) == 2 and keys[0] != keys[1]


# ------------------------------------------------------------------ errors
def test_durable_needs_a_named_agent_with_a_model() -> None:
    runtime = Runtime([], store=RunStore.memory())
    with pytest.raises(InvalidArgumentError, match="name"):
        durable(Agent(TestModel()), runtime)
    with pytest.raises(InvalidArgumentError, match="no model"):
        durable(Agent(name="modelless"), runtime)


def test_durable_twice_is_harmless_but_another_agent_under_the_name_is_refused() -> None:
    runtime = Runtime([], store=RunStore.memory())
    agent = Agent(TestModel(), name="support")
    durable(agent, runtime)
    durable(agent, runtime)
    assert list(runtime.agents) == ["support"]
    with pytest.raises(InvalidArgumentError, match="support"):
        durable(Agent(TestModel(), name="support"), runtime)


def test_the_library_imports_without_pydantic_ai() -> None:
    """The extra is optional: kuralle_es and its integrations package import
    without it, and the integration says which extra to install."""
    script = (
        "import sys; sys.modules['pydantic_ai'] = None\n"
        "import kuralle_es, kuralle_es.integrations\n"
        "try:\n"
        "    import kuralle_es.integrations.pydantic_ai\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert "pip install 'kuralle_es[pydantic-ai]'" in out


# --------------------------------------------------- retries and outputs
class Quote(BaseModel):
    cents: int


async def test_a_tools_model_retry_is_journaled_and_a_structured_output_returned(
    open_store: Any,
) -> None:
    """A tool's ``ModelRetry`` is recorded as the step's result, so a resume
    (here after a crash just before the final answer was saved) retries the
    same way without running the tool again; the output keeps its type."""
    ran: list[int] = []

    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1].parts[-1]
        if isinstance(last, ToolReturnPart) and last.outcome == "retried":  # the ModelRetry
            return ModelResponse(parts=[ToolCallPart("price", {"qty": 2}, tool_call_id="p2")])
        if isinstance(last, ToolReturnPart) and last.tool_name == "price":
            final = {"cents": last.content}
            return ModelResponse(parts=[ToolCallPart(info.output_tools[0].name, final)])
        return ModelResponse(parts=[ToolCallPart("price", {"qty": 0}, tool_call_id="p1")])

    agent = Agent(FunctionModel(answer), name="quoter", output_type=Quote)

    @agent.tool_plain
    def price(qty: int) -> int:
        """Price a quantity."""
        ran.append(qty)
        if qty < 1:
            raise ModelRetry("order at least one")
        return 1200 * qty

    dying, reopen = crashing(open_store)
    # model, price, model, price, the final model: killed once that call's intent
    # (which carries the last price's result) is saved, before the model answers.
    dying.plan = CrashPlan("after_intent", nth=5)
    with pytest.raises(Crash):
        await durable(agent, Runtime([], store=dying, holder=HOLDER)).run(
            "2 please", session_id="q"
        )
    dying.plan = None
    runtime = Runtime([], store=reopen(), holder=HOLDER)
    run_id = (await runtime.views.list_runs(session_id="q"))[0].run_id

    done = await durable(agent, runtime).run("2 please", session_id="q", run_id=run_id)

    assert done.status == "finished" and done.output == Quote(cents=2400)
    assert ran == [0, 2]
    retried = next(s for s in await runtime.get_steps(run_id, "q") if s.name == "price")
    assert retried.result == {"__pydantic_ai_model_retry": "order at least one"}
