"""A refund agent: a conversation whose refund is a child flow with a human approval.

    python -m kuralle_es.examples.refund_agent [--store URL] [--approve-as NAME] TEXT

The ``support`` agent looks the order up and calls ``request_refund``, a
``flow_tool``: the call starts a ``refund_review`` child run that asks a
supervisor and refunds exactly once (``outside.Ledger`` keeps one refund per
key); the conversation waits for it, then tells the customer. Offline the
model is scripted; ``KURALLE_MODEL=openai:gpt-4o-mini`` uses a real one.
Approve from anywhere: ``--approve-as``, ``kuralle-es approve CHILD_RUN_ID
--by NAME --app kuralle_es.examples.refund_agent:AGENTS``, the dashboard or
HTTP. See docs/examples.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
from typing import Any

from pydantic import BaseModel, Field

from kuralle_es import (
    Agent,
    Model,
    ModelRequest,
    ModelResponse,
    RunContext,
    RunStore,
    Runtime,
    ToolCall,
    ToolCallRequest,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    flow_tool,
    openai_model,
)
from kuralle_es.examples.outside import Ledger
from kuralle_es.testing import ScriptedModel

ORDERS = {"A17": {"order_id": "A17", "cents": 4250, "status": "delivered"}}


class OrderId(BaseModel):
    order_id: str


class RefundRequest(BaseModel):
    """The child flow's input: the model's args to ``request_refund``."""

    order_id: str
    cents: int = Field(gt=0)
    reason: str


async def review(state: dict[str, Any], ctx: RunContext) -> Any:
    asked: RefundRequest = ctx.input
    decision = await ctx.approve(
        f"Refund {asked.cents} cents on order {asked.order_id}?", description=asked.reason
    )
    if not decision.approved:
        return end(f"declined by {decision.by}: {decision.reason or 'no reason given'}")
    receipt = await ctx.tool("issue_refund", asked.model_dump())
    ctx.logger.info("refunded %s cents on %s", receipt["cents"], receipt["order_id"])
    return end(f"refunded {receipt['cents']} cents on order {receipt['order_id']}")


def scripted(request: ModelRequest) -> ModelResponse | str:
    """The offline model: look the order up, ask for its refund, report."""
    last, said = request.messages[-1], str(request.messages[-1].content or "")
    if last.role == "user":
        found = re.search(r"\b[A-Z]\d+\b", said)
        order = {"order_id": found.group(0) if found else "?"}
        return ModelResponse(tool_calls=[ToolCallRequest("c1", "lookup_order", order)])
    result = json.loads(said or "null")
    if last.name == "lookup_order" and result:
        args = {"order_id": result["order_id"], "cents": result["cents"], "reason": "asked"}
        return ModelResponse(tool_calls=[ToolCallRequest("c2", "request_refund", args)])
    return f"Update on your refund: {result}."


def pick_model() -> Model:
    """``KURALLE_MODEL=openai:<model>`` for a real model, else the scripted one."""
    name = os.environ.get("KURALLE_MODEL", "scripted")
    if name.startswith("openai:"):
        return openai_model(name.removeprefix("openai:"))
    return ScriptedModel(scripted)


def build_agents(payments: Ledger | None = None, model: Model | None = None) -> list[Agent]:
    """The ``support`` conversation agent and the ``refunds`` agent of its child flow."""
    ledger = payments or Ledger()

    def issue_refund(args: RefundRequest, call: ToolCall) -> dict[str, Any]:
        return ledger.record(call.idempotency_key, "payments", "refund", args.model_dump())

    support = define_agent(
        "support",
        "You help customers with refunds: look the order up, then request its refund.",
        model or pick_model(),
        [
            define_tool("lookup_order", "Find an order", OrderId, lambda a: ORDERS.get(a.order_id)),
            flow_tool("request_refund", "Refund an order (a supervisor approves)",
                      "refund_review", RefundRequest),
        ],
    )  # fmt: skip
    review_flow = define_flow(
        "refund_review", "a supervisor approves, then the refund is issued once", "go",
        [action("go", review)], input=RefundRequest,
    )  # fmt: skip
    refunds = define_agent(
        "refunds", "", None, [define_tool("issue_refund", "Refund", RefundRequest, issue_refund)],
        [review_flow],
    )  # fmt: skip
    return [support, refunds]


AGENTS = build_agents()


async def main(store_url: str, text: str, approver: str | None) -> None:
    with RunStore.from_url(store_url) as store:
        runtime = Runtime(AGENTS, store=store)
        turn = await runtime.run("customer-1", input=text).result()
        wait = turn.waiting_for
        if wait is None or wait.child_run_id is None:
            print(turn.status, turn.output)
            return
        print(f"waiting for child run {wait.child_run_id} (a supervisor's approval)")
        if approver is not None:
            await runtime.approve(wait.child_run_id, "customer-1", by=approver)
            state = await runtime.get_run(turn.run_id, "customer-1")
            assert state is not None
            print(state.status, state.messages[-1].content)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="sqlite:///refunds.db")
    parser.add_argument("--approve-as", default=None)
    parser.add_argument("text")
    args = parser.parse_args()
    asyncio.run(main(args.store, args.text, args.approve_as))
