"""The app of the deploy tests: an ``order`` flow in two versions, and a ledger.

Version 1 reserves, asks a supervisor, ships. Version 2 does the same, then
notifies in a node of its own (so its digest differs). ``order_v1_reordered``
is version 1's definition (same digest) with code that asks for the clock
first: a run of version 1 no longer replays on it. Every tool appends one
line (tool, idempotency key, run id) to the JSONL file named by
``KURALLE_DEPLOY_LEDGER``, so a test in another process sees each execution.

As ``--app procs.deploy_app:ATTR`` (with ``tests/`` on ``PYTHONPATH``):
``v1``, ``v1_and_v2`` (one agent with both versions), ``split`` (each version
in an agent of its own), ``v2`` and ``v1_reordered``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    Agent,
    Flow,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
)

LEDGER_ENV = "KURALLE_DEPLOY_LEDGER"
FLOW = "order"


class Sku(BaseModel):
    sku: str


def ledger() -> list[dict[str, Any]]:
    """Every execution of a tool so far, in order."""
    path = Path(os.environ[LEDGER_ENV])
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line]


def _tool(name: str) -> Any:
    def execute(args: Sku, call: ToolCall) -> dict[str, str]:
        entry = {"tool": name, "key": call.idempotency_key, "run_id": call.run_id}
        with Path(os.environ[LEDGER_ENV]).open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        return {name: args.sku}

    return define_tool(name, f"{name} an order", Sku, execute)


TOOLS = [_tool("reserve"), _tool("ship"), _tool("notify")]


def _order(version: str, *, reordered: bool = False) -> Any:
    async def order(state: dict[str, Any], ctx: Any) -> Any:
        if reordered:
            await ctx.now()
        await ctx.tool("reserve", {"sku": "A-1"})  # step 0
        decision = await ctx.approve("Ship order A-1?")  # step 1, once delivered
        if not decision.approved:
            return end(f"v{version}: held")
        await ctx.tool("ship", {"sku": "A-1"})
        return goto("notify") if version == "2" else end(f"v{version}: shipped")

    return order


async def _notify(state: dict[str, Any], ctx: Any) -> Any:
    await ctx.tool("notify", {"sku": "A-1"})
    return end("v2: shipped")


def order_v1(*, reordered: bool = False) -> Flow:
    nodes = [action("order", _order("1", reordered=reordered))]
    return define_flow(FLOW, "reserve, approve, ship", "order", nodes, version="1")


def order_v2() -> Flow:
    nodes = [action("order", _order("2")), action("notify", _notify)]
    return define_flow(FLOW, "reserve, approve, ship, notify", "order", nodes, version="2")


def _shop(*flows: Flow, agent_id: str = "shop") -> Agent:
    return define_agent(agent_id, "", None, TOOLS, list(flows))


def v1() -> list[Agent]:
    return [_shop(order_v1())]


def v1_and_v2() -> list[Agent]:
    return [_shop(order_v1(), order_v2())]


def split() -> list[Agent]:
    return [_shop(order_v1()), _shop(order_v2(), agent_id="shop-next")]


def v2() -> list[Agent]:
    return [_shop(order_v2())]


def v1_reordered() -> list[Agent]:
    return [_shop(order_v1(reordered=True))]
