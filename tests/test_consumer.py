"""``Consumer``: named positions, handlers with and without ``tx``, ``run()``/``stop()``.

On memory, SQLite and PostgreSQL (the crash tests with real processes are in
``test_consumer_crash.py``).
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from events_kit import dumps, everything, refund_run

from kuralle_es import InvalidArgumentError, Runtime
from kuralle_es.events import Consumer, RunEvent, RunFinished, RunOpened, follow
from kuralle_es.examples import refund


@pytest.fixture(autouse=True)
def _ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(refund.LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    monkeypatch.delenv(refund.MODEL_ENV, raising=False)


def create_seen_table(store: Any) -> None:
    with store.recorder.datastore.transaction(commit=True) as curs:
        curs.execute("CREATE TABLE IF NOT EXISTS seen (position BIGINT, type TEXT)")


def seen_rows(store: Any) -> list[tuple[int, str]]:
    with store.recorder.datastore.transaction(commit=False) as curs:
        curs.execute("SELECT position, type FROM seen ORDER BY position")
        return [(row["position"], row["type"]) for row in curs.fetchall()]


def insert_seen(event: RunEvent, tx: Any) -> None:
    mark = "?" if isinstance(tx, sqlite3.Connection) else "%s"
    tx.execute(f"INSERT INTO seen VALUES ({mark}, {mark})", (event.position, event.type))


async def test_two_consumers_with_different_names_each_see_every_event(open_store: Any) -> None:
    store = open_store()
    runtime = Runtime([refund.build_agent()], store=store)
    await refund_run(runtime, "a", approve=True)
    first: list[RunEvent] = []
    second: list[RunEvent] = []
    one = Consumer(store, "mailer", first.append)

    async def slow_append(event: RunEvent) -> None:
        await asyncio.sleep(0)
        second.append(event)

    two = Consumer(open_store(), "audit", slow_append)
    assert await one.run_until_caught_up() == len(first) > 0
    await refund_run(runtime, "b", approve=False)
    await two.run_until_caught_up()
    await one.run_until_caught_up()
    full = await everything(store)
    assert dumps(first) == dumps(second) == dumps(full)
    assert await one.position() == await two.position() == full[-1].position


async def test_a_consumer_resumes_where_its_name_left_off(open_store: Any) -> None:
    store = open_store()
    runtime = Runtime([refund.build_agent()], store=store)
    await refund_run(runtime, "a", approve=None)
    got: list[RunEvent] = []
    assert await Consumer(store, "mailer", got.append).run_until_caught_up() == len(got)
    before = len(got)
    # a new instance (as after a restart) over a new store object: nothing again
    again = Consumer(open_store(), "mailer", got.append)
    assert await again.run_until_caught_up() == 0
    await refund_run(runtime, "b", approve=True)
    applied = await again.run_until_caught_up()
    assert applied == len(got) - before > 0
    assert dumps(got) == dumps(await everything(store))


async def test_writes_through_tx_commit_with_the_position_or_not_at_all(
    open_store: Any, backend: str
) -> None:
    store = open_store()
    runtime = Runtime([refund.build_agent()], store=store)
    await refund_run(runtime, "a", approve=True)
    full = await everything(store)
    if backend == "memory":
        txs: list[Any] = []
        await Consumer(store, "c", lambda event, tx: txs.append(tx)).run_until_caught_up()
        assert txs == [None] * len(full)
        return
    create_seen_table(store)
    fail_at = full[len(full) // 2].position

    def flaky(event: RunEvent, tx: Any) -> None:
        insert_seen(event, tx)
        if event.position == fail_at:
            raise RuntimeError("the mail server is down")

    consumer = Consumer(store, "c", flaky)
    with pytest.raises(RuntimeError, match="mail server"):
        await consumer.run_until_caught_up()
    # the failed event's row was rolled back with its position
    assert [p for p, _ in seen_rows(store)] == [e.position for e in full if e.position < fail_at]
    assert await consumer.position() == max(e.position for e in full if e.position < fail_at)

    async def steady(event: RunEvent, tx: Any) -> None:
        insert_seen(event, tx)

    await Consumer(store, "c", steady).run_until_caught_up()
    assert seen_rows(store) == [(e.position, e.type) for e in full]


async def test_run_applies_new_events_until_stopped(open_store: Any) -> None:
    store = open_store()
    runtime = Runtime([refund.build_agent()], store=store)
    got: list[RunEvent] = []
    opened, finished = asyncio.Event(), asyncio.Event()

    async def handler(event: RunEvent) -> None:  # on the loop: it may set asyncio events
        got.append(event)
        if isinstance(event, RunOpened):
            opened.set()
        if isinstance(event, RunFinished):  # the last public event of an approved refund
            finished.set()

    consumer = Consumer(open_store(), "live", handler, poll_interval=0.05)
    task = asyncio.create_task(consumer.run())
    await refund_run(runtime, "a", approve=True)
    await asyncio.wait_for(opened.wait(), 10)
    await asyncio.wait_for(finished.wait(), 10)
    full = await everything(store)
    consumer.stop()
    await asyncio.wait_for(task, 5)
    assert dumps(got) == dumps(full)
    assert await consumer.position() == full[-1].position


async def test_a_bad_name_or_handler_is_refused(open_store: Any) -> None:
    store = open_store()
    with pytest.raises(InvalidArgumentError, match="non-empty name"):
        Consumer(store, " ", print)
    with pytest.raises(InvalidArgumentError, match="handler"):
        Consumer(store, "x", "not callable")  # type: ignore[arg-type]


async def test_follow_and_a_consumer_agree(open_store: Any) -> None:
    store = open_store()
    await refund_run(Runtime([refund.build_agent()], store=store), "a", approve=True)
    full = await everything(store)
    stream = follow(store)
    got = [await asyncio.wait_for(anext(stream), 5) for _ in full]
    await stream.aclose()
    assert dumps(got) == dumps(full)


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_two_instances_of_one_consumer_apply_each_event_once_through_tx(
    open_store: Any, backend: str
) -> None:
    store = open_store()
    runtime = Runtime([refund.build_agent()], store=store)
    for session in ("a", "b"):
        await refund_run(runtime, session, approve=True)
    create_seen_table(store)
    one = Consumer(open_store(), "twins", insert_seen)
    two = Consumer(open_store(), "twins", insert_seen)
    applied = await asyncio.gather(one.run_until_caught_up(), two.run_until_caught_up())
    full = await everything(store)
    assert sum(applied) == len(full)
    assert seen_rows(store) == [(e.position, e.type) for e in full]
