"""The refund flow: collect the amount, ask a supervisor, refund exactly once, reply.

Offline it runs on a ``ScriptedModel`` that reads amounts out of the user's
words; ``KURALLE_MODEL=openai:gpt-4o-mini`` (with ``OPENAI_API_KEY``) uses a
real model instead. ``processRefund`` appends to a ledger file
(``REFUND_LEDGER``) so the demo can show it ran exactly once.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from .._definitions.agents import Agent, define_agent
from .._definitions.flows import Flow, Goto, action, collect, define_flow, end, goto, reply
from .._definitions.llm import Model, ModelRequest, ModelResponse, openai_model
from .._definitions.tools import define_tool
from .._runtime.context import RunContext
from ..shapes import ToolCall
from ..testing import ScriptedModel

__all__ = ["LEDGER_ENV", "MODEL_ENV", "build_agent", "demo_model", "ledger_entries", "refund_flow"]

LEDGER_ENV = "REFUND_LEDGER"
MODEL_ENV = "KURALLE_MODEL"


class RefundDetails(BaseModel):
    """What the collect node gathers from the conversation."""

    amount: float | None = Field(default=None, gt=0, description="refund amount in dollars")


class RefundRequest(BaseModel):
    amount_cents: int = Field(gt=0)


def ledger_entries() -> list[dict[str, Any]]:
    path = os.environ.get(LEDGER_ENV)
    if not path or not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def process_refund(args: RefundRequest, call: ToolCall) -> dict[str, Any]:
    """The payment side effect; the idempotency key is what a payment API dedups on."""
    path = os.environ.get(LEDGER_ENV)
    if path:
        with Path(path).open("a", encoding="utf-8") as f:
            entry = {"tool": "processRefund", "key": call.idempotency_key, **args.model_dump()}
            f.write(json.dumps(entry) + "\n")
    return {"refund_id": f"rf_{call.idempotency_key[:10]}", "amount_cents": args.amount_cents}


async def ask_supervisor(state: dict[str, Any], ctx: RunContext) -> Goto:
    amount = float(state["amount"])
    decision = await ctx.approve(
        f"Refund ${amount:.2f}?", description="a customer asked for a refund"
    )
    if not decision.approved:
        return goto("declined", {"declined_by": decision.by, "reason": decision.reason})
    receipt = await ctx.tool("processRefund", {"amount_cents": round(amount * 100)})
    return goto("approved", {"receipt": receipt, "approved_by": decision.by})


refund_flow: Flow = define_flow(
    "refund",
    "Refund a customer after a supervisor approves it",
    "amount",
    [
        collect(
            "amount",
            RefundDetails,
            ["amount"],
            ask=lambda missing: "How much should be refunded, in dollars?",
            on_complete=lambda data: goto("approve"),
        ),
        action("approve", ask_supervisor),
        reply("approved", "Tell the customer the refund was approved.", end("approved")),
        reply("declined", "Tell the customer the refund was declined.", end("declined")),
    ],
)


def _scripted(request: ModelRequest) -> ModelResponse | str:
    """Offline stand-in for a model: deterministic, so every process agrees."""
    if request.purpose == "extract":
        said = " ".join(str(m.content or "") for m in request.messages if m.role == "user")
        found = re.search(r"\$?\s*(\d+(?:\.\d+)?)", said)
        return ModelResponse(data={"amount": float(found.group(1))} if found else {})
    if "approved" in (request.instructions or ""):
        return "Good news: your refund was approved and is on its way."
    return "Sorry, your refund was declined."


def demo_model() -> Model:
    """The model named by ``KURALLE_MODEL``: ``scripted`` (default) or ``openai:<model>``."""
    name = os.environ.get(MODEL_ENV, "scripted")
    if name == "scripted":
        return ScriptedModel(_scripted)
    provider, _, model = name.partition(":")
    if provider != "openai" or not model:
        msg = f"{MODEL_ENV} must be 'scripted' or 'openai:<model>', got {name!r}"
        raise ValueError(msg)
    return openai_model(model)


def build_agent(model: Model | None = None) -> Agent:
    return define_agent(
        "support",
        "You help customers with refunds. Be brief and kind.",
        model if model is not None else demo_model(),
        [define_tool("processRefund", "Refund the customer", RefundRequest, process_refund)],
        [refund_flow],
    )
