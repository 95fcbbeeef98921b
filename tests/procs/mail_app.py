"""The app of the message doors' tests (``--app mail_app:AGENTS``, importable from here).

``order``: publishes its progress, receives two ``item`` messages (the second
with a schema: ``{"sku": str}``), publishes what it got and ends with both.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kuralle_es import RunContext, action, define_agent, define_flow, end


class Item(BaseModel):
    sku: str


async def order(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.publish("progress", {"pct": 0})
    first = await ctx.receive("item")
    second = await ctx.receive("item", schema=Item)
    await ctx.publish("progress", {"pct": 100})
    await ctx.publish("items", [first, second.sku])
    return end(f"{first}+{second.sku}")


ORDER = define_flow("order", "two items, then done", "order", [action("order", order)])
AGENTS = [define_agent("orders", "", None, [], [ORDER])]
