"""Views of a SQLite store: tables in the store's own database file (internal).

``eventsourcing`` 9.5 has no subscriptions on SQLite, so these views are
filled by catching up over the notification log (see ``projector``). A batch
of rows and the tracking position commit in one SQLite transaction; its first
statement is a write, so it takes the database's write lock at once, and two
projectors (threads or processes) apply batches one after the other.
Times are stored as fixed-width UTC text, so comparing text compares times.
Tables of an older ``VIEWS_GENERATION`` (``<prefix>_meta``) are upgraded
when the views are opened, in the transaction that creates them: missing
columns added, rows and position emptied, so the next catch-up rebuilds
them from the log; that transaction holds the write lock, so of several
processes opening the views at once one upgrades and the others see it done.
"""

from __future__ import annotations

import random
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime

from eventsourcing.persistence import OperationalError, Tracking, TrackingRecorder
from eventsourcing.sqlite import SQLiteCursor, SQLiteDatastore

from .._journal.eventsourcing_hooks import SQLiteCreateTableHook
from .._journal.recorders import sqlite_time
from .backend import StepKey, ViewBackend
from .fold import RunRow, StepRow
from .query import (
    ADDED_COLUMNS,
    RUN_COLUMNS,
    SQL_INDEXES,
    STEP_COLUMNS,
    VIEWS_GENERATION,
    RunQuery,
    UsageQuery,
    UsageShare,
    run_row,
    run_values,
    sql_order,
    sql_runs,
    sql_usage,
    sql_where,
    step_row,
    step_values,
    tool_stats,
)
from .summaries import ToolStats

__all__ = ["SQLiteViews"]

_CREATE_ATTEMPTS = 100


def to_text(value: datetime) -> str:
    return sqlite_time(value)


def from_text(value: str | None) -> datetime | None:
    if value is None:
        return None
    return datetime.fromisoformat(value).replace(tzinfo=UTC)  # C-fast; the format is ISO


class SQLiteViews(SQLiteCreateTableHook, TrackingRecorder, ViewBackend):
    """Run and step view tables plus their tracking row, in the store's database."""

    def __init__(
        self, datastore: SQLiteDatastore, prefix: str = "runviews", leases_table: str = ""
    ) -> None:
        self.runs_table = f"{prefix}_runs"
        #: The store's lease records, which the queries join (``query.sql_runs``).
        self.leases_table = leases_table
        self.steps_table = f"{prefix}_steps"
        self.tracking_table = f"{prefix}_tracking"
        self.meta_table = f"{prefix}_meta"
        self._prefix = prefix
        super().__init__(datastore)
        placeholders = ", ".join("?" * len(RUN_COLUMNS))
        self._upsert_run = (
            f"INSERT OR REPLACE INTO {self.runs_table} ({', '.join(RUN_COLUMNS)}) "
            f"VALUES ({placeholders})"
        )
        placeholders = ", ".join("?" * len(STEP_COLUMNS))
        self._upsert_step = (
            f"INSERT OR REPLACE INTO {self.steps_table} ({', '.join(STEP_COLUMNS)}) "
            f"VALUES ({placeholders})"
        )

    def construct_create_table_statements(self) -> list[str]:
        statements = [
            f"CREATE TABLE IF NOT EXISTS {self.runs_table} ("
            "run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, kind TEXT NOT NULL, "
            "status TEXT NOT NULL, flow TEXT, active_flow TEXT, active_node TEXT, "
            "waiting_for TEXT, wait_kind TEXT, wait_deadline TEXT, lease_holder TEXT, "
            "lease_expires_at TEXT, step_count INTEGER NOT NULL, created_at TEXT NOT NULL, "
            "updated_at TEXT NOT NULL, version INTEGER NOT NULL, event_count INTEGER NOT NULL, "
            "agent TEXT, flow_version TEXT, parent_run_id TEXT, parent_step INTEGER, "
            "node TEXT, outcome TEXT, error_type TEXT, subject TEXT)",
            f"CREATE TABLE IF NOT EXISTS {self.steps_table} ("
            "run_id TEXT NOT NULL, idx INTEGER NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL, "
            "status TEXT NOT NULL, started_at TEXT NOT NULL, finished_at TEXT, "
            "attempts INTEGER NOT NULL, error_type TEXT, duration_ms REAL, agent TEXT, "
            "input_tokens INTEGER, output_tokens INTEGER, total_tokens INTEGER, "
            "PRIMARY KEY (run_id, idx)) WITHOUT ROWID",
            f"CREATE INDEX IF NOT EXISTS {self.steps_table}_tool "
            f"ON {self.steps_table} (kind, name)",
            f"CREATE TABLE IF NOT EXISTS {self.tracking_table} ("
            "application_name TEXT PRIMARY KEY, notification_id INTEGER) WITHOUT ROWID",
            f"INSERT OR IGNORE INTO {self.tracking_table} VALUES ('{self.application_name}', NULL)",
            f"CREATE TABLE IF NOT EXISTS {self.meta_table} ("
            "name TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID",
        ]
        statements += [
            f"CREATE INDEX IF NOT EXISTS {self.runs_table}_{name} ON {self.runs_table} ({columns})"
            for name, columns in SQL_INDEXES
        ]
        return statements

    def create_table(self) -> None:
        """Create the tables if missing, waiting out another process's write.

        The creating transaction starts by reading the schema, so a concurrent
        writer makes it fail with "database is locked" at once rather than wait;
        the statements are idempotent, so trying again is safe.
        """
        for attempt in range(_CREATE_ATTEMPTS):
            try:
                super().create_table()
                return
            except OperationalError as e:
                if "locked" not in str(e) or attempt == _CREATE_ATTEMPTS - 1:
                    raise
                time.sleep(random.uniform(0.02, 0.1))

    def create_tables_on(self, c: SQLiteCursor) -> None:
        # Tables first, then the upgrade (the tracking row's INSERT took the write
        # lock: upgrading is ours alone), then the indexes: one may cover a column
        # that the upgrade adds to an older table.
        statements = self.create_table_statements
        indexes = [s for s in statements if s.startswith("CREATE INDEX")]
        for statement in statements:
            if statement not in indexes:
                c.execute(statement)
        self._upgrade(c)
        for statement in indexes:
            c.execute(statement)

    def _upgrade(self, c: SQLiteCursor) -> None:
        """Bring tables of an older generation to this one; their rows are rebuilt."""
        c.execute(f"SELECT value FROM {self.meta_table} WHERE name = 'generation'")
        found = c.fetchone()
        if found is not None and int(found[0]) >= VIEWS_GENERATION:
            return
        for kind, table in (("runs", self.runs_table), ("steps", self.steps_table)):
            c.execute(f"PRAGMA table_info({table})")
            present = {str(r[1]) for r in c.fetchall()}
            for column, sql_type in ADDED_COLUMNS[kind]:
                if column not in present:
                    c.execute(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}")
        self._empty(c)
        c.execute(
            f"INSERT OR REPLACE INTO {self.meta_table} (name, value) VALUES ('generation', ?)",
            (VIEWS_GENERATION,),
        )

    # ------------------------------------------------ TrackingRecorder
    def insert_tracking(self, tracking: Tracking) -> None:
        with self.datastore.transaction(commit=True) as c:
            c.execute(
                f"UPDATE {self.tracking_table} SET notification_id = ? WHERE application_name = ?",
                (tracking.notification_id, tracking.application_name),
            )

    def max_tracking_id(self, application_name: str) -> int | None:
        with self.datastore.transaction(commit=False) as c:
            return _position(c, self.tracking_table, application_name)

    # ------------------------------------------------------ ViewBackend
    @contextmanager
    def view_transaction(self) -> Iterator[_SQLiteTransaction]:
        with self.datastore.transaction(commit=True) as c:
            # A write first: take the write lock before reading the position.
            c.execute(
                f"UPDATE {self.tracking_table} SET notification_id = notification_id "
                "WHERE application_name = ?",
                (self.application_name,),
            )
            yield _SQLiteTransaction(self, c)

    def view_position(self) -> int | None:
        return self.max_tracking_id(self.application_name)

    def select_runs(self, query: RunQuery) -> list[RunRow]:
        where, params = sql_where(query, "?", to_text, steps=self.steps_table)
        order, more = sql_order(query, "?")
        with self.datastore.transaction(commit=False) as c:
            runs = sql_runs(self.runs_table, self.leases_table, "?")
            c.execute(f"SELECT * FROM {runs}{where}{order}", [*params, *more])
            return [run_row(r, from_text) for r in c.fetchall()]

    def select_tool_stats(self) -> list[ToolStats]:
        with self.datastore.transaction(commit=False) as c:
            c.execute(
                f"SELECT name, status, duration_ms FROM {self.steps_table} WHERE kind = 'tool'"
            )
            return tool_stats((r[0], r[1], r[2]) for r in c.fetchall())

    def select_usage(self, query: UsageQuery) -> list[UsageShare]:
        statement, params = sql_usage(query, self.steps_table, self.runs_table, "?", to_text)
        with self.datastore.transaction(commit=False) as c:
            c.execute(statement, params)
            return [
                UsageShare(r[0], r[1], r[2], int(r[3]), int(r[4]), int(r[5]), int(r[6]))
                for r in c.fetchall()
            ]

    def select_steps(self) -> list[StepRow]:
        with self.datastore.transaction(commit=False) as c:
            c.execute(f"SELECT * FROM {self.steps_table} ORDER BY run_id, idx")
            return [step_row(r, from_text) for r in c.fetchall()]

    def delete_runs(self, run_ids: Sequence[str], *, keep_steps: bool) -> None:
        marks = ",".join("?" * len(run_ids))
        with self.datastore.transaction(commit=True) as c:
            c.execute(f"DELETE FROM {self.runs_table} WHERE run_id IN ({marks})", list(run_ids))
            if not keep_steps:
                c.execute(
                    f"DELETE FROM {self.steps_table} WHERE run_id IN ({marks})", list(run_ids)
                )

    def reset_views(self) -> None:
        with self.datastore.transaction(commit=True) as c:
            self._empty(c)

    def _empty(self, c: SQLiteCursor) -> None:
        c.execute(f"UPDATE {self.tracking_table} SET notification_id = NULL")
        c.execute(f"DELETE FROM {self.runs_table}")
        c.execute(f"DELETE FROM {self.steps_table}")


class _SQLiteTransaction:
    def __init__(self, views: SQLiteViews, cursor: SQLiteCursor) -> None:
        self.views = views
        self.c = cursor

    def position(self) -> int | None:
        return _position(self.c, self.views.tracking_table, self.views.application_name)

    def load_runs(self, run_ids: Collection[str]) -> dict[str, RunRow]:
        rows: dict[str, RunRow] = {}
        for run_id in run_ids:
            self.c.execute(f"SELECT * FROM {self.views.runs_table} WHERE run_id = ?", (run_id,))
            found = self.c.fetchone()
            if found is not None:
                rows[run_id] = run_row(found, from_text)
        return rows

    def load_steps(self, keys: Collection[StepKey]) -> dict[StepKey, StepRow]:
        rows: dict[StepKey, StepRow] = {}
        for run_id, index in keys:
            self.c.execute(
                f"SELECT * FROM {self.views.steps_table} WHERE run_id = ? AND idx = ?",
                (run_id, index),
            )
            found = self.c.fetchone()
            if found is not None:
                rows[(run_id, index)] = step_row(found, from_text)
        return rows

    def write(self, runs: Sequence[RunRow], steps: Sequence[StepRow], position: int) -> None:
        self.c.executemany(self.views._upsert_run, [run_values(r, to_text) for r in runs])
        self.c.executemany(self.views._upsert_step, [step_values(s, to_text) for s in steps])
        self.c.execute(
            f"UPDATE {self.views.tracking_table} SET notification_id = ? "
            "WHERE application_name = ?",
            (position, self.views.application_name),
        )


def _position(c: SQLiteCursor, table: str, application_name: str) -> int | None:
    c.execute(
        f"SELECT notification_id FROM {table} WHERE application_name = ?", (application_name,)
    )
    found = c.fetchone()
    return None if found is None or found[0] is None else int(found[0])
