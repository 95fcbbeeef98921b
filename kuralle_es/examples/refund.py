"""The refund flow: look the order up, ask a supervisor, refund exactly once.

The tools append to a ledger file (``REFUND_LEDGER``) so the demo can show
that a replayed tool did not run again and the refund ran exactly once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from ..agents import Agent, define_agent
from ..context import RunContext
from ..flows import End, Flow, Goto, action, define_flow, end, goto
from ..models import ToolCall
from ..tools import define_tool

__all__ = ["LEDGER_ENV", "build_agent", "ledger_entries", "refund_flow"]

LEDGER_ENV = "REFUND_LEDGER"


class OrderLookup(BaseModel):
    order_id: str = Field(min_length=1)


class RefundRequest(BaseModel):
    order_id: str = Field(min_length=1)
    amount_cents: int = Field(gt=0)


def _ledger() -> Path | None:
    path = os.environ.get(LEDGER_ENV)
    return Path(path) if path else None


def _record(tool: str, call: ToolCall, detail: dict[str, Any]) -> None:
    path = _ledger()
    if path is not None:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"tool": tool, "key": call.idempotency_key, **detail}) + "\n")


def ledger_entries() -> list[dict[str, Any]]:
    path = _ledger()
    if path is None or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def lookup_order(args: OrderLookup, call: ToolCall) -> dict[str, Any]:
    _record("lookup_order", call, {"order_id": args.order_id})
    return {"order_id": args.order_id, "paid_cents": 4200, "customer": "Ada"}


def process_refund(args: RefundRequest, call: ToolCall) -> dict[str, Any]:
    _record("processRefund", call, {"amount_cents": args.amount_cents})
    return {"refund_id": f"rf_{call.idempotency_key[:10]}", "amount_cents": args.amount_cents}


async def check_and_approve(state: dict[str, Any], ctx: RunContext) -> Goto | End:
    # On resume this node runs again from the top: the lookup replays from the
    # journal and the approval returns the delivered decision.
    order = await ctx.tool("lookup_order", {"order_id": state.get("order_id", "A-1001")})
    decision = await ctx.approve(
        f"Refund {order['paid_cents'] / 100:.2f} to {order['customer']}?",
        description=f"order {order['order_id']}",
    )
    if not decision.approved:
        return end("declined")
    return goto(
        "refund", {"order": order, "amount_cents": order["paid_cents"], "approved_by": decision.by}
    )


async def refund(state: dict[str, Any], ctx: RunContext) -> End:
    receipt = await ctx.tool(
        "processRefund",
        {"order_id": state["order"]["order_id"], "amount_cents": state["amount_cents"]},
    )
    state["receipt"] = receipt
    return end("approved")


refund_flow: Flow = define_flow(
    "refund",
    "Refund an order after a supervisor approves it",
    "check",
    [
        action("check", check_and_approve),
        action("refund", refund),
    ],
)


def build_agent(model: Any = None) -> Agent:
    return define_agent(
        "support",
        "You help customers with refunds.",
        model,
        [
            define_tool("lookup_order", "Look an order up", OrderLookup, lookup_order),
            define_tool("processRefund", "Refund an order", RefundRequest, process_refund),
        ],
        [refund_flow],
    )
