"""How soon a dead worker's run is finished by another, and what a sweep pass costs.

1. **Death to completion.** A ``kuralle-es worker`` process (the sweeper,
   ``--interval I``) runs over the store. A doomed process starts a run of
   the ``charge`` flow below with ``lease_ttl = T``; its tool writes a marker
   and keeps executing (the heartbeat renews the lease every ``T/3``). The
   benchmark SIGKILLs the doomed process and measures from the kill to the
   run's ``Finished`` event, saved by the worker after it recovered the run.
   Expected: the lease runs out between ``2T/3`` and ``T`` after the kill
   (the last renewal), the next pass comes within ``I``, then one turn
   replays and re-executes the tool. A small grid of ``T`` and ``I``, each
   cell the median of ``--reps`` deaths; the floor is the same cell's
   ``T`` (no recovery can start before the lease runs out).
2. **One sweep pass over idle runs.** ``--idle`` runs (90 % finished, 10 %
   paused on a signal without a deadline) are stored, the views catch up once
   (timed on its own), then a sweep pass (``create_sweep_job_runner``: the
   three view queries, each with its catch-up check) is timed, median of
   ``--passes``; the baseline is the same pass over an empty store, measured
   in the same run.

PostgreSQL is ``KURALLE_BENCH_POSTGRES_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``; a database is created and
dropped); SQLite is a temp file. Usage:
``python benchmarks/recovery.py [--reps N] [--idle N] [--passes N] [--backends sqlite,postgres]``.
No assertion is made on speed; this prints tables.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import psycopg
from psycopg import sql
from pydantic import BaseModel

from kuralle_es import (
    Agent,
    RunStore,
    Runtime,
    ToolCall,
    action,
    create_sweep_job_runner,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es._journal.run import Run
from kuralle_es._journal.wait import Wait
from kuralle_es.shapes import Message

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DSN_ENV = "KURALLE_BENCH_POSTGRES_DSN"
HERE = Path(__file__).resolve().parent
GRID = [(1.0, 0.2), (1.0, 1.0), (3.0, 0.2), (3.0, 1.0)]  # (lease_ttl, interval)


class Amount(BaseModel):
    cents: int


def build_agents() -> list[Agent]:
    """The ``charge`` flow; in the doomed process its tool marks and waits to be killed."""

    async def charge(args: Amount, call: ToolCall) -> dict[str, Any]:
        marker = os.environ.get("BENCH_MARKER")
        if marker:
            await asyncio.to_thread(Path(marker + ".tmp").write_text, call.run_id)
            os.replace(marker + ".tmp", marker)  # seen whole or not at all
            await asyncio.sleep(600)
        return {"charged": args.cents}

    async def pay(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("charge", {"cents": 500})
        return end("charged")

    tool = define_tool("charge", "charge a card", Amount, charge)
    flow = define_flow("charge", "charge once", "pay", [action("pay", pay)])
    return [define_agent("cashier", "charges", None, [tool], [flow])]


async def _doomed(url: str, lease_ttl: str) -> None:
    with RunStore.from_url(url) as store:
        runtime = Runtime(build_agents(), store=store, lease_ttl=float(lease_ttl))
        await runtime.run(f"s-{uuid.uuid4().hex[:8]}", kind="flow", flow_name="charge").result()


# ---------------------------------------------------------- death -> done
def _finished_at(url: str, run_id: str, timeout: float) -> datetime:
    deadline = time.monotonic() + timeout
    with RunStore.from_url(url) as store:
        while time.monotonic() < deadline:
            run = store.load(run_id)
            if run is not None and run.status == "finished":
                return run.modified_on
            time.sleep(0.02)
    msg = f"run {run_id} not finished within {timeout} s"
    raise RuntimeError(msg)


def one_death(url: str, lease_ttl: float, tmp: Path) -> float:
    """Seconds from the SIGKILL of a worker mid-tool to the run's ``Finished`` event."""
    marker = tmp / f"marker-{uuid.uuid4().hex}"
    doomed = subprocess.Popen(
        [sys.executable, __file__, "doomed", url, str(lease_ttl)],
        env={**os.environ, "BENCH_MARKER": str(marker)},
    )
    while not marker.exists():
        if doomed.poll() is not None:
            msg = "the doomed worker exited before its tool ran"
            raise RuntimeError(msg)
        time.sleep(0.01)
    run_id = marker.read_text()
    # Let the heartbeat renew the lease at least once, as a long tool would.
    time.sleep(lease_ttl / 2)
    killed = datetime.now(UTC)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    return (_finished_at(url, run_id, 60 + lease_ttl) - killed).total_seconds()


def death_grid(url: str, reps: int, tmp: Path) -> list[tuple[float, float, list[float]]]:
    cells = []
    with RunStore.from_url(url):
        pass  # the schema exists before the worker and the doomed processes start
    for lease_ttl, interval in GRID:
        command = [
            sys.executable, "-m", "kuralle_es.cli", "worker", "--store", url,
            "--app", "recovery:build_agents", "--interval", str(interval),
            "--lease-ttl", str(lease_ttl),
        ]  # fmt: skip
        log = tmp / f"worker-{uuid.uuid4().hex[:6]}.log"
        with log.open("w") as err:
            worker = subprocess.Popen(command, cwd=HERE, stderr=err)
        try:
            times = [one_death(url, lease_ttl, tmp) for _ in range(reps)]
        except RuntimeError:
            print(log.read_text(), file=sys.stderr)
            raise
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
        cells.append((lease_ttl, interval, times))
    return cells


# ------------------------------------------------------------- idle pass
def store_idle_runs(store: RunStore, count: int) -> None:
    """``count`` runs straight through the domain: 90 % finished, 10 % paused without deadline."""
    for i in range(count):
        run = Run(uuid.uuid4(), f"idle-{i}", "flow", "cashier", "charge", "digest")
        run.start_turn(0, Message(role="user", content="hi"), None)
        if i % 10 == 0:
            request = uuid.uuid4().hex
            logical = f"{run.run_id}#0"
            run.pause(Wait("go", 0, "signal", request_id=request, logical_run=logical))
        else:
            run.finish("done", None, "cashier", {})
        store.create_run(run)


async def pass_cost(store: RunStore, passes: int) -> tuple[float, list[float]]:
    """(seconds of the first pass, which catches the views up; seconds of the later passes)."""
    job = create_sweep_job_runner(Runtime(build_agents(), store=store))
    started = time.perf_counter()
    report = await job()
    first = time.perf_counter() - started
    assert not report.driven, report
    times = []
    for _ in range(passes):
        started = time.perf_counter()
        await job()
        times.append(time.perf_counter() - started)
    return first, times


def idle_sweep(url: str, idle: int, passes: int) -> list[tuple[str, int, float, float, float]]:
    rows = []
    with RunStore.from_url(url) as store:
        first, times = asyncio.run(pass_cost(store, passes))
        rows.append(("empty store", 0, first, statistics.median(times), min(times)))
        started = time.perf_counter()
        store_idle_runs(store, idle)
        stored = time.perf_counter() - started
        print(f"  stored {idle} idle runs in {stored:.1f} s", flush=True)
        first, times = asyncio.run(pass_cost(store, passes))
        rows.append((f"{idle} idle runs", idle, first, statistics.median(times), min(times)))
    return rows


# --------------------------------------------------------------- backends
@contextmanager
def postgres_url() -> Iterator[str]:
    admin = os.environ.get(DSN_ENV, DEFAULT_DSN)
    name = f"kuralle_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield urlunparse(urlparse(admin)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@contextmanager
def backend_url(backend: str, tmp: Path) -> Iterator[str]:
    if backend == "postgres":
        with postgres_url() as url:
            yield url
    else:
        yield f"sqlite:///{tmp / f'runs-{uuid.uuid4().hex[:6]}.db'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--reps", type=int, default=3, help="deaths per grid cell (3)")
    parser.add_argument("--idle", type=int, default=10_000, help="idle runs (10000)")
    parser.add_argument("--passes", type=int, default=20, help="timed sweep passes (20)")
    parser.add_argument("--backends", default="sqlite,postgres")
    args = parser.parse_args()
    print(
        f"kuralle_es recovery: python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
        f"{args.reps} deaths per cell, {args.idle} idle runs, {args.passes} passes",
        flush=True,
    )
    deaths, idles = [], []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for backend in args.backends.split(","):
            with backend_url(backend, tmp) as url:
                print(f"{backend}: death -> done grid", flush=True)
                for lease_ttl, interval, times in death_grid(url, args.reps, tmp):
                    deaths.append((backend, lease_ttl, interval, times))
            with backend_url(backend, tmp) as url:
                print(f"{backend}: sweep passes", flush=True)
                idles.extend((backend, *row) for row in idle_sweep(url, args.idle, args.passes))

    print("\ndeath -> done: SIGKILL of a worker inside a tool -> the run's Finished event")
    print("backend  | lease_ttl | interval | median s | min-max s   | vs lease_ttl")
    print("---------+-----------+----------+----------+-------------+-------------")
    for backend, lease_ttl, interval, times in deaths:
        median = statistics.median(times)
        print(
            f"{backend:8} | {lease_ttl:9.1f} | {interval:8.1f} | {median:8.2f} | "
            f"{min(times):5.2f}-{max(times):5.2f} | {median / lease_ttl:11.2f}x"
        )
    print("\none sweep pass (recover + deadlines + timers; views caught up)")
    print("backend  | store           | first pass ms | median ms | min ms | vs empty")
    print("---------+-----------------+---------------+-----------+--------+---------")
    empty: dict[str, float] = {}
    for backend, label, count, first, median, low in idles:
        if count == 0:
            empty[backend] = median
        print(
            f"{backend:8} | {label:15} | {first * 1000:13.1f} | {median * 1000:9.2f} | "
            f"{low * 1000:6.2f} | {median / empty[backend]:7.2f}x"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "doomed":
        asyncio.run(_doomed(*sys.argv[2:]))
    else:
        main()
