"""``RunStore``: the runs of a deployment, in one event log or several (API).

A store is the ``eventsourcing`` application that holds runs (its first log,
``RunLog``), and, when partitioned, the router over every log it has:

- ``RunStore.postgres(dsn, partitions=K)`` keeps K logs in one database,
  each with its own tables, its own lock and its own notification log, so
  saves of runs of different logs never wait for each other. The database
  records its K (``kuralle_partitions``): ``RunStore.postgres(dsn)`` opens
  every log it has, a larger ``partitions=`` adds logs, a smaller one is
  refused.
- ``RunStore.sharded([url, ...])`` keeps one log per database, which may be
  on several servers; each database is one partition, numbered by its place
  in the list.

A run lives in one log for its whole life, and so do all the runs of its
session (the session's index of runs is saved with each of them, in one
transaction): a new session goes to the log its id hashes to, among the
logs the store has when it first appears; a session already stored stays
where it is, so adding a log never moves a run. Every call that names a run
or a session is routed to its log (looked up once, then remembered); the
views, the followers and the sweeps read every log (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from uuid import UUID

import psycopg
from eventsourcing.postgres import PostgresApplicationRecorder
from eventsourcing.utils import EnvType
from psycopg.sql import SQL, Identifier

from ..errors import InvalidArgumentError
from .leases import Lease, LeaseOp
from .log import RunLog, parse_run_id, postgres_env
from .run import Run
from .sessions import session_runs_id
from .urls import locate

__all__ = ["RunStore"]

#: What the store routes to a log: a run's aggregate id, or a session's id.
_Key = TypeVar("_Key", UUID, str)

#: The table of a partitioned database that records how many logs it has.
PARTITIONS_TABLE = "kuralle_partitions"


class RunStore(RunLog):
    """Holds runs (see the module docstring): the first log, and the router over all."""

    def __init__(self, env: EnvType | None = None, *, partitions: int | None = None) -> None:
        """A store over ``env`` (the ``eventsourcing`` environment); on PostgreSQL,
        every partition its database records, or ``partitions`` (see ``postgres``)."""
        if partitions is not None and (
            isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1
        ):
            msg = f"partitions must be a whole number, 1 or more, got {partitions!r}"
            raise InvalidArgumentError(msg)
        super().__init__(env=env)
        #: Every log of the store, by partition number (this one first).
        self.partitions: tuple[RunLog, ...] = (self,)
        self._runs: dict[UUID, RunLog] = {}
        self._sessions: dict[str, RunLog] = {}
        self._routing = threading.Lock()
        try:
            if isinstance(self.recorder, PostgresApplicationRecorder):
                count = _agree_partitions(self.env, partitions)
                self.partitions = (
                    self,
                    *(RunLog(env=self.env, partition=i, own_tables=True) for i in range(1, count)),
                )
            elif partitions not in (None, 1):
                msg = (
                    "partitions are logs of a PostgreSQL database: open the store with "
                    "RunStore.postgres(dsn, partitions=...), or leave partitions out"
                )
                raise InvalidArgumentError(msg)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ shortcuts
    @classmethod
    def memory(cls) -> RunStore:
        return cls(env={"PERSISTENCE_MODULE": "eventsourcing.popo"})

    @classmethod
    def sqlite(cls, path: str) -> RunStore:
        return cls(env={"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": path})

    @classmethod
    def postgres(
        cls, dsn_or_params: str | Mapping[str, Any], *, partitions: int | None = None
    ) -> RunStore:
        """A store in one PostgreSQL database; ``partitions`` (K logs) as the module's
        docstring says: None opens the logs the database has (one if it is new)."""
        return cls(env=postgres_env(dsn_or_params), partitions=partitions)

    @classmethod
    def sharded(cls, urls: Sequence[str]) -> RunStore:
        """A store of one log per database of ``urls`` (``postgresql://...``, which may
        be on several servers), partition i being ``urls[i]``."""
        if isinstance(urls, str) or not urls or not all(isinstance(u, str) for u in urls):
            msg = f"sharded takes a list of store URLs, got {urls!r}"
            raise InvalidArgumentError(msg)
        if len(set(urls)) != len(urls):
            msg = f"a sharded store lists each database once, got {list(urls)!r}"
            raise InvalidArgumentError(msg)
        places = [locate(url) for url in urls]
        for url, place in zip(urls, places, strict=True):
            if place.partitions is not None:
                msg = f"a shard is a database of one partition: leave ?partitions= out of {url!r}"
                raise InvalidArgumentError(msg)
            if place.env["PERSISTENCE_MODULE"] == "eventsourcing.popo":
                msg = f"a shard is a database: {url!r} is not one"
                raise InvalidArgumentError(msg)
        first = cls(env=places[0].env)
        opened: list[RunLog] = [first]
        try:
            if len(first.partitions) > 1:
                msg = (
                    f"{urls[0]!r} is a partitioned database ({len(first.partitions)} "
                    "partitions): a shard of a sharded store is a database of one"
                )
                raise InvalidArgumentError(msg)
            for i, place in enumerate(places[1:], start=1):
                opened.append(RunLog(env=place.env, partition=i))
        except BaseException:
            for log in opened:
                log.close()
            raise
        first.partitions = tuple(opened)
        return first

    # ------------------------------------------------------------- routing
    def _log_of_run(self, run_id: str) -> RunLog | None:
        """The log that holds the run, looked up once (each log asked in turn)."""
        aggregate_id = parse_run_id(run_id)
        if aggregate_id is None:
            return None
        known = self._known(self._runs, aggregate_id)
        if known is not None:
            return known
        return self._run_found(aggregate_id, self._holder(aggregate_id))

    async def _log_of_run_async(self, run_id: str) -> RunLog | None:
        """``_log_of_run`` for async code."""
        aggregate_id = parse_run_id(run_id)
        return None if aggregate_id is None else await self._log_of_id_async(aggregate_id)

    async def _log_of_id_async(self, aggregate_id: UUID) -> RunLog | None:
        """The log that holds the run with this aggregate id: every log asked at once,
        from the loop, the first time."""
        known = self._known(self._runs, aggregate_id)
        if known is not None:
            return known
        return self._run_found(aggregate_id, await self._holder_async(aggregate_id))

    def _run_found(self, run_id: UUID, log: RunLog | None) -> RunLog | None:
        if log is not None:
            self._remember(self._runs, run_id, log)
        return log

    def _holder(self, aggregate_id: UUID) -> RunLog | None:
        """The first log that holds an event of ``aggregate_id``, or None (each
        log asked in turn)."""
        return next((log for log in self.partitions if log.holds(aggregate_id)), None)

    async def _holder_async(self, aggregate_id: UUID) -> RunLog | None:
        """``_holder`` for async code: every log asked at once, from the loop."""
        held = await asyncio.gather(*(log.holds_async(aggregate_id) for log in self.partitions))
        return next((log for log, holds in zip(self.partitions, held, strict=True) if holds), None)

    def _known(self, routes: dict[_Key, RunLog], key: _Key) -> RunLog | None:
        """The log of ``key`` (a run's aggregate id in ``_runs``, a session's id in
        ``_sessions``) if it is known without asking a database."""
        if len(self.partitions) == 1:
            return self
        with self._routing:
            return routes.get(key)

    def _remember(self, routes: dict[_Key, RunLog], key: _Key, log: RunLog) -> None:
        with self._routing:
            routes[key] = log

    def _log_of_session(self, session_id: str) -> RunLog:
        """The log of the session's runs: where its index is, else where its id hashes."""
        known = self._known(self._sessions, session_id)
        if known is not None:
            return known
        return self._session_found(session_id, self._holder(session_runs_id(session_id)))

    async def _log_of_session_async(self, session_id: str) -> RunLog:
        """``_log_of_session`` for async code: every log asked at once, from the loop."""
        known = self._known(self._sessions, session_id)
        if known is not None:
            return known
        found = await self._holder_async(session_runs_id(session_id))
        return self._session_found(session_id, found)

    def _session_found(self, session_id: str, log: RunLog | None) -> RunLog:
        """Where a session's runs go: the log that holds its index, else (a new
        session) the log its id hashes to."""
        if log is not None:
            self._remember(self._sessions, session_id, log)
            return log
        digest = hashlib.sha256(session_id.encode("utf-8")).digest()
        return self.partitions[int.from_bytes(digest[:8], "big") % len(self.partitions)]

    def _log_of(self, run: Run) -> RunLog:
        log = self._log_of_run(run.run_id)
        return log if log is not None else self._log_of_session(run.session_id)

    # ---------------------------------------------------------------- runs
    def load(self, run_id: str) -> Run | None:
        """The run with this public id, or None if there is none."""
        log = self._log_of_run(run_id)
        return None if log is None else RunLog.load(log, run_id)

    def load_history(self, run_id: str) -> Run | None:
        """The run folded from all its events (see ``RunLog.load_history``)."""
        log = self._log_of_run(run_id)
        return None if log is None else RunLog.load_history(log, run_id)

    async def load_async(self, run_id: str, *, history: bool = False) -> Run | None:
        log = await self._log_of_run_async(run_id)
        return None if log is None else await RunLog.load_async(log, run_id, history=history)

    def create_run(self, run: Run, lease: LeaseOp | None = None) -> None:
        """Save a new run in its session's log, with its entry in the session's index."""
        log = self._log_of_session(run.session_id)
        RunLog.create_run(log, run, lease)
        self._created_in(run, log)

    async def create_run_async(self, run: Run, lease: LeaseOp | None = None) -> None:
        """``create_run`` for async code, without blocking the event loop."""
        log = await self._log_of_session_async(run.session_id)
        await RunLog.create_run_async(log, run, lease)
        self._created_in(run, log)

    def _created_in(self, run: Run, log: RunLog) -> None:
        """Route the new run, and its session, to ``log`` from now on."""
        if log is not self:
            self._remember(self._runs, run.id, log)
            self._remember(self._sessions, run.session_id, log)

    def session_run_ids(self, session_id: str) -> list[str]:
        return RunLog.session_run_ids(self._log_of_session(session_id), session_id)

    def save_run(self, run: Run, lease: LeaseOp | None = None) -> None:
        RunLog.save_run(self._log_of(run), run, lease)

    async def save_run_async(self, run: Run, lease: LeaseOp | None = None) -> None:
        log = await self._log_of_id_async(run.id)
        if log is None:
            log = await self._log_of_session_async(run.session_id)
        await RunLog.save_run_async(log, run, lease)

    def stored_events(self, run_id: str) -> list[Any]:
        log = self._log_of_run(run_id)
        return [] if log is None else RunLog.stored_events(log, run_id)

    def run_events(self, run_id: str) -> list[Any]:
        log = self._log_of_run(run_id)
        return [] if log is None else RunLog.run_events(log, run_id)

    def partition_of(self, run_id: str) -> int | None:
        """The number of the partition that holds the run (None: no such run)."""
        log = self._log_of_run(run_id)
        return None if log is None else log.partition

    # --------------------------------------------------------------- leases
    def lease(self, run_id: str) -> Lease | None:
        log = self._log_of_run(run_id)
        return None if log is None else RunLog.lease(log, run_id)

    async def lease_async(self, run_id: str) -> Lease | None:
        log = await self._log_of_run_async(run_id)
        return None if log is None else await RunLog.lease_async(log, run_id)

    def close(self) -> None:
        for log in self.partitions[1:]:
            log.close()
        RunLog.close(self)


def _agree_partitions(env: Mapping[str, str], wanted: int | None) -> int:
    """The number of logs of the database: the one it records, raised to ``wanted``
    (recorded, in one transaction under a lock); a smaller ``wanted`` is refused."""
    connect: Callable[[], psycopg.Connection[Any]] = lambda: psycopg.connect(  # noqa: E731
        host=env.get("POSTGRES_HOST"),
        port=env.get("POSTGRES_PORT") or "5432",
        dbname=env.get("POSTGRES_DBNAME"),
        user=env.get("POSTGRES_USER"),
        password=env.get("POSTGRES_PASSWORD") or None,
        connect_timeout=5,
    )
    table = Identifier(PARTITIONS_TABLE)
    with connect() as conn, conn.transaction():
        # The lock first: two stores opened at the same instant on a new database
        # would otherwise both create the table, and one fail on a duplicate
        # catalog key (CREATE TABLE IF NOT EXISTS is not safe against a race).
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('kuralle_partitions'))")
        conn.execute(
            SQL(
                "CREATE TABLE IF NOT EXISTS {} (store text PRIMARY KEY, count int NOT NULL)"
            ).format(table)
        )
        row = conn.execute(
            SQL("SELECT count FROM {} WHERE store = 'RunStore'").format(table)
        ).fetchone()
        recorded = int(row[0]) if row is not None else 1
        if wanted is None:
            return recorded
        if wanted < recorded:
            msg = (
                f"the database has {recorded} partitions and a store never drops one: open "
                f"it with partitions={recorded} (or more), or leave partitions= out"
            )
            raise InvalidArgumentError(msg)
        if wanted != recorded or row is None:
            conn.execute(
                SQL(
                    "INSERT INTO {} (store, count) VALUES ('RunStore', %s) "
                    "ON CONFLICT (store) DO UPDATE SET count = EXCLUDED.count"
                ).format(table),
                (wanted,),
            )
        return wanted
