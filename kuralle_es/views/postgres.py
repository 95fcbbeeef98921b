"""Views of a PostgreSQL store: an ``eventsourcing`` tracking recorder that
also writes the view rows (internal).

``PostgresViews`` is a ``PostgresTrackingRecorder``: ``eventsourcing``'s
``ProjectionRunner`` drives it through ``RunViewsProjection`` (LISTEN/NOTIFY,
one transaction per event), and ``RunViews`` catches it up over the
notification log before a query (one transaction per batch). Either way the
rows and the tracking record commit in one transaction, under a transaction
advisory lock that makes concurrent projectors take turns; each skips what
the tracking record says is applied already, so nothing is applied twice.

Tables of an older ``VIEWS_GENERATION`` (``<prefix>_meta``) are upgraded
when the views are opened, in the transaction that creates them and under
the projectors' lock: missing columns added, rows and tracking record
deleted, so the next catch-up rebuilds them from the log. Of several
processes opening the views at once, one upgrades; the others wait for the
lock and find it done.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from eventsourcing.persistence import Tracking
from eventsourcing.postgres import PostgresDatastore, PostgresTrackingRecorder
from eventsourcing.projection import Projection
from psycopg import Cursor
from psycopg.rows import DictRow
from psycopg.sql import SQL, Composed, Identifier

from .._clock import as_utc
from .._journal.eventsourcing_hooks import insert_tracking
from .._journal.store_url import PostgresAddress
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
)
from .source import Logged
from .summaries import ToolStats

__all__ = ["PostgresViews", "RunViewsProjection"]

_TRACKING_SUFFIX = "_tracking"
#: How a run id prefix is compared: byte by byte, whatever the database's collation,
#: so that the range of ``query.prefix_bounds`` holds exactly the ids that start with
#: it, served by the ``by_id`` index of the same expression.
_BYTE_ORDER = ' COLLATE "C"'


class PostgresViews(PostgresTrackingRecorder, ViewBackend):
    """Run and step view tables next to the tracking table ``<prefix>_tracking``."""

    #: The lease records the queries join, when none is named.
    default_leases_table = "runstore_leases"
    #: The store's address, when ``eventsourcing`` built this view's pool from the
    #: variables alone (the projection runner): libpq's other parameters for it.
    address: PostgresAddress | None = None

    def __init__(
        self,
        datastore: PostgresDatastore,
        *,
        tracking_table_name: str = "runviews_tracking",
        leases_table_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if self.address is not None:
            self.address.configure(datastore.pool)
        super().__init__(datastore, tracking_table_name=tracking_table_name, **kwargs)
        leases_table_name = leases_table_name or self.default_leases_table
        prefix = tracking_table_name.removesuffix(_TRACKING_SUFFIX)
        schema = Identifier(datastore.schema)
        runs, steps = f"{prefix}_runs", f"{prefix}_steps"
        self.check_identifier_length(f"{runs}_deadline")
        self._runs = Composed([schema, SQL("."), Identifier(runs)])
        # The store's lease records, which the queries join (``query.sql_runs``).
        leases = Composed([schema, SQL("."), Identifier(leases_table_name)]).as_string()
        self._runs_read = SQL(sql_runs(self._runs.as_string(), leases, "?::uuid"))
        self._steps = Composed([schema, SQL("."), Identifier(steps)])
        self._meta = Composed([schema, SQL("."), Identifier(f"{prefix}_meta")])
        # Indexes are made after the upgrade (``_create_table``): one may cover a
        # column that the upgrade adds to an older table.
        self._index_statements: list[Composed] = []
        for statement in self._create_statements(runs, steps):
            is_index = statement.as_string().startswith("CREATE INDEX")
            (self._index_statements if is_index else self.sql_create_statements).append(statement)
        run_updates = SQL(", ").join(
            SQL("{0} = EXCLUDED.{0}").format(Identifier(c)) for c in RUN_COLUMNS[1:]
        )
        step_updates = SQL(", ").join(
            SQL("{0} = EXCLUDED.{0}").format(Identifier(c)) for c in STEP_COLUMNS[2:]
        )
        # The statements of every applied batch are rendered once, here.
        self._upsert_run = (
            SQL("INSERT INTO {0} ({1}) VALUES ({2}) ON CONFLICT (run_id) DO UPDATE SET {3}")
            .format(self._runs, _names(RUN_COLUMNS), _slots(RUN_COLUMNS), run_updates)
            .as_string()
        )
        self._upsert_step = (
            SQL("INSERT INTO {0} ({1}) VALUES ({2}) ON CONFLICT (run_id, idx) DO UPDATE SET {3}")
            .format(self._steps, _names(STEP_COLUMNS), _slots(STEP_COLUMNS), step_updates)
            .as_string()
        )
        self._load_runs = (
            SQL("SELECT * FROM {0} WHERE run_id = ANY(%s)").format(self._runs).as_bytes()
        )
        self._load_steps = (
            SQL(
                "SELECT s.* FROM {0} s JOIN unnest(%s::text[], %s::int[]) AS k(run_id, idx) "
                "ON s.run_id = k.run_id AND s.idx = k.idx"
            )
            .format(self._steps)
            .as_bytes()
        )
        self._position = (
            SQL("SELECT notification_id FROM {0}.{1} WHERE application_name = %s")
            .format(schema, Identifier(tracking_table_name))
            .as_bytes()
        )
        # Projectors of these views take turns: one lock per tracking table.
        self._lock = (
            SQL("SELECT pg_advisory_xact_lock(hashtext({0}))")
            .format(f"{datastore.schema}.{tracking_table_name}")
            .as_bytes()
        )

    def _create_statements(self, runs: str, steps: str) -> list[Composed]:
        statements = [
            SQL(
                "CREATE TABLE IF NOT EXISTS {0} ("
                "run_id text PRIMARY KEY, session_id text NOT NULL, kind text NOT NULL, "
                "status text NOT NULL, flow text, active_flow text, active_node text, "
                "waiting_for text, wait_kind text, wait_deadline timestamptz, "
                "lease_holder text, lease_expires_at timestamptz, step_count int NOT NULL, "
                "created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL, "
                "version bigint NOT NULL, event_count bigint NOT NULL, agent text, "
                "flow_version text, parent_run_id text, parent_step bigint, node text, "
                "outcome text, error_type text, subject text)"
            ).format(self._runs),
            SQL(
                "CREATE TABLE IF NOT EXISTS {0} ("
                "run_id text NOT NULL, idx int NOT NULL, kind text NOT NULL, "
                "name text NOT NULL, status text NOT NULL, started_at timestamptz NOT NULL, "
                "finished_at timestamptz, attempts int NOT NULL, error_type text, "
                "duration_ms double precision, agent text, input_tokens bigint, "
                "output_tokens bigint, total_tokens bigint, PRIMARY KEY (run_id, idx))"
            ).format(self._steps),
            SQL(
                "CREATE TABLE IF NOT EXISTS {0} (name text PRIMARY KEY, value int NOT NULL)"
            ).format(self._meta),
            SQL("CREATE INDEX IF NOT EXISTS {0} ON {1} (kind, name, duration_ms)").format(
                Identifier(f"{steps}_tool"), self._steps
            ),
        ]
        statements += [
            SQL("CREATE INDEX IF NOT EXISTS {0} ON {1} ({2})").format(
                Identifier(f"{runs}_{name}"), self._runs, SQL(columns)
            )
            for name, columns in (*SQL_INDEXES, ("by_id", f"(run_id{_BYTE_ORDER})"))
        ]
        return statements

    def create_table(self) -> None:
        """The tables, their upgrade and their indexes, in one transaction that holds
        the projectors' lock first: index creation locks the tables it indexes, so
        a projector starting up never deadlocks with one that is writing rows."""
        with self.datastore.transaction(commit=True) as curs:
            curs.execute(self._lock)
            for statement in self.sql_create_statements:
                curs.execute(statement, prepare=False)
            self._upgrade(curs)
            for statement in self._index_statements:
                curs.execute(statement, prepare=False)

    def _upgrade(self, curs: Cursor[DictRow]) -> None:
        """Bring tables of an older generation to this one; their rows are rebuilt."""
        curs.execute(SQL("SELECT value FROM {0} WHERE name = 'generation'").format(self._meta))
        found = curs.fetchone()
        if found is not None and int(found["value"]) >= VIEWS_GENERATION:
            return
        for kind, table in (("runs", self._runs), ("steps", self._steps)):
            for column, sql_type in ADDED_COLUMNS[kind]:
                curs.execute(
                    SQL("ALTER TABLE {0} ADD COLUMN IF NOT EXISTS {1} {2}").format(
                        table, Identifier(column), SQL(sql_type)
                    )
                )
        self._empty(curs)
        curs.execute(
            SQL(
                "INSERT INTO {0} (name, value) VALUES ('generation', %s) "
                "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value"
            ).format(self._meta),
            (VIEWS_GENERATION,),
        )

    # ------------------------------------------------------ ViewBackend
    @contextmanager
    def view_transaction(self) -> Iterator[_PostgresTransaction]:
        # Pipelined: statements go out together until a result is needed; the
        # server still runs them in order, so the position is read after the lock.
        with (
            self.datastore.get_connection() as conn,
            conn.pipeline(),
            conn.transaction(),
            conn.cursor() as curs,
        ):
            curs.execute(self._lock)
            yield _PostgresTransaction(self, curs)

    def view_position(self) -> int | None:
        position = self.max_tracking_id(self.application_name)
        return None if position is None else int(position)

    def select_runs(self, query: RunQuery) -> list[RunRow]:
        steps = self._steps.as_string()
        where, params = sql_where(query, "%s", as_utc, byte_order=_BYTE_ORDER, steps=steps)
        order, more = sql_order(query, "%s")
        statement = SQL("SELECT * FROM ") + self._runs_read + SQL(where + order)
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(statement, [*params, *more])
            return [run_row(r, _utc_or_none) for r in curs.fetchall()]

    def select_tool_stats(self) -> list[ToolStats]:
        statement = SQL(
            "SELECT name, count(*) AS count, count(*) FILTER (WHERE status = 'error') AS errors, "
            "percentile_cont(0.5) WITHIN GROUP (ORDER BY duration_ms) AS p50_ms, "
            "percentile_cont(0.95) WITHIN GROUP (ORDER BY duration_ms) AS p95_ms "
            "FROM {0} WHERE kind = 'tool' GROUP BY name ORDER BY name"
        ).format(self._steps)
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(statement)
            return [ToolStats.model_validate(dict(r)) for r in curs.fetchall()]

    def select_usage(self, query: UsageQuery) -> list[UsageShare]:
        text, params = sql_usage(
            query, self._steps.as_string(), self._runs.as_string(), "%s", as_utc
        )
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(text.encode(), params)
            return [_usage_share(r) for r in curs.fetchall()]

    def select_steps(self) -> list[StepRow]:
        statement = SQL("SELECT * FROM {0} ORDER BY run_id, idx").format(self._steps)
        with self.datastore.get_connection() as conn, conn.cursor() as curs:
            curs.execute(statement)
            return [step_row(r, _utc_or_none) for r in curs.fetchall()]

    def delete_runs(self, run_ids: Sequence[str], *, keep_steps: bool) -> None:
        with self.datastore.transaction(commit=True) as curs:
            curs.execute(
                SQL("DELETE FROM {0} WHERE run_id = ANY(%s)").format(self._runs), (list(run_ids),)
            )
            if not keep_steps:
                curs.execute(
                    SQL("DELETE FROM {0} WHERE run_id = ANY(%s)").format(self._steps),
                    (list(run_ids),),
                )

    def reset_views(self) -> None:
        with self.datastore.transaction(commit=True) as curs:
            curs.execute(self._lock)
            self._empty(curs)

    def _empty(self, curs: Cursor[DictRow]) -> None:
        curs.execute(SQL("DELETE FROM {0}").format(self._runs))
        curs.execute(SQL("DELETE FROM {0}").format(self._steps))
        curs.execute(
            SQL("DELETE FROM {0}.{1} WHERE application_name = %s").format(
                Identifier(self.datastore.schema), Identifier(self.tracking_table_name)
            ),
            (self.application_name,),
        )


class _PostgresTransaction:
    def __init__(self, views: PostgresViews, curs: Cursor[DictRow]) -> None:
        self.views = views
        self.curs = curs

    def position(self) -> int | None:
        self.curs.execute(self.views._position, (self.views.application_name,))
        found = self.curs.fetchone()
        return None if found is None else found["notification_id"]

    def load_runs(self, run_ids: Collection[str]) -> dict[str, RunRow]:
        if not run_ids:
            return {}
        self.curs.execute(self.views._load_runs, (list(run_ids),))
        return {r["run_id"]: run_row(r, _utc_or_none) for r in self.curs.fetchall()}

    def load_steps(self, keys: Collection[StepKey]) -> dict[StepKey, StepRow]:
        if not keys:
            return {}
        self.curs.execute(self.views._load_steps, ([k[0] for k in keys], [k[1] for k in keys]))
        return {(r["run_id"], r["idx"]): step_row(r, _utc_or_none) for r in self.curs.fetchall()}

    def write(self, runs: Sequence[RunRow], steps: Sequence[StepRow], position: int) -> None:
        for statement, values in (
            (self.views._upsert_run, [run_values(r, as_utc) for r in runs]),
            (self.views._upsert_step, [step_values(s, as_utc) for s in steps]),
        ):
            if len(values) == 1:
                self.curs.execute(statement, values[0])
            elif values:
                self.curs.executemany(statement, values)
        # eventsourcing's tracking upsert: an IntegrityError if it would go backwards.
        insert_tracking(self.views, self.curs, Tracking(self.views.application_name, position))


class RunViewsProjection(Projection[PostgresViews]):
    """``eventsourcing`` projection of the run store into ``PostgresViews``.

    Its upstream is ``ViewSource``, whose events are ``Logged`` entries.
    """

    name = "RunViews"

    def process_event(self, domain_event: Any, tracking: Tracking) -> None:
        assert isinstance(domain_event, Logged)
        self.view.apply([domain_event], tracking.notification_id)


def _names(columns: Sequence[str]) -> Composed:
    return SQL(", ").join(Identifier(c) for c in columns)


def _slots(columns: Sequence[str]) -> Composed:
    return SQL(", ").join(SQL("%s") for _ in columns)


def _usage_share(r: DictRow) -> UsageShare:
    counts = (int(r[c]) for c in ("calls", "input_tokens", "output_tokens", "total_tokens"))
    return UsageShare(r["grp"], r["kind"], r["model"], *counts)


def _utc_or_none(value: datetime | None) -> datetime | None:
    return None if value is None else as_utc(value)
