"""How fast the run views are filled, how late they are, and how fast they answer.

On a fresh PostgreSQL database (``KURALLE_BENCH_POSTGRES_DSN``, default
``postgresql://postgres@127.0.0.1:5432/postgres``; created and dropped here):

1. **Throughput.** ``--runs`` refund runs are stored (each opened, paused for
   the amount, paused for approval, approved, refunded, finished: about 31
   stored events), then fresh views catch up over the whole log: in batches
   (500 events per transaction, what a query's catch-up does) and one event
   per transaction (what ``eventsourcing``'s ``ProjectionRunner`` does live).
   The floor, on the same database: read the same notifications and commit
   one single-row ``INSERT`` per event through one psycopg connection.
2. **Lag.** The projector runs as ``kuralle-es views follow`` does
   (``ProjectionRunner``, woken by LISTEN/NOTIFY) while a writer *process*
   drives ``--lag-runs`` refund runs ``--pace`` seconds apart. A poller reads
   the views' tracking position about every millisecond; an event's lag is
   the moment the position first covers it minus the stored event's
   timestamp (taken just before its save, so the save is included).
3. **Queries on 100,000 runs.** View rows for 100,000 runs are inserted
   *directly in bulk* (``COPY``; not projected: projecting 3 million events
   would only measure step 1 again) — 2 % paused (some past their deadline,
   some on due timers), 5 % running (some with expired leases), the rest
   ended — with the tracking position at the log's head, so each query's
   catch-up is a no-op check. Each query is timed through ``RunViews`` (the
   catch-up check, the SQL, building the ``RunSummary`` objects): median of
   ``--reps``. The same rows in a SQLite file give the SQLite figures.

Usage: ``python benchmarks/projection_lag.py [--runs N] [--lag-runs N] [--pace S] [--reps R]``.
No assertion is made on speed; this prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlparse, urlunparse

import psycopg
from eventsourcing.persistence import Tracking
from psycopg import sql

from kuralle_es import RunStore, Runtime, RunViews, SignalDelivery
from kuralle_es.examples import refund
from kuralle_es.views.api import open_backend
from kuralle_es.views.fold import RunRow
from kuralle_es.views.postgres import PostgresViews
from kuralle_es.views.projector import follow, run_projection_runner
from kuralle_es.views.query import RUN_COLUMNS, run_values
from kuralle_es.views.source import read_after
from kuralle_es.views.sqlite import SQLiteViews, to_text

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DSN_ENV = "KURALLE_BENCH_POSTGRES_DSN"
BIG = 100_000


async def refund_runs(store: RunStore, count: int, pace: float = 0.0) -> None:
    """``count`` refund runs driven to their end (approved), ``pace`` seconds apart."""
    runtime = Runtime([refund.build_agent()], store=store)
    for i in range(count):
        session = f"bench-{uuid.uuid4().hex[:8]}-{i}"
        first = await runtime.run(
            session, input="I want a refund", kind="flow", flow_name="refund"
        ).result()
        await runtime.run(session, run_id=first.run_id, input="It was $42.50").result()
        delivery = SignalDelivery(
            signal_id=f"ok-{first.run_id}", name="__approval",
            payload={"approved": True, "by": "bench"}, actor="bench",
        )  # fmt: skip
        await runtime.run(session, run_id=first.run_id, signal_delivery=delivery).result()
        if pace:
            await asyncio.sleep(pace)


# ------------------------------------------------------------- throughput
def floor(dsn: str, store: RunStore) -> tuple[int, float]:
    """Read every notification and commit one single-row INSERT per event."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_floor (position bigint, topic text)")
        started = time.perf_counter()
        count, position = 0, None
        while True:
            batch = store.recorder.select_notifications(
                start=position, limit=500, inclusive_of_start=position is None
            )
            if not batch:
                break
            for n in batch:
                with conn.transaction():
                    conn.execute("INSERT INTO bench_floor VALUES (%s, %s)", (n.id, n.topic))
                count += 1
            position = batch[-1].id
        return count, time.perf_counter() - started


async def throughput(dsn: str, runs: int) -> None:
    store = RunStore.postgres(dsn)
    started = time.perf_counter()
    await refund_runs(store, runs)
    head = store.recorder.max_notification_id() or 0
    print(
        f"stored {runs} refund runs ({head} stored events) in {time.perf_counter() - started:.1f} s"
    )
    rows = []
    views = RunViews(store, name="bench_batch")
    started = time.perf_counter()
    applied = await views.catch_up()
    took = time.perf_counter() - started
    rows.append(("views catch-up, 500 events per transaction", applied, took))

    single = open_backend(store, "bench_single")
    events = read_after(store, None, head)
    started = time.perf_counter()
    for event in events:
        single.apply([event], event.notification_id)
    took = time.perf_counter() - started
    rows.append(("views apply, 1 event per transaction", len(events), took))

    stop = threading.Event()
    runner = threading.Thread(target=run_projection_runner, args=(store, "bench_runner", stop))
    tracked = open_backend(store, "bench_runner")
    started = time.perf_counter()
    runner.start()
    await asyncio.to_thread(_wait_until, lambda: (tracked.view_position() or 0) >= head)
    took = time.perf_counter() - started
    stop.set()
    runner.join()
    rows.append(("ProjectionRunner, woken per event, batches", head, took))
    count, took = floor(dsn, store)
    rows.append(("floor: read + 1 INSERT+COMMIT per event", count, took))
    base = count / took
    print(f"{'path':<48} | events | events/s | vs floor")
    for label, n, took in rows:
        print(f"{label:<48} | {n:6d} | {n / took:8.0f} | {n / took / base:7.2f}x")
    store.close()


# -------------------------------------------------------------------- lag
def _wait_until(condition: Callable[[], bool]) -> None:
    while not condition():
        time.sleep(0.002)


def poll_positions(dsn: str, stop: threading.Event, seen: list[tuple[int, float]]) -> None:
    """Record (position, wall time) each time the views' tracking position moves."""
    last = -1
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            row = conn.execute(
                "SELECT notification_id FROM runviews_tracking WHERE application_name = 'RunStore'"
            ).fetchone()
            position = row[0] if row and row[0] is not None else 0
            if position > last:
                seen.append((position, time.time()))
                last = position
            time.sleep(0.001)


async def lag(dsn: str, runs: int, pace: float) -> None:
    store = RunStore.postgres(dsn)
    views = RunViews(store)
    await views.catch_up()
    start = store.recorder.max_notification_id() or 0
    stop = threading.Event()
    seen: list[tuple[int, float]] = []
    projector = threading.Thread(target=follow, args=(store, open_backend(store), stop))
    poller = threading.Thread(target=poll_positions, args=(dsn, stop, seen))
    projector.start()
    poller.start()
    began = time.perf_counter()
    writer = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--writer", dsn, "--lag-runs", str(runs), "--pace", str(pace)
    )
    await writer.wait()
    head = store.recorder.max_notification_id() or 0
    await asyncio.to_thread(_wait_until, lambda: bool(seen) and seen[-1][0] >= head)
    took = time.perf_counter() - began
    stop.set()
    projector.join()
    poller.join()

    events = []
    position: int | None = start
    while True:
        batch = read_after(store, position, 1000)
        if not batch:
            break
        events += batch
        position = batch[-1].notification_id
    lags = []
    i = 0
    for event in events:
        while seen[i][0] < event.notification_id:
            i += 1
        lags.append((seen[i][1] - event.timestamp.timestamp()) * 1000)
    lags.sort()
    p50, p99 = lags[len(lags) // 2], lags[min(len(lags) - 1, int(len(lags) * 0.99))]
    print(
        f"lag save->visible over {len(lags)} events ({runs} runs, a run every {pace} s, "
        f"ProjectionRunner + LISTEN/NOTIFY): p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
        f"max {lags[-1]:.1f} ms; {len(lags) / took:.0f} events/s applied as written"
    )
    store.close()


# ------------------------------------------------------------ 100k queries
def big_rows(now: datetime) -> list[RunRow]:
    rng = random.Random(7)
    rows = []
    for i in range(BIG):
        roll = rng.random()
        flow = f"flow{i % 10}"
        updated = now - timedelta(seconds=rng.randrange(30 * 24 * 3600))
        status, wait, lease_holder, lease = "finished", None, None, None
        if roll < 0.02:
            status = "paused"
            kind = ("approval", "signal", "input", "timer")[i % 4]
            deadline = now + timedelta(hours=rng.choice((-2, 2, 48))) if kind != "input" else None
            wait = {
                "name": "__timer" if kind == "timer" else "__approval", "callsite": 0,
                "title": None, "description": None,
                "deadline": deadline.isoformat() if deadline else None,
                "request_id": uuid.UUID(int=i).hex, "kind": kind, "operation": None,
            }  # fmt: skip
        elif roll < 0.07:
            status, lease_holder = "running", f"worker-{i % 8}"
            lease = now + timedelta(seconds=rng.choice((-600, 30)))
        elif roll < 0.10:
            status = rng.choice(("error", "aborted"))
        rows.append(
            RunRow(
                run_id=str(uuid.UUID(int=i + 1)),
                session_id=f"session-{i % 20000}",
                kind="flow",
                status=status,
                flow=flow,
                active_flow=flow if status in ("paused", "running") else None,
                active_node="node" if status in ("paused", "running") else None,
                waiting_for=wait,
                lease_holder=lease_holder,
                lease_expires_at=lease,
                step_count=rng.randrange(1, 40),
                created_at=updated - timedelta(minutes=5),
                updated_at=updated,
                version=10,
                event_count=10,
                agent=None,
                flow_version=None,
            )
        )
    return rows


QUERIES: list[tuple[str, Callable[[RunViews, datetime], Awaitable[list[Any]]]]] = [
    ("list_runs()                    (limit 100)", lambda v, now: v.list_runs()),
    ("list_runs(status='paused')     (limit 100)", lambda v, now: v.list_runs(status="paused")),
    ("list_runs(session_id=...)", lambda v, now: v.list_runs(session_id="session-4242")),
    ("list_runs(flow=..., limit=20)", lambda v, now: v.list_runs(flow="flow3", limit=20)),
    ("waiting_runs()                 (all paused)", lambda v, now: v.waiting_runs()),
    ("orphaned_runs(now)", lambda v, now: v.orphaned_runs(now)),
    ("expired_deadlines(now)", lambda v, now: v.expired_deadlines(now)),
    ("due_timers(now)", lambda v, now: v.due_timers(now)),
]


async def time_queries(label: str, views: RunViews, now: datetime, reps: int) -> None:
    for name, query in QUERIES:
        found = await query(views, now)  # warm-up
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            await query(views, now)
            times.append((time.perf_counter() - started) * 1000)
        print(f"{label:<10} | {name:<44} | {len(found):5d} | {statistics.median(times):8.2f}")


async def queries(dsn: str, reps: int, tmp: str) -> None:
    now = datetime.now(UTC)
    rows = big_rows(now)
    print(f"{'backend':<10} | {'query on 100,000 runs':<44} | rows  | ms (median of {reps})")

    store = RunStore.postgres(dsn)
    backend = open_backend(store, "bench100k")
    assert isinstance(backend, PostgresViews)
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        columns = sql.SQL(", ").join(sql.Identifier(c) for c in RUN_COLUMNS)
        with cur.copy(sql.SQL("COPY bench100k_runs ({}) FROM STDIN").format(columns)) as copy:
            for row in rows:
                copy.write_row(run_values(row, lambda t: t))
        conn.execute("ANALYZE bench100k_runs")
    backend.insert_tracking(Tracking("RunStore", store.recorder.max_notification_id() or 1))
    await time_queries("postgres", RunViews(store, name="bench100k"), now, reps)
    store.close()

    lite = RunStore.sqlite(os.path.join(tmp, "big.db"))
    sqlite_views = open_backend(lite, "bench100k")
    assert isinstance(sqlite_views, SQLiteViews)
    with sqlite_views.datastore.transaction(commit=True) as c:
        c.executemany(
            f"INSERT INTO bench100k_runs ({', '.join(RUN_COLUMNS)}) "
            f"VALUES ({', '.join('?' * len(RUN_COLUMNS))})",
            [run_values(r, to_text) for r in rows],
        )
        c.execute("ANALYZE")
    await time_queries("sqlite", RunViews(lite, name="bench100k"), now, reps)
    lite.close()


# ------------------------------------------------------------------ main
def _db_dsn(admin: str, name: str) -> str:
    return urlunparse(urlparse(admin)._replace(path=f"/{name}"))


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=200, help="refund runs for the throughput")
    parser.add_argument("--lag-runs", type=int, default=60, help="refund runs for the lag")
    parser.add_argument("--pace", type=float, default=0.05, help="seconds between lag runs")
    parser.add_argument("--reps", type=int, default=15, help="repetitions of each query")
    parser.add_argument("--writer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[refund.LEDGER_ENV] = os.path.join(tmp, "ledger.jsonl")
        if args.writer:  # the lag measurement's writer process
            with RunStore.postgres(args.writer) as store:
                await refund_runs(store, args.lag_runs, args.pace)
            return 0
        admin = os.environ.get(DSN_ENV, DEFAULT_DSN)
        name = f"kuralle_bench_views_{os.getpid()}"
        with psycopg.connect(admin, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        print(
            f"kuralle_es run views: PostgreSQL {version[0] if version else '?'}, "
            f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, database {name}"
        )
        try:
            dsn = _db_dsn(admin, name)
            await throughput(dsn, args.runs)
            await lag(dsn, args.lag_runs, args.pace)
            await queries(dsn, args.reps, tmp)
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
