"""How often the lease heartbeat's thread looks at its heartbeats, a tool step.

    python benchmarks/heartbeat_wakes.py [--steps 200] [--runs 3]

The heartbeat renews a run's lease from a thread of its own while effects
execute (docs/contract.md, leases). A step shorter than the heartbeat's
interval should not wake that thread: this drives ``--runs`` flow runs of
``--steps`` sequential no-op tool steps on PostgreSQL (a database of its
own; on the memory store the loop never lets go of the interpreter, so the
thread would not get to run whatever woke it), counts the thread's looks
(each wake-up looks at every heartbeat it watches: ``Heartbeat.due``) and
prints them per step. Server: ``KURALLE_BENCH_POSTGRES_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``). A count, not a time: the same
on a noisy machine. Before the heartbeat slept until its next beat was due,
it was about one look a step (benchmarks/RESULTS.md, 2026-12-04, later).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from typing import Any

from journal_overhead import DEFAULT_DSN, DSN_ENV, create_database, drop_database, with_dbname
from pydantic import BaseModel

from kuralle_es import RunStore, Runtime, action, define_agent, define_flow, define_tool, end
from kuralle_es._runtime import heartbeat


class Step(BaseModel):
    n: int


def agent(steps: int) -> Any:
    async def count(args: Step) -> dict[str, int]:
        return {"n": args.n}

    async def tools(state: dict[str, Any], ctx: Any) -> Any:
        for n in range(steps):
            await ctx.tool("count", {"n": n})
        return end("done")

    flow = define_flow("tools", "tool steps", "t", [action("t", tools)])
    return define_agent("bench", "", None, [define_tool("count", "", Step, count)], [flow])


async def looks_a_step(dsn: str, steps: int, runs: int) -> float:
    looks = 0
    due = heartbeat.Heartbeat.due

    def counted(self: heartbeat.Heartbeat, now: float) -> float:
        nonlocal looks
        looks += 1
        return due(self, now)

    with RunStore.postgres(dsn) as store:
        runtime = Runtime([agent(steps)], store=store)
        await runtime.run(f"warm-{uuid.uuid4().hex}", kind="flow", flow_name="tools").result()
        heartbeat.Heartbeat.due = counted  # type: ignore[method-assign]
        try:
            for _ in range(runs):
                result = await runtime.run(
                    f"b-{uuid.uuid4().hex}", kind="flow", flow_name="tools"
                ).result()
                assert result.status == "finished", result
        finally:
            heartbeat.Heartbeat.due = due  # type: ignore[method-assign]
    return looks / (steps * runs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    admin = os.environ.get(DSN_ENV, DEFAULT_DSN)
    database = create_database(admin)
    if database is None:
        return 1
    try:
        looks = asyncio.run(looks_a_step(with_dbname(admin, database), args.steps, args.runs))
    finally:
        drop_database(admin, database)
    print(f"heartbeat thread's looks a tool step: {looks:.3f}   (a step should wake it: no)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
