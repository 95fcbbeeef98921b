"""``RunStore``: the runs of a deployment, in one event log or several (API).

A store is made of its logs (``RunLog``, each an ``eventsourcing``
application: one partition) and a router (``routing``) that says which log
holds a run or a session. Where it is comes from one parsed address
(``store_url``): ``RunStore.from_url(url)``, the shortcuts, or the
``eventsourcing`` variables of ``RunStore(env)``.

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
session; every call that names a run or a session is routed to its log
(looked up once, then remembered); the views, the followers and the sweeps
read every log (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from eventsourcing.persistence import ApplicationRecorder, EventStore, Mapper
from eventsourcing.utils import Environment, EnvType
from psycopg.sql import SQL, Identifier

from ..errors import InvalidArgumentError
from .encryption import cipher_env, cipher_of
from .leases import Lease, LeaseOp
from .log import KEY_STORE_ENV, RunLog
from .pg_pool import PgConnections
from .pruning import delete_runs
from .routing import Router
from .run import Run
from .store_url import (
    MemoryAddress,
    PostgresAddress,
    ShardedAddress,
    SqliteAddress,
    address_from_env,
    parse_store_url,
    postgres_address,
    redact,
    shards_of,
)
from .stream_log import StreamLog, StreamSealing, stream_log_for
from .subject_keys import KeyTable, PostgresKeyTable, key_table_at

__all__ = ["RunStore"]

#: The table of a partitioned database that records how many logs it has.
PARTITIONS_TABLE = "kuralle_partitions"


class RunStore:
    """Holds runs (see the module docstring): its logs, one per partition, and the
    router that says which of them holds a run or a session."""

    def __init__(
        self,
        env: EnvType | None = None,
        *,
        partitions: int | None = None,
        cipher_key: str | None = None,
        key_store: str | None = None,
    ) -> None:
        """A store over ``env`` (the ``eventsourcing`` environment, over the process's);
        on PostgreSQL, every partition its database records, or ``partitions`` (see
        ``postgres``). ``cipher_key`` (else ``KURALLE_CIPHER_KEY``) encrypts what it
        stores; ``key_store`` (a store URL; else ``KURALLE_KEY_STORE``, else this
        database) is where the subjects' keys live (docs/privacy.md).
        ``EncryptionKeyError`` when the store was written with another key."""
        env = _with_privacy(env, cipher_key, key_store)
        address = address_from_env(env)
        if partitions is not None:
            if not isinstance(address, PostgresAddress):
                if partitions != 1 or isinstance(partitions, bool):
                    msg = (
                        "partitions are logs of a PostgreSQL database: open the store with "
                        "RunStore.postgres(dsn, partitions=...), or leave partitions out"
                    )
                    raise InvalidArgumentError(msg)
            else:
                address = replace(address, partitions=postgres_address(
                    address.params, partitions=partitions, env_pooler=False
                ).partitions)  # fmt: skip
        base = {**(env or {}), **(address.env() if address is not None else {})}
        keys = _key_table(base, address)
        self._use(_open_database(address, base, keys))

    def _use(self, logs: Sequence[RunLog]) -> None:
        #: Every log of the store, by partition number.
        self.partitions: tuple[RunLog, ...] = tuple(logs)
        self._router = Router(self.partitions)
        #: Each partition's stored streams (``stream_log``), made on first use.
        self._streams: dict[int, StreamLog] = {}
        self._streams_guard = threading.Lock()

    def __repr__(self) -> str:
        labels = dict.fromkeys(str(log.address and log.address.label()) for log in self.partitions)
        return f"<{type(self).__name__} {','.join(labels)} ({len(self.partitions)} partitions)>"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------ shortcuts
    @classmethod
    def memory(cls, *, cipher_key: str | None = None, key_store: str | None = None) -> Self:
        """A store in this process's memory (``cipher_key``, ``key_store``: see ``__init__``)."""
        return cls(env=MemoryAddress().env(), cipher_key=cipher_key, key_store=key_store)

    @classmethod
    def sqlite(
        cls, path: str, *, cipher_key: str | None = None, key_store: str | None = None
    ) -> Self:
        """A store in the SQLite file ``path`` (``cipher_key``, ``key_store``: see ``__init__``)."""
        return cls(env=SqliteAddress(Path(path)).env(), cipher_key=cipher_key, key_store=key_store)

    @classmethod
    def postgres(
        cls,
        dsn_or_params: str | Mapping[str, Any],
        *,
        partitions: int | None = None,
        pooler: str | None = None,
        cipher_key: str | None = None,
        key_store: str | None = None,
        pool_size: int | None = None,
    ) -> Self:
        """A store in one PostgreSQL database (a URL, several hosts allowed, a conninfo
        string or a mapping of libpq parameters); ``partitions`` (K logs) as the
        module's docstring says: None opens the logs the database has (one if it is
        new); ``pool_size`` (default 10, or the URL's ``?pool_size=``) the most
        connections the store holds, whatever K; ``pooler="transaction"`` when
        PgBouncer in transaction mode is in front (else the URL's ``?pooler=``, else
        ``KURALLE_POSTGRES_POOLER``: docs/high-availability.md);
        ``cipher_key`` and ``key_store`` as ``__init__`` says."""
        address = postgres_address(
            dsn_or_params, partitions=partitions, pooler=pooler, pool_size=pool_size
        )
        return cls(
            env=address.env(),
            partitions=address.partitions,
            cipher_key=cipher_key,
            key_store=key_store,
        )

    @classmethod
    def sharded(
        cls, urls: Sequence[str], *, cipher_key: str | None = None, key_store: str | None = None
    ) -> Self:
        """A store of one log per database of ``urls`` (``postgresql://...``, which may
        be on several servers), partition i being ``urls[i]``; one key table for all
        (``key_store``, else the first database's)."""
        if isinstance(urls, str) or not urls or not all(isinstance(u, str) for u in urls):
            what = repr(redact(urls)) if isinstance(urls, str) else type(urls).__name__
            msg = f"sharded takes a list of store URLs, got {what}"
            raise InvalidArgumentError(msg)
        return cls._over_shards(shards_of(urls), cipher_key, key_store)

    @classmethod
    def from_url(
        cls, url: str, *, cipher_key: str | None = None, key_store: str | None = None
    ) -> Self:
        """The store ``url`` names: ``memory:``, ``sqlite:///relative.db``,
        ``sqlite:////absolute.db``, ``postgresql://user[:pw]@host[:port][,host2...]/db``
        (``?partitions=K``, ``?pooler=``, libpq parameters), or several URLs separated
        by commas for a sharded store. ``InvalidArgumentError`` for anything else;
        ``StoreUnavailableError`` within seconds when a server cannot be reached."""
        address = parse_store_url(url)
        if isinstance(address, ShardedAddress):
            return cls._over_shards(address, cipher_key, key_store)
        partitions = address.partitions if isinstance(address, PostgresAddress) else None
        return cls(
            env=address.env(), partitions=partitions, cipher_key=cipher_key, key_store=key_store
        )

    @classmethod
    def _over_shards(
        cls, address: ShardedAddress, cipher_key: str | None, key_store: str | None
    ) -> Self:
        """A store whose partition i is the database of ``address.shards[i]``. Made
        without ``__init__``, which opens one database."""
        privacy = _with_privacy({}, cipher_key, key_store)
        keys = _key_table(privacy, address.shards[0])
        logs: list[RunLog] = []
        try:
            for i, shard in enumerate(address.shards):
                if isinstance(shard, PostgresAddress) and _agree_partitions(shard) > 1:
                    msg = (
                        f"{shard.label()!r} is a partitioned database: a shard of a sharded "
                        "store is a database of one"
                    )
                    raise InvalidArgumentError(msg)
                logs.append(RunLog(env={**privacy, **shard.env()}, partition=i, keys=keys))
        except BaseException:
            _close(logs)
            raise
        store = cls.__new__(cls)
        store._use(logs)
        return store

    # ------------------------------------------------- the first log's parts
    # A store of one partition reads like the eventsourcing application it is;
    # a partitioned store's other logs are ``partitions``.
    @property
    def recorder(self) -> ApplicationRecorder:
        """The first partition's recorder (``max_notification_id``, ...)."""
        return self.partitions[0].recorder

    @property
    def events(self) -> EventStore[Any]:
        return self.partitions[0].events

    @property
    def snapshots(self) -> EventStore[Any] | None:
        return self.partitions[0].snapshots

    @property
    def mapper(self) -> Mapper[Any]:
        return self.partitions[0].mapper

    @property
    def saves_block(self) -> bool:
        """Whether a save waits on I/O (SQLite, Postgres) and so belongs off the loop."""
        return self.partitions[0].saves_block

    # ---------------------------------------------------------------- runs
    def load(self, run_id: str) -> Run | None:
        """The run with this public id, or None if there is none."""
        log = self._router.of_run(run_id)
        return None if log is None else log.load(run_id)

    def load_history(self, run_id: str) -> Run | None:
        """The run folded from all its events (see ``RunLog.load_history``)."""
        log = self._router.of_run(run_id)
        return None if log is None else log.load_history(run_id)

    async def load_async(self, run_id: str, *, history: bool = False) -> Run | None:
        log = await self._router.of_run_async(run_id)
        return None if log is None else await log.load_async(run_id, history=history)

    def create_run(self, run: Run, lease: LeaseOp | None = None) -> None:
        """Save a new run in its session's log, with its entry in the session's index."""
        log = self._router.of_session(run.session_id)
        log.create_run(run, lease)
        self._router.created(run, log)

    async def create_run_async(self, run: Run, lease: LeaseOp | None = None) -> None:
        """``create_run`` for async code, without blocking the event loop."""
        log = await self._router.of_session_async(run.session_id)
        await log.create_run_async(run, lease)
        self._router.created(run, log)

    def session_run_ids(self, session_id: str) -> list[str]:
        return self._router.of_session(session_id).session_run_ids(session_id)

    def save_run(self, run: Run, lease: LeaseOp | None = None) -> None:
        self._router.of(run).save_run(run, lease)

    async def save_run_async(self, run: Run, lease: LeaseOp | None = None) -> None:
        log = await self._router.of_async(run)
        await log.save_run_async(run, lease)

    def stored_events(self, run_id: str) -> list[Any]:
        log = self._router.of_run(run_id)
        return [] if log is None else log.stored_events(run_id)

    def run_events(self, run_id: str) -> list[Any]:
        log = self._router.of_run(run_id)
        return [] if log is None else log.run_events(run_id)

    async def run_events_async(self, run_id: str, after: int | None = None) -> list[Any]:
        """The run's events after version ``after`` (all of them for None), oldest first."""
        log = await self._router.of_run_async(run_id)
        return [] if log is None else await log.run_events_async(run_id, after)

    def partition_of(self, run_id: str) -> int | None:
        """The number of the partition that holds the run (None: no such run)."""
        log = self._router.of_run(run_id)
        return None if log is None else log.partition

    # -------------------------------------------------------------- privacy
    @property
    def keys(self) -> KeyTable:
        """The subjects' key table (docs/privacy.md)."""
        keys = self.partitions[0].keys
        assert keys is not None, "a run log has its key table once it is open"
        return keys

    def erase_keys(self, subject: str) -> bool:
        """Destroy the subject's data key; whether it had one."""
        return self.keys.erase(subject)

    def delete_runs(self, run_ids: Sequence[str]) -> int:
        """Delete these ended runs' events, snapshots and lease records, each run in its
        own log (``prune``); how many events went."""
        by_log: dict[int, list[str]] = {}
        for run_id in run_ids:
            log = self._router.of_run(run_id)
            if log is not None:
                by_log.setdefault(log.partition, []).append(run_id)
        deleted = 0
        for partition, ids in by_log.items():
            deleted += delete_runs(self.partitions[partition], ids)
            self.stream_log(partition).delete(ids)
        return deleted

    # --------------------------------------------------------------- leases
    def lease(self, run_id: str) -> Lease | None:
        log = self._router.of_run(run_id)
        return None if log is None else log.lease(run_id)

    async def lease_async(self, run_id: str) -> Lease | None:
        log = await self._router.of_run_async(run_id)
        return None if log is None else await log.lease_async(run_id)

    # -------------------------------------------------------------- streams
    def stream_log(self, partition: int = 0) -> StreamLog:
        """The stored streams of a partition's runs (docs/streaming.md)."""
        with self._streams_guard:
            log = self._streams.get(partition)
            if log is None:
                run_log = self.partitions[partition]
                log = self._streams[partition] = stream_log_for(run_log.recorder, run_log.address)
                log.sealing = StreamSealing(run_log.mapper.transcoder, self.keys)
            return log

    async def stream_log_async(self, run_id: str) -> StreamLog | None:
        """The stored streams of the run's partition (None: no such run)."""
        log = await self._router.of_run_async(run_id)
        if log is None:
            return None
        with self._streams_guard:
            made = self._streams.get(log.partition)
        if made is not None:
            return made
        if log.saves_block:  # its table is set up on first use
            return await asyncio.to_thread(self.stream_log, log.partition)
        return self.stream_log(log.partition)

    def close(self) -> None:
        with self._streams_guard:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:  # what they still hold queued goes first
            stream.close()
        _close(self.partitions)
        keys = self.partitions[0].keys if self.partitions else None
        if keys is not None:
            keys.close()


def _close(logs: Iterable[RunLog]) -> None:
    """Close the logs, then the connections they share (one pool per database)."""
    logs = list(logs)
    for log in logs:
        log.close()
    shared = {id(log.connections): log.connections for log in logs if not log.owns_connections}
    for connections in shared.values():
        if connections is not None:
            connections.close()


def _with_privacy(
    env: EnvType | None, cipher_key: str | None, key_store: str | None
) -> dict[str, str]:
    """``env`` with the store's cipher key and key table's place, when given."""
    out = dict(env or {})
    if cipher_key is not None:
        out.update(cipher_env(out, cipher_key))
    if key_store is not None:
        parse_store_url(key_store)  # a bad URL is refused before anything opens
        out[KEY_STORE_ENV] = key_store
    return out


def _key_table(
    env: Mapping[str, str], address: MemoryAddress | SqliteAddress | PostgresAddress | None
) -> KeyTable:
    """The store's one key table: where ``KURALLE_KEY_STORE`` says, else in the
    store's (first) database; its keys encrypted with the store's cipher, if any."""
    environment = Environment("RunStore", {**os.environ, **env})
    where = environment.get(KEY_STORE_ENV) or address
    ciphered = {**env, **cipher_env(env)} if not env.get("CIPHER_TOPIC") else dict(env)
    return key_table_at(where, cipher_of(Environment("RunStore", ciphered)))


def _open_database(
    address: MemoryAddress | SqliteAddress | PostgresAddress | None, env: EnvType, keys: KeyTable
) -> list[RunLog]:
    """The logs of one database: on PostgreSQL, as many as it records (or as the
    address asks, which it then records); elsewhere one."""
    count = _agree_partitions(address) if isinstance(address, PostgresAddress) else 1
    # One pool for all the database's logs (``pg_pool``).
    connections = PgConnections(address) if isinstance(address, PostgresAddress) else None
    logs: list[RunLog] = []
    try:
        for i in range(count):
            logs.append(
                RunLog(env=env, partition=i, own_tables=i > 0, keys=keys, connections=connections)
            )
    except BaseException:
        _close(logs)
        if connections is not None:
            connections.close()
        raise
    if (
        isinstance(keys, PostgresKeyTable)
        and keys.address == address
        and connections is not None
        and connections.datastore is not None
    ):
        keys.share(connections.datastore)  # the key table adds no connection of its own
    return logs


def _agree_partitions(address: PostgresAddress) -> int:
    """The number of logs of the database: the one it records, raised to the
    address's ``partitions`` (recorded, in one transaction under a lock); a smaller
    one is refused. Its connection is the store's first: a server that is away is a
    ``StoreUnavailableError`` in seconds, not a pool retrying for thirty."""
    wanted = address.partitions
    table = Identifier(PARTITIONS_TABLE)
    with address.connect() as conn, conn.transaction():
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
