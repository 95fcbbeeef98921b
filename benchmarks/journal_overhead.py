"""Per-step cost of the journal, next to the raw database floor, in one run.

For each backend (memory/POPO, SQLite file, PostgreSQL) this times two kinds
of journaled step, each inside one flow run whose single ``action`` node
loops N times:

* ``tool``: ``await ctx.tool("noop", {...})``: an intent save, the (no-op)
  tool, a result save: two ``Application.save`` calls per step;
* ``now``:  ``await ctx.now()``: a clock read, journaled through the funnel
  (intent and result in one save in the current library).

On PostgreSQL they run through the one-round-trip recorder's statement
sent from the event loop over an async connection, as ``RunStore`` does by
default (``journal:`` rows); through ``eventsourcing``'s own
``PostgresApplicationRecorder`` on a worker thread (``es recorder:`` rows);
and through the one-trip recorder's blocking call, on a worker thread
(``saves threaded:``, what the library did before it sent saves from the
loop) and on the event loop's own thread, blocking it (``saves inline:``;
the library never does this: it is the floor of a save without a hop).

The ``saves/step`` column counts the ``RunStore.save_run_async`` calls the
loop actually made (a counter wrapped around the store instance), so the
table stays true if the library changes how many saves a step takes.

Next to them, measured in the same process against the same database, the
floor a hand-written journal could not beat: one, and two, single-row
``INSERT`` + ``COMMIT`` per step on a plain table (psycopg 3, one
connection; sqlite3 in WAL mode, as ``eventsourcing`` opens it).

Each figure is the median of ``--reps`` repetitions (default 3) of N steps
(default 500) after a warm-up, timed with ``time.perf_counter`` around the
loop only (opening and closing the run are not counted).

PostgreSQL: a fresh database is created on the server named by
``KURALLE_BENCH_POSTGRES_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``) and dropped at the end.
If the server is unreachable the PostgreSQL rows are skipped.

Usage: ``python benchmarks/journal_overhead.py [--steps N] [--reps R] [--breakdown]``.
``--breakdown`` adds one instrumented run of tool steps per backend and
prints where its time went (saves, snapshots, thread hops, the rest).
No assertion is made on speed; this prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import psycopg
from psycopg import sql
from pydantic import BaseModel

from kuralle_es import (
    RunStore,
    Runtime,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es._runtime.context import RunContext

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DSN_ENV = "KURALLE_BENCH_POSTGRES_DSN"

#: eventsourcing's own PostgreSQL recorder: the rows "without the one-round-trip save".
DEFAULT_RECORDER = "eventsourcing.postgres:PostgresApplicationRecorder"
#: The variable that names the recorder of the store's log (eventsourcing reads it
#: prefixed with the application's name, "RunStore", before the plain one).
ES_RECORDER_ENV = "RUNSTORE_APPLICATION_RECORDER_TOPIC"

#: Bytes written per floor row: about the size of one stored StepStarted event.
FLOOR_PAYLOAD = b"x" * 400

#: Steps of the warm-up run (per backend and step kind).
WARMUP_CAP = 50


# --------------------------------------------------------------------- results
@dataclass
class Measure:
    """One benchmarked series: µs per step for each repetition."""

    backend: str
    label: str
    steps: int
    samples_us: list[float] = field(default_factory=list)
    #: Commits (floors) or ``RunStore.save_run`` calls (journal) per step.
    saves_per_step: float = 0.0

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    @property
    def spread(self) -> str:
        return f"{min(self.samples_us):.0f}-{max(self.samples_us):.0f}"


@dataclass
class Breakdown:
    """Where one instrumented run of tool steps spent its time (``--breakdown``)."""

    backend: str
    steps: int
    step_us: float
    saves_s: list[float]
    snapshots_s: list[float]
    hop_us: float
    #: Saves that ran off the event loop's thread (each one a thread round trip).
    off_loop_saves: int

    @property
    def hop_step_us(self) -> float:
        return self.off_loop_saves / self.steps * self.hop_us

    def lines(self) -> list[str]:
        per_step = 1e6 / self.steps
        snaps = self.snapshots_s or [0.0]
        return [
            f"{self.backend}: {self.step_us:.0f} us/tool step (instrumented run) =",
            f"  {len(self.saves_s) / self.steps:.2f} RunStore.save_run_async calls/step "
            "(whole run), "
            f"{sum(self.saves_s) * per_step:.0f} us/step in them "
            f"(median save {statistics.median(self.saves_s) * 1e6:.0f} us),",
            f"    of which {len(self.snapshots_s)} snapshots "
            f"({snaps[0] * 1e3:.1f} ms first, {snaps[-1] * 1e3:.1f} ms last): "
            f"{sum(self.snapshots_s) * per_step:.0f} us/step amortised;",
            f"    and thread hops: {self.off_loop_saves / self.steps:.2f} saves/step off the loop"
            f" x {self.hop_us:.0f} us (a no-op to_thread) = {self.hop_step_us:.0f} us/step;",
            f"  the rest (funnel, keys, events, stream parts, wake-ups): "
            f"{self.step_us - sum(self.saves_s) * per_step:.0f} us/step.",
        ]


@dataclass
class BackendResult:
    backend: str
    journal: list[Measure] = field(default_factory=list)
    floor_one: Measure | None = None
    floor_two: Measure | None = None
    breakdown: Breakdown | None = None


# ------------------------------------------------------------ the bench flows
class NoopArgs(BaseModel):
    x: int


@dataclass
class Probe:
    """What the bench nodes read (how many steps) and write (how long)."""

    steps: int = 0
    elapsed: float = 0.0
    saves: int = 0
    loop_saves: int = 0


PROBE = Probe()


async def tool_node(state: dict[str, Any], ctx: RunContext) -> Any:
    n = PROBE.steps
    saves = PROBE.saves
    start = time.perf_counter()
    for i in range(n):
        await ctx.tool("noop", {"x": i})
    PROBE.elapsed = time.perf_counter() - start
    PROBE.loop_saves = PROBE.saves - saves
    return end("done")


async def now_node(state: dict[str, Any], ctx: RunContext) -> Any:
    n = PROBE.steps
    saves = PROBE.saves
    start = time.perf_counter()
    for _ in range(n):
        await ctx.now()
    PROBE.elapsed = time.perf_counter() - start
    PROBE.loop_saves = PROBE.saves - saves
    return end("done")


NOOP = define_tool("noop", "does nothing", NoopArgs, lambda a: {"x": a.x})
FLOWS = {
    "tool": define_flow("bench_tool", "tool steps", "n", [action("n", tool_node)]),
    "now": define_flow("bench_now", "now steps", "n", [action("n", now_node)]),
}
AGENT = define_agent("bench", "benchmark agent", None, [NOOP], list(FLOWS.values()))


async def one_flow_run(runtime: Runtime, kind: str, steps: int) -> float:
    """Run one flow of ``steps`` steps of ``kind``; returns seconds spent in the loop."""
    PROBE.steps = steps
    PROBE.elapsed = -1.0
    flow = FLOWS[kind]
    result = await runtime.run(
        f"bench-{uuid.uuid4().hex[:8]}", kind="flow", flow_name=flow.name
    ).result()
    if result.status != "finished" or PROBE.elapsed < 0:
        msg = f"bench flow {flow.name} ended {result.status}, not finished"
        raise RuntimeError(msg)
    return PROBE.elapsed


async def bench_journal(
    result: BackendResult,
    store: RunStore,
    steps: int,
    reps: int,
    breakdown: bool,
    label: str = "journal",
) -> None:
    runtime = Runtime([AGENT], store=store)
    save_run_async = store.save_run_async

    async def counted_save(run: Any, lease: Any = None) -> None:
        PROBE.saves += 1
        await save_run_async(run, lease)

    store.save_run_async = counted_save  # type: ignore[method-assign]
    try:
        for kind in ("tool", "now"):
            measure = Measure(result.backend, f"{label}: {kind} step", steps)
            await one_flow_run(runtime, kind, min(steps, WARMUP_CAP))
            for _ in range(reps):
                gc.collect()
                seconds = await one_flow_run(runtime, kind, steps)
                measure.samples_us.append(seconds / steps * 1e6)
            measure.saves_per_step = PROBE.loop_saves / steps
            result.journal.append(measure)
    finally:
        del store.save_run_async
    if breakdown:
        result.breakdown = await break_down(result.backend, runtime, store, steps)


async def break_down(backend: str, runtime: Runtime, store: RunStore, steps: int) -> Breakdown:
    """One more run of tool steps, timing every save and every snapshot.

    Wrapped on the instances: ``save_run``, and the application's
    ``_take_snapshots`` hook (whichever way it takes a snapshot: a reload, as
    the library does, or from the saved aggregate), counting the calls that
    wrote a snapshot through the snapshot store's ``put``.
    """
    saves: list[float] = []
    snapshots: list[float] = []
    save_run = store.save_run
    save_run_async = store.save_run_async
    log = store.partitions[0]  # a store of one log: the application that snapshots
    take_snapshots = log._take_snapshots
    snapshot_store = store.snapshots
    if snapshot_store is None:
        msg = "RunStore has no snapshot store; nothing to break down"
        raise RuntimeError(msg)
    put_snapshot = snapshot_store.put
    puts = 0

    loop_thread = threading.get_ident()
    off_loop = 0

    def threaded_save(run: Any, lease: Any = None) -> None:
        nonlocal off_loop
        if threading.get_ident() != loop_thread:
            off_loop += 1
        save_run(run, lease)

    async def timed_save(run: Any, lease: Any = None) -> None:
        start = time.perf_counter()
        try:
            await save_run_async(run, lease)
        finally:
            saves.append(time.perf_counter() - start)

    def counted_put(*args: Any, **kwargs: Any) -> Any:
        nonlocal puts
        puts += 1
        return put_snapshot(*args, **kwargs)

    def timed_snapshots(*args: Any, **kwargs: Any) -> None:
        before = puts
        start = time.perf_counter()
        try:
            take_snapshots(*args, **kwargs)
        finally:
            if puts != before:
                snapshots.append(time.perf_counter() - start)

    hops = 1000
    start = time.perf_counter()
    for _ in range(hops):
        await asyncio.to_thread(lambda: None)
    hop_us = (time.perf_counter() - start) / hops * 1e6
    store.save_run = threaded_save  # type: ignore[method-assign]
    store.save_run_async = timed_save  # type: ignore[method-assign]
    log._take_snapshots = timed_snapshots  # type: ignore[method-assign]
    snapshot_store.put = counted_put  # type: ignore[method-assign]
    try:
        gc.collect()
        seconds = await one_flow_run(runtime, "tool", steps)
    finally:
        del store.save_run, store.save_run_async, log._take_snapshots, snapshot_store.put
    return Breakdown(backend, steps, seconds / steps * 1e6, saves, snapshots, hop_us, off_loop)


class InlineSaves(RunStore):
    """A ``RunStore`` whose saves are the recorder's blocking call, on the loop's thread."""

    async def save_run_async(self, run: Any, lease: Any = None) -> None:
        self.save_run(run, lease)


class ThreadedSaves(RunStore):
    """A ``RunStore`` whose saves are the recorder's blocking call, on a worker thread."""

    async def save_run_async(self, run: Any, lease: Any = None) -> None:
        await asyncio.to_thread(self.save_run, run, lease)


# --------------------------------------------------------------------- floors
def time_floor(
    backend: str,
    label: str,
    insert_commit: Callable[[], None],
    commits_per_step: int,
    steps: int,
    reps: int,
) -> Measure:
    """µs per step of ``commits_per_step`` x (INSERT + COMMIT)."""
    measure = Measure(backend, label, steps, saves_per_step=commits_per_step)
    for _ in range(min(steps, WARMUP_CAP)):
        insert_commit()
    for _ in range(reps):
        gc.collect()
        start = time.perf_counter()
        for _ in range(steps * commits_per_step):
            insert_commit()
        measure.samples_us.append((time.perf_counter() - start) / steps * 1e6)
    return measure


def sqlite_floors(path: Path, steps: int, reps: int) -> tuple[Measure, Measure]:
    # Opened as eventsourcing opens its SQLite database: autocommit, explicit
    # BEGIN/COMMIT, WAL journal, default synchronous setting.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL;")
        conn.execute(
            "CREATE TABLE floor (id INTEGER PRIMARY KEY AUTOINCREMENT, payload BLOB NOT NULL)"
        )

        def insert_commit() -> None:
            cur = conn.cursor()
            cur.execute("BEGIN")
            cur.execute("INSERT INTO floor (payload) VALUES (?)", (FLOOR_PAYLOAD,))
            conn.commit()

        one = time_floor("sqlite", "floor: 1x INSERT+COMMIT", insert_commit, 1, steps, reps)
        two = time_floor("sqlite", "floor: 2x INSERT+COMMIT", insert_commit, 2, steps, reps)
        return one, two
    finally:
        conn.close()


def postgres_floors(dsn: str, steps: int, reps: int) -> tuple[Measure, Measure]:
    # One psycopg 3 connection, not autocommit: each step is
    # (implicit BEGIN) INSERT ... ; COMMIT, as a careful hand-written journal would do.
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE floor (id BIGSERIAL PRIMARY KEY, payload BYTEA NOT NULL)")
        conn.commit()

        def insert_commit() -> None:
            conn.execute("INSERT INTO floor (payload) VALUES (%s)", (FLOOR_PAYLOAD,))
            conn.commit()

        one = time_floor("postgres", "floor: 1x INSERT+COMMIT", insert_commit, 1, steps, reps)
        two = time_floor("postgres", "floor: 2x INSERT+COMMIT", insert_commit, 2, steps, reps)
        return one, two


# ------------------------------------------------------------------ postgres
def with_dbname(dsn: str, dbname: str) -> str:
    url = urlparse(dsn)
    return urlunparse(url._replace(path=f"/{dbname}"))


def create_database(admin_dsn: str) -> str | None:
    """Create a fresh benchmark database; its name, or None if the server is unreachable."""
    name = f"kuralle_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=3) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.OperationalError as e:
        print(f"PostgreSQL at {admin_dsn} is unreachable ({e}); skipping PostgreSQL.".strip())
        return None
    return name


def drop_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=3) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def server_settings(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        sync = conn.execute("SHOW synchronous_commit").fetchone()
    v = version[0] if version else "?"
    s = sync[0] if sync else "?"
    return f"PostgreSQL {v}, synchronous_commit={s}"


# ------------------------------------------------------------------- drivers
async def run_memory(steps: int, reps: int, breakdown: bool) -> BackendResult:
    result = BackendResult("memory")
    with RunStore.memory() as store:
        await bench_journal(result, store, steps, reps, breakdown)
    return result


async def run_sqlite(steps: int, reps: int, breakdown: bool, tmp: Path) -> BackendResult:
    result = BackendResult("sqlite")
    with RunStore.sqlite(str(tmp / "runs.sqlite")) as store:
        await bench_journal(result, store, steps, reps, breakdown)
    result.floor_one, result.floor_two = sqlite_floors(tmp / "floor.sqlite", steps, reps)
    return result


async def run_postgres(
    steps: int, reps: int, breakdown: bool, admin_dsn: str
) -> BackendResult | None:
    name = create_database(admin_dsn)
    if name is None:
        return None
    dsn = with_dbname(admin_dsn, name)
    try:
        print(f"postgres: {server_settings(dsn)}; benchmark database {name}")
        result = BackendResult("postgres")
        with RunStore.postgres(dsn) as store:  # the one-round-trip recorder (the default)
            await bench_journal(result, store, steps, reps, breakdown)
        # eventsourcing's own recorder, named in os.environ only while this store is
        # made (a store reads its environment once; the SQLite store is made already).
        os.environ[ES_RECORDER_ENV] = DEFAULT_RECORDER
        try:
            es_store = ThreadedSaves.postgres(dsn)
        finally:
            del os.environ[ES_RECORDER_ENV]
        with es_store as store:
            await bench_journal(result, store, steps, reps, False, "es recorder")
        # The one-trip recorder's blocking call on a worker thread (the library's save
        # before it sent them from the loop), and on the loop's thread (blocking it).
        with ThreadedSaves.postgres(dsn) as store:
            await bench_journal(result, store, steps, reps, False, "saves threaded")
        with InlineSaves.postgres(dsn) as store:
            await bench_journal(result, store, steps, reps, False, "saves inline")
        result.floor_one, result.floor_two = postgres_floors(dsn, steps, reps)
        return result
    finally:
        drop_database(admin_dsn, name)


# --------------------------------------------------------------------- table
def ratio(value: float, floor: Measure | None) -> str:
    return "-" if floor is None else f"{value / floor.median_us:.2f}x"


def table(results: Sequence[BackendResult]) -> str:
    header = (
        "backend",
        "step kind",
        "steps",
        "saves/step",
        "us/step",
        "min-max",
        "vs 2-commit",
        "vs 1-commit",
    )
    rows: list[tuple[str, ...]] = []
    for r in results:
        series = [*r.journal, *(m for m in (r.floor_two, r.floor_one) if m is not None)]
        for m in series:
            rows.append(
                (
                    r.backend,
                    m.label,
                    str(m.steps),
                    f"{m.saves_per_step:.2f}",
                    f"{m.median_us:.0f}",
                    m.spread,
                    ratio(m.median_us, r.floor_two),
                    ratio(m.median_us, r.floor_one),
                )
            )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    right = {2, 3, 4, 5, 6, 7}

    def fmt(cells: Sequence[str]) -> str:
        return " | ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    lines = [fmt(header), "-+-".join("-" * w for w in widths)]
    lines += [fmt(row) for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------- main
async def main_async(steps: int, reps: int, breakdown: bool, admin_dsn: str) -> list[BackendResult]:
    results: list[BackendResult] = []
    phases: list[tuple[str, Callable[[], Awaitable[BackendResult | None]]]] = []
    with tempfile.TemporaryDirectory(prefix="kuralle-bench-") as tmp:
        phases = [
            ("memory", lambda: run_memory(steps, reps, breakdown)),
            ("sqlite", lambda: run_sqlite(steps, reps, breakdown, Path(tmp))),
            ("postgres", lambda: run_postgres(steps, reps, breakdown, admin_dsn)),
        ]
        for name, phase in phases:
            start = time.perf_counter()
            result = await phase()
            if result is not None:
                results.append(result)
                print(f"{name}: done in {time.perf_counter() - start:.1f} s", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=500, help="steps per run (default 500)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time saves, snapshots and thread hops in one extra run per backend",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.reps < 1:
        parser.error("--steps and --reps must be at least 1")
    admin_dsn = os.environ.get(DSN_ENV, DEFAULT_DSN)
    print(
        f"kuralle_es journal overhead: {args.steps} steps/run, median of {args.reps} reps, "
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus",
        flush=True,
    )
    results = asyncio.run(main_async(args.steps, args.reps, args.breakdown, admin_dsn))
    print()
    print(table(results))
    for r in results:
        if r.breakdown is not None:
            print()
            print("\n".join(r.breakdown.lines()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
