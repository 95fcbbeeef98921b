"""The one-round-trip PostgreSQL save, sent from the event loop (internal).

A turn's saves are awaited on its event loop. Through ``eventsourcing``'s
recorder a save is a blocking call, so it runs on a worker thread, and on
this kind of machine the hop to that thread and back costs more than the
save's own round trip (benchmarks/RESULTS.md). This module sends the very
statement of ``OneTripPostgresRecorder`` (the lease op, the table lock, the
``NOTIFY`` and the insert in one PL/pgSQL call, on an autocommit
connection) over psycopg's asynchronous connection instead: the loop waits
on the socket, no thread is involved, and the other turns on the loop run
meanwhile. A turn reads its run's lease record over the same connection.

Each event loop that saves gets its own connection (an asynchronous
connection belongs to one loop); the saves of the turns on one loop take
turns on it, as they would on the events table's lock anyway. Errors map to
``eventsourcing``'s, and a lost connection is replaced and the save retried,
as the recorder's own retry does: a version clash is ``IntegrityError``;
``OperationalError`` or ``InterfaceError`` after the last attempt.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import psycopg
from eventsourcing.persistence import (
    IntegrityError,
    InterfaceError,
    OperationalError,
    StoredEvent,
)
from psycopg.types.composite import register_composite

from .leases import Lease, LeaseOp
from .recorders import OneTripPostgresRecorder, lease_refusal

__all__ = ["AsyncOneTripSaver"]

#: Attempts of a save whose connection fails, and the wait between them
#: (the recorder's own ``@retry``: 10 attempts, 0.2 s).
ATTEMPTS = 10
RETRY_WAIT = 0.2


class AsyncOneTripSaver:
    """Inserts stored events with the one-trip statement, from any event loop."""

    def __init__(self, recorder: OneTripPostgresRecorder) -> None:
        self._recorder = recorder
        self._connections: dict[asyncio.AbstractEventLoop, psycopg.AsyncConnection[Any]] = {}
        self._guard = threading.Lock()  # loops of several threads may share one store
        self._closed = False

    async def insert(
        self, stored_events: Sequence[StoredEvent], lease: LeaseOp | None = None
    ) -> list[int]:
        """The events' notification ids, once their transaction (with the lease op)
        has committed; ``LeaseRefused`` if the lease op was refused."""
        recorder = self._recorder
        parameters = recorder.parameters(stored_events, lease)
        rows = await self._execute(recorder.one_trip_statement, parameters, lease)
        return [int(row[0]) for row in rows]

    async def select_lease(self, run_id: Any) -> Lease | None:
        """The run's lease record, read on this loop's connection."""
        rows = await self._execute(self._recorder.select_lease_statement, (run_id,), None)
        if not rows:
            return None
        holder, token, expires_at = rows[0]
        return Lease(holder, expires_at, token)

    async def _execute(
        self, statement: Any, parameters: Sequence[Any], lease: LeaseOp | None
    ) -> list[Any]:
        """Run one statement on this loop's connection, replacing a lost connection and
        trying again as the recorder's own retry does."""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                connection = await self._connection()
            except OperationalError:
                if attempt == ATTEMPTS:
                    raise
                await asyncio.sleep(RETRY_WAIT)
                continue
            try:
                cursor = connection.cursor()
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
                # unknown, so it is never used again.
                self._discard(connection)
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close every loop's connection (from any thread, loop running or not)."""
        with self._guard:
            self._closed = True
            connections = list(self._connections.values())
            self._connections.clear()
        for connection in connections:
            _finish(connection)

    # ------------------------------------------------------------ connections
    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        loop = asyncio.get_running_loop()
        with self._guard:
            if self._closed:
                raise InterfaceError("the run store is closed")
            for gone in [held for held in self._connections if held.is_closed()]:
                _finish(self._connections.pop(gone))
            connection = self._connections.get(loop)
        if connection is not None and not connection.closed:
            return connection
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

    def _discard(self, connection: psycopg.AsyncConnection[Any]) -> None:
        with self._guard:
            for loop, held in list(self._connections.items()):
                if held is connection:
                    del self._connections[loop]
        _finish(connection)


def _finish(connection: psycopg.AsyncConnection[Any]) -> None:
    """Close a connection without awaiting (its loop may be gone or another thread's)."""
    if not connection.closed:
        connection.pgconn.finish()
