"""Workers that start together on one PostgreSQL database all come up.

``eventsourcing`` sets up its schema at start (``CREATE TABLE IF NOT EXISTS``,
``CREATE OR REPLACE FUNCTION``); run at the same instant from several
processes, PostgreSQL fails all but one ("tuple concurrently updated", or a
duplicate catalog key on a brand-new database). ``RunStore`` retries that
idempotent setup, so a fleet restart never loses a worker to it.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

from kuralle_es import RunStore

pytestmark = pytest.mark.postgres

WORKERS = 4
STARTS = 4


def start_stores(dsn: str, barrier: Any, results: Any) -> None:
    """Open and close a store a few times, each start at the same instant as the others."""
    try:
        for _ in range(STARTS):
            barrier.wait(timeout=60)
            RunStore.postgres(dsn).close()
        results.put("ok")
    except Exception as e:  # reported so the parent can show it
        results.put(f"{type(e).__name__}: {e}")


@pytest.mark.timeout(180)
def test_workers_starting_together_on_a_fresh_database_all_come_up(pg_dsn: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(WORKERS)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=start_stores, args=(pg_dsn, barrier, results)) for _ in range(WORKERS)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=150) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert outcomes == ["ok"] * WORKERS
    assert [p.exitcode for p in procs] == [0] * WORKERS
    with RunStore.postgres(pg_dsn) as store:
        assert store.session_run_ids("nobody") == []


def test_stores_opened_at_the_same_instant_on_a_new_database_all_open(pg_dsn: str) -> None:
    """Found in CI: on a brand-new database, the record of its partitions was
    created by every store at once, and all but one failed on a duplicate
    catalog key. Threads make the race likely: eight stores opened after one
    barrier, five times, the record dropped before each."""
    import threading

    import psycopg

    errors: list[str] = []

    def open_one(barrier: threading.Barrier) -> None:
        barrier.wait(timeout=30)
        try:
            RunStore.postgres(pg_dsn).close()
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")

    for _ in range(5):
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS kuralle_partitions")
        barrier = threading.Barrier(8)
        threads = [threading.Thread(target=open_one, args=(barrier,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert errors == []
