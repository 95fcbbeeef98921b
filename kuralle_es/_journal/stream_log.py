"""A store's stored streams: the parts each run's turns sent, by offset, beside the
journal and never in it (internal; docs/streaming.md).

A run's stream is what its turns sent their consumers (text deltas, retracts,
tool calls, custom parts, the turn's end), each part at an offset that
counts from 1 per run. It is not the run's history: the journal is, and a
model step's journaled response stays the source of truth. So the stream has
a table of its own (``kuralle_stream``, in the database of the run's
partition), and is written the cheap way:

- **in batches.** ``add`` only queues a part; one writer task per log sends
  what every run queued in one transaction (a group commit across runs), at
  once after a quiet spell, then at most every ``SPACING`` seconds while
  parts keep coming. A streaming run therefore costs at most 20 saves a
  second, whatever the model's delta rate, and none of them touches the
  events table or its lock. ``close`` writes what is still queued.
- **woken, not polled, where it can be.** After each write the followers of
  the written runs in this process are woken at once; on PostgreSQL the
  write's ``pg_notify`` (payload: the run id) wakes those of other processes;
  SQLite followers in other processes look again every ``SQLITE_POLL``. Behind a
  transaction pooler a LISTEN would be lost with its server session: the log
  listens on the direct server the address names (``listen_host``), else its
  followers look again every ``POOLED_POLL`` (docs/high-availability.md).
- **without waiting for the disk** on PostgreSQL (``synchronous_commit`` off
  for the stream's own transactions): a database crash may lose the stream's
  last fraction of a second, never a journaled step.

Offsets are given by the turn that holds the run's lease (one writer a run);
a row whose offset is taken already (a writer whose lease was taken over) is
dropped, never written twice.

A part's JSON is a payload of its run like any other: it is stored sealed under
the run's data subject's key (``StreamSealing``, the journal's own sealing), so
the table holds no plaintext, and once the subject is erased its parts read
back with their payload gone (docs/privacy.md). A part carries the key its
turn took when it opened the stream (``key_for_async``), not its subject: a
part still queued when its subject is erased is written under the erased key,
never under a fresh one that would read it back. A pruned run's parts are
deleted with it (``delete``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from eventsourcing.persistence import PersistenceError, Transcoder
from eventsourcing.postgres import PostgresDatastore
from eventsourcing.sqlite import SQLiteDatastore
from psycopg.sql import SQL, Composed, Identifier

from ..redaction import Redacted
from .sealing import SEALED_KEY, SealedAsList, open_payload, seal_payload, sealed_json
from .store_url import PostgresAddress
from .subject_keys import KeyTable, SubjectKey

__all__ = [
    "SPACING",
    "MemoryStreamLog",
    "PostgresStreamLog",
    "SqliteStreamLog",
    "StoredPart",
    "StreamLog",
    "StreamSealing",
    "stream_log_for",
]

_log = logging.getLogger("kuralle.stream")

#: Seconds between two writes of a log while parts keep coming (at most 20 a second).
SPACING = 0.05
#: Seconds between two reads of a SQLite follower that nothing woke (another process writes).
SQLITE_POLL = 0.05
#: Seconds a woken-only follower waits before it looks again anyway (a lost notification).
SAFETY_POLL = 1.0
#: Seconds between two reads of a follower behind a transaction pooler that names no
#: server to LISTEN on (other processes' writes cannot wake it): ``follow``'s interval.
POOLED_POLL = 0.1
#: Writes of one batch tried before its parts are given up (the journal stands).
WRITE_ATTEMPTS = 5
#: Runs whose saves a log counts (the latest: a long-lived process forgets the rest).
COUNTED_RUNS = 10_000
#: The table every backend keeps its streams in, and PostgreSQL's notify channel.
TABLE = "kuralle_stream"
CHANNEL = "kuralle_stream"


@dataclass(frozen=True)
class StoredPart:
    """One part of a run's stored stream: its offset, what it is (``type``, and
    for a model step's parts its ``step`` and ``attempt``) and its JSON. A part
    that ends a turn has the run's ``version`` as that turn left it, so a reader
    knows whether a later turn's parts are still to come."""

    run_id: str
    offset: int
    type: str
    step: int | None
    attempt: int | None
    body: str
    version: int | None = None
    #: The key of the run's data subject as the turn took it: the body is sealed
    #: under it when it is written. Not stored.
    key: SubjectKey | None = None

    def row(self) -> tuple[str, int, str, int | None, int | None, str, int | None]:
        return (
            self.run_id, self.offset, self.type, self.step, self.attempt, self.body, self.version,
        )  # fmt: skip


def _part(row: Sequence[Any], run_id: str) -> StoredPart:
    offset, kind, step, attempt, body, version = row
    return StoredPart(run_id, int(offset), str(kind), step, attempt, str(body), version)


#: How a sealed part's JSON begins (``sealed_json``'s form, as the view rows keep it).
_SEALED_PREFIX = '{"' + SEALED_KEY + '"'


@dataclass(frozen=True)
class StreamSealing:
    """Parts sealed under their run's subject's key as they are written, and opened
    as they are read back: the store's transcoder and key table, the same sealing
    as the journal's payloads (``sealing``)."""

    transcoder: Transcoder
    keys: KeyTable

    def seal(self, part: StoredPart) -> StoredPart:
        if part.key is None:
            return part
        sealed = seal_payload(self.transcoder, part.key, part.body)
        return dataclasses.replace(part, body=json.dumps(sealed_json(sealed)))

    def open(self, part: StoredPart) -> StoredPart:
        """The part as it was sent; of an erased subject, its type and position only."""
        if not part.body.startswith(_SEALED_PREFIX):
            return part  # a part with no subject to seal it under
        sealed = SealedAsList().decode(json.loads(part.body)[SEALED_KEY])
        plain = open_payload(self.transcoder, self.keys, sealed)
        if isinstance(plain, Redacted):
            kept = {"type": part.type, "step": part.step, "attempt": part.attempt}
            kept["offset"] = part.offset
            body = json.dumps({k: v for k, v in kept.items() if v is not None})
        else:
            body = str(plain)
        return dataclasses.replace(part, body=body)


class _Follower:
    """A follower of one run in this process: the event that wakes it, on its loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.woken = asyncio.Event()

    def wake(self) -> None:
        if self.loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.woken.set()
        else:
            self.loop.call_soon_threadsafe(self.woken.set)


class StreamLog(ABC):
    """The stored streams of one partition: parts queued and written in batches,
    read back by offset, and the followers woken when a run's stream grows.

    The public methods own the batching, the retries and the wake-ups; a backend
    gives the narrow hooks (``_insert``, ``_select``, ...)."""

    #: Seconds a follower waits for a wake-up before it reads again anyway.
    poll_interval = SAFETY_POLL
    #: Whether a read or write waits on I/O (and so runs on a worker thread).
    blocking = True

    def __init__(self) -> None:
        self._guard = threading.Lock()
        #: Seals parts as they are written and opens them as they are read (the
        #: store sets it: ``RunStore.stream_log``); None keeps them as sent.
        self.sealing: StreamSealing | None = None
        self._queued: list[StoredPart] = []
        #: The batch being written (neither queued nor readable meanwhile).
        self._writing: list[StoredPart] = []
        self._writer: asyncio.Task[None] | None = None
        self._last_write = 0.0
        #: The last offset this process gave each run (queued parts are not read back).
        self._given: dict[str, int] = {}
        self._followers: dict[str, set[_Follower]] = collections.defaultdict(set)
        self._closed = False
        #: Held by every write, on whatever thread: ``close`` waits for the write in
        #: flight before the store closes the connections it uses (closing a SQLite
        #: connection under a write on another thread crashes the process).
        self._write_lock = threading.Lock()
        self._shut = False
        #: Writes that carried each run's parts, for the latest ``COUNTED_RUNS`` runs
        #: (the figure ``benchmarks/streaming.py`` shows).
        self.saves: collections.Counter[str] = collections.Counter()
        #: Writes made, each a transaction that may carry several runs' parts.
        self.writes = 0

    # ----------------------------------------------------------- writing
    def add(self, part: StoredPart) -> None:
        """Queue ``part``; it is written with the next batch (from the running loop)."""
        with self._guard:
            if self._closed:
                return
            self._queued.append(part)
            self._given[part.run_id] = max(part.offset, self._given.get(part.run_id, 0))
            writer = self._writer
            if writer is not None and not writer.get_loop().is_closed():
                return
            self._writer = asyncio.get_running_loop().create_task(self._write_batches())

    async def key_for_async(self, subject: str) -> SubjectKey | None:
        """The key a turn seals its parts under: the subject's, read off the loop
        when it is not at hand and the log waits on a database; None when parts
        are not sealed."""
        sealing = self.sealing
        if sealing is None:
            return None
        keys = sealing.keys
        if self.blocking and not keys.has_cached(subject):
            return await asyncio.to_thread(keys.key_for, subject)
        return keys.key_for(subject)

    def given(self, run_id: str) -> int:
        """The last offset this process gave the run's parts (0: none)."""
        with self._guard:
            return self._given.get(run_id, 0)

    async def _write_batches(self) -> None:
        """Write what is queued, a batch at a time, ``SPACING`` apart, until none is
        left. Cancelled (its loop is ending: ``asyncio.run`` returned), it writes
        what is queued there and then, so a program's last turn keeps its end."""
        try:
            await self._batches()
        except asyncio.CancelledError:
            self.flush()
            raise

    async def _batches(self) -> None:
        failures = 0
        while True:
            wait = self._last_write + SPACING - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            with self._guard:
                batch, self._queued = self._queued, []
                if not batch:
                    self._writer = None
                    return
                self._writing = batch
            try:
                await self._write_async(batch)
            except (PersistenceError, psycopg.Error, OSError) as error:
                failures += 1
                self._last_write = time.monotonic()
                with self._guard:
                    self._writing = []
                    if failures < WRITE_ATTEMPTS and not self._closed:
                        self._queued[:0] = batch
                        continue
                _log.warning("stream parts of %d runs not stored: %s", _runs(batch), error)
                failures = 0
                continue
            with self._guard:
                self._writing = []
            failures = 0
            self._last_write = time.monotonic()

    async def _write_async(self, batch: list[StoredPart]) -> None:
        if self.blocking:
            await asyncio.to_thread(self._write, batch)
        else:
            self._write(batch)

    def _write(self, batch: list[StoredPart]) -> None:
        """One transaction of ``batch`` (several runs' parts), then the wake-ups."""
        with self._write_lock:
            if self._shut:
                return  # the store is closing: its connections are going
            # Read under the lock: a delete meanwhile took its runs' parts out.
            runs = list(dict.fromkeys(part.run_id for part in batch))
            if not batch:
                return
            self._insert_sealed(batch, runs)
        self.writes += 1
        self.saves.update(runs)
        with self._guard:
            # A run none of whose parts waits any more reads its offsets back.
            waiting = {part.run_id for part in self._queued}
            for run in runs:
                if run not in waiting:
                    self._given.pop(run, None)
            while len(self.saves) > COUNTED_RUNS:
                del self.saves[next(iter(self.saves))]
        self._wake(runs)

    def _insert_sealed(self, batch: list[StoredPart], runs: list[str]) -> None:
        sealing = self.sealing
        self._insert([sealing.seal(p) for p in batch] if sealing else batch, runs)

    def flush(self) -> None:
        """Write what is queued now, on this thread (the writer task is cancelled: its
        loop is ending)."""
        with self._guard:
            batch, self._queued = self._queued, []
        if batch:
            with contextlib.suppress(PersistenceError, psycopg.Error, OSError):
                self._write(batch)

    # ----------------------------------------------------------- reading
    async def read(self, run_id: str, after: int, limit: int) -> list[StoredPart]:
        """The run's stored parts after offset ``after``, oldest first, at most ``limit``."""
        parts: list[StoredPart] = await self._call(self._opened, self._select, run_id, after, limit)
        return parts

    async def last_offset(self, run_id: str) -> int:
        """The run's last offset, stored or given by this process (0: none)."""
        # What this process gave first: once it is written (and forgotten here),
        # the read after it finds it stored.
        given = self.given(run_id)
        stored: int = await self._call(self._select_last, run_id)
        return max(stored, given)

    async def step_parts(self, run_id: str, step: int) -> list[StoredPart]:
        """The stored deltas and retracts of model step ``step``, oldest first,
        with those this process has not written yet."""
        with self._guard:  # before the read: a batch written meanwhile is then read
            unwritten = [*self._writing, *self._queued]
        stored: list[StoredPart] = await self._call(self._opened, self._select_step, run_id, step)
        seen = {part.offset for part in stored}
        queued = [
            p for p in unwritten if p.run_id == run_id and p.step == step and p.offset not in seen
        ]
        return sorted([*stored, *queued], key=lambda part: part.offset)

    def _opened(self, select: Callable[..., list[StoredPart]], *args: Any) -> list[StoredPart]:
        """What ``select`` read, opened (on the reading thread: a key may be read)."""
        parts = select(*args)
        sealing = self.sealing
        return [sealing.open(part) for part in parts] if sealing else parts

    def delete(self, run_ids: Sequence[str]) -> None:
        """Delete the runs' stored parts (pruned runs: ``RunStore.delete_runs``), and
        those not written yet (a turn's last parts, still queued when it ended):
        written after the delete, they would outlive their run, and a run that
        takes its id again (a session's conversation) would find them at its
        offsets."""
        gone = set(run_ids)
        if not gone:
            return
        with self._write_lock:
            with self._guard:
                self._queued = [p for p in self._queued if p.run_id not in gone]
                # The batch taken for writing, in place: its write waits for this lock.
                self._writing[:] = [p for p in self._writing if p.run_id not in gone]
                for run_id in gone:
                    self._given.pop(run_id, None)
            self._delete(list(gone))

    async def _call(self, hook: Any, *args: Any) -> Any:
        if self.blocking:
            return await asyncio.to_thread(hook, *args)
        return hook(*args)

    # ----------------------------------------------------------- waking
    @contextlib.asynccontextmanager
    async def following(self, run_id: str) -> AsyncIterator[_Follower]:
        """Register a follower of the run on this loop while the block runs; its
        ``woken`` event is set when the run's stream may have grown."""
        follower = _Follower()
        with self._guard:
            self._followers[run_id].add(follower)
        try:
            await self._listen(follower.loop)
            yield follower
        finally:
            with self._guard:
                followers = self._followers.get(run_id)
                if followers is not None:
                    followers.discard(follower)
                    if not followers:
                        del self._followers[run_id]
            await self._unlisten(follower.loop)

    async def wait(self, follower: _Follower) -> None:
        """Until the follower is woken, or ``poll_interval`` passed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(follower.woken.wait(), self.poll_interval)
        follower.woken.clear()

    def _wake(self, runs: Iterable[str]) -> None:
        with self._guard:
            woken = [f for run in runs for f in self._followers.get(run, ())]
        for follower in woken:
            follower.wake()

    async def _listen(self, loop: asyncio.AbstractEventLoop) -> None:  # noqa: B027
        """Hook: start hearing other processes' writes on ``loop`` (PostgreSQL)."""

    async def _unlisten(self, loop: asyncio.AbstractEventLoop) -> None:  # noqa: B027
        """Hook: stop hearing them once the loop has no follower left."""

    def close(self) -> None:
        """Write what is queued and the batch in flight, then let go of the log's
        connections (once the write in flight on another thread, if any, is done).

        The batch in flight is written here too: its writer task may not have
        reached its write yet, and would find the log shut (a part already
        stored is skipped, so one written by both is stored once)."""
        with self._guard:
            self._closed = True
            writer, self._writer = self._writer, None
        with self._write_lock:
            with self._guard:
                batch, self._queued = [*self._writing, *self._queued], []
            if batch:
                runs = list(dict.fromkeys(part.run_id for part in batch))
                try:
                    self._insert_sealed(batch, runs)
                except (PersistenceError, psycopg.Error, OSError) as error:
                    _log.warning("stream parts of %d runs not stored: %s", len(runs), error)
                else:
                    self._wake(runs)
            self._shut = True
        if writer is not None and not writer.get_loop().is_closed():
            writer.get_loop().call_soon_threadsafe(writer.cancel)

    # ----------------------------------------------------------- hooks
    @abstractmethod
    def _insert(self, batch: list[StoredPart], runs: list[str]) -> None:
        """Store ``batch`` in one transaction (an offset stored already: skip that part)."""

    @abstractmethod
    def _delete(self, run_ids: list[str]) -> None: ...

    @abstractmethod
    def _select(self, run_id: str, after: int, limit: int) -> list[StoredPart]: ...

    @abstractmethod
    def _select_last(self, run_id: str) -> int: ...

    @abstractmethod
    def _select_step(self, run_id: str, step: int) -> list[StoredPart]: ...


def _runs(batch: Iterable[StoredPart]) -> int:
    return len({part.run_id for part in batch})


# ------------------------------------------------------------------ memory
class MemoryStreamLog(StreamLog):
    """Streams in this process's memory (a memory store's)."""

    blocking = False

    def __init__(self) -> None:
        super().__init__()
        self._parts: dict[str, dict[int, StoredPart]] = collections.defaultdict(dict)
        self._rows_guard = threading.Lock()

    def _insert(self, batch: list[StoredPart], runs: list[str]) -> None:
        with self._rows_guard:
            for part in batch:
                self._parts[part.run_id].setdefault(part.offset, part)

    def _delete(self, run_ids: list[str]) -> None:
        with self._rows_guard:
            for run_id in run_ids:
                self._parts.pop(run_id, None)

    def _stored(self, run_id: str) -> list[StoredPart]:
        with self._rows_guard:
            return sorted(self._parts.get(run_id, {}).values(), key=lambda part: part.offset)

    def _select(self, run_id: str, after: int, limit: int) -> list[StoredPart]:
        return [part for part in self._stored(run_id) if part.offset > after][:limit]

    def _select_last(self, run_id: str) -> int:
        with self._rows_guard:
            return max(self._parts.get(run_id, {0: None}))

    def _select_step(self, run_id: str, step: int) -> list[StoredPart]:
        return [part for part in self._stored(run_id) if part.step == step]


# ------------------------------------------------------------------ SQLite
_COLUMNS = "position, type, step, attempt, part, version"
_SQLITE_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (run_id TEXT NOT NULL, position INTEGER NOT NULL, "
    "type TEXT NOT NULL, step INTEGER, attempt INTEGER, part TEXT NOT NULL, version INTEGER, "
    "PRIMARY KEY (run_id, position)) WITHOUT ROWID",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_step ON {TABLE} (run_id, step)",
)


class SqliteStreamLog(StreamLog):
    """Streams in the store's SQLite file, through its recorder's connections."""

    poll_interval = SQLITE_POLL

    def __init__(self, datastore: SQLiteDatastore) -> None:
        super().__init__()
        self._datastore = datastore
        with datastore.transaction(commit=True) as c:
            for statement in _SQLITE_SCHEMA:
                c.execute(statement)

    def _insert(self, batch: list[StoredPart], runs: list[str]) -> None:
        with self._datastore.transaction(commit=True) as c:
            c.executemany(
                f"INSERT OR IGNORE INTO {TABLE} (run_id, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [part.row() for part in batch],
            )

    def _delete(self, run_ids: list[str]) -> None:
        marks = ",".join("?" * len(run_ids))
        with self._datastore.transaction(commit=True) as c:
            c.execute(f"DELETE FROM {TABLE} WHERE run_id IN ({marks})", run_ids)

    def _select(self, run_id: str, after: int, limit: int) -> list[StoredPart]:
        with self._datastore.transaction(commit=False) as c:
            c.execute(
                f"SELECT {_COLUMNS} FROM {TABLE} WHERE run_id = ? AND position > ? "
                "ORDER BY position LIMIT ?",
                (run_id, after, limit),
            )
            return [_part(row, run_id) for row in c.fetchall()]

    def _select_last(self, run_id: str) -> int:
        with self._datastore.transaction(commit=False) as c:
            c.execute(f"SELECT max(position) FROM {TABLE} WHERE run_id = ?", (run_id,))
            row = c.fetchone()
        return int(row[0]) if row is not None and row[0] is not None else 0

    def _select_step(self, run_id: str, step: int) -> list[StoredPart]:
        with self._datastore.transaction(commit=False) as c:
            c.execute(
                f"SELECT {_COLUMNS} FROM {TABLE} WHERE run_id = ? AND step = ? ORDER BY position",
                (run_id, step),
            )
            return [_part(row, run_id) for row in c.fetchall()]


# -------------------------------------------------------------- PostgreSQL
class PostgresStreamLog(StreamLog):
    """Streams in the store's PostgreSQL database, through its recorder's pool;
    followers of other processes woken by ``LISTEN``/``NOTIFY``."""

    def __init__(
        self, datastore: PostgresDatastore, address: PostgresAddress | None = None
    ) -> None:
        super().__init__()
        self._datastore = datastore
        #: Where a listener connects: the pool's server, or behind a transaction
        #: pooler the direct server ``address`` names; None: nowhere, followers poll.
        self._listen_at: dict[str, str] | None = {}
        if address is not None and address.pooled:
            self._listen_at = None if address.listen is None else dict(address.listen)
            if self._listen_at is None:
                self.poll_interval = POOLED_POLL
        table = Composed([Identifier(datastore.schema), SQL("."), Identifier(TABLE)])
        self._create = [
            SQL(
                "CREATE TABLE IF NOT EXISTS {} (run_id text NOT NULL, position bigint NOT NULL, "
                "type text NOT NULL, step int, attempt int, part text NOT NULL, version bigint, "
                "PRIMARY KEY (run_id, position))"
            ).format(table),
            SQL("CREATE INDEX IF NOT EXISTS {} ON {} (run_id, step)").format(
                Identifier(f"{TABLE}_step"), table
            ),
        ]
        # The columns go as binary arrays (%b): text arrays would be escaped
        # element by element, a regular expression a sealed part.
        self._insert_sql = SQL(
            "INSERT INTO {} (run_id, position, type, step, attempt, part, version) "
            "SELECT * FROM unnest(%b::text[], %b::bigint[], %b::text[], %b::int[], %b::int[], "
            "%b::text[], %b::bigint[]) ON CONFLICT DO NOTHING"
        ).format(table)
        self._notify_sql = SQL("SELECT pg_notify({}, run) FROM unnest(%b::text[]) AS run").format(
            SQL("'" + CHANNEL + "'")
        )
        self._select_sql = SQL(
            "SELECT position, type, step, attempt, part, version FROM {} WHERE run_id = %s "
            "AND position > %s ORDER BY position LIMIT %s"
        ).format(table)
        self._delete_sql = SQL("DELETE FROM {} WHERE run_id = ANY(%s)").format(table)
        self._last_sql = SQL("SELECT max(position) FROM {} WHERE run_id = %s").format(table)
        self._step_sql = SQL(
            "SELECT position, type, step, attempt, part, version FROM {} WHERE run_id = %s "
            "AND step = %s ORDER BY position"
        ).format(table)
        self._listeners: dict[asyncio.AbstractEventLoop, _Listener] = {}
        self._set_up()

    def _set_up(self) -> None:
        """The table, made once; workers starting together may race on it."""
        for attempt in range(8):
            try:
                with self._datastore.transaction(commit=True) as c:
                    # One setup at a time in the database: CREATE ... IF NOT EXISTS
                    # is not safe against a concurrent one.
                    c.execute(SQL("SELECT pg_advisory_xact_lock(hashtext('kuralle_stream'))"))
                    for statement in self._create:
                        c.execute(statement)
                return
            except PersistenceError:
                if attempt == 7:
                    raise
                time.sleep(0.02 * (attempt + 1))

    def _insert(self, batch: list[StoredPart], runs: list[str]) -> None:
        columns = list(zip(*(part.row() for part in batch), strict=True))
        with self._datastore.transaction(commit=True) as c:
            c.execute(SQL("SET LOCAL synchronous_commit = off"))
            c.execute(self._insert_sql, [list(column) for column in columns])
            c.execute(self._notify_sql, (runs,))

    def _delete(self, run_ids: list[str]) -> None:
        with self._datastore.transaction(commit=True) as c:
            c.execute(self._delete_sql, (run_ids,))

    def _select(self, run_id: str, after: int, limit: int) -> list[StoredPart]:
        with self._datastore.transaction(commit=False) as c:
            c.execute(self._select_sql, (run_id, after, limit))
            return [_part(list(row.values()), run_id) for row in c.fetchall()]

    def _select_last(self, run_id: str) -> int:
        with self._datastore.transaction(commit=False) as c:
            c.execute(self._last_sql, (run_id,))
            row = c.fetchone()
        value = None if row is None else next(iter(row.values()))
        return int(value) if value is not None else 0

    def _select_step(self, run_id: str, step: int) -> list[StoredPart]:
        with self._datastore.transaction(commit=False) as c:
            c.execute(self._step_sql, (run_id, step))
            return [_part(list(row.values()), run_id) for row in c.fetchall()]

    # ------------------------------------------------------------ LISTEN
    async def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._listen_at is None:
            return  # behind a transaction pooler: the followers poll
        with self._guard:
            listener = self._listeners.get(loop)
            if listener is None:
                listener = self._listeners[loop] = _Listener(
                    self._datastore, self._listen_at, self._wake
                )
            listener.users += 1
        await listener.started()

    async def _unlisten(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._guard:
            listener = self._listeners.get(loop)
            if listener is None:
                return
            listener.users -= 1
            if listener.users > 0:
                return
            del self._listeners[loop]
        await listener.stop()

    def close(self) -> None:
        super().close()
        with self._guard:
            listeners, self._listeners = list(self._listeners.values()), {}
        for listener in listeners:
            listener.abandon()


class _Listener:
    """One loop's ``LISTEN`` on the stream channel: each notification wakes the
    followers of the run it names. A lost connection is made again; meanwhile
    followers read on their safety poll."""

    def __init__(
        self,
        datastore: PostgresDatastore,
        at: dict[str, str],
        wake: Callable[[list[str]], None],
    ) -> None:
        self._datastore = datastore
        self._at = at
        self._wake = wake
        self.users = 0
        self._ready = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._connection: psycopg.AsyncConnection[Any] | None = None

    async def started(self) -> None:
        """Once ``LISTEN`` is in place (or has failed once: followers poll meanwhile)."""
        await self._ready.wait()

    async def _run(self) -> None:
        while True:
            try:
                params = {**_connect_params(self._datastore), **self._at}
                connection = await psycopg.AsyncConnection.connect(**params, autocommit=True)
                self._connection = connection
                await connection.execute(SQL("LISTEN {}").format(Identifier(CHANNEL)))
                self._ready.set()
                async for notify in connection.notifies():
                    self._wake([notify.payload])
            except psycopg.Error:
                self._ready.set()
                await asyncio.sleep(SAFETY_POLL)
            finally:
                self._drop()

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not connection.closed:
            connection.pgconn.finish()

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._drop()

    def abandon(self) -> None:
        """Stop from any thread (a store closed while its followers' loops live). The
        connection goes with the task, on its loop: freeing it under psycopg's
        waiting generator would crash the process."""
        loop = self._task.get_loop()
        if loop.is_closed():
            self._drop()
        else:
            loop.call_soon_threadsafe(self._task.cancel)


def stream_log_for(recorder: Any, address: object = None) -> StreamLog:
    """The stream log that goes with an application recorder of the store: in its
    memory, its SQLite file or its PostgreSQL database (``address``, the log's:
    whether a transaction pooler is in front)."""
    datastore = getattr(recorder, "datastore", None)
    if isinstance(datastore, SQLiteDatastore):
        return SqliteStreamLog(datastore)
    if isinstance(datastore, PostgresDatastore):
        return PostgresStreamLog(
            datastore, address if isinstance(address, PostgresAddress) else None
        )
    return MemoryStreamLog()


def _connect_params(datastore: PostgresDatastore) -> dict[str, Any]:
    """The parameters the store's pool connects with (a listener's own connection)."""
    pool = datastore.pool
    kwargs = pool.kwargs or {}
    params: dict[str, Any] = dict(kwargs() if callable(kwargs) else kwargs)
    params.pop("row_factory", None)
    get_password = getattr(pool, "get_password_func", None)
    if get_password is not None:
        params["password"] = get_password()
    return params
