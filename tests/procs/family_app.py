"""The app of the child-run kill test: a parent flow whose child charges a card.

As ``--app family_app:build_agents`` (importable from this folder) it is what
``kuralle-es worker`` recovers runs with. Run as a script it is the worker
that dies:

    family_app.py start STORE_URL SESSION

starts one ``household`` run (the parent), prints its id, and drives it: its
``ctx.child`` starts an ``errand`` child run (typed input ``{"cents": 500}``)
inside its own turn, whose ``charge`` tool writes the ledger of
``charge_app`` (one row per idempotency key, one per execution). With
``KT_KILL_AT=in-tool`` the process stands still inside the tool, after the
charge is written and before its result is journaled, and writes
``KT_MARKER`` for the test to SIGKILL it there.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from charge_app import Amount, reach, record_charge

from kuralle_es import (
    Agent,
    RunStore,
    Runtime,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)

PARENT = "household"
CHILD = "errand"


def build_agents() -> list[Agent]:
    async def charge(args: Amount, call: ToolCall) -> dict[str, Any]:
        await asyncio.to_thread(record_charge, call.idempotency_key, call.run_id, args.cents)
        await reach("in-tool")
        return {"charged": args.cents}

    async def errand(state: dict[str, Any], ctx: Any) -> Any:
        receipt = await ctx.tool("charge", {"cents": ctx.input.cents})
        return end(f"charged {receipt['charged']}")

    async def household(state: dict[str, Any], ctx: Any) -> Any:
        answer = await ctx.child(CHILD, {"cents": 500})
        return end(f"the errand says: {answer}")

    tool = define_tool("charge", "charge a card once", Amount, charge)
    flows = [
        define_flow(PARENT, "a parent run", "go", [action("go", household)]),
        define_flow(CHILD, "a child run that charges", "go", [action("go", errand)], input=Amount),
    ]
    return [define_agent("family", "runs errands", None, [tool], flows)]


async def _start(url: str, session: str) -> None:
    with RunStore.from_url(url) as store:
        runtime = Runtime(
            build_agents(), store=store, lease_ttl=1.0, holder=f"doomed-{os.getpid()}"
        )
        handle = runtime.run(session, kind="flow", flow_name=PARENT)
        print(await handle.run_id, flush=True)
        await handle.result()


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command != "start":
        raise SystemExit(f"unknown command {command!r}")
    asyncio.run(_start(*rest))
