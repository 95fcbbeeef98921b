"""Run events on PostgreSQL: how fast a consumer applies them, and how late they arrive.

Two measurements, one run, one fresh database:

* **throughput**: ``--runs`` refund runs (each opened, paused for its amount,
  paused for approval, approved, refunded, finished) are stored first; then a
  ``Consumer`` catches up over all of their public events with a handler that
  inserts one row per event through ``tx`` (the exactly-once path), and again
  with a one-argument handler that does nothing (the at-least-once path). The
  baselines, measured right after on the same database: a hand-written loop
  that reads the same notifications (``select_notifications``) and inserts one
  row per event through one psycopg connection, committing after every event
  (what an unbatched consumer could not beat) and after every 100 (the
  consumer's batch size for ``handler(event, tx)``).
* **lag**: a consumer runs (``consumer.run()``, woken by ``LISTEN``) while a
  writer *process* drives ``--lag-runs`` refund runs, one every ``--pace``
  seconds; for each event the handler records ``now - event.occurred_at`` (the
  stored event's timestamp, taken just before its save) and prints p50/p99.

PostgreSQL is the server named by ``KURALLE_BENCH_POSTGRES_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``); the benchmark creates its
own database and drops it. Usage:
``python benchmarks/run_events.py [--runs N] [--lag-runs N] [--pace S]``.
No assertion is made on speed; this prints lines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlparse, urlunparse

import psycopg
from psycopg import sql

from kuralle_es import RunStore, Runtime, SignalDelivery
from kuralle_es.events import Consumer, RunEvent
from kuralle_es.events.consumer import BATCH_SIZE
from kuralle_es.events.translate import PUBLIC_TOPICS
from kuralle_es.examples import refund

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DSN_ENV = "KURALLE_BENCH_POSTGRES_DSN"


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


def rows_table(dsn: str, table: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (position BIGINT, type TEXT)").format(sql.Identifier(table))
        )


async def throughput(dsn: str, runs: int) -> None:
    store = RunStore.postgres(dsn)
    started = time.perf_counter()
    await refund_runs(store, runs)
    stored = store.recorder.max_notification_id() or 0
    print(f"stored {runs} refund runs ({stored} stored events) in "
          f"{time.perf_counter() - started:.1f} s")  # fmt: skip

    rows_table(dsn, "bench_rows")

    def insert(event: RunEvent, tx: Any) -> None:
        tx.execute("INSERT INTO bench_rows VALUES (%s, %s)", (event.position, event.type))

    def nothing(event: RunEvent) -> None:
        pass

    figures: dict[str, tuple[int, float]] = {}
    for label, handler in (("consumer, handler(event, tx) INSERT", insert),
                           ("consumer, handler(event) no-op", nothing)):  # fmt: skip
        consumer = Consumer(store, f"bench-{label}", handler)
        t0 = time.perf_counter()
        applied = await consumer.run_until_caught_up()
        figures[label] = (applied, time.perf_counter() - t0)

    for per_commit in (1, BATCH_SIZE):
        table = f"floor_rows_{per_commit}"
        rows_table(dsn, table)
        label = f"floor: read + INSERT, COMMIT every {per_commit}"
        figures[label] = await asyncio.to_thread(floor, store, dsn, table, per_commit)
    store.close()

    base = figures["floor: read + INSERT, COMMIT every 1"]
    base_rate = base[0] / base[1]
    print(f"{'path':<42} | events | events/s | vs floor")
    for label, (count, seconds) in figures.items():
        rate = count / seconds
        print(f"{label:<42} | {count:6d} | {rate:8.0f} | {rate / base_rate:7.2f}x")


def floor(store: RunStore, dsn: str, table: str, per_commit: int) -> tuple[int, float]:
    """Read the public notifications and insert one row each, committing every ``per_commit``."""
    insert = sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(sql.Identifier(table))
    t0 = time.perf_counter()
    count = 0
    with psycopg.connect(dsn) as conn:
        position = 0
        while True:
            batch = store.recorder.select_notifications(
                start=position, limit=500, topics=PUBLIC_TOPICS, inclusive_of_start=False
            )
            for n in batch:
                conn.execute(insert, (n.id, n.topic))
                count += 1
                if count % per_commit == 0:
                    conn.commit()
            conn.commit()
            if len(batch) < 500:
                break
            position = batch[-1].id
    return count, time.perf_counter() - t0


async def lag(dsn: str, runs: int, pace: float) -> None:
    store = RunStore.postgres(dsn)
    lags: list[float] = []

    def record(event: RunEvent) -> None:
        lags.append((datetime.now(UTC) - event.occurred_at).total_seconds() * 1000)

    consumer = Consumer(store, "bench-lag", record)
    await consumer.run_until_caught_up()
    lags.clear()
    task = asyncio.create_task(consumer.run())
    writer = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--writer", dsn, "--lag-runs", str(runs), "--pace", str(pace),
    )  # fmt: skip
    await writer.wait()
    await asyncio.sleep(1.0)  # let the last events arrive
    consumer.stop()
    await task
    store.close()
    q = statistics.quantiles(lags, n=100)
    print(
        f"lag save->handler over {len(lags)} events ({runs} runs, a run every {pace} s, "
        f"LISTEN/NOTIFY): p50 {q[49]:.1f} ms, p99 {q[98]:.1f} ms, max {max(lags):.1f} ms"
    )


def _db_dsn(admin: str, name: str) -> str:
    return urlunparse(urlparse(admin)._replace(path=f"/{name}"))


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--lag-runs", type=int, default=60)
    parser.add_argument("--pace", type=float, default=0.05)
    parser.add_argument("--writer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[refund.LEDGER_ENV] = os.path.join(tmp, "ledger.jsonl")
        if args.writer:  # the lag measurement's writer process
            store = RunStore.postgres(args.writer)
            await refund_runs(store, args.lag_runs, args.pace)
            store.close()
            return 0
        admin = os.environ.get(DSN_ENV, DEFAULT_DSN)
        name = f"kuralle_bench_events_{os.getpid()}"
        with psycopg.connect(admin, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        print(
            f"kuralle_es run events: PostgreSQL {version[0] if version else '?'}, "
            f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, database {name}"
        )
        try:
            dsn = _db_dsn(admin, name)
            await throughput(dsn, args.runs)
            await lag(dsn, args.lag_runs, args.pace)
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
