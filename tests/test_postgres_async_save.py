"""PostgreSQL saves sent from the event loop (README.md, "Architecture").

A turn's save on PostgreSQL is the one-trip statement sent over psycopg's
async connection, one connection per event loop: no worker thread. These
tests hold it to what the threaded save guaranteed: notification ids in
commit order for a reader tailing the log while writers on several loops
and threads save at once, a version clash as ``StaleWriteError`` with
nothing stored, a lost or cancelled connection replaced, a store used from
one loop after another, and ``close`` leaving no connection open.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from uuid import uuid4

import psycopg
import pytest
from log_tail import tail_while

from kuralle_es import Message, RunStore, StaleWriteError
from kuralle_es._journal.run import Run

pytestmark = pytest.mark.postgres


@pytest.fixture
def store(pg_dsn: str) -> Iterator[RunStore]:
    with RunStore.postgres(pg_dsn) as opened:
        yield opened


def fresh_run(store: RunStore, session: str) -> Run:
    run = Run(uuid4(), session, "flow", "agent", "flow", "digest")
    store.create_run(run)
    return run


def grow(run: Run, n: int) -> None:
    """``n`` more events on the run (messages appended)."""
    for i in range(n):
        run.append_message(Message(role="user", content=f"m{i}"))


def backends(dsn: str) -> list[int]:
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        ).fetchall()
    return [int(row[0]) for row in rows]


def test_saves_from_several_loops_and_threads_reach_a_tailing_reader_once_in_order(
    store: RunStore, pg_dsn: str
) -> None:
    loops, runs_per_loop, saves_per_run = 4, 5, 6
    errors: list[BaseException] = []
    written: list[Run] = []

    async def write(session: str) -> None:
        runs = [fresh_run(store, session) for _ in range(runs_per_loop)]
        written.extend(runs)

        async def one(run: Run) -> None:
            for _ in range(saves_per_run):
                grow(run, 2)
                await store.save_run_async(run)

        await asyncio.gather(*(one(run) for run in runs))

    def writer(n: int) -> None:
        try:
            asyncio.run(write(f"s{n}"))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def write_on_every_loop() -> None:
        threads = [threading.Thread(target=writer, args=(n,)) for n in range(loops)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    seen = tail_while(store.recorder, write_on_every_loop)
    assert not errors, errors
    everything = [n.id for n in store.recorder.select_notifications(start=None, limit=100_000)]
    assert seen == everything  # none skipped, none twice, in order
    assert len(written) == loops * runs_per_loop
    for run in written:
        stored = store.load(run.run_id)
        assert stored is not None and stored.version == 1 + saves_per_run * 2


async def test_a_version_clash_is_a_stale_write_and_stores_nothing(
    store: RunStore, pg_dsn: str
) -> None:
    run = fresh_run(store, "s")
    with RunStore.postgres(pg_dsn) as other:
        theirs = other.load(run.run_id)
        assert theirs is not None
        grow(theirs, 1)
        await other.save_run_async(theirs)
    grow(run, 3)
    with pytest.raises(StaleWriteError):
        await store.save_run_async(run)
    stored = store.load(run.run_id)
    assert stored is not None and stored.version == theirs.version


@pytest.mark.direct_only(
    "kills the store's server connections: behind PgBouncer they are PgBouncer's, "
    "and the store's own connections to it live on"
)
async def test_a_killed_connection_is_replaced_and_the_save_lands(
    store: RunStore, pg_dsn: str
) -> None:
    run = fresh_run(store, "s")
    grow(run, 1)
    await store.save_run_async(run)
    dbname = psycopg.conninfo.conninfo_to_dict(pg_dsn)["dbname"]
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        killed = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        ).fetchall()
    assert killed  # the loop's connection (and the pool's) really died
    grow(run, 1)
    await store.save_run_async(run)
    stored = store.load(run.run_id)
    assert stored is not None and stored.version == run.version


async def test_a_cancelled_save_leaves_the_store_usable(store: RunStore) -> None:
    run = fresh_run(store, "s")
    grow(run, 1)
    save = asyncio.ensure_future(store.save_run_async(run))
    await asyncio.sleep(0)
    save.cancel()
    landed = True
    try:
        await save
    except asyncio.CancelledError:
        landed = False
    stored = store.load(run.run_id)
    assert stored is not None
    # Cancelled before or after its commit: either the save is whole, or absent.
    assert stored.version in ((run.version,) if landed else (run.version - 1, run.version))
    other = fresh_run(store, "s2")
    grow(other, 1)
    await store.save_run_async(other)
    again = store.load(other.run_id)
    assert again is not None and again.version == other.version


def test_one_store_saves_from_one_loop_after_another_and_closes_clean(pg_dsn: str) -> None:
    store = RunStore.postgres(pg_dsn)
    run = fresh_run(store, "s")
    for _ in range(3):
        grow(run, 1)
        asyncio.run(store.save_run_async(run))
    stored = store.load(run.run_id)
    assert stored is not None and stored.version == run.version
    store.close()
    # Neither the pool nor any loop's connection is left (a server backend exits
    # a moment after its client closed the socket, so the list is polled).
    deadline = time.monotonic() + 5
    while backends(pg_dsn) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backends(pg_dsn) == []
