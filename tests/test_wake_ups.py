"""Followers on PostgreSQL are woken after each save commits, outside the save.

A save no longer sends ``NOTIFY`` in its own transaction (PostgreSQL would
hold its server-wide notification lock through that transaction's flush);
the writer sends the wake-up once the save has committed. These tests
listen on a real server's channel: a save from async code and one from sync
code each wake the listener, only after their events can be read, and a
connection the server drops after a wake-up costs no save and is replaced, and
a store closed while a wake-up is in flight closes cleanly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg import sql
from runs_kit import stored_run, with_message

from kuralle_es import RunStore
from kuralle_es._journal import pg_async

pytestmark = pytest.mark.postgres


def listener(server_dsn: str, store: RunStore) -> psycopg.Connection[Any]:
    """A LISTEN of the test's own, on the server itself (one through a transaction
    pooler would be lost with its server session)."""
    conn = psycopg.connect(server_dsn, autocommit=True)
    channel = store.recorder.channel_name  # type: ignore[attr-defined]
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
    return conn


def woken(conn: psycopg.Connection[Any], timeout: float = 5.0) -> bool:
    return any(True for _ in conn.notifies(timeout=timeout, stop_after=1))


async def test_an_async_save_wakes_a_follower_once_its_events_are_readable(
    pg_dsn: str, pg_server_dsn: str
) -> None:
    with RunStore.postgres(pg_dsn) as store, listener(pg_server_dsn, store) as ear:
        run = stored_run(store)
        woken(ear, timeout=0.2)  # the creation's own wake-up
        head = store.recorder.max_notification_id()
        await store.save_run_async(with_message(run, "hello"))
        assert await asyncio.to_thread(woken, ear)
        assert (store.recorder.max_notification_id() or 0) > (head or 0)


def test_a_sync_save_wakes_a_follower(pg_dsn: str, pg_server_dsn: str) -> None:
    with RunStore.postgres(pg_dsn) as store, listener(pg_server_dsn, store) as ear:
        run = stored_run(store)
        woken(ear, timeout=0.2)
        store.save_run(with_message(run, "hello"))
        assert woken(ear)


async def test_saves_at_once_wake_followers_without_a_wake_up_each(
    pg_dsn: str, pg_server_dsn: str
) -> None:
    with RunStore.postgres(pg_dsn) as store, listener(pg_server_dsn, store) as ear:
        runs = [stored_run(store) for _ in range(30)]
        while woken(ear, timeout=0.2):
            pass
        await asyncio.gather(*(store.save_run_async(with_message(r, "hi")) for r in runs))
        await asyncio.sleep(0.2)
        count = sum(1 for _ in ear.notifies(timeout=0.5))
        assert 1 <= count < 30


@pytest.mark.direct_only(
    "kills the server connection that sent the wake-up: behind PgBouncer it has run "
    "other clients' statements since"
)
async def test_a_connection_dropped_after_a_wake_up_costs_no_save_and_is_replaced(
    pg_dsn: str, pg_server_dsn: str
) -> None:
    with RunStore.postgres(pg_dsn) as store, listener(pg_server_dsn, store) as ear:
        run = stored_run(store)
        await store.save_run_async(with_message(run, "one"))
        assert await asyncio.to_thread(woken, ear)
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND query LIKE '%pg_notify%' "
                "AND pid <> pg_backend_pid()"
            ).fetchall()
        assert killed, "no connection had sent a wake-up"
        for text in ("two", "three"):
            await store.save_run_async(with_message(run, text))
        loaded = store.load(run.run_id)
        assert loaded is not None
        assert [m["content"] for m in loaded.messages] == ["one", "two", "three"]
        await store.save_run_async(with_message(run, "four"))
        assert await asyncio.to_thread(woken, ear)


def test_a_wake_up_still_due_when_the_store_closes_is_sent_then(
    pg_dsn: str, pg_server_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long spacing: the second save's wake-up is still due when the loop ends.
    monkeypatch.setattr(pg_async, "WAKE_SPACING", 30.0)
    store = RunStore.postgres(pg_dsn)
    with listener(pg_server_dsn, store) as ear:
        run = stored_run(store)
        while woken(ear, timeout=0.2):
            pass

        async def two_saves() -> None:
            await store.save_run_async(with_message(run, "one"))
            await asyncio.sleep(0.3)  # its wake-up has gone; the next waits 30 s
            await store.save_run_async(with_message(run, "two"))

        asyncio.run(two_saves())
        assert sum(1 for _ in ear.notifies(timeout=0.5)) == 1
        store.close()
        assert woken(ear, timeout=2.0), "the wake-up due at close was not sent"


async def test_a_store_closed_while_its_wake_up_is_in_flight_closes_cleanly(
    pg_dsn: str,
) -> None:
    # Closing frees the connections; one a wake-up (or a save) is on must be left
    # to it until its statement is done: freeing it mid-statement crashed the
    # process (a segmentation fault in libpq).
    stores = []
    try:
        for _ in range(10):
            store = RunStore.postgres(pg_dsn)
            stores.append(store)
            run = stored_run(store)
            await store.save_run_async(with_message(run, "one"))
            await asyncio.sleep(0.2)  # its wake-up sent: the wake-up connection is open
            await store.save_run_async(with_message(run, "two"))
            await asyncio.sleep(0)  # the next wake-up is now on that connection
            store.close()
            # New connections reuse the closed ones' file descriptors, so a wake-up
            # left waiting on a freed connection would be woken, and crash.
            stores.append(RunStore.postgres(pg_dsn))
            await stores[-1].save_run_async(with_message(stored_run(stores[-1]), "x"))
            await asyncio.sleep(0.1)
    finally:
        for store in stores:
            store.close()
    with RunStore.postgres(pg_dsn) as reopened:
        assert len(reopened.session_run_ids("s-group")) == 20


class Dead(BaseException):
    """A turn killed by its process dying (as the crash kit's ``Crash``)."""


async def dying_turn(store: RunStore, run: Any, passes: int) -> None:
    """Two saves, ``passes`` passes of the loop, then the turn dies."""
    await store.save_run_async(with_message(run, "a"))
    await store.save_run_async(with_message(run, "b"))
    for _ in range(passes):
        await asyncio.sleep(0)  # the wake-up takes the connection, sends
    raise Dead


def test_a_store_closed_between_turns_of_one_loop_leaves_a_shared_connection_alone(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A save and a wake-up share the loop's connection. The save ended, the turn
    # died, and the loop stopped with the wake-up's statement under way; the store
    # was then closed, and the loop ran again. Closing freed the connection under
    # the statement, which crashed the process (a segmentation fault) before the
    # saver counted every user of a connection, not just whether it had one.
    monkeypatch.setattr(pg_async, "WAKE_SPACING", 0.0)
    with asyncio.Runner() as runner:
        for turn_number in range(40):
            store = RunStore.postgres(pg_dsn)
            run = stored_run(store)

            with pytest.raises(Dead):
                runner.run(dying_turn(store, run, turn_number % 4))
            store.close()  # the loop is stopped: a wake-up may be under way
    with RunStore.postgres(pg_dsn) as reopened:
        assert len(reopened.session_run_ids("s-group")) == 40
