"""The app the HTTP API tests serve: ``kuralle-es serve --app http_app:build_agents``
(importable from this folder).

- ``refund``: the refund example (a ``collect`` node asking for input, then an
  approval, then ``processRefund``, which appends to ``REFUND_LEDGER``).
- ``charge``: a ``charge`` tool that needs approval (its frozen operation is
  what the approver sees); it appends one line per execution to
  ``HTTP_LEDGER`` (a JSON-lines file: ``{"key", "cents", "pid"}``). Denied,
  the run ends ``denied``.
- ``ship``: waits for the ``shipped`` signal (payload ``{"tracking": str}``)
  and ends with its tracking number. ``HTTP_SHIP_VARIANT=2`` adds a node, so a
  server started with it sees the runs of an earlier server drift.
- ``boom``: its node raises: the run ends ``error``.
- ``order``: typed input (``Order``: ``sku``, ``qty``); asks for approval, then
  ends ``"<qty>x<sku>"``.
- ``household``: a parent run whose child is an ``order`` of two teas; it ends
  with the child's output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    Agent,
    RunContext,
    ToolApprovalDeniedError,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
)
from kuralle_es.examples import refund

LEDGER_ENV = "HTTP_LEDGER"
VARIANT_ENV = "HTTP_SHIP_VARIANT"


class Charge(BaseModel):
    cents: int


class Shipment(BaseModel):
    tracking: str


class Order(BaseModel):
    sku: str
    qty: int = 1


async def order(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.approve(f"Ship {ctx.input.qty} {ctx.input.sku}?")
    return end(f"{ctx.input.qty}x{ctx.input.sku}")


async def household(state: dict[str, Any], ctx: RunContext) -> Any:
    return end(f"ordered {await ctx.child('order', {'sku': 'tea', 'qty': 2})}")


def ledger_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def charge(args: Charge, call: ToolCall) -> dict[str, Any]:
    entry = {"key": call.idempotency_key, "cents": args.cents, "pid": os.getpid()}
    with Path(os.environ[LEDGER_ENV]).open("a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return {"charged": args.cents}


async def pay(state: dict[str, Any], ctx: RunContext) -> Any:
    try:
        state["receipt"] = await ctx.tool("charge", {"cents": 500})
    except ToolApprovalDeniedError as e:
        state["denied"] = {"by": e.denied_by, "reason": e.reason}
        return end("denied")
    return end("charged")


async def wait_for_shipment(state: dict[str, Any], ctx: RunContext) -> Any:
    shipped = await ctx.signal("shipped", schema=Shipment)
    return end(shipped.tracking) if os.environ.get(VARIANT_ENV) != "2" else goto("audit")


async def audit(state: dict[str, Any], ctx: RunContext) -> Any:
    return end("audited")


async def explode(state: dict[str, Any], ctx: RunContext) -> Any:
    raise RuntimeError("the boom node always fails")


def _ship_nodes() -> list[Any]:
    nodes = [action("wait", wait_for_shipment)]
    if os.environ.get(VARIANT_ENV) == "2":
        nodes.append(action("audit", audit))
    return nodes


def build_agents() -> list[Agent]:
    ops = define_agent(
        "ops",
        "charges, shipments",
        None,
        [define_tool("charge", "charge a card once", Charge, charge, needs_approval=True)],
        [
            define_flow("charge", "charge after approval", "pay", [action("pay", pay)]),
            define_flow("ship", "wait for the carrier", "wait", _ship_nodes()),
            define_flow("boom", "always fails", "boom", [action("boom", explode)]),
            define_flow("order", "typed input", "go", [action("go", order)], input=Order),
            define_flow("household", "a parent run", "go", [action("go", household)]),
        ],
    )
    return [refund.build_agent(), ops]
