"""A new run is saved with its session's index, from async code, on every backend.

On PostgreSQL the save goes from the event loop with the index as this process
last saved it (or a new one), and falls back to reading the index afresh when
that clashes. These tests make it clash every way it can (another store added
a run to the session, runs created at once in one session, a run that already
exists) and check that every run is listed once, in order, with its events
written once and its lease taken, and that nothing else was written.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from uuid import uuid4

import pytest
from conftest import StoreFactory

from kuralle_es import RunStore, StaleWriteError
from kuralle_es._journal.leases import LeaseOp
from kuralle_es._journal.run import Run


def a_run(session_id: str) -> Run:
    return Run(uuid4(), session_id, "flow", "agent", "f", "d")


def take(run: Run, holder: str) -> LeaseOp:
    return LeaseOp.take(run.id, holder, uuid4().hex, timedelta(seconds=30))


async def test_runs_created_by_two_stores_in_turn_are_each_listed_once_in_order(
    open_store: StoreFactory,
) -> None:
    first, second = open_store(), open_store()
    runs = [a_run("s-shared") for _ in range(5)]
    # Each store's index of the session is stale by the time it creates again.
    await first.create_run_async(runs[0])
    await second.create_run_async(runs[1])
    await first.create_run_async(runs[2], take(runs[2], "worker-a"))
    second.create_run(runs[3])
    await first.create_run_async(runs[4])
    expected = [r.run_id for r in runs]
    assert first.session_run_ids("s-shared") == expected
    assert second.session_run_ids("s-shared") == expected
    for run in runs:
        assert len(first.stored_events(run.run_id)) == len(first.stored_events(runs[0].run_id))
    lease = first.lease(runs[2].run_id)
    assert lease is not None and lease.holder == "worker-a"
    assert first.lease(runs[1].run_id) is None


async def test_runs_created_at_once_in_one_session_are_all_listed(
    open_store: StoreFactory,
) -> None:
    store = open_store()
    await store.create_run_async(a_run("s-busy"))
    runs = [a_run("s-busy") for _ in range(8)]
    await asyncio.gather(*(store.create_run_async(r) for r in runs))
    listed = store.session_run_ids("s-busy")
    assert len(listed) == 9 and len(set(listed)) == 9
    assert set(listed) >= {r.run_id for r in runs}
    for run in runs:
        loaded = store.load(run.run_id)
        assert loaded is not None and loaded.session_id == "s-busy"


async def test_a_run_that_exists_is_refused_and_nothing_is_written(
    open_store: StoreFactory,
) -> None:
    store = open_store()
    run = a_run("s-once")
    await store.create_run_async(run)
    events = store.stored_events(run.run_id)
    again = Run(run.id, "s-once", "flow", "agent", "f", "d")
    with pytest.raises(StaleWriteError, match="already exists"):
        await store.create_run_async(again)
    assert store.session_run_ids("s-once") == [run.run_id]
    assert len(store.stored_events(run.run_id)) == len(events)


@pytest.mark.postgres
async def test_runs_created_on_a_partitioned_store_stay_with_their_session(
    pg_dsn: str,
) -> None:
    with RunStore.postgres(pg_dsn, partitions=3) as store:
        sessions = [f"s-{i}" for i in range(6)]
        runs = {s: [a_run(s) for _ in range(3)] for s in sessions}
        for batch in zip(*runs.values(), strict=True):
            await asyncio.gather(*(store.create_run_async(r) for r in batch))
        with RunStore.postgres(pg_dsn) as reopened:
            for session, made in runs.items():
                assert reopened.session_run_ids(session) == [r.run_id for r in made]
                places = {reopened.partition_of(r.run_id) for r in made}
                assert len(places) == 1, f"{session}'s runs were split over {places}"
