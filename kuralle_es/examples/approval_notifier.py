"""Approval notifier: one outbox row each time a run pauses for an approval.

A supervisor should be paged once per approval a run waits for (the refund
flow's "Refund $42.50?"), even if the notifier is killed mid-way. The
notifier is a ``Consumer`` named ``approvals``: for each ``RunPaused`` event
waiting on an approval it inserts a row into the ``kuralle_approval_outbox``
table of the store's own database, through the ``tx`` its handler is given.
That insert commits in the same transaction as the consumer's position, so
on PostgreSQL and SQLite each row is written exactly once across crashes and
restarts. A mailer (or anything) then drains the outbox; each row carries
the event's ``partition`` and ``position``, together a stable key for
deduplicating further downstream. In a store of several partitions each
partition's database has its outbox (docs/scaling.md).

Run it as ``kuralle-es consume approvals`` (or ``python -m
kuralle_es.examples.approval_notifier``) with ``--store URL`` /
``KURALLE_STORE`` or ``--sqlite FILE``; ``--once`` catches up and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import sys
from collections.abc import Sequence
from typing import Any

from eventsourcing.sqlite import SQLiteApplicationRecorder

from .._journal.store import RunStore
from ..errors import InvalidArgumentError, StoreUnavailableError
from ..events import Consumer, RunEvent, RunPaused

__all__ = [
    "CONSUMER_NAME",
    "OUTBOX_TABLE",
    "approval_consumer",
    "consume",
    "create_outbox",
    "main",
    "notify_approval",
    "open_store",
]

CONSUMER_NAME = "approvals"
OUTBOX_TABLE = "kuralle_approval_outbox"

_COLUMNS = "partition, position, run_id, session_id, request_id, title, description, created_at"
_POSTGRES_DDL = (
    f"CREATE TABLE IF NOT EXISTS {OUTBOX_TABLE} (id BIGSERIAL PRIMARY KEY, "
    "position BIGINT NOT NULL, run_id TEXT NOT NULL, session_id TEXT NOT NULL, "
    "request_id TEXT NOT NULL, title TEXT, description TEXT, created_at TEXT NOT NULL, "
    "partition INTEGER NOT NULL DEFAULT 0)"
)
_SQLITE_DDL = _POSTGRES_DDL.replace("BIGSERIAL PRIMARY KEY", "INTEGER PRIMARY KEY AUTOINCREMENT")
#: An outbox made before partitions had no ``partition`` column: its rows are partition 0.
_POSTGRES_UPGRADE = (
    f"ALTER TABLE {OUTBOX_TABLE} ADD COLUMN IF NOT EXISTS partition INTEGER NOT NULL DEFAULT 0"
)
_SQLITE_UPGRADE = f"ALTER TABLE {OUTBOX_TABLE} ADD COLUMN partition INTEGER NOT NULL DEFAULT 0"


def create_outbox(store: RunStore) -> None:
    """Create the outbox table in each of the store's databases, if it is not there yet."""
    for log in store.partitions:
        datastore: Any = getattr(log.recorder, "datastore", None)
        if datastore is None:
            msg = "the approval notifier needs a SQLite or PostgreSQL store, not an in-memory one"
            raise SystemExit(msg)
        sqlite = isinstance(log.recorder, SQLiteApplicationRecorder)
        with datastore.transaction(commit=True) as curs:
            curs.execute(_SQLITE_DDL if sqlite else _POSTGRES_DDL)
            if not sqlite:
                curs.execute(_POSTGRES_UPGRADE)
                continue
            curs.execute(f"SELECT name FROM pragma_table_info('{OUTBOX_TABLE}')")
            if "partition" not in {row["name"] for row in curs.fetchall()}:
                curs.execute(_SQLITE_UPGRADE)


def notify_approval(event: RunEvent, tx: Any) -> None:
    """Write one outbox row for a pause on an approval, through the consumer's transaction."""
    if not isinstance(event, RunPaused) or event.waiting_for.kind != "approval":
        return
    wait = event.waiting_for
    row = (
        event.partition,
        event.position,
        event.run_id,
        event.session_id,
        wait.request_id,
        wait.title,
        wait.description,
        event.occurred_at.isoformat(),
    )
    marks = ", ".join(["?" if isinstance(tx, sqlite3.Connection) else "%s"] * len(row))
    tx.execute(f"INSERT INTO {OUTBOX_TABLE} ({_COLUMNS}) VALUES ({marks})", row)


def approval_consumer(store: RunStore) -> Consumer:
    """The ``approvals`` consumer over ``store`` (its outbox table must exist)."""
    return Consumer(store, CONSUMER_NAME, notify_approval)


async def consume(store: RunStore, *, once: bool = False) -> int:
    """Run the notifier until SIGTERM/SIGINT (or, with ``once``, until caught up)."""
    await asyncio.to_thread(create_outbox, store)
    consumer = approval_consumer(store)
    if once:
        applied = await consumer.run_until_caught_up()
        print(json.dumps({"consumer": CONSUMER_NAME, "applied": applied}))
        return 0
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, consumer.stop)
    print(f"{CONSUMER_NAME}: following run events", file=sys.stderr, flush=True)
    await consumer.run()
    return 0


def open_store(url: str | None, sqlite_path: str | None) -> RunStore:
    """The store named by ``--sqlite``, else a URL (``--store`` / ``KURALLE_STORE``),
    else the ``eventsourcing`` environment variables; ``StoreUnavailableError`` if away."""
    if sqlite_path:
        return RunStore.sqlite(sqlite_path)
    url = url or os.environ.get("KURALLE_STORE")
    return RunStore.from_url(url) if url else RunStore()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="approval_notifier", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--store", help="postgresql://... or sqlite:///path (env KURALLE_STORE)")
    parser.add_argument("--sqlite", help="SQLite file, short for --store sqlite:///FILE")
    parser.add_argument("--once", action="store_true", help="catch up, then exit")
    args = parser.parse_args(argv)
    try:
        store = open_store(args.store, args.sqlite)
    except (StoreUnavailableError, InvalidArgumentError) as e:
        print(f"approval_notifier: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(consume(store, once=args.once))
    finally:
        with contextlib.suppress(Exception):
            store.close()


if __name__ == "__main__":
    raise SystemExit(main())
