"""A conversation run inside a flow (docs/contract.md: flows' handoff, turns' addressing): a plain
call with ``flow_name`` enters the flow in the session's conversation run, its
input continues the flow, ``end`` returns the conversation to its agent, and
``handoff`` makes another agent answer the next turn.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    ModelRequest,
    ModelResponse,
    RunContext,
    RunStore,
    Runtime,
    SignalDelivery,
    ToolCall,
    action,
    collect,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
    handoff,
)
from kuralle_es.testing import ScriptedModel

SESSION = "conv-flow"


class Order(BaseModel):
    order_id: str | None = None


class Charge(BaseModel):
    cents: int


def extract_order(request: ModelRequest) -> ModelResponse | str:
    if request.purpose == "extract":
        said = " ".join(m.content or "" for m in request.messages if m.role == "user")
        words = [w for w in said.split() if w.startswith("A-")]
        return ModelResponse(data={"order_id": words[0]} if words else {})
    return f"support agent answering turn {len(request.messages)}"


def billing_answer(request: ModelRequest) -> str:
    return "billing here"


def build(charges: list[str], then: str, store: RunStore) -> Runtime:
    def charge(args: Charge, call: ToolCall) -> dict[str, int]:
        charges.append(call.idempotency_key)
        return {"charged": args.cents}

    async def settle(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("charge", {"cents": 500})
        decision = await ctx.approve("Close the order?")
        if then == "handoff":
            return handoff("billing", "needs billing")
        return end("closed" if decision.approved else "kept")

    flow = define_flow(
        "order",
        "close an order",
        "ask",
        [
            collect(
                "ask", Order, ["order_id"], lambda missing: "Which order?", lambda d: goto("settle")
            ),
            action("settle", settle),
        ],
    )
    support = define_agent(
        "support",
        "help",
        ScriptedModel(extract_order, id="support-model"),
        [define_tool("charge", "charge", Charge, charge)],
        [flow],
    )
    billing = define_agent("billing", "bill", ScriptedModel(billing_answer, id="billing-model"))
    return Runtime([support, billing], store=store)


async def test_a_plain_call_with_flow_name_runs_the_flow_inside_the_conversation(
    open_store: Any,
) -> None:
    charges: list[str] = []
    runtime = build(charges, then="end", store=open_store())
    first = await runtime.run(SESSION, input="I want to close an order", flow_name="order").result()
    assert first.status == "paused"
    assert first.waiting_for is not None and first.waiting_for.kind == "input"
    state = await runtime.get_run(first.run_id, SESSION)
    assert state is not None
    assert (state.kind, state.active_flow, state.active_node) == ("conversation", "order", "ask")

    # The next plain call is the user's answer: it continues the flow, same run.
    second = await runtime.run(SESSION, input="it is A-17").result()
    assert second.run_id == first.run_id
    assert second.status == "paused"
    assert second.waiting_for is not None and second.waiting_for.name == "__approval"

    done = await runtime.run(
        SESSION,
        signal_delivery=SignalDelivery(
            signal_id="ok-1", name="__approval", payload={"approved": True}
        ),
    ).result()
    assert done.status == "finished"
    state = await runtime.get_run(first.run_id, SESSION)
    assert state is not None
    assert state.outcome == "closed"
    assert state.active_flow is None and state.active_node is None
    assert state.state["order_id"] == "A-17"
    assert len(charges) == 1

    # Out of the flow, the next user turn is the agent loop again (a new epoch).
    after = await runtime.run(SESSION, input="thanks").result()
    assert after.status == "finished"
    assert after.output is not None and after.output.startswith("support agent answering")
    assert len(charges) == 1


async def test_a_handoff_inside_a_conversation_makes_the_other_agent_answer_next(
    open_store: Any,
) -> None:
    charges: list[str] = []
    runtime = build(charges, then="handoff", store=open_store())
    first = await runtime.run(SESSION, input="close A-9", flow_name="order").result()
    assert first.waiting_for is not None and first.waiting_for.name == "__approval"
    handed = await runtime.run(
        SESSION,
        signal_delivery=SignalDelivery(
            signal_id="ok-2", name="__approval", payload={"approved": True}
        ),
    ).result()
    assert handed.status == "finished"
    state = await runtime.get_run(first.run_id, SESSION)
    assert state is not None
    assert state.active_agent == "billing"
    assert state.outcome == "needs billing"
    assert state.active_flow is None

    next_turn = await runtime.run(SESSION, input="what do I owe?").result()
    assert next_turn.output == "billing here"
    steps = await runtime.get_steps(first.run_id, SESSION)
    assert steps[-1].kind == "model" and steps[-1].name == "billing-model"
    assert len(charges) == 1
