"""The one-round-trip PostgreSQL recorder is as safe as eventsourcing's default.

eventsourcing's own recorder test cases run against it (insert and select,
notifications, concurrent writers, non-interleaving notification ids), and a
reader tailing the notification log while many writers save must see every
event exactly once, in order: the property the table lock exists for.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any
from uuid import uuid4

import pytest
from eventsourcing.persistence import IntegrityError, StoredEvent
from eventsourcing.postgres import PostgresDatastore
from eventsourcing.tests.persistence import (
    ApplicationRecorderTestCase,
    NonInterleavingNotificationIDsBaseCase,
)
from log_tail import tail_while
from psycopg.conninfo import conninfo_to_dict

from kuralle_es import RunStore
from kuralle_es._journal.recorders import OneTripPostgresRecorder

pytestmark = pytest.mark.postgres


def _datastore(dsn: str) -> PostgresDatastore:
    params: dict[str, Any] = conninfo_to_dict(dsn)
    datastore = PostgresDatastore(
        dbname=str(params["dbname"]),
        host=str(params.get("host") or "127.0.0.1"),
        port=str(params.get("port") or 5432),
        user=str(params.get("user") or "postgres"),
        password=str(params.get("password") or ""),
        pool_size=4,
        max_overflow=12,
    )
    if os.environ.get("KURALLE_POSTGRES_POOLER") == "transaction":
        # As the store's own pools behind a transaction pooler: no prepared statement
        # (docs/high-availability.md); eventsourcing's datastore has no switch for it.
        datastore.pool.kwargs["prepare_threshold"] = None  # type: ignore[index]
    return datastore


@pytest.fixture
def make_recorder(pg_dsn: str) -> Iterator[Callable[[], OneTripPostgresRecorder]]:
    datastores: list[PostgresDatastore] = []

    def make() -> OneTripPostgresRecorder:
        datastore = _datastore(pg_dsn)
        datastores.append(datastore)
        recorder = OneTripPostgresRecorder(datastore, events_table_name="stored_events")
        recorder.create_table()
        return recorder

    yield make
    for datastore in datastores:
        datastore.close()


class _LibraryCases(ApplicationRecorderTestCase[OneTripPostgresRecorder]):
    """eventsourcing's application recorder cases, minus its timing printouts."""

    __test__ = False
    make: Callable[[], OneTripPostgresRecorder]
    test_performance = None  # type: ignore[assignment]
    test_concurrent_throughput = None  # type: ignore[assignment]

    def create_recorder(self) -> OneTripPostgresRecorder:
        return self.make()


class _NonInterleaving(NonInterleavingNotificationIDsBaseCase):
    __test__ = False
    make: Callable[[], OneTripPostgresRecorder]

    def create_recorder(self) -> OneTripPostgresRecorder:
        return self.make()


@pytest.mark.parametrize("case", ["test_insert_select", "test_concurrent_no_conflicts"])
def test_eventsourcing_recorder_cases_pass(
    case: str, make_recorder: Callable[[], OneTripPostgresRecorder]
) -> None:
    test = _LibraryCases(case)
    test.make = make_recorder
    getattr(test, case)()


def test_two_concurrent_saves_never_interleave_their_notification_ids(
    make_recorder: Callable[[], OneTripPostgresRecorder],
) -> None:
    test = _NonInterleaving("test")
    test.make = make_recorder
    test.test()


def test_a_version_clash_is_an_integrity_error_and_stores_nothing(
    make_recorder: Callable[[], OneTripPostgresRecorder],
) -> None:
    recorder = make_recorder()
    run = uuid4()
    first = [StoredEvent(run, 1, "t", b"a"), StoredEvent(run, 2, "t", b"b")]
    assert recorder.insert_events(first) is not None
    with pytest.raises(IntegrityError):
        recorder.insert_events([StoredEvent(run, 3, "t", b"c"), StoredEvent(run, 2, "t", b"x")])
    assert [e.state for e in recorder.select_events(run)] == [b"a", b"b"]


def test_a_reader_tailing_the_log_during_concurrent_saves_sees_each_event_once_in_order(
    make_recorder: Callable[[], OneTripPostgresRecorder],
) -> None:
    writer_recorder = make_recorder()
    reader_recorder = make_recorder()
    writers, saves_per_writer, events_per_save = 6, 40, 3
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(saves_per_writer):
                run = uuid4()
                events = [StoredEvent(run, v, "t", b"{}") for v in range(1, events_per_save + 1)]
                writer_recorder.insert_events(events)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def write_from_every_thread() -> None:
        threads = [threading.Thread(target=write) for _ in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    seen = tail_while(reader_recorder, write_from_every_thread)
    assert not errors, errors
    everything = [n.id for n in reader_recorder.select_notifications(start=None, limit=10_000)]
    assert len(everything) == writers * saves_per_writer * events_per_save
    assert seen == everything  # none skipped, none twice, in order


def test_run_store_on_postgres_saves_through_the_one_trip_recorder(pg_dsn: str) -> None:
    with RunStore.postgres(pg_dsn) as store:
        assert isinstance(store.recorder, OneTripPostgresRecorder)
