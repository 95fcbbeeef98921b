"""What one PostgreSQL save is made of, next to the raw floor, in one run.

A save of one event, timed apart, in interleaved rounds on one connection
(median of ``--calls``, default 300):

* **python**: the event made into a stored event (the transcoder's JSON);
* **floor**: the raw INSERT + COMMIT of ``journal_overhead.py`` and
  ``peers.py`` (a table with one index, two round trips);
* **plain insert**: an autocommit INSERT of the stored event into the events
  table (its two indexes, ``RETURNING`` the notification id), no lock, no
  ``NOTIFY``: what a save would cost without the notification log's order;
* **one-trip save**: the store's own statement (the table lock, ``NOTIFY``,
  insert and commit in one call of a PL/pgSQL function);
* **pipelined**: the same work sent as ``eventsourcing``'s recorder sends it
  (BEGIN, lock, NOTIFY, insert, COMMIT in one pipeline).

The store's rows include the python part; the others do not (it is printed
so the save's Python and server shares can be read apart).

Usage: ``python benchmarks/save_parts.py [--calls 300]``. Server:
``KURALLE_BENCH_POSTGRES_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``); a fresh database,
dropped afterwards.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from journal_overhead import (
    DEFAULT_DSN,
    DSN_ENV,
    FLOOR_PAYLOAD,
    create_database,
    drop_database,
    server_settings,
    with_dbname,
)
from psycopg.types.composite import register_composite

from kuralle_es import RunStore
from kuralle_es._journal.recorders import OneTripPostgresRecorder
from kuralle_es._journal.run import Run


def parts(dsn: str, calls: int) -> dict[str, float]:
    """Median µs of each part, from ``calls`` interleaved rounds."""
    with RunStore.postgres(dsn) as store:
        recorder = store.recorder
        assert isinstance(recorder, OneTripPostgresRecorder)
        table, channel = recorder.events_table_name, recorder.channel_name
        insert = (
            f"INSERT INTO {table} (originator_id, originator_version, topic, state) "
            "VALUES (%s, %s, %s, %s) RETURNING notification_id"
        )

        def stored() -> list[Any]:
            run = Run(uuid.uuid4(), "bench", "flow", "agent", "flow", "d" * 64)
            return [store.mapper.to_stored_event(event) for event in run.collect_events()]

        conn = psycopg.connect(dsn, autocommit=True)
        floor_conn = psycopg.connect(dsn)
        try:
            name = recorder.stored_event_type_name
            info = recorder.datastore.psycopg_type_adapters[name]
            register_composite(info, conn, factory=recorder.datastore.psycopg_python_types[name])
            floor_conn.execute(
                "CREATE TABLE floor (id BIGSERIAL PRIMARY KEY, payload BYTEA NOT NULL)"
            )
            floor_conn.commit()

            def floor() -> None:
                floor_conn.execute("INSERT INTO floor (payload) VALUES (%s)", (FLOOR_PAYLOAD,))
                floor_conn.commit()

            def plain(events: list[Any]) -> None:
                rows = [(e.originator_id, e.originator_version, e.topic, e.state) for e in events]
                with conn.cursor() as cur:
                    cur.executemany(insert, rows, returning=True)

            def one_trip(events: list[Any]) -> None:
                rows = [
                    recorder.construct_pg_stored_event(
                        e.originator_id, e.originator_version, e.topic, e.state
                    )
                    for e in events
                ]
                conn.execute(recorder.one_trip_statement, (rows,), prepare=True).fetchall()

            def pipelined(events: list[Any]) -> None:
                with conn.pipeline():
                    conn.execute("BEGIN")
                    conn.execute(f"LOCK TABLE {table} IN EXCLUSIVE MODE")
                    conn.execute(f'NOTIFY "{channel}"')
                    plain(events)
                    conn.execute("COMMIT")

            timed: dict[str, Callable[[list[Any]], None]] = {
                "floor: 1x INSERT+COMMIT (one-index table)": lambda _: floor(),
                "plain autocommit INSERT into the events table": plain,
                "one-trip save (lock, NOTIFY, insert, commit)": one_trip,
                "pipelined as eventsourcing sends it": pipelined,
            }
            samples: dict[str, list[float]] = {"python: an event to a stored event": []}
            samples.update({label: [] for label in timed})
            for _ in range(calls):
                start = time.perf_counter()
                events = stored()
                samples["python: an event to a stored event"].append(time.perf_counter() - start)
                for label, save in timed.items():
                    events = stored()
                    start = time.perf_counter()
                    save(events)
                    samples[label].append(time.perf_counter() - start)
        finally:
            conn.close()
            floor_conn.close()
    return {label: statistics.median(values) * 1e6 for label, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    admin = os.environ.get(DSN_ENV, DEFAULT_DSN)
    name = create_database(admin)
    if name is None:
        return 1
    dsn = with_dbname(admin, name)
    try:
        print(f"kuralle_es save parts: python {sys.version.split()[0]}, {os.cpu_count()} cpus")
        print(f"postgres: {server_settings(dsn)}")
        result = parts(dsn, args.calls)
    finally:
        drop_database(admin, name)
    floor = result["floor: 1x INSERT+COMMIT (one-index table)"]
    print(f"\none event a save, median of {args.calls} interleaved rounds")
    print(f"{'part':48s} | {'us':>6} | vs floor")
    for label, us in result.items():
        print(f"{label:48s} | {us:6.0f} | {us / floor:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
