"""One PostgreSQL database's connections, shared by every partition of a store (internal).

A store of K partitions is K ``eventsourcing`` applications, and each would
build its own pool (and the loop's saver its own connections): a store's
connections grew with K (95 for four partitions under 32 concurrent runs).
Here the database has one ``PgConnections``: the first partition's
``PostgresDatastore`` is kept and given one psycopg_pool ``ConnectionPool``,
the other partitions' recorders use that same datastore, and the saves sent
from async code take their connections from one ``AsyncConnectionPool`` a
running event loop (an asynchronous connection belongs to one loop). The
two pools share ``pool_size`` (default 10): at most that many connections a
store, whatever its K (docs/scaling.md, "Connections").

Behind PgBouncer in transaction mode (``pooler="transaction"``) no
connection keeps session state: no prepared statement
(``prepare_threshold=None``) and no ``SET`` when a connection is made; the
followers LISTEN only on a direct connection (docs/high-availability.md).

Connections are made with TCP keepalives (unless the address sets its own),
so a server that vanishes without closing its sockets (a failover, a cut
cable) fails a statement within seconds instead of leaving it waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from typing import Any

import psycopg
from eventsourcing.postgres import ConnectionPool, PostgresDatastore, PostgresFactory
from psycopg.rows import DictRow
from psycopg.sql import SQL
from psycopg.types.composite import register_composite
from psycopg_pool import AsyncConnectionPool

from .store_url import PostgresAddress

__all__ = ["PgConnections", "SaverConnection", "pool_shares"]

#: libpq's keepalives where the address says nothing of them: a dead peer is
#: noticed after about 5 + 3 x 2 seconds of silence, and a write nobody
#: acknowledges fails after 10 s (``tcp_user_timeout``, in ms).
KEEPALIVES = {
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",
}


def pool_shares(pool_size: int) -> tuple[int, int]:
    """``pool_size`` split into the most connections of the blocking pool (loads,
    views, consumers, saves from sync code) and of a loop's pool (the saves and
    lease reads of async code, sent by group commit: a few connections carry any
    number of concurrent runs)."""
    loop_share = max(1, pool_size * 2 // 5)
    return pool_size - loop_share, loop_share


class SaverConnection(psycopg.AsyncConnection[Any]):
    """An asynchronous connection that keeps the cursor its saves go through: a new
    cursor would look up and make its parameters' dumpers afresh (the composite
    rows' and the arrays'), about 3% of a lone run's CPU."""

    saver_cursor: psycopg.AsyncCursor[Any] | None = None

    def reused_cursor(self) -> psycopg.AsyncCursor[Any]:
        if self.saver_cursor is None:
            self.saver_cursor = self.cursor()
        return self.saver_cursor


class PgConnections:
    """The connections of one database of a store: its datastore (one blocking pool
    for all its partitions) and one asynchronous pool per event loop that saves."""

    def __init__(self, address: PostgresAddress) -> None:
        self.address = address
        self.blocking_size, self.loop_size = pool_shares(address.pool_size)
        #: The partitions' shared datastore (the first partition's, once it is built).
        self.datastore: PostgresDatastore | None = None
        self._loops: dict[asyncio.AbstractEventLoop, _LoopPool] = {}
        self._guard = threading.Lock()
        self._closed = False
        self._closing: set[asyncio.Future[Any]] = set()

    @property
    def pooled(self) -> bool:
        return self.address.pooled

    # ------------------------------------------------------------ blocking
    def share(self, factory: PostgresFactory) -> None:
        """Make ``factory`` (a partition's, just built) use the database's datastore:
        the first one's becomes it, with the store's pool in place of its own."""
        with self._guard:
            built = factory.datastore
            if self.datastore is None:
                unused = built.pool
                built.pool = self._blocking_pool(built)
                self.datastore = built
                unused.close()  # never opened: it made no connection
            else:
                factory.datastore = self.datastore
                built.close()

    def _blocking_pool(self, datastore: PostgresDatastore) -> ConnectionPool[Any]:
        """The store's blocking pool, with the settings ``eventsourcing`` read from
        its variables for ``datastore``'s own."""
        made = datastore.pool
        kwargs = dict(made.kwargs) if isinstance(made.kwargs, dict) else {}
        kwargs.update(self.address.options)
        for key, value in KEEPALIVES.items():
            kwargs.setdefault(key, value)
        timeout_ms = int(datastore.idle_in_transaction_session_timeout * 1000)
        pooled = self.pooled

        def configure(conn: psycopg.Connection[DictRow]) -> None:
            conn.autocommit = True
            if pooled:  # no session state behind a transaction pooler
                conn.prepare_threshold = None
            else:
                conn.execute(
                    SQL("SET idle_in_transaction_session_timeout = {0}").format(timeout_ms)
                )

        pool: ConnectionPool[Any] = ConnectionPool(
            get_password_func=made.get_password_func,
            connection_class=psycopg.Connection[DictRow],
            kwargs=kwargs,
            min_size=1,
            max_size=self.blocking_size,
            open=False,
            configure=configure,
            timeout=made.timeout,
            max_waiting=made.max_waiting,
            max_lifetime=made.max_lifetime,
            check=ConnectionPool.check_connection if datastore.pre_ping else None,
            name=f"kuralle-{self.address.params['dbname']}",
        )
        return pool

    # ---------------------------------------------------------------- loops
    async def loop_pool(self) -> AsyncConnectionPool[SaverConnection]:
        """The running loop's pool, open (``getconn`` / ``putconn`` a statement: the
        saver calls them directly, a context manager a statement cost a tenth more
        Python calls a lone run's step)."""
        entry = self._loop_pool()
        if not entry.opened.done():
            await asyncio.shield(entry.opened)
        return entry.pool

    def _loop_pool(self) -> _LoopPool:
        loop = asyncio.get_running_loop()
        entry = self._loops.get(loop)
        if entry is not None:
            return entry
        with self._guard:
            if self._closed:
                raise psycopg.InterfaceError("the run store is closed")
            entry = self._loops.get(loop)
            if entry is None:
                # A loop's first statement: what closed loops left behind goes now.
                for gone in [held for held in self._loops if held.is_closed()]:
                    self._loops.pop(gone).free()
                entry = self._loops[loop] = _LoopPool(*self._new_loop_pool(), loop)
        return entry

    def _new_loop_pool(
        self,
    ) -> tuple[AsyncConnectionPool[SaverConnection], weakref.WeakSet[SaverConnection]]:
        """A loop's pool, and the set of the connections it makes (to free them if
        the loop closes with the pool open)."""
        assert self.datastore is not None, "the datastore is shared before any save"
        datastore = self.datastore
        made = datastore.pool
        given = made.kwargs if isinstance(made.kwargs, dict) else {}
        params: dict[str, Any] = {k: v for k, v in given.items() if k != "row_factory"}
        params["autocommit"] = True
        if made.get_password_func is not None:
            params["password"] = made.get_password_func()
        pooled = self.pooled
        connections: weakref.WeakSet[SaverConnection] = weakref.WeakSet()

        async def configure(conn: SaverConnection) -> None:
            connections.add(conn)
            if pooled:
                conn.prepare_threshold = None
            # The same composite-type adapters as the recorders' own connections.
            for name, info in datastore.psycopg_type_adapters.items():
                register_composite(info, conn, factory=datastore.psycopg_python_types[name])

        pool: AsyncConnectionPool[SaverConnection] = AsyncConnectionPool(
            connection_class=SaverConnection,
            kwargs=params,
            min_size=1,
            max_size=self.loop_size,
            open=False,
            configure=configure,
            timeout=made.timeout,
            max_lifetime=made.max_lifetime,
            name=f"kuralle-{self.address.params['dbname']}-loop",
        )
        return pool, connections

    # ---------------------------------------------------------------- close
    def close(self) -> None:
        """Close every pool, from any thread, a loop running or not: a loop's pool is
        closed on that loop (a connection a statement is on is closed when it comes
        back); one whose loop is closed has its connections freed here."""
        with self._guard:
            self._closed = True
            entries = list(self._loops.values())
            self._loops.clear()
            datastore, self.datastore = self.datastore, None
        for entry in entries:
            closing = entry.close()
            if closing is not None:
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
        if datastore is not None:
            datastore.close()


class _LoopPool:
    """One event loop's pool, its opening, and its keeper: a task that waits for
    ever and closes the pool when it is cancelled. A loop that ends (``asyncio.run``
    returning) cancels every task it has; psycopg_pool's workers survive a
    cancellation that lands while they run a maintenance task (they log it and wait
    for the next), so the loop would wait for them for ever. The keeper, cancelled
    with them, closes the pool, which stops its workers: the loop ends."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        made: weakref.WeakSet[SaverConnection],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.pool = pool
        self.made = made
        self.loop = loop
        self.opened: asyncio.Future[None] = loop.create_task(pool.open())
        self.keeper: asyncio.Future[None] = loop.create_task(_keep(pool))

    def close(self) -> asyncio.Future[Any] | None:
        """Close the pool on its loop; the keeper closing it when that loop is this
        thread's running one (a sync ``close`` from async code cannot wait)."""
        loop = self.loop
        if loop.is_closed():
            self.free()
            return None
        here = _running_loop()
        if loop.is_running():
            if here is loop:
                self.keeper.cancel()
                return self.keeper
            future = asyncio.run_coroutine_threadsafe(_stop(self.keeper), loop)
            with contextlib.suppress(Exception):
                future.result(timeout=10)
            return None
        if here is None:  # a stopped loop of this thread (between two runs)
            with contextlib.suppress(Exception):
                loop.run_until_complete(_stop(self.keeper))
            return None
        self.free()
        return None

    def free(self) -> None:
        """Free the connections of a pool whose loop can no longer run: nothing can
        resume a statement on them."""
        for conn in list(self.made):
            if not conn.closed:
                conn.pgconn.finish()


async def _keep(pool: AsyncConnectionPool[Any]) -> None:
    """Wait for ever; cancelled, close ``pool`` (see ``_LoopPool``)."""
    try:
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            await pool.close(timeout=5)


async def _stop(keeper: asyncio.Future[None]) -> None:
    """Cancel the keeper and wait until it has closed its pool."""
    keeper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await keeper


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
