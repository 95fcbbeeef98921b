"""The one-round-trip PostgreSQL save, sent from the event loop (internal).

A turn's saves are awaited on its event loop. Through ``eventsourcing``'s
recorder a save is a blocking call, so it runs on a worker thread, and on
this kind of machine the hop to that thread and back costs more than the
save's own round trip (benchmarks/RESULTS.md). This module sends the very
statement of ``OneTripPostgresRecorder`` (the lease op, the table lock and
the insert in one PL/pgSQL call, on an autocommit connection) over
psycopg's asynchronous connection instead: the loop waits
on the socket, no thread is involved, and the other turns on the loop run
meanwhile. A turn reads its run's lease record over the same connection.

Each event loop that saves gets its own connection (an asynchronous
connection belongs to one loop). A save made while no other is in flight on
the loop is sent at once, alone, so one run's latency is one round trip.
The saves that runs make while one is in flight queue up, and go together in
the next statement (group commit): the batch function of the recorder writes
them in one transaction, under one lock, with one flush, each in a
subtransaction of its own, so one run's version clash or refused lease
fails that save alone and writes none of its events. Errors map to
``eventsourcing``'s, and a lost connection is replaced and the statement
retried, as the recorder's own retry does: a version clash is
``IntegrityError``; ``OperationalError`` or ``InterfaceError`` after the
last attempt.

Once a statement that wrote events has committed, the followers are woken
(the recorder's ``wake_statement``, a transaction of its own on the loop's
connection, from a task of its own). The first commit after a quiet spell
wakes them at once; the commits of the next ``WAKE_SPACING``
seconds share one more wake-up at its end (one wake-up a save doubled the
statements of a lone run). A wake-up still due when the store is closed is
sent then.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from eventsourcing.persistence import (
    IntegrityError,
    InterfaceError,
    OperationalError,
    StoredEvent,
)
from psycopg.types.composite import register_composite

from .leases import Lease, LeaseOp, LeaseRefused
from .recorders import OneTripPostgresRecorder, lease_refusal

__all__ = ["AsyncOneTripSaver"]

#: Attempts of a save whose connection fails, and the wait between them
#: (the recorder's own ``@retry``: 10 attempts, 0.2 s).
ATTEMPTS = 10
RETRY_WAIT = 0.2
#: The most saves one group commit carries.
MAX_BATCH = 256
#: Seconds the commits after a wake-up wait to share the next one: a follower
#: hears of a busy writer at most this late, and reads all it committed
#: meanwhile at once (4 worker processes: 1.53x one at 5 ms, 1.64x at 50 ms;
#: each wake-up is a transaction of its own on the server).
WAKE_SPACING = 0.05


@dataclass
class _Queued:
    """A save waiting for the next group commit of its loop."""

    rows: list[Any]
    lease: LeaseOp | None
    done: asyncio.Future[list[int]]


@dataclass
class _Lane:
    """One loop's saves: whether a statement is in flight, the saves queued, and
    the cursor its statements go through.

    The lane sends one statement at a time, so they can share one cursor: a new
    cursor a save would look up and make its parameters' dumpers afresh (the
    composite rows' and the arrays'), about 3% of a lone run's CPU."""

    busy: bool = False
    queued: list[_Queued] = field(default_factory=list)
    flusher: asyncio.Task[None] | None = None
    cursor: psycopg.AsyncCursor[Any] | None = None

    def cursor_on(self, connection: psycopg.AsyncConnection[Any]) -> psycopg.AsyncCursor[Any]:
        """The lane's cursor on ``connection`` (a new one after a reconnection)."""
        if self.cursor is None or self.cursor.connection is not connection:
            self.cursor = connection.cursor()
        return self.cursor


@dataclass
class _Waker:
    """One loop's wake-ups of the followers: the one in flight, and whether
    another is due after it."""

    sending: asyncio.Task[None] | None = None
    again: bool = False


class AsyncOneTripSaver:
    """Inserts stored events with the one-trip statement, from any event loop."""

    def __init__(self, recorder: OneTripPostgresRecorder) -> None:
        self._recorder = recorder
        self._connections: dict[asyncio.AbstractEventLoop, psycopg.AsyncConnection[Any]] = {}
        self._lanes: dict[asyncio.AbstractEventLoop, _Lane] = {}
        self._wakers: dict[asyncio.AbstractEventLoop, _Waker] = {}
        #: Statements sent, and the saves they carried (a group commit carries several).
        self.statements = 0
        self.saves = 0
        self._guard = threading.Lock()  # loops of several threads may share one store
        self._closed = False
        #: Connections a statement is on: ``close`` leaves them to their user, which
        #: closes each once its statement is done (freeing one mid-statement
        #: would crash the process).
        self._in_use: collections.Counter[psycopg.AsyncConnection[Any]] = collections.Counter()

    async def insert(
        self, stored_events: Sequence[StoredEvent], lease: LeaseOp | None = None
    ) -> list[int]:
        """The events' notification ids, once their transaction (with the lease op)
        has committed; ``LeaseRefused`` if the lease op was refused,
        ``IntegrityError`` on a version clash (nothing of the save written)."""
        recorder = self._recorder
        rows = recorder.rows(stored_events)
        loop = asyncio.get_running_loop()
        lane = self._lanes.get(loop)
        if lane is None:  # not ``setdefault``: that makes a lane on every save
            lane = self._lanes[loop] = _Lane()
        if not lane.busy:
            lane.busy = True
            self.statements += 1
            self.saves += 1
            try:
                parameters = recorder.parameters_of(rows, lease)
                found = await self._execute(recorder.one_trip_statement, parameters, lease, lane)
                if rows:
                    self._wake_followers()
                return [int(row[0]) for row in found]
            finally:
                self._after_statement(lane)
        queued = _Queued(rows, lease, loop.create_future())
        lane.queued.append(queued)
        try:
            return await queued.done
        except asyncio.CancelledError:
            if queued in lane.queued:  # not sent yet: it never will be
                lane.queued.remove(queued)
            raise

    def _after_statement(self, lane: _Lane) -> None:
        """A statement returned: send what queued meanwhile, or let the lane idle."""
        if lane.queued:
            lane.flusher = asyncio.get_running_loop().create_task(self._flush(lane))
        else:
            lane.busy = False

    async def _flush(self, lane: _Lane) -> None:
        """Send the queued saves, a group commit at a time, until none is left."""
        try:
            while lane.queued:
                # One pass of the loop first: the runs that the last statement's
                # return just woke queue their next saves, and go in this group
                # instead of the next (at 32 runs, 18 saves a statement, not 13).
                await asyncio.sleep(0)
                batch, lane.queued = lane.queued[:MAX_BATCH], lane.queued[MAX_BATCH:]
                await self._commit_group(lane, batch)
        finally:
            lane.busy = False
            lane.flusher = None

    async def _commit_group(self, lane: _Lane, batch: list[_Queued]) -> None:
        self.statements += 1
        self.saves += len(batch)
        if len(batch) == 1:
            [one] = batch
            statement = self._recorder.one_trip_statement
            parameters = self._recorder.parameters_of(one.rows, one.lease)
        else:
            statement = self._recorder.batch_statement
            parameters = self._recorder.batch_parameters([(q.rows, q.lease) for q in batch])
        single = batch[0].lease if len(batch) == 1 else None
        try:
            found = await self._execute(statement, parameters, single, lane)
        except BaseException as error:
            for queued in batch:
                if not queued.done.done():
                    queued.done.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        if any(q.rows for q in batch):
            self._wake_followers()
        if len(batch) == 1:
            batch[0].done.set_result([int(row[0]) for row in found])
            return
        for save, outcome, ids, detail in found:
            queued = batch[save - 1]
            if outcome == "ok":
                queued.done.set_result([int(i) for i in ids])
            elif outcome == "clash":
                queued.done.set_exception(IntegrityError("another writer appended first"))
            else:
                queued.done.set_exception(_refused(queued.lease, outcome, detail))

    def _wake_followers(self) -> None:
        """Wake the followers after a commit: now if no wake-up is in flight on this
        loop, else once more after it."""
        loop = asyncio.get_running_loop()
        waker = self._wakers.get(loop)
        if waker is None:
            waker = self._wakers[loop] = _Waker()
        if waker.sending is not None:
            waker.again = True
            return
        waker.sending = loop.create_task(self._send_wake_ups(waker))

    async def _send_wake_ups(self, waker: _Waker) -> None:
        """Send a wake-up, then one more after each ``WAKE_SPACING`` in which a
        commit asked for one. A failed one is dropped: the events are committed,
        and a follower also looks again when it is next woken (``follow`` every
        second besides)."""
        try:
            while True:
                waker.again = False
                try:
                    await self._execute(self._recorder.wake_statement, (), None)
                except (psycopg.Error, OperationalError, InterfaceError):
                    return
                except BaseException:
                    waker.again = True  # cancelled: still due, ``close`` sends it
                    raise
                await asyncio.sleep(WAKE_SPACING)
                if not waker.again or self._closed:
                    return
        finally:
            waker.sending = None

    async def holds(self, originator_id: Any) -> bool:
        """Whether the events table holds any event of ``originator_id``."""
        return bool(await self._execute(self._recorder.holds_statement, (originator_id,), None))

    async def select_lease(self, run_id: Any) -> Lease | None:
        """The run's lease record, read on this loop's connection (live or not by
        the server's clock)."""
        rows = await self._execute(self._recorder.select_lease_statement, (run_id,), None)
        if not rows:
            return None
        holder, token, expires_at, live = rows[0]
        return Lease(holder, expires_at, token, live)

    async def _execute(
        self,
        statement: Any,
        parameters: Sequence[Any],
        lease: LeaseOp | None,
        lane: _Lane | None = None,
    ) -> list[Any]:
        """Run one statement on this loop's connection (through the lane's cursor for
        a save), replacing a lost connection and trying again as the recorder's own
        retry does."""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                connection = await self._connection()
            except OperationalError:
                if attempt == ATTEMPTS:
                    raise
                await asyncio.sleep(RETRY_WAIT)
                continue
            try:
                with self._using(connection):
                    cursor = connection.cursor() if lane is None else lane.cursor_on(connection)
                    await cursor.execute(statement, parameters, prepare=True)
                    return await cursor.fetchall()
            except psycopg.IntegrityError as clash:
                raise IntegrityError(str(clash)) from clash
            except (psycopg.OperationalError, psycopg.InterfaceError) as lost:
                self._discard(connection)
                if attempt == ATTEMPTS:
                    interface = isinstance(lost, psycopg.InterfaceError)
                    raise (InterfaceError if interface else OperationalError)(str(lost)) from lost
                await asyncio.sleep(RETRY_WAIT)
            except psycopg.Error as error:
                refusal = lease_refusal(error, lease)
                if refusal is not None:
                    raise refusal from None
                raise
            except BaseException:
                # Cancelled (or worse) mid-statement: the connection's state is
                # unknown, so it is never used again; and psycopg may still hold
                # the statement's generator, so it is not freed here either
                # (freeing a connection under a live generator crashes the
                # process): it goes when nothing refers to it any more.
                self._discard(connection, free=False)
                raise
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _using(self, connection: psycopg.AsyncConnection[Any]) -> Iterator[None]:
        """Run a statement on ``connection``: ``close`` meanwhile leaves it to this
        user, which closes it when the statement is done."""
        with self._guard:
            if self._closed:
                raise InterfaceError("the run store is closed")
            self._in_use[connection] += 1  # a save and a wake-up may share it
        done = False  # the statement ended (returned or raised), not interrupted
        try:
            yield
            done = True
        except Exception:
            done = True
            raise
        finally:
            with self._guard:
                self._in_use[connection] -= 1
                if self._in_use[connection] <= 0:
                    del self._in_use[connection]
                orphaned = self._closed and connection not in self._in_use
            if orphaned and done:
                _finish(connection)

    def close(self) -> None:
        """Close every loop's connection (from any thread, loop running or not);
        one a statement is on is closed by its user when the statement is done."""
        with self._guard:
            self._closed = True
            connections = [c for c in self._connections.values() if c not in self._in_use]
            self._connections.clear()
            due = any(w.again for w in self._wakers.values())
        for connection in connections:
            _finish(connection)
        if due:  # commits whose wake-up was still waiting out its spacing
            with contextlib.suppress(Exception), self._recorder.datastore.get_connection() as conn:
                self._recorder.wake_followers(conn.cursor())

    # ------------------------------------------------------------ connections
    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        loop = asyncio.get_running_loop()
        with self._guard:
            if self._closed:
                raise InterfaceError("the run store is closed")
            connection = self._connections.get(loop)
            if connection is not None and not connection.closed:
                return connection
            # A loop's first statement (or one after a lost connection): what closed
            # loops left behind goes now, not on every statement.
            self._forget_closed_loops()
        connection = await self._connect()
        with self._guard:
            if self._closed:
                _finish(connection)
                raise InterfaceError("the run store is closed")
            meanwhile = self._connections.get(loop)
            if meanwhile is not None and not meanwhile.closed:
                # Another save on this loop connected meanwhile: one connection a loop.
                _finish(connection)
                return meanwhile
            self._connections[loop] = connection
        return connection

    def _forget_closed_loops(self) -> None:
        """Drop the connections, lanes and wake-ups of loops that are closed (under
        ``_guard``). A statement its loop left unfinished keeps its connection (see
        ``_using``): it goes when nothing refers to it any more."""
        for gone in [held for held in self._connections if held.is_closed()]:
            left = self._connections.pop(gone)
            if left not in self._in_use:
                _finish(left)
        for gone in [held for held in self._lanes if held.is_closed()]:
            del self._lanes[gone]
        for gone in [held for held in self._wakers if held.is_closed()]:
            del self._wakers[gone]

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        datastore = self._recorder.datastore
        pool = datastore.pool
        kwargs = pool.kwargs if isinstance(pool.kwargs, dict) else {}
        params = {key: value for key, value in kwargs.items() if key != "row_factory"}
        get_password = getattr(pool, "get_password_func", None)
        if get_password is not None:
            params["password"] = get_password()
        try:
            connection = await psycopg.AsyncConnection.connect(
                autocommit=True, connect_timeout=max(1, round(pool.timeout)), **params
            )
        except psycopg.OperationalError as down:
            raise OperationalError(str(down)) from down
        # The same composite-type adapter as the recorder's own connections.
        name = self._recorder.stored_event_type_name
        info = datastore.psycopg_type_adapters.get(name)
        if info is not None:
            register_composite(info, connection, factory=datastore.psycopg_python_types[name])
        return connection

    def _discard(self, connection: psycopg.AsyncConnection[Any], *, free: bool = True) -> None:
        """Never use ``connection`` again; with ``free``, close it now (without, it
        goes when nothing refers to it, so no lane's cursor may keep it)."""
        with self._guard:
            for loop, held in list(self._connections.items()):
                if held is connection:
                    del self._connections[loop]
            for lane in self._lanes.values():
                if lane.cursor is not None and lane.cursor.connection is connection:
                    lane.cursor = None
        if free:
            _finish(connection)


def _finish(connection: psycopg.AsyncConnection[Any]) -> None:
    """Close a connection without awaiting (its loop may be gone or another thread's)."""
    if not connection.closed:
        connection.pgconn.finish()


def _refused(op: LeaseOp | None, outcome: str, detail: str | None) -> LeaseRefused:
    """A save of a group commit whose lease op was refused."""
    assert op is not None, "only a save with a lease op can have it refused"
    if outcome == "lost" or not detail:
        return LeaseRefused(op, None)
    holder, _, epoch = detail.rpartition(" ")
    return LeaseRefused(op, Lease(holder, datetime.fromtimestamp(float(epoch), UTC)))
