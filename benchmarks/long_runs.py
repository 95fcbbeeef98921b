"""Long runs on PostgreSQL: step cost, bytes per step and resume time vs length; DBOS recovery.

For each length N in ``--lengths`` (default 100, 1000, 10000), on a fresh
PostgreSQL database:

* **step cost**: a flow run does N no-op tool steps, then pauses on an
  approval; the turn's time / N (open and pause included);
* **bytes per step**: ``pg_total_relation_size`` of the events and the
  snapshots tables (with their indexes) / steps, once every run is finished;
* **resume**: a fresh ``RunStore`` and ``Runtime`` (a new process's first
  call) delivers the approval: the run is loaded (latest snapshot + later
  events), its node re-runs with its tool calls answered from the journal,
  and the run finishes. The load alone is timed too.

Each length in two shapes, each in its own database: **one node** (all N
steps in one node: a resume replays all N, as any replaying engine must) and
**nodes of 100** (the node goes to itself after every 100 steps: the earlier
visits' steps are archived, so a load and a resume carry one visit's steps).

Then, if DBOS is installed (the ``bench`` extra), **DBOS's recovery of the
same length**: a child process runs a workflow of N no-op steps and a last
step that never returns there, and is SIGKILLed once the N steps are stored;
a fresh child (another executor id, so its ``DBOS.launch()`` recovers
nothing by itself) times ``DBOS._recover_pending_workflows(["local"])`` (the
recovery ``launch()`` would run: it replays the N recorded steps) until the
workflow's result; and ``DBOS.launch()`` alone, what a new process pays first. (The DBOS us/step
column is the first child's rate, seen from outside by polling, so rough.)

And **memory per paused run**: ``--paused`` runs (default 1000) paused on an
approval by one runtime; the growth of the Python heap (``tracemalloc``) and
of the process's RSS, per run. A paused run is rows in the database; the
process keeps nothing per run.

Rounds: ``--rounds`` runs of each length up to 1000 steps, one of longer
ones (each resumed once; medians). ``--json FILE`` writes the figures for
``chart.py``. Server: ``KURALLE_BENCH_POSTGRES_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``).

Usage: ``python benchmarks/long_runs.py [--lengths 100,1000,10000] [--rounds 3]
[--paused 1000] [--no-dbos] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
import tracemalloc
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg
from journal_overhead import (
    DEFAULT_DSN,
    DSN_ENV,
    create_database,
    drop_database,
    server_settings,
    with_dbname,
)
from pydantic import BaseModel

from kuralle_es import (
    RunStore,
    Runtime,
    SignalDelivery,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
)
from kuralle_es._runtime.context import RunContext


class NoopArgs(BaseModel):
    x: int


STEPS = {"n": 100}


async def long_node(state: dict[str, Any], ctx: RunContext) -> Any:
    for i in range(STEPS["n"]):
        await ctx.tool("noop", {"x": i})
    decision = await ctx.approve("finish?")
    return end("approved" if decision.approved else "declined")


#: Steps per node visit of the ``nodes`` shape.
NODE_STEPS = 100


async def spread_node(state: dict[str, Any], ctx: RunContext) -> Any:
    """One visit: NODE_STEPS tool steps, then the next visit (fresh callsites, the
    earlier visits' steps archived) or, after N steps in all, the approval."""
    for i in range(NODE_STEPS):
        await ctx.tool("noop", {"x": i})
    visits = int(state.get("visits", 0)) + 1
    if visits * NODE_STEPS < STEPS["n"]:
        return goto("s", {"visits": visits})
    decision = await ctx.approve("finish?")
    return end("approved" if decision.approved else "declined")


NOOP = define_tool("noop", "does nothing", NoopArgs, lambda a: {"x": a.x})
LONG = define_flow("bench_long", "N tool steps, then an approval", "n", [action("n", long_node)])
SPREAD = define_flow(
    "bench_spread",
    "N tool steps, 100 a node visit, then an approval",
    "s",
    [action("s", spread_node)],
)
AGENT = define_agent("bench", "benchmark agent", None, [NOOP], [LONG, SPREAD])
#: The two shapes of a long run: all N steps in one node, or 100 a node visit.
SHAPES = {"one node": LONG, "nodes of 100": SPREAD}


def approval() -> SignalDelivery:
    return SignalDelivery(
        signal_id=uuid.uuid4().hex, name="__approval", payload={"approved": True, "by": "bench"}
    )


@dataclass
class Length:
    steps: int
    shape: str = "one node"
    step_us: list[float] = field(default_factory=list)
    resume_ms: list[float] = field(default_factory=list)
    load_ms: list[float] = field(default_factory=list)
    events_bytes: int = 0
    snapshot_bytes: int = 0
    snapshots: int = 0
    #: The stored payloads alone (``octet_length`` of the events' and snapshots' state).
    payload_bytes: int = 0
    runs: int = 0
    dbos_recovery_ms: float | None = None
    dbos_launch_ms: float | None = None
    dbos_step_us: float | None = None

    @property
    def payload_per_step(self) -> float:
        return self.payload_bytes / (self.runs * self.steps)

    @property
    def bytes_per_step(self) -> float:
        return (self.events_bytes + self.snapshot_bytes) / (self.runs * self.steps)


def relation_bytes(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT pg_total_relation_size(%s::regclass)", (table,)).fetchone()
    return int(row[0]) if row else 0


def table_names(store: RunStore) -> tuple[str, str]:
    events = getattr(store.recorder, "events_table_name")  # noqa: B009
    assert store.snapshots is not None
    snapshots = getattr(store.snapshots.recorder, "events_table_name")  # noqa: B009
    return events, snapshots


async def kuralle_length(dsn: str, steps: int, rounds: int, shape: str = "one node") -> Length:
    result = Length(steps, shape)
    flow = SHAPES[shape]
    STEPS["n"] = steps
    paused: list[tuple[str, str]] = []
    with RunStore.postgres(dsn) as store:
        runtime = Runtime([AGENT], store=store)
        for _ in range(rounds):
            session = f"long-{uuid.uuid4().hex[:8]}"
            gc.collect()
            start = time.perf_counter()
            turn = await runtime.run(session, kind="flow", flow_name=flow.name).result()
            result.step_us.append((time.perf_counter() - start) / steps * 1e6)
            if turn.status != "paused":
                raise RuntimeError(f"long run ended {turn.status}, not paused")
            paused.append((session, turn.run_id))
        events_table, snapshots_table = table_names(store)
    for session, run_id in paused:
        gc.collect()
        start = time.perf_counter()
        with RunStore.postgres(dsn) as fresh:  # a new process's first call
            loaded = fresh.load(run_id)
            result.load_ms.append((time.perf_counter() - start) * 1e3)
            assert loaded is not None
            done = (
                await Runtime([AGENT], store=fresh)
                .run(session, run_id=run_id, signal_delivery=approval())
                .result()
            )
            result.resume_ms.append((time.perf_counter() - start) * 1e3)
        if done.status != "finished" or done.output != "approved":
            raise RuntimeError(f"resumed long run ended {done.status} {done.output}")
    result.runs = len(paused)
    result.events_bytes = relation_bytes(dsn, events_table)
    result.snapshot_bytes = relation_bytes(dsn, snapshots_table)
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {snapshots_table}").fetchone()
        result.snapshots = int(row[0]) if row else 0
        row = conn.execute(
            f"SELECT (SELECT coalesce(sum(octet_length(state)), 0) FROM {events_table})"
            f" + (SELECT coalesce(sum(octet_length(state)), 0) FROM {snapshots_table})"
        ).fetchone()
        result.payload_bytes = int(row[0]) if row else 0
    return result


# ---------------------------------------------------------------------- DBOS
DBOS_CHILD = r"""
import os, sys, time
from dbos import DBOS, SetWorkflowID
mode, dsn, steps, wf_id = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
# The recovering process has another executor id, so that launch() leaves the
# workflow alone and the recovery below is timed by itself (no result polling).
DBOS(config={"name": "kuralle_bench_long", "system_database_url": dsn,
             "run_admin_server": False, "log_level": "WARNING",
             "executor_id": "local" if mode == "run" else "recoverer"})

@DBOS.step()
def noop(x: int) -> dict:
    return {"x": x}

@DBOS.step()
def gate() -> None:
    # In the first process the last step never returns (the process is killed in it);
    # in the recovering one it returns at once.
    while mode == "run":
        time.sleep(1)

@DBOS.workflow()
def long_wf(n: int) -> int:
    for i in range(n):
        noop(i)
    gate()
    return n

if mode == "run":
    DBOS.launch()
    with SetWorkflowID(wf_id):
        DBOS.start_workflow(long_wf, steps)
    print("started", flush=True)
    time.sleep(3600)
else:
    start = time.perf_counter()
    DBOS.launch()
    launched = time.perf_counter()
    handles = DBOS._recover_pending_workflows(["local"])
    results = [h.get_result() for h in handles]
    end = time.perf_counter()
    assert results in ([steps], []), results
    print(f"{(end - launched) * 1e3:.3f} {(launched - start) * 1e3:.3f}", flush=True)
    DBOS.destroy()
    os._exit(0)
"""


def dbos_recovery(dsn: str, steps: int) -> tuple[float, float, float]:
    """(recovery ms, launch ms, first-run µs/step) for one workflow of ``steps``."""
    wf_id = uuid.uuid4().hex
    python = sys.executable
    child = subprocess.Popen(
        [python, "-c", DBOS_CHILD, "run", dsn, str(steps), wf_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()
        start = time.perf_counter()
        while True:  # the steps are stored once operation_outputs holds them all
            with psycopg.connect(dsn) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM dbos.operation_outputs WHERE workflow_uuid = %s",
                    (wf_id,),
                ).fetchone()
            if row and int(row[0]) >= steps:
                break
            time.sleep(0.01)
        step_us = (time.perf_counter() - start) / steps * 1e6
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    out = subprocess.run(
        [python, "-c", DBOS_CHILD, "recover", dsn, str(steps), wf_id],
        capture_output=True,
        text=True,
        check=True,
        timeout=3600,
    ).stdout.split()
    return float(out[0]), float(out[1]), step_us


# -------------------------------------------------------------------- memory
async def paused_memory(dsn: str, count: int) -> dict[str, float]:
    STEPS["n"] = 1
    with RunStore.postgres(dsn) as store:
        runtime = Runtime([AGENT], store=store)
        for _ in range(20):  # warm up: imports, pools, caches
            await runtime.run(f"w-{uuid.uuid4().hex}", kind="flow", flow_name=LONG.name).result()
        gc.collect()
        tracemalloc.start()
        heap_before = tracemalloc.get_traced_memory()[0]
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(count):
            r = await runtime.run(
                f"m-{uuid.uuid4().hex}", kind="flow", flow_name=LONG.name
            ).result()
            if r.status != "paused":
                raise RuntimeError(f"memory run ended {r.status}")
        gc.collect()
        heap_after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "paused_runs": count,
        "heap_bytes_per_run": (heap_after - heap_before) / count,
        "max_rss_kib_growth_per_run": (rss_after - rss_before) / count,
    }


# -------------------------------------------------------------------- driver
def have_dbos() -> str | None:
    try:
        import dbos  # noqa: F401
    except ImportError as e:
        return f"{e} (install the bench extra: pip install -e '.[bench]')"
    return None


async def measure_shape(
    admin_dsn: str,
    steps: int,
    shape: str,
    args: argparse.Namespace,
    no_dbos: str | None,
    *,
    first: bool,
) -> Length:
    """One length of one shape in its own database (so its bytes are its own);
    DBOS's recovery of the same length beside the one-node shape."""
    name = create_database(admin_dsn)
    if name is None:
        raise SystemExit(f"PostgreSQL at {admin_dsn} is unreachable")
    dsn = with_dbname(admin_dsn, name)
    try:
        if first:
            print(f"postgres: {server_settings(dsn)}", flush=True)
        rounds = args.rounds if steps <= 1000 else 1
        start = time.perf_counter()
        length = await kuralle_length(dsn, steps, rounds, shape)
        print(
            f"{steps} steps ({shape}) x {rounds}: kuralle_es done in "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
    finally:
        drop_database(admin_dsn, name)
    if not no_dbos and shape == "one node":
        dbos_db = create_database(admin_dsn)
        assert dbos_db is not None
        try:
            rec, launch, step = dbos_recovery(with_dbname(admin_dsn, dbos_db), steps)
            length.dbos_recovery_ms, length.dbos_launch_ms, length.dbos_step_us = rec, launch, step
        finally:
            drop_database(admin_dsn, dbos_db)
        print(f"{steps} steps: DBOS recovery done", flush=True)
    return length


async def paused_memory_in_fresh_db(admin_dsn: str, count: int) -> dict[str, float]:
    name = create_database(admin_dsn)
    assert name is not None
    try:
        return await paused_memory(with_dbname(admin_dsn, name), count)
    finally:
        drop_database(admin_dsn, name)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    admin_dsn = os.environ.get(DSN_ENV, DEFAULT_DSN)
    lengths = [int(x) for x in args.lengths.split(",")]
    results: list[Length] = []
    no_dbos = "--no-dbos given" if args.no_dbos else have_dbos()
    if no_dbos:
        print(f"skipped DBOS recovery: {no_dbos}", flush=True)
    memory: dict[str, float] = {}
    for steps in lengths:
        for shape in SHAPES:
            length = await measure_shape(admin_dsn, steps, shape, args, no_dbos, first=not results)
            results.append(length)
            if args.paused and steps == lengths[0] and shape == "one node":
                memory = await paused_memory_in_fresh_db(admin_dsn, args.paused)
    print()
    header = (
        f"{'steps':>6} | {'shape':<12} | {'runs':>4} | {'us/step':>7} | {'bytes/step':>10} | "
        f"{'payload B/step':>14} | {'events B':>10} | "
        f"{'snap B':>10} | {'snaps':>5} | {'load ms':>8} | {'resume ms':>9} | "
        f"{'DBOS recovery ms':>16} | {'DBOS launch ms':>14} | {'DBOS us/step':>12}"
    )
    print(header)
    print("-" * len(header))

    def opt(v: float | None, w: int) -> str:
        return f"{v:>{w}.0f}" if v is not None else f"{'-':>{w}}"

    for r in results:
        print(
            f"{r.steps:>6} | {r.shape:<12} | {r.runs:>4} | {statistics.median(r.step_us):>7.0f} | "
            f"{r.bytes_per_step:>10.0f} | {r.payload_per_step:>14.0f} | "
            f"{r.events_bytes:>10} | {r.snapshot_bytes:>10} | "
            f"{r.snapshots:>5} | {statistics.median(r.load_ms):>8.1f} | "
            f"{statistics.median(r.resume_ms):>9.1f} | {opt(r.dbos_recovery_ms, 16)} | "
            f"{opt(r.dbos_launch_ms, 14)} | {opt(r.dbos_step_us, 12)}"
        )
    print()
    shortest = results[0]
    for shape in SHAPES:
        rows = [r for r in results if r.shape == shape]
        first, last = rows[0], rows[-1]
        payload_ratio = last.payload_per_step / first.payload_per_step
        resume_ratio = statistics.median(last.resume_ms) / statistics.median(shortest.resume_ms)
        print(
            f"{shape}: bytes/step at {last.steps} vs {first.steps} steps: "
            f"{last.bytes_per_step / first.bytes_per_step:.2f}x (payloads alone: "
            f"{payload_ratio:.2f}x); resume at {last.steps} vs a {shortest.steps}-step run: "
            f"{resume_ratio:.1f}x"
        )
    if memory:
        print(
            f"memory per paused run ({memory['paused_runs']:.0f} runs paused by one runtime): "
            f"{memory['heap_bytes_per_run']:.0f} bytes of Python heap, "
            f"{memory['max_rss_kib_growth_per_run']:.2f} KiB of max RSS"
        )
    return {
        "lengths": [
            {
                "steps": r.steps,
                "shape": r.shape,
                "runs": r.runs,
                "step_us": statistics.median(r.step_us),
                "bytes_per_step": r.bytes_per_step,
                "payload_bytes_per_step": r.payload_per_step,
                "events_bytes": r.events_bytes,
                "snapshot_bytes": r.snapshot_bytes,
                "snapshots": r.snapshots,
                "load_ms": statistics.median(r.load_ms),
                "resume_ms": statistics.median(r.resume_ms),
                "dbos_recovery_ms": r.dbos_recovery_ms,
                "dbos_launch_ms": r.dbos_launch_ms,
                "dbos_step_us": r.dbos_step_us,
            }
            for r in results
        ],
        "memory": memory,
        "dbos_skipped": no_dbos,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--lengths", default="100,1000,10000", help="steps per run, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs per length up to 1000 steps")
    parser.add_argument("--paused", type=int, default=1000, help="runs for memory per paused run")
    parser.add_argument("--no-dbos", action="store_true", help="skip DBOS's recovery")
    parser.add_argument("--json", help="write the figures to this file (for chart.py)")
    args = parser.parse_args()
    print(f"kuralle_es long runs: python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    result = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
