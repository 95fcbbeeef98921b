"""A money transfer with compensation: withdraw, deposit, and refund the withdrawal
when the deposit fails (a saga), started with a typed ``Transfer``.

    python -m kuralle_es.examples.money_transfer [--store URL] SOURCE TARGET CENTS

Each movement is a tool step under its own idempotency key, which the bank
(``outside.Ledger``) keeps one effect for: a worker that dies mid-transfer is
recovered by another (``kuralle-es worker --app
kuralle_es.examples.money_transfer:AGENTS``) and no money moves twice. A
deposit to ``closed-007`` fails, to show the refund. See docs/examples.md.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pydantic import BaseModel, Field

from kuralle_es import (
    Agent,
    RunContext,
    RunStore,
    Runtime,
    Tool,
    ToolCall,
    ToolExecutionError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es.examples.outside import Ledger

CLOSED_ACCOUNTS = {"closed-007"}


class Transfer(BaseModel):
    """What a transfer is started with; node code reads it as ``ctx.input``."""

    source: str
    target: str
    cents: int = Field(gt=0)


class Movement(BaseModel):
    account: str
    cents: int


async def transfer(state: dict[str, Any], ctx: RunContext) -> Any:
    order: Transfer = ctx.input
    await ctx.tool("withdraw", {"account": order.source, "cents": order.cents})
    try:
        await ctx.tool("deposit", {"account": order.target, "cents": order.cents})
    except ToolExecutionError as failed:  # recorded: the same on every replay
        ctx.logger.warning("deposit to %s failed (%s); refunding", order.target, failed.message)
        await ctx.tool("refund", {"account": order.source, "cents": order.cents})
        return end(f"refunded {order.cents} cents to {order.source}")
    ctx.logger.info("moved %s cents from %s to %s", order.cents, order.source, order.target)
    return end(f"transferred {order.cents} cents")


def build_agents(bank: Ledger | None = None) -> list[Agent]:
    """The bank clerk and its ``money_transfer`` flow, moving money at ``bank``."""
    ledger = bank or Ledger()

    def movement(name: str) -> Tool[Movement]:
        def execute(args: Movement, call: ToolCall) -> dict[str, Any]:
            if name == "deposit" and args.account in CLOSED_ACCOUNTS:
                raise ValueError(f"account {args.account} is closed")
            return ledger.record(call.idempotency_key, "bank", name, args.model_dump())

        return define_tool(name, f"{name} money (once per key)", Movement, execute)

    flow = define_flow(
        "money_transfer", "move money, or give it back", "go", [action("go", transfer)],
        input=Transfer,
    )  # fmt: skip
    tools = [movement(name) for name in ("withdraw", "deposit", "refund")]
    return [define_agent("bank_clerk", "moves money between accounts", None, tools, [flow])]


AGENTS = build_agents()


async def main(store_url: str, order: Transfer) -> None:
    with RunStore.from_url(store_url) as store:
        runtime = Runtime(AGENTS, store=store)
        handle = runtime.run("bank", kind="flow", flow_name="money_transfer", input=order)
        result = await handle.result()
        print(result.run_id, result.status, result.output)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="sqlite:///transfers.db")
    parser.add_argument("source")
    parser.add_argument("target")
    parser.add_argument("cents", type=int)
    args = parser.parse_args()
    asyncio.run(main(args.store, Transfer.model_validate(vars(args))))
