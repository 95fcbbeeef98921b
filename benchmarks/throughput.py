"""Throughput with 1, 2 and 4 worker processes on one PostgreSQL database.

Each worker is a separate Python process with its own ``RunStore`` and
``Runtime`` on the same database; it drives flow runs of ``--steps`` no-op
tool steps (default 20) one after another for ``--seconds`` (default 10)
after a common start, and counts the runs and steps it finished. The
figures are the totals over all workers per second, and the ratio to one
worker, measured in the same run on the same (fresh) database. The rounds
(``--rounds``, default 3) interleave the worker counts; medians are
reported, with the CPU a step the workers (``getrusage``, every thread)
and the whole machine (``/proc/stat``: the PostgreSQL server's processes
too) spent over the same window, how busy the cores were, and the steps/s
the cores would allow at that CPU a step: where the worker count stops
adding, that says whether the cores are the bound.

Server: ``KURALLE_BENCH_POSTGRES_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``). ``--json FILE`` writes
the medians for ``chart.py``.

``--sample-waits`` adds one round of the largest worker count during which
``pg_stat_activity`` is sampled every 20 ms: what the workers' busy backends
wait on (the events table's lock, the WAL flush, ...), on average.

``--per-worker C`` makes each worker drive C runs at once (their saves share
commits: group commit), ``--partitions K`` spreads the runs over K event logs
of the database (docs/scaling.md).

Usage: ``python benchmarks/throughput.py [--workers 1,2,4] [--steps 20] [--seconds 10]
[--rounds 3] [--per-worker 1] [--partitions 1] [--tool sync|async] [--sample-waits]
[--json FILE]``. ``--tool`` picks the no-op tool: ``sync`` (the default) runs on a
worker thread, as every sync tool does, ``async`` on the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import psycopg
from concurrency import TOOLS
from journal_overhead import (
    DEFAULT_DSN,
    DSN_ENV,
    create_database,
    drop_database,
    server_settings,
    with_dbname,
)
from pydantic import BaseModel

from kuralle_es import RunStore, Runtime, action, define_agent, define_flow, define_tool, end
from kuralle_es._runtime.context import RunContext


class NoopArgs(BaseModel):
    x: int


STEPS = {"n": 20}


async def loop_node(state: dict[str, Any], ctx: RunContext) -> Any:
    for i in range(STEPS["n"]):
        await ctx.tool("noop", {"x": i})
    return end("done")


LOOP = define_flow("bench_loop", "N no-op tool steps", "n", [action("n", loop_node)])


def agent(tool: str) -> Any:
    """The benchmark's agent with the no-op tool of kind ``tool`` (sync: on a worker
    thread; async: on the loop; ``concurrency.TOOLS``)."""
    noop = define_tool("noop", "does nothing", NoopArgs, TOOLS[tool])
    return define_agent("bench", "benchmark agent", None, [noop], [LOOP])


def process_cpu() -> float:
    """Seconds of CPU this process has used, every thread of it (tool threads too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_busy() -> float | None:
    """Seconds of CPU the whole machine has used, every core and process (the
    PostgreSQL server's too), from ``/proc/stat``; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy.
    ticks = [int(x) for x in fields[:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


async def work(
    dsn: str, steps: int, ready: Any, done: Any, seconds: float, per_worker: int, tool: str
) -> tuple[int, int, float]:
    """(runs, steps, CPU seconds) of one worker's timed window."""
    STEPS["n"] = steps
    runs = 0
    with RunStore.postgres(dsn) as store:  # every partition the database has
        runtime = Runtime([agent(tool)], store=store)
        await runtime.run(f"w-{uuid.uuid4().hex}", kind="flow", flow_name=LOOP.name).result()
        ready.wait()  # every worker warmed up (and the parent counting): start together
        cpu = process_cpu()
        stop = time.time() + seconds

        async def driver() -> None:
            nonlocal runs
            while time.time() < stop:
                result = await runtime.run(
                    f"t-{uuid.uuid4().hex}", kind="flow", flow_name=LOOP.name
                ).result()
                if result.status != "finished":
                    raise RuntimeError(f"run ended {result.status}")
                runs += 1

        await asyncio.gather(*(driver() for _ in range(per_worker)))
        cpu = process_cpu() - cpu
        done.wait()  # the parent reads the machine's CPU before any store closes
    return runs, runs * steps, cpu


def worker(
    dsn: str,
    steps: int,
    ready: Any,
    done: Any,
    seconds: float,
    per_worker: int,
    tool: str,
    out: Any,
) -> None:
    try:
        out.put(asyncio.run(work(dsn, steps, ready, done, seconds, per_worker, tool)))
    except BaseException as e:  # reported by the parent, which would otherwise wait forever
        out.put(f"{type(e).__name__}: {e}")
        raise


class WaitSampler(threading.Thread):
    """What the workers' backends wait on: ``pg_stat_activity`` every 20 ms."""

    def __init__(self, dsn: str, workers: int) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.workers = workers
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.samples = 0
        self.stop = threading.Event()

    def run(self) -> None:
        dbname = urlparse(self.dsn).path.lstrip("/")
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.wait(0.02):
                rows = conn.execute(
                    "SELECT state, coalesce(wait_event_type, '-'), coalesce(wait_event, '-')"
                    " FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
                    " AND state <> 'idle'",
                    (dbname,),
                ).fetchall()
                self.samples += 1
                self.counts.update((str(a), str(b), str(c)) for a, b, c in rows)

    def report(self) -> str:
        lines = [f"busy backends of {self.workers} workers, mean over {self.samples} samples:"]
        for (state, kind, event), n in self.counts.most_common(6):
            lines.append(f"  {n / max(self.samples, 1):.2f} {state} {kind}/{event}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Round:
    """One round of N workers: their rates, and the CPU a step they and the whole
    machine (the PostgreSQL server's processes included) spent."""

    runs_per_s: float
    steps_per_s: float
    #: The workers' own CPU a step (every thread), from ``getrusage``.
    worker_cpu_us: float
    #: The machine's CPU a step, every process, from ``/proc/stat`` (None elsewhere).
    machine_cpu_us: float | None
    #: How busy the machine's cores were, 0 to 1.
    busy: float | None


def one_round(
    dsn: str,
    workers: int,
    steps: int,
    seconds: float,
    per_worker: int = 1,
    sampler: WaitSampler | None = None,
    tool: str = "sync",
) -> Round:
    """What ``workers`` processes did together in one timed window."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # The parent waits at both barriers too: it reads the machine's CPU from the
    # common start until every worker's last run has finished.
    ready = ctx.Barrier(workers + 1)
    done = ctx.Barrier(workers + 1)
    procs = [
        ctx.Process(target=worker, args=(dsn, steps, ready, done, seconds, per_worker, tool, out))
        for _ in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        ready.wait(timeout=300)
        busy, started = machine_busy(), time.perf_counter()
        if sampler is not None:
            sampler.start()
        done.wait(timeout=seconds + 300)
        busy_end, elapsed = machine_busy(), time.perf_counter() - started
    except threading.BrokenBarrierError:
        busy = busy_end = None  # a worker failed: its error is on the queue
        elapsed = seconds
    totals = [out.get(timeout=seconds + 300) for _ in procs]
    if sampler is not None:
        sampler.stop.set()
        sampler.join()
    for p in procs:
        p.join()
    errors = [t for t in totals if isinstance(t, str)]
    if errors:
        raise RuntimeError(f"a worker failed: {errors[0]}")
    done_steps = sum(t[1] for t in totals)
    machine = None if busy is None or busy_end is None else busy_end - busy
    return Round(
        runs_per_s=sum(t[0] for t in totals) / seconds,
        steps_per_s=done_steps / seconds,
        worker_cpu_us=sum(t[2] for t in totals) / done_steps * 1e6,
        machine_cpu_us=None if machine is None else machine / done_steps * 1e6,
        busy=None if machine is None else machine / elapsed / (os.cpu_count() or 1),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="tool steps per run (default 20)")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument(
        "--per-worker", type=int, default=1, help="runs each worker drives at once (default 1)"
    )
    parser.add_argument(
        "--partitions", type=int, default=1, help="event logs in the database (default 1)"
    )
    parser.add_argument(
        "--tool", choices=sorted(TOOLS), default="sync",
        help="the no-op tool: sync (on a worker thread) or async (on the loop)",
    )  # fmt: skip
    parser.add_argument("--json", help="write the medians to this file (for chart.py)")
    parser.add_argument(
        "--sample-waits",
        action="store_true",
        help="then one more round of the largest count, printing what its backends wait on",
    )
    args = parser.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    admin_dsn = os.environ.get(DSN_ENV, DEFAULT_DSN)
    print(f"kuralle_es throughput: python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    name = create_database(admin_dsn)
    if name is None:
        raise SystemExit(f"PostgreSQL at {admin_dsn} is unreachable")
    dsn = with_dbname(admin_dsn, name)
    samples: dict[int, list[Round]] = {n: [] for n in counts}
    try:
        print(f"postgres: {server_settings(dsn)}", flush=True)
        # Create the tables once, before the workers race (and record the partitions).
        RunStore.postgres(dsn, partitions=args.partitions).close()
        for r in range(args.rounds):
            for n in counts:
                samples[n].append(
                    one_round(dsn, n, args.steps, args.seconds, args.per_worker, tool=args.tool)
                )
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        if args.sample_waits:
            sampler = WaitSampler(dsn, counts[-1])
            one_round(
                dsn, counts[-1], args.steps, args.seconds, args.per_worker, sampler, args.tool
            )
            print(sampler.report(), flush=True)
    finally:
        drop_database(admin_dsn, name)
    base_steps = statistics.median(s.steps_per_s for s in samples[counts[0]])
    print()
    print(
        f"runs of {args.steps} {args.tool} tool steps, {args.per_worker} at once per worker, "
        f"{args.partitions} partition(s), {args.seconds:.0f} s a round, "
        f"median of {args.rounds} interleaved rounds"
    )
    print(
        f"{'workers':>7} | {'runs/s':>7} | {'steps/s':>8} | vs {counts[0]} worker(s) | "
        "CPU a step: workers | server and rest | machine busy | machine-bound ceiling"
    )
    medians: dict[str, dict[str, float]] = {}
    cores = os.cpu_count() or 1
    for n in counts:
        runs_s = statistics.median(s.runs_per_s for s in samples[n])
        steps_s = statistics.median(s.steps_per_s for s in samples[n])
        medians[str(n)] = {"runs_per_s": runs_s, "steps_per_s": steps_s}
        workers_us = statistics.median(s.worker_cpu_us for s in samples[n])
        machine = [s.machine_cpu_us for s in samples[n] if s.machine_cpu_us is not None]
        busy = [s.busy for s in samples[n] if s.busy is not None]
        if machine and busy:
            machine_us = statistics.median(machine)
            # The steps/s the machine's cores would allow at this CPU a step.
            ceiling = cores / (machine_us / 1e6)
            profile = (
                f"{workers_us:>16,.0f} us | {machine_us - workers_us:>12,.0f} us | "
                f"{statistics.median(busy):>12.0%} | {ceiling:>13,.0f} steps/s"
            )
        else:
            profile = f"{workers_us:>16,.0f} us | (no /proc/stat)"
        print(
            f"{n:>7} | {runs_s:>7.1f} | {steps_s:>8.0f} | {steps_s / base_steps:>13.2f}x | "
            + profile
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"steps": args.steps, "seconds": args.seconds, "workers": medians}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
