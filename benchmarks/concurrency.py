"""One process, C flow runs at once, next to C plain connections doing INSERT+COMMIT.

For each C (``--concurrency``, default 1,8,32), in one process on one event
loop, C tasks drive flow runs of ``--steps`` no-op tool steps (default 10)
one after another for ``--seconds``; next to it, measured in the same run on
the same database, C threads each commit single-row INSERTs on a connection
of their own, as fast as they can: the rate PostgreSQL itself reaches when C
clients commit at once (it flushes many commits together). A journaled tool
step is one commit on average (its intent; its result rides the next save:
docs/guarantees.md, "One commit a step"), so ``of raw`` is
``steps/s / commits/s``: 1.0 would be a journal as cheap as bare commits.

``--partitions K`` runs the runs on ``RunStore.postgres(dsn, partitions=K)``
(K event logs in the database, each with its own lock), and ``--servers``
(a comma-separated list of admin DSNs) spreads them over a sharded store of
one database per server. Figures are the medians of ``--rounds`` rounds
(default 3) that interleave kuralle_es and the raw floor.

Server: ``KURALLE_BENCH_POSTGRES_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``); a fresh database is
created and dropped. Usage::

    python benchmarks/concurrency.py [--concurrency 1,8,32] [--steps 10]
        [--seconds 5] [--rounds 3] [--partitions 1] [--servers DSN,DSN]
        [--tool sync|async]

``--tool`` picks the no-op tool: ``sync`` (the default) runs on a worker
thread, as every sync tool does, ``async`` on the event loop; the difference
is the hop's cost, not the journal's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import psycopg
from journal_overhead import DEFAULT_DSN, DSN_ENV, create_database, drop_database, with_dbname
from pydantic import BaseModel

from kuralle_es import (
    RunContext,
    RunStore,
    Runtime,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)


class Step(BaseModel):
    x: int


STEPS = {"n": 10}


async def loop_node(state: dict[str, Any], ctx: RunContext) -> Any:
    for i in range(STEPS["n"]):
        await ctx.tool("noop", {"x": i})
    return end("done")


def sync_noop(args: Step) -> dict[str, int]:
    return {"x": args.x}


async def async_noop(args: Step) -> dict[str, int]:
    return {"x": args.x}


#: The tool's two kinds: a sync tool runs on a worker thread (so a blocking one
#: never stops the event loop: docs/node-code.md), an async one on the loop.
TOOLS = {"sync": sync_noop, "async": async_noop}


def agent(tool: str) -> Any:
    return define_agent(
        "bench", "", None, [define_tool("noop", "", Step, TOOLS[tool])],
        [define_flow("loop", "", "n", [action("n", loop_node)])],
    )  # fmt: skip


def open_store(dsns: list[str], partitions: int) -> RunStore:
    if len(dsns) > 1:
        return RunStore.sharded(dsns)
    if partitions > 1:
        return RunStore.postgres(dsns[0], partitions=partitions)
    return RunStore.postgres(dsns[0])


#: This process's CPU seconds and the wall seconds of each journaled phase, by C.
CPU: dict[int, list[tuple[float, float]]] = {}


async def journaled(store: RunStore, concurrency: int, seconds: float, tool: str) -> float:
    """Tool steps per second of ``concurrency`` runs driven at once (and, in
    ``CPU``, what this process's own CPU was while they ran)."""
    runtime = Runtime([agent(tool)], store=store)
    await runtime.run(f"warm-{uuid.uuid4().hex}", kind="flow", flow_name="loop").result()
    done = 0
    stop = time.perf_counter() + seconds

    async def driver() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            result = await runtime.run(
                f"b-{uuid.uuid4().hex}", kind="flow", flow_name="loop"
            ).result()
            assert result.status == "finished", result
            done += STEPS["n"]

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(driver() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    CPU.setdefault(concurrency, []).append((time.process_time() - cpu, done))
    return done / wall


def raw_commits(dsn: str, concurrency: int, seconds: float) -> float:
    """Commits per second of ``concurrency`` connections inserting one row each time."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS raw_floor (id bigserial PRIMARY KEY, v text)")
    counts = [0] * concurrency
    stop = time.perf_counter() + seconds

    def client(slot: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while time.perf_counter() < stop:
                conn.execute("INSERT INTO raw_floor (v) VALUES (%s)", ("x",), prepare=True)
                counts[slot] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--servers", default="", help="admin DSNs, comma-separated (sharded)")
    parser.add_argument(
        "--tool", choices=sorted(TOOLS), default="sync",
        help="the no-op tool: sync (on a worker thread) or async (on the loop)",
    )  # fmt: skip
    args = parser.parse_args()
    STEPS["n"] = args.steps
    admins = [d for d in args.servers.split(",") if d] or [os.environ.get(DSN_ENV, DEFAULT_DSN)]
    names = [create_database(admin) for admin in admins]
    if any(n is None for n in names):
        raise SystemExit(f"a PostgreSQL server of {admins} is unreachable")
    dsns = [with_dbname(a, str(n)) for a, n in zip(admins, names, strict=True)]
    layout = (
        f"{len(dsns)} servers (sharded)" if len(dsns) > 1 else f"{args.partitions} partition(s)"
    )
    print(f"kuralle_es concurrency: python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
          f"{layout}, runs of {args.steps} {args.tool} tool steps")  # fmt: skip
    levels = [int(c) for c in args.concurrency.split(",")]
    steps: dict[int, list[float]] = {c: [] for c in levels}
    commits: dict[int, list[float]] = {c: [] for c in levels}
    try:
        store = open_store(dsns, args.partitions)
        try:
            for _ in range(args.rounds):
                for c in levels:
                    commits[c].append(raw_commits(dsns[0], c, args.seconds))
                    steps[c].append(asyncio.run(journaled(store, c, args.seconds, args.tool)))
        finally:
            store.close()
    finally:
        for admin, name in zip(admins, names, strict=True):
            drop_database(admin, str(name))
    header = f"{'runs at once':>12} | {'raw commits/s':>13} | {'steps/s':>8}"
    print(f"{header} | of raw (1 commit a step) | client CPU per step | client CPU busy")
    for c in levels:
        raw, ours = statistics.median(commits[c]), statistics.median(steps[c])
        # The client's own CPU (the event loop's Python, psycopg, threads) per step,
        # and the share of one core it kept busy: near 100 %, the loop is the limit.
        per_step = statistics.median(cpu / done * 1e6 for cpu, done in CPU[c] if done)
        busy = per_step * ours / 1e6
        print(
            f"{c:>12} | {raw:>13,.0f} | {ours:>8,.0f} | {ours / raw:>24.2f} | "
            f"{per_step:>15,.0f} us | {busy:>14.0%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
