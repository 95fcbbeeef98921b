"""The run store's recorders: events and lease records, saved together (internal).

Each backend's ``eventsourcing`` application recorder, with one addition: a
table of lease records (``leases``) beside the events table, and a
``lease=`` argument to ``insert_events`` whose ``LeaseOp`` is applied in the
same transaction as the events (or alone, with no events). A take that
finds another holder's live lease raises ``LeaseRefused`` and writes
nothing, events included. Each backend decides a lease by its own clock:
memory and SQLite by this machine's, PostgreSQL by the server's
(``clock_timestamp()``), never by a time a worker sends (docs/concepts.md,
"Leases").

- memory: a dict under the recorder's own lock;
- SQLite: a table in the same file, changed on the insert's own cursor;
- PostgreSQL: one PL/pgSQL call per save (``OneTripPostgresRecorder``) that
  applies the lease op, takes the events table's ``EXCLUSIVE`` lock (so
  notification ids are issued in commit order and a follower never passes
  a gap that fills in later) and inserts the events, on an autocommit
  connection: one round trip a save where the library's default path takes
  two (benchmarks/RESULTS.md). Followers are woken by a ``NOTIFY`` in a
  save only when a wake-up is due (once every ``pg_async.WAKE_SPACING``),
  else by a transaction of its own after the commit (``wake_statement``):
  PostgreSQL holds one server-wide lock from a notifying transaction's
  commit until its flush is done, so notifying every save would flush the
  saves of every partition and every process one at a time. A save that carries
  tracking records takes the library's default path, so none is dropped.

The SQLite one writes its lease op through ``eventsourcing_hooks``; the
others extend their recorders at their public methods.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Protocol
from uuid import UUID

import psycopg
from eventsourcing.persistence import (
    IntegrityError,
    InterfaceError,
    OperationalError,
    StoredEvent,
)
from eventsourcing.popo import POPOApplicationRecorder
from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore
from eventsourcing.sqlite import SQLiteCursor, SQLiteDatastore
from eventsourcing.utils import retry
from psycopg.sql import SQL, Composed, Identifier, Literal

from .._clock import as_utc
from .eventsourcing_hooks import SQLiteInsertHook
from .leases import Lease, LeaseOp, LeaseRefused, store_now

__all__ = [
    "LEASE_HELD",
    "LEASE_LOST",
    "SAVE_DEADLINE",
    "SQLITE_TIME_FORMAT",
    "InDoubt",
    "LeasingPOPORecorder",
    "LeasingRecorder",
    "LeasingSQLiteRecorder",
    "OneTripPostgresRecorder",
    "lease_refusal",
    "sqlite_time",
    "stored_outcome",
]

#: Seconds a save (or a read) keeps trying on new connections before it fails: a
#: failover's promotion fits in it.
SAVE_DEADLINE = 30.0

#: SQLSTATEs the PostgreSQL save raises for a refused lease op.
LEASE_HELD = "KL001"
LEASE_LOST = "KL002"


class LeasingRecorder(Protocol):
    """What the run store needs of its recorder besides ``eventsourcing``'s API."""

    def insert_events(
        self, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None: ...

    def select_lease(self, run_id: UUID) -> Lease | None: ...


# ------------------------------------------------------------------ memory
class LeasingPOPORecorder(POPOApplicationRecorder):
    """The in-memory recorder, with lease records under its own lock."""

    def __init__(self) -> None:
        super().__init__()
        self._leases: dict[UUID, Lease] = {}
        self._lease_guard = threading.RLock()

    def insert_events(
        self, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        op: LeaseOp | None = kwargs.pop("lease", None)
        with self._lease_guard:
            if op is None:
                return super().insert_events(stored_events, **kwargs) if stored_events else []
            now = store_now()
            _check(op, self._leases.get(op.run_id), now)
            ids = super().insert_events(stored_events, **kwargs) if stored_events else []
            _apply(op, self._leases, now)
            return ids

    def select_lease(self, run_id: UUID) -> Lease | None:
        with self._lease_guard:
            held = self._leases.get(run_id)
        return None if held is None else _as_read(held)

    def leases(self) -> dict[UUID, Lease]:
        """Every lease record, as it is now (the memory views join these)."""
        with self._lease_guard:
            return dict(self._leases)


def _as_read(held: Lease) -> Lease:
    """A record as a reader gets it: live or not by the store's clock, now."""
    return Lease(held.holder, held.expires_at, held.token, held.expires_at > store_now())


def _check(op: LeaseOp, held: Lease | None, now: datetime) -> None:
    """Refuse ``op`` on a record holding ``held`` at ``now`` (``LeaseRefused``), or let it be."""
    if op.kind == "take":
        if held is not None and held.holder != op.holder and held.expires_at > now:
            raise LeaseRefused(op, held)
    elif op.kind == "renew" and (held is None or held.token != op.token):
        raise LeaseRefused(op, None)


def _apply(op: LeaseOp, leases: dict[UUID, Lease], now: datetime) -> None:
    if op.kind in ("take", "renew"):
        assert op.ttl is not None
        holder = op.holder if op.kind == "take" else leases[op.run_id].holder
        leases[op.run_id] = Lease(holder, now + op.ttl, op.token)
    elif op.kind == "clear" or (
        op.kind == "release" and op.run_id in leases and leases[op.run_id].token == op.token
    ):
        leases.pop(op.run_id, None)


# ------------------------------------------------------------------ SQLite
#: How SQLite tables of the store write a time: UTC, fixed width, so that text
#: order is time order (the views' tables write theirs the same way).
SQLITE_TIME_FORMAT = "%Y-%m-%d %H:%M:%S.%f"


def sqlite_time(at: datetime) -> str:
    return as_utc(at).strftime(SQLITE_TIME_FORMAT)


class LeasingSQLiteRecorder(SQLiteInsertHook):
    """The SQLite recorder, with a lease table in the same file."""

    def __init__(
        self, datastore: SQLiteDatastore, *, events_table_name: str = "stored_events"
    ) -> None:
        self.leases_table = _leases_table(events_table_name)
        super().__init__(datastore, events_table_name=events_table_name)

    def construct_create_table_statements(self) -> list[str]:
        return [
            *super().construct_create_table_statements(),
            f"CREATE TABLE IF NOT EXISTS {self.leases_table} (run_id TEXT PRIMARY KEY, "
            "holder TEXT NOT NULL, token TEXT NOT NULL, expires_at TEXT NOT NULL)",
        ]

    def before_insert(self, c: SQLiteCursor, kwargs: dict[str, Any]) -> None:
        op: LeaseOp | None = kwargs.pop("lease", None)
        if op is not None:
            self._lease_op(c, op)

    def _lease_op(self, c: SQLiteCursor, op: LeaseOp) -> None:
        run = str(op.run_id)
        table = self.leases_table
        # Read before the statement, which may wait for another process's write
        # lock: a take then meets the record as it stood earlier (it may refuse a
        # lease that lapsed meanwhile, never take a live one), and the expiry it
        # sets is at most that wait short of a full TTL.
        now = store_now()
        if op.kind == "take":
            assert op.ttl is not None
            c.execute(
                f"INSERT INTO {table} (run_id, holder, token, expires_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (run_id) DO UPDATE SET holder = excluded.holder, "
                "token = excluded.token, expires_at = excluded.expires_at "
                f"WHERE {table}.expires_at <= ? OR {table}.holder = ?",
                (run, op.holder, op.token, sqlite_time(now + op.ttl), sqlite_time(now),
                 op.holder),
            )  # fmt: skip
            if c.sqlite_cursor.rowcount == 0:
                raise LeaseRefused(op, self._held(c, op.run_id))
        elif op.kind == "renew":
            assert op.ttl is not None
            c.execute(
                f"UPDATE {table} SET expires_at = ? WHERE run_id = ? AND token = ?",
                (sqlite_time(now + op.ttl), run, op.token),
            )
            if c.sqlite_cursor.rowcount == 0:
                raise LeaseRefused(op, None)
        elif op.kind == "release":
            c.execute(f"DELETE FROM {table} WHERE run_id = ? AND token = ?", (run, op.token))
        else:
            c.execute(f"DELETE FROM {table} WHERE run_id = ?", (run,))

    def _held(self, c: SQLiteCursor, run_id: UUID) -> Lease | None:
        c.execute(
            f"SELECT holder, token, expires_at FROM {self.leases_table} WHERE run_id = ?",
            (str(run_id),),
        )
        row = c.fetchone()
        if row is None:
            return None
        expires_at = datetime.fromisoformat(row[2]).replace(tzinfo=UTC)
        return Lease(row[0], expires_at, row[1], expires_at > store_now())

    def select_lease(self, run_id: UUID) -> Lease | None:
        with self.datastore.transaction(commit=False) as c:
            return self._held(c, run_id)


# -------------------------------------------------------------- PostgreSQL
class OneTripPostgresRecorder(PostgresApplicationRecorder):
    """``PostgresApplicationRecorder`` with the lease op, the lock, the notify and
    the insert in one call of a PL/pgSQL function."""

    def __init__(
        self, datastore: PostgresDatastore, *, events_table_name: str = "stored_events"
    ) -> None:
        super().__init__(datastore, events_table_name=events_table_name)
        self.leases_table = _leases_table(self.events_table_name)
        # One function per events table: it names the table, its leases and its channel.
        self.one_trip_function = f"kuralle_write_{self.events_table_name}"[:63]
        schema = Identifier(self.datastore.schema)
        function = Identifier(self.one_trip_function)
        self.leases = Composed([schema, SQL("."), Identifier(self.leases_table)])
        self.sql_create_statements.append(
            SQL(
                "CREATE TABLE IF NOT EXISTS {leases} (run_id uuid PRIMARY KEY, "
                "holder text NOT NULL, token text NOT NULL, expires_at timestamptz NOT NULL)"
            ).format(leases=self.leases)
        )
        names = {
            "schema": schema,
            "event": Identifier(self.stored_event_type_name),
            "leases": self.leases,
            "held": SQL(LEASE_HELD),
            "lost": SQL(LEASE_LOST),
            "lock_timeout": self.datastore.lock_timeout,
            "table": Identifier(self.events_table_name),
            "channel": Identifier(self.channel_name),
        }
        # The events table's lock is always taken before a lease record's row lock
        # (here and in the batch), so two saves never wait on each other in a cycle.
        self.sql_create_statements.append(
            SQL(
                "CREATE OR REPLACE FUNCTION {schema}.{function}(events {schema}.{event}[], "
                "op text, run uuid, holder_ text, token_ text, ttl interval) "
                "RETURNS SETOF bigint LANGUAGE plpgsql AS $BODY$ "
                "DECLARE held_holder text; held_until timestamptz; "
                "BEGIN "
                "IF cardinality(events) > 0 THEN "
                "SET LOCAL lock_timeout = '{lock_timeout}s'; "
                "LOCK TABLE {schema}.{table} IN EXCLUSIVE MODE; "
                "END IF; " + _LEASE_OP + "IF cardinality(events) > 0 THEN "
                "RETURN QUERY INSERT INTO {schema}.{table} AS t "
                "(originator_id, originator_version, topic, state) "
                "SELECT originator_id, originator_version, topic, state FROM unnest(events) "
                "RETURNING notification_id; "
                "END IF; "
                "END; $BODY$"
            ).format(function=function, **names)
        )
        # Group commit: the saves of several runs in one transaction (one lock,
        # one flush), each in a subtransaction of its own, so that one run's
        # version clash or refused lease writes none of its events and never
        # touches another's. ``starts``/``ends`` cut ``events`` into the saves.
        self.batch_function = f"kuralle_write_batch_{self.events_table_name}"[:63]
        batch = Identifier(self.batch_function)
        self.sql_create_statements.append(
            SQL(
                "CREATE OR REPLACE FUNCTION {schema}.{batch}(events {schema}.{event}[], "
                "starts int[], ends int[], ops text[], runs uuid[], holders text[], "
                "tokens text[], ttls interval[]) "
                "RETURNS TABLE (save int, outcome text, ids bigint[], detail text) "
                "LANGUAGE plpgsql AS $BODY$ "
                "DECLARE held_holder text; held_until timestamptz; op text; run uuid; "
                "holder_ text; token_ text; ttl interval; "
                "BEGIN "
                "SET LOCAL lock_timeout = '{lock_timeout}s'; "
                "LOCK TABLE {schema}.{table} IN EXCLUSIVE MODE; "
                "FOR i IN 1 .. cardinality(starts) LOOP "
                "op := ops[i]; run := runs[i]; holder_ := holders[i]; token_ := tokens[i]; "
                "ttl := ttls[i]; "
                "BEGIN " + _LEASE_OP + "save := i; outcome := 'ok'; detail := NULL; "
                "WITH inserted AS (INSERT INTO {schema}.{table} AS t "
                "(originator_id, originator_version, topic, state) "
                "SELECT originator_id, originator_version, topic, state "
                "FROM unnest(events[starts[i]:ends[i]]) RETURNING notification_id) "
                "SELECT array_agg(notification_id ORDER BY notification_id) INTO ids "
                "FROM inserted; "
                "RETURN NEXT; "
                "EXCEPTION "
                "WHEN unique_violation THEN "
                "save := i; outcome := 'clash'; ids := NULL; detail := NULL; RETURN NEXT; "
                "WHEN SQLSTATE '{held}' THEN "
                "save := i; outcome := 'held'; ids := NULL; "
                "detail := held_holder || ' ' || extract(epoch FROM held_until)::text; "
                "RETURN NEXT; "
                "WHEN SQLSTATE '{lost}' THEN "
                "save := i; outcome := 'lost'; ids := NULL; detail := NULL; RETURN NEXT; "
                "END; "
                "END LOOP; "
                "END; $BODY$"
            ).format(batch=batch, **names)
        )
        # The events go in binary: the composite rows' fields are dumped by
        # psycopg's C dumpers, where the text format escapes every JSON state
        # with a regular expression (a tenth of a busy process's time). The
        # statements run on every save are kept as bytes: psycopg would compose
        # and quote a ``Composed`` again on every execute.
        # The same saves carrying the followers' wake-up in their own transaction
        # (delivered at its commit): what a save sends when a wake-up is due, so a
        # busy writer's wake-ups cost no transaction of their own (``pg_async``).
        woken = SQL("WITH woken AS (SELECT pg_notify({channel}, '')) ").format(
            channel=Literal(self.channel_name)
        )
        self.batch_statement = (
            SQL("SELECT * FROM {schema}.{batch}(%b, %s, %s, %s, %s, %s, %s, %s)")
            .format(schema=schema, batch=batch)
            .as_bytes()
        )
        self.batch_waking_statement = Composed(
            [
                woken,
                SQL(
                    "SELECT b.* FROM {schema}.{batch}(%b, %s, %s, %s, %s, %s, %s, %s) AS b, woken"
                ).format(schema=schema, batch=batch),
            ]
        ).as_bytes()
        self.one_trip_statement = (
            SQL("SELECT * FROM {schema}.{function}(%b, %s, %s, %s, %s, %s)")
            .format(schema=schema, function=function)
            .as_bytes()
        )
        self.one_trip_waking_statement = Composed(
            [
                woken,
                SQL(
                    "SELECT f.* FROM {schema}.{function}(%b, %s, %s, %s, %s, %s) AS f, woken"
                ).format(schema=schema, function=function),
            ]
        ).as_bytes()
        # A wake-up for the followers, sent once a save has committed: its own
        # transaction, with no flush to wait for (a lost wake-up only delays a
        # follower; the events are committed already), so the notification
        # lock is held for a moment. One statement, so it can be prepared.
        self.wake_statement = (
            SQL("SELECT set_config('synchronous_commit', 'off', true), pg_notify({channel}, '')")
            .format(channel=Literal(self.channel_name))
            .as_bytes()
        )
        # What a save in doubt (its connection died after it was sent) left: its
        # events as stored, if they are (``pg_async``).
        self.read_back_statement = (
            SQL(
                "SELECT notification_id, originator_id, originator_version, topic, state "
                "FROM {schema}.{table} WHERE (originator_id, originator_version) IN "
                "(SELECT * FROM unnest(%s::{id_type}[], %s::bigint[]))"
            )
            .format(
                schema=schema,
                table=Identifier(self.events_table_name),
                id_type=SQL(self.datastore.originator_id_type),
            )
            .as_bytes()
        )
        self.holds_statement = (
            SQL("SELECT 1 FROM {schema}.{table} WHERE originator_id = %s LIMIT 1")
            .format(schema=schema, table=Identifier(self.events_table_name))
            .as_bytes()
        )
        # Whether the lease is live is the server's to say, as a take would.
        self.select_lease_statement = (
            SQL(
                "SELECT holder, token, expires_at, expires_at > clock_timestamp() AS live "
                "FROM {leases} WHERE run_id = %s"
            )
            .format(leases=self.leases)
            .as_bytes()
        )

    def rows(self, stored_events: Sequence[StoredEvent]) -> list[Any]:
        """The events as the composite rows the one-trip function takes."""
        return [
            self.construct_pg_stored_event(e.originator_id, e.originator_version, e.topic, e.state)
            for e in stored_events
        ]

    def parameters(
        self, stored_events: Sequence[StoredEvent], op: LeaseOp | None
    ) -> tuple[Any, ...]:
        """The one-trip statement's parameters: the events and the lease op."""
        return self.parameters_of(self.rows(stored_events), op)

    @staticmethod
    def parameters_of(rows: list[Any], op: LeaseOp | None) -> tuple[Any, ...]:
        """The one-trip statement's parameters, the events already made rows."""
        if op is None:
            return (rows, "none", None, None, None, None)
        return (rows, op.kind, op.run_id, op.holder, op.token, op.ttl)

    @staticmethod
    def batch_parameters(saves: Sequence[tuple[list[Any], LeaseOp | None]]) -> tuple[Any, ...]:
        """The group commit's parameters: every save's rows, where each save's rows
        start and end in them (1-based, inclusive), and each save's lease op."""
        rows: list[Any] = []
        starts, ends, ops, runs, holders, tokens, ttls = ([] for _ in range(7))
        for save_rows, op in saves:
            starts.append(len(rows) + 1)
            rows.extend(save_rows)
            ends.append(len(rows))
            ops.append(op.kind if op is not None else "none")
            runs.append(op.run_id if op is not None else None)
            holders.append(op.holder if op is not None else None)
            tokens.append(op.token if op is not None else None)
            ttls.append(op.ttl if op is not None else None)
        return (rows, starts, ends, ops, runs, holders, tokens, ttls)

    def insert_events(
        self, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        """The one-trip save; a lost connection is tried again on another within
        ``SAVE_DEADLINE``, and a save in doubt (its connection died after it was
        sent) is read back before it is sent again (``stored_outcome``)."""
        op: LeaseOp | None = kwargs.pop("lease", None)
        if kwargs.get("tracking") is not None:
            assert op is None, "a save with tracking records carries no lease op"
            default_path: Sequence[int] | None = super().insert_events(stored_events, **kwargs)
            return default_path
        if not stored_events and op is None:
            return []
        deadline = time.monotonic() + SAVE_DEADLINE
        wait = 0.1
        while True:
            try:
                return self._insert_once(stored_events, op)
            except InDoubt:
                found: list[int] | Exception | None = self._read_back(stored_events)
                if isinstance(found, Exception):
                    raise found from None
                if found is not None:
                    return found
            except (InterfaceError, OperationalError):
                if time.monotonic() + wait >= deadline:
                    raise
                time.sleep(wait)
                wait = min(1.0, wait * 2)

    def _insert_once(self, stored_events: Sequence[StoredEvent], op: LeaseOp | None) -> list[int]:
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            assert conn.autocommit  # the statement's own transaction commits it
            try:
                curs.execute(
                    self.one_trip_statement, self.parameters(stored_events, op), prepare=True
                )
            except (psycopg.OperationalError, psycopg.InterfaceError) as lost:
                if conn.broken or conn.closed:
                    raise InDoubt from lost
                raise
            except psycopg.Error as e:
                refusal = lease_refusal(e, op)
                if refusal is not None:
                    raise refusal from None
                raise
            ids = [int(row[self.one_trip_function]) for row in curs.fetchall()]
            if stored_events:
                self.wake_followers(curs)
            return ids

    @retry((InterfaceError, OperationalError), max_attempts=10, wait=0.2)
    def _read_back(self, stored_events: Sequence[StoredEvent]) -> list[int] | Exception | None:
        if not stored_events:
            return None  # a lease op alone: sending it again does it once
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(self.read_back_statement, self.read_back_parameters(stored_events))
            rows = [tuple(row.values()) for row in curs.fetchall()]
        return stored_outcome(stored_events, rows)

    @staticmethod
    def read_back_parameters(stored_events: Sequence[StoredEvent]) -> tuple[Any, ...]:
        """``read_back_statement``'s parameters: the events' ids and versions."""
        return (
            [e.originator_id for e in stored_events],
            [e.originator_version for e in stored_events],
        )

    def wake_followers(self, curs: psycopg.Cursor[Any]) -> None:
        """Notify the followers after a committed save; a failure is not the save's
        (it committed: trying it again would clash), and only delays them."""
        with contextlib.suppress(psycopg.Error):
            curs.execute(self.wake_statement, prepare=True)

    def select_lease(self, run_id: UUID) -> Lease | None:
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(self.select_lease_statement, (run_id,), prepare=True)
            row = curs.fetchone()
        if row is None:
            return None
        return Lease(row["holder"], as_utc(row["expires_at"]), row["token"], row["live"])


class InDoubt(Exception):
    """A save's connection died after the statement was sent: it may have committed."""


def stored_outcome(
    stored_events: Sequence[StoredEvent], rows: Sequence[Sequence[Any]]
) -> list[int] | Exception | None:
    """What a save in doubt came to, from ``read_back_statement``'s rows
    ``(notification_id, originator_id, originator_version, topic, state)``: its
    events' ids if they are stored exactly as sent, a clash if another writer's are
    there, None if none is (nothing of it was written: it may be sent again)."""
    by_key = {(row[1], row[2]): row for row in rows}
    found = [by_key.get((e.originator_id, e.originator_version)) for e in stored_events]
    if not stored_events or all(row is None for row in found):
        return None
    if all(
        row is not None and row[3] == e.topic and bytes(row[4]) == bytes(e.state)
        for row, e in zip(found, stored_events, strict=True)
    ):
        return [int(row[0]) for row in found if row is not None]
    return IntegrityError("another writer appended first")


def lease_refusal(error: psycopg.Error, op: LeaseOp | None) -> LeaseRefused | None:
    """The ``LeaseRefused`` a failed one-trip statement stands for, if it is one."""
    if op is None or error.sqlstate not in (LEASE_HELD, LEASE_LOST):
        return None
    if error.sqlstate == LEASE_LOST:
        return LeaseRefused(op, None)
    diag = error.diag
    holder = diag.message_primary or ""
    until = datetime.fromtimestamp(float(diag.message_detail or 0), UTC)
    return LeaseRefused(op, Lease(holder, until))


#: The PL/pgSQL that applies one lease op (``op``, ``run``, ``holder_``, ``token_``,
#: ``ttl``): a refused one raises ``LEASE_HELD`` (the holder as the message, the
#: expiry's epoch as the detail) or ``LEASE_LOST``. Times are the server's, and
#: ``clock_timestamp()``, not ``now()``: the transaction may have started before
#: it waited for the events table's lock, and a lease is decided at the moment
#: the record is compared and set.
_LEASE_OP = (
    "IF op = 'take' THEN "
    "INSERT INTO {leases} AS l (run_id, holder, token, expires_at) "
    "VALUES (run, holder_, token_, clock_timestamp() + ttl) ON CONFLICT (run_id) DO UPDATE SET "
    "holder = EXCLUDED.holder, token = EXCLUDED.token, expires_at = EXCLUDED.expires_at "
    "WHERE l.expires_at <= clock_timestamp() OR l.holder = holder_; "
    "IF NOT FOUND THEN "
    "SELECT l.holder, l.expires_at INTO held_holder, held_until FROM {leases} l "
    "WHERE l.run_id = run; "
    "RAISE EXCEPTION USING ERRCODE = '{held}', MESSAGE = held_holder, "
    "DETAIL = extract(epoch FROM held_until)::text; "
    "END IF; "
    "ELSIF op = 'renew' THEN "
    "UPDATE {leases} SET expires_at = clock_timestamp() + ttl "
    "WHERE run_id = run AND token = token_; "
    "IF NOT FOUND THEN "
    "RAISE EXCEPTION USING ERRCODE = '{lost}', MESSAGE = 'lease taken over'; "
    "END IF; "
    "ELSIF op = 'release' THEN "
    "DELETE FROM {leases} WHERE run_id = run AND token = token_; "
    "ELSIF op = 'clear' THEN "
    "DELETE FROM {leases} WHERE run_id = run; "
    "END IF; "
)


def _leases_table(events_table_name: str) -> str:
    """The lease table beside an events table (``runstore_events`` -> ``runstore_leases``)."""
    base = events_table_name.removesuffix("_events")
    return f"{base}_leases"
