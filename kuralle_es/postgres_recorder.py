"""A PostgreSQL application recorder whose save is one round trip.

Internal module. ``eventsourcing``'s default PostgreSQL save sends ``BEGIN``,
``SET LOCAL lock_timeout``, ``LOCK TABLE``, ``NOTIFY`` and the ``INSERT`` in a
pipeline, waits for them, then sends ``COMMIT`` and waits again: two round
trips a save. This recorder sends the same work as one statement, a call of a
PL/pgSQL function, on an autocommit connection; the statement's implicit
transaction commits when it returns.

Every guarantee of the default path is kept (measured in benchmarks/RESULTS.md):

- the ``EXCLUSIVE`` table lock is taken before the insert and held until the
  commit, so notification ids are issued in commit order and a reader tailing
  the notification log never passes a gap that is filled in later;
- the ``NOTIFY`` is sent in the same transaction, so subscribers wake on commit;
- a version clash is the same ``IntegrityError`` (the primary key);
- a save that carries tracking records (a process application's) takes the
  default path, so no tracking record is ever dropped.

``eventsourcing``'s own ``POSTGRES_ENABLE_DB_FUNCTIONS`` path is not this: it
skips the table lock and ignores tracking records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eventsourcing.persistence import InterfaceError, OperationalError, StoredEvent
from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore
from eventsourcing.utils import retry
from psycopg.sql import SQL, Identifier

__all__ = ["OneTripPostgresRecorder"]


class OneTripPostgresRecorder(PostgresApplicationRecorder):
    """``PostgresApplicationRecorder`` with the lock, notify and insert in one call."""

    def __init__(
        self, datastore: PostgresDatastore, *, events_table_name: str = "stored_events"
    ) -> None:
        super().__init__(datastore, events_table_name=events_table_name)
        # One function per events table: it names the table and its channel.
        self.one_trip_function = f"kuralle_save_{self.events_table_name}"[:63]
        schema = Identifier(self.datastore.schema)
        function = Identifier(self.one_trip_function)
        self.sql_create_statements.append(
            SQL(
                "CREATE OR REPLACE FUNCTION {schema}.{function}(events {schema}.{event}[]) "
                "RETURNS SETOF bigint LANGUAGE plpgsql AS $BODY$ "
                "BEGIN "
                "SET LOCAL lock_timeout = '{lock_timeout}s'; "
                "LOCK TABLE {schema}.{table} IN EXCLUSIVE MODE; "
                "NOTIFY {channel}; "
                "RETURN QUERY INSERT INTO {schema}.{table} AS t "
                "(originator_id, originator_version, topic, state) "
                "SELECT originator_id, originator_version, topic, state FROM unnest(events) "
                "RETURNING notification_id; "
                "END; $BODY$"
            ).format(
                schema=schema,
                function=function,
                event=Identifier(self.stored_event_type_name),
                lock_timeout=self.datastore.lock_timeout,
                table=Identifier(self.events_table_name),
                channel=Identifier(self.channel_name),
            )
        )
        self.one_trip_statement = SQL("SELECT * FROM {schema}.{function}(%s)").format(
            schema=schema, function=function
        )

    @retry((InterfaceError, OperationalError), max_attempts=10, wait=0.2)
    def insert_events(
        self, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        if kwargs.get("tracking") is not None or not stored_events:
            default_path: Sequence[int] | None = super().insert_events(stored_events, **kwargs)
            return default_path
        rows = [
            self.construct_pg_stored_event(e.originator_id, e.originator_version, e.topic, e.state)
            for e in stored_events
        ]
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            assert conn.autocommit  # the statement's own transaction commits it
            curs.execute(self.one_trip_statement, (rows,), prepare=True)
            return [int(row[self.one_trip_function]) for row in curs.fetchall()]
