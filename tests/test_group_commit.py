"""Group commit on PostgreSQL: saves that several runs make at once share a statement.

A save made while no other is in flight on its event loop is sent alone (one
round trip: a single run's latency does not change); the saves made while
one is in flight queue up and go in the next statement together, in one
transaction under one lock, each in a subtransaction of its own. These tests
check, against a real server, that such a batch happens, that each run's
save succeeds or fails alone (a version clash or a refused lease fails that
save, writes none of its events, and leaves every other save of the batch
written), and that the notification log stays in commit order.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from runs_kit import stored_run, with_message

from kuralle_es import LeaseHeldError, RunStore, StaleWriteError
from kuralle_es._journal.leases import LeaseOp


@pytest.fixture
def pg_dsn(routed_pg_dsn: str) -> str:
    """A fresh database, straight to the server and through PgBouncer in transaction mode."""
    return routed_pg_dsn


pytestmark = pytest.mark.postgres


async def test_saves_made_at_once_go_in_fewer_statements_and_all_land(pg_dsn: str) -> None:
    with RunStore.postgres(pg_dsn) as store:
        runs = [stored_run(store) for _ in range(40)]
        saver: Any = store.partitions[0]._saver
        before = (saver.statements, saver.saves)
        await asyncio.gather(*(store.save_run_async(with_message(r, "hi")) for r in runs))
        statements, saves = saver.statements - before[0], saver.saves - before[1]
        assert saves == 40
        assert statements < saves, "no save was sent with another"
        for run in runs:
            loaded = store.load(run.run_id)
            assert loaded is not None and loaded.messages[-1]["content"] == "hi"


async def test_a_clash_in_a_group_commit_fails_that_save_alone_and_writes_none_of_it(
    pg_dsn: str,
) -> None:
    with RunStore.postgres(pg_dsn) as store:
        bystanders = [stored_run(store) for _ in range(6)]
        contested = stored_run(store)
        twin = store.load(contested.run_id)
        assert twin is not None
        first = store.save_run_async(with_message(bystanders[0], "first"))
        saves = [
            first,
            store.save_run_async(with_message(contested, "winner")),
            *(store.save_run_async(with_message(r, "by")) for r in bystanders[1:3]),
            store.save_run_async(with_message(with_message(twin, "loser"), "loser 2")),
            *(store.save_run_async(with_message(r, "by")) for r in bystanders[3:]),
        ]
        outcomes = await asyncio.gather(*saves, return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(errors) == 1 and isinstance(errors[0], StaleWriteError), outcomes
        stored = store.load(contested.run_id)
        assert stored is not None
        contents = [m["content"] for m in stored.messages]
        assert contents == ["winner"], "the losing save wrote some of its events"
        for run in bystanders:
            loaded = store.load(run.run_id)
            assert loaded is not None and loaded.messages, "a bystander's save was lost"


async def test_a_refused_lease_in_a_group_commit_fails_that_save_alone(pg_dsn: str) -> None:
    with RunStore.postgres(pg_dsn) as store:
        held = stored_run(store)
        store.save_run(held, LeaseOp.take(held.id, "worker-a", "ta", timedelta(minutes=5)))
        others = [stored_run(store) for _ in range(5)]
        saves = [store.save_run_async(with_message(r, "x")) for r in others[:2]]
        take = LeaseOp.take(held.id, "worker-b", "tb", timedelta(minutes=5))
        saves.append(store.save_run_async(with_message(held, "b"), take))
        saves += [store.save_run_async(with_message(r, "x")) for r in others[2:]]
        outcomes = await asyncio.gather(*saves, return_exceptions=True)
        refused = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(refused) == 1 and isinstance(refused[0], LeaseHeldError), outcomes
        assert refused[0].holder == "worker-a"
        lease = store.lease(held.run_id)
        assert lease is not None and lease.holder == "worker-a"
        reloaded = store.load(held.run_id)
        assert reloaded is not None and reloaded.messages == []
        for run in others:
            loaded = store.load(run.run_id)
            assert loaded is not None and loaded.messages


async def test_the_notification_log_of_group_commits_is_in_commit_order(pg_dsn: str) -> None:
    with RunStore.postgres(pg_dsn) as store:
        runs = [stored_run(store) for _ in range(30)]
        for round_ in range(3):
            await asyncio.gather(
                *(store.save_run_async(with_message(r, f"m{round_}")) for r in runs)
            )
        notifications = store.recorder.select_notifications(start=None, limit=10_000)
        ids = [n.id for n in notifications]
        assert ids == sorted(ids)
        per_run: dict[Any, list[int]] = {}
        for n in notifications:
            per_run.setdefault(n.originator_id, []).append(n.originator_version)
        assert all(v == sorted(v) for v in per_run.values())
        assert sum(len(v) for v in per_run.values()) == len(ids)
