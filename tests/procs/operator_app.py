"""The app the operator-verb tests drive from ``kuralle-es``, ``serve`` and the dashboard
(``--app operator_app:build_agents``, importable from this folder).

- ``desk`` (the first agent: what ``say`` talks to by default): a conversation
  whose model looks an order up with the ``lookup`` tool when the message
  names one (``order 7``), then answers ``Order 7 is shipped.``; asked to
  ``refund order 7`` it calls ``refund_order``, which needs an approval; otherwise
  it answers ``You said: <text>``.
- ``pay`` (agent ``ops``): an approval, then ``charge`` (one JSON line per
  execution in ``OPS_LEDGER``), then a ``reply`` node's model turn, then a
  durable sleep of ``OPS_SLEEP`` seconds (default 0.5). While the file
  ``OPS_MODEL_DOWN`` names exists, every model call fails
  (``ConnectionError``): the run ends ``error`` with that model step in doubt.
- ``drifty``: waits for the ``go`` signal; with ``OPS_FLOW_VARIANT=2`` the flow
  has another node, so runs of the first variant drift.
- ``sleepy``: sleeps ``OPS_SLEEP`` seconds (``ctx.sleep``), then ends ``rested``.
- ``intake``: the refund example's ``collect`` node alone: it asks for the
  amount (a ``collect`` input wait), then ends with it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    Agent,
    ModelRequest,
    ModelResponse,
    RunContext,
    ToolCall,
    ToolCallRequest,
    action,
    collect,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
    reply,
)
from kuralle_es.testing import ScriptedModel

LEDGER_ENV = "OPS_LEDGER"
DOWN_ENV = "OPS_MODEL_DOWN"
VARIANT_ENV = "OPS_FLOW_VARIANT"
SLEEP_ENV = "OPS_SLEEP"


class Charge(BaseModel):
    cents: int


class Order(BaseModel):
    order: int


class Amount(BaseModel):
    amount: float | None = None


def ledger(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def charge(args: Charge, call: ToolCall) -> dict[str, Any]:
    with Path(os.environ[LEDGER_ENV]).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"key": call.idempotency_key, "cents": args.cents}) + "\n")
    return {"charged": args.cents}


def lookup(args: Order) -> dict[str, Any]:
    return {"order": args.order, "status": "shipped"}


def _model_is_down() -> None:
    flag = os.environ.get(DOWN_ENV)
    if flag and Path(flag).exists():
        raise ConnectionError("the model provider is down")


def refund_order(args: Order) -> dict[str, Any]:
    return {"refunded": args.order}


def _desk_model(request: ModelRequest) -> ModelResponse | str:
    _model_is_down()
    last = request.messages[-1]
    if last.role == "tool":
        result = json.loads(last.content or "{}")
        if result.get("__denied"):
            return "I could not refund that order."
        if "refunded" in result:
            return f"Order {result['refunded']} is refunded."
        return f"Order {result.get('order')} is shipped."
    text = last.content or ""
    order = re.search(r"(refund )?order (\d+)", text)
    if order:
        tool = "refund_order" if order[1] else "lookup"
        call = ToolCallRequest(id=f"call-{len(request.messages)}", name=tool,
                               args={"order": int(order[2])})  # fmt: skip
        return ModelResponse(tool_calls=[call])
    return f"You said: {text}"


def _ops_model(request: ModelRequest) -> ModelResponse | str:
    _model_is_down()
    if request.purpose == "extract":
        said = " ".join(m.content or "" for m in request.messages if m.role == "user")
        amount = re.search(r"(\d+(?:\.\d+)?)", said)
        return ModelResponse(data={"amount": float(amount[1])} if amount else {})
    return "Paid."


async def pay(state: dict[str, Any], ctx: RunContext) -> Any:
    decision = await ctx.approve("Charge 5.00?")
    if not decision.approved:
        return end("declined")
    state["receipt"] = await ctx.tool("charge", {"cents": 500})
    return goto("tell")


async def wait_for_go(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.signal("go")
    return end("went") if os.environ.get(VARIANT_ENV) != "2" else goto("audit")


async def audit(state: dict[str, Any], ctx: RunContext) -> Any:
    return end("audited")


def _rest(outcome: str) -> Any:
    async def rest(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.sleep(float(os.environ.get(SLEEP_ENV, "0.5")))
        return end(outcome)

    return rest


def _drifty_nodes() -> list[Any]:
    nodes = [action("wait", wait_for_go)]
    if os.environ.get(VARIANT_ENV) == "2":
        nodes.append(action("audit", audit))
    return nodes


def build_agents() -> list[Agent]:
    desk = define_agent(
        "desk",
        "answers about orders",
        ScriptedModel(_desk_model, id="desk-model"),
        [
            define_tool("lookup", "find an order", Order, lookup),
            define_tool(
                "refund_order", "refund an order", Order, refund_order, needs_approval=True
            ),
        ],
        [],
    )
    ops = define_agent(
        "ops",
        "payments and other flows",
        ScriptedModel(_ops_model, id="ops-model"),
        [define_tool("charge", "charge a card once", Charge, charge)],
        [
            define_flow(
                "pay",
                "charge after approval, then say so",
                "pay",
                [
                    action("pay", pay),
                    reply("tell", "Say it was paid.", goto("rest")),
                    action("rest", _rest("paid")),
                ],
            ),
            define_flow("drifty", "waits for go", "wait", _drifty_nodes()),
            define_flow("sleepy", "sleeps a little", "rest", [action("rest", _rest("rested"))]),
            define_flow(
                "intake",
                "asks for an amount",
                "amount",
                [
                    collect(
                        "amount",
                        Amount,
                        ["amount"],
                        lambda missing: "How much, in dollars?",
                        lambda data: end(f"amount {data['amount']}"),
                    )
                ],
            ),
        ],
    )
    return [desk, ops]
