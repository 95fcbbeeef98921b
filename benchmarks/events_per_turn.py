"""How many events a run's journal gets: a plain conversation turn, and one tool
call that takes 10 s (memory store; the journal is the same on every backend).

    python benchmarks/events_per_turn.py [--tool-seconds 10]

Prints, per case, the run's events by stored topic. A lease is a record apart
from the journal (docs/concepts.md, "Leases"): renewing it while the tool runs
appends nothing, so the counts do not grow with the tool's duration or shrink
with the lease's TTL. Only public API is used, so the same script measures an
earlier release too (run it with that release on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from kuralle_es import RunStore, Runtime, action, define_agent, define_flow, define_tool, end
from kuralle_es.testing import ScriptedModel


class Nothing(BaseModel):
    pass


def topics(store: RunStore, run_id: str) -> Counter[str]:
    return Counter(e.TOPIC.rsplit(".", 1)[-1] for e in store.events.get(UUID(run_id)))


async def plain_turn() -> Counter[str]:
    store = RunStore.memory()
    agent = define_agent("chat", "", ScriptedModel(["hello", "again"]), [])
    runtime = Runtime([agent], store=store)
    await runtime.run("s", input="hi").result()
    return topics(store, (await runtime.run("s", input="and?").result()).run_id)


async def slow_tool(seconds: float, lease_ttl: float) -> Counter[str]:
    store = RunStore.memory()

    def slow(args: Nothing) -> dict[str, Any]:
        time.sleep(seconds)
        return {"slept": seconds}

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("slow", {})
        return end("done")

    agent = define_agent(
        "a", "", None, [define_tool("slow", "", Nothing, slow)],
        [define_flow("f", "", "n", [action("n", node)])],
    )  # fmt: skip
    runtime = Runtime([agent], store=store, lease_ttl=lease_ttl)
    result = await runtime.run("s", kind="flow", flow_name="f").result()
    return topics(store, result.run_id)


def show(name: str, counts: Counter[str]) -> None:
    leases = counts["LeaseTaken"] + counts["LeaseReleased"]
    detail = ", ".join(f"{t} {n}" for t, n in sorted(counts.items()))
    total = sum(counts.values())
    print(f"{name:<44} {total:>3} events, {leases:>2} of them lease events: {detail}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tool-seconds", type=float, default=10.0)
    args = parser.parse_args()
    show("a conversation of two plain turns", await plain_turn())
    for ttl in (30.0, 3.0):
        show(
            f"a {args.tool_seconds:g} s tool, lease_ttl={ttl:g} s",
            await slow_tool(args.tool_seconds, ttl),
        )


if __name__ == "__main__":
    asyncio.run(main())
