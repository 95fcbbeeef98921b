"""``follow``: the public events after a position, in order, waiting for new ones (public API).

Reading is a pull over each partition's notification log
(``select_notifications`` after the last position seen there, filtered to
the stored topics that have a public meaning). That pull is the whole
correctness argument: notification ids only grow in commit order within a
log (PostgreSQL saves lock the log's events table; SQLite has one writer),
so reading strictly after the last id seen never skips an event and never
repeats one, whatever gaps the ids have. A store of several partitions
(docs/scaling.md) is read one batch per partition in turn: each run's
events, and each partition's, stay in order; there is no order across
partitions. Waiting is only a wake-up: on PostgreSQL a ``LISTEN`` on every
partition's notify channel, on SQLite and memory a short poll; a missed
wake-up costs at most one poll interval, never an event. Behind PgBouncer in
transaction mode a ``LISTEN`` would be lost with its server session: there
the follower listens on a direct connection to the server if the store names
one (``listen_host``), and polls otherwise (docs/high-availability.md). A
listening connection that dies (a restart, a failover) is made again, and
until then the follower polls: its position is its own, so nothing is missed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import psycopg
from eventsourcing.postgres import PostgresApplicationRecorder
from psycopg import sql

from .._journal.log import RunLog
from .._journal.pg_pool import KEEPALIVES
from .._journal.store import RunStore
from .._journal.store_url import PostgresAddress
from ..errors import InvalidArgumentError
from .translate import PUBLIC_TOPICS, Translator
from .types import RunEvent

__all__ = ["After", "EventReader", "Tail", "follow", "start_positions"]

#: Notifications read per query.
BATCH_SIZE = 500
#: Seconds between polls (SQLite, memory), and the safety net of a PostgreSQL wait.
POLL_INTERVAL = 0.1

#: Where to start: None (from the first), a position (a store of one partition)
#: or ``{partition: position}`` (a partition left out starts from its first event).
After = int | Mapping[int, int | None] | None


def start_positions(store: RunStore, after: After) -> dict[int, int]:
    """Each partition's position to read after, from what ``follow`` was given;
    raises ``InvalidArgumentError`` naming what is wrong with ``after``."""
    count = len(store.partitions)
    start = dict.fromkeys(range(count), 0)
    if after is None:
        return start
    if isinstance(after, int) and not isinstance(after, bool):
        if after < 0:
            msg = f"after must be a notification position (an int >= 0) or None, got {after!r}"
            raise InvalidArgumentError(msg)
        if count > 1 and after != 0:
            msg = (
                f"this store has {count} partitions, each with its own positions: pass "
                "after={partition: position} (each event says its partition and position)"
            )
            raise InvalidArgumentError(msg)
        return {**start, 0: after}
    if isinstance(after, Mapping):
        for partition, position in after.items():
            if isinstance(partition, bool) or partition not in start:
                msg = (
                    f"after names partition {partition!r}, but the store's partitions "
                    f"are 0..{count - 1}"
                )
                raise InvalidArgumentError(msg)
            if position is not None and (
                isinstance(position, bool) or not isinstance(position, int) or position < 0
            ):
                msg = f"after[{partition}] must be a position (int >= 0) or None, got {position!r}"
                raise InvalidArgumentError(msg)
            start[partition] = position or 0
        return start
    msg = (
        "after must be None, a position (an int >= 0) or a mapping {partition: position}, "
        f"got {after!r}"
    )
    raise InvalidArgumentError(msg)


class LogReader:
    """A position in one partition's log and the translator that goes with it
    (blocking calls)."""

    def __init__(self, log: RunLog, position: int, batch_size: int = BATCH_SIZE) -> None:
        self.log = log
        self.partition = log.partition
        self.position = position
        self.batch_size = batch_size
        self._translator = Translator(log)

    def read(self, stop: int | None = None) -> tuple[list[RunEvent], bool]:
        """The next batch of public events (up to ``stop``), and whether more may follow at once."""
        notifications = self.log.recorder.select_notifications(
            start=self.position,
            limit=self.batch_size,
            stop=stop,
            topics=PUBLIC_TOPICS,
            inclusive_of_start=False,
        )
        events: list[RunEvent] = []
        for notification in notifications:
            event = self._translator.translate(notification)
            if event is not None:
                events.append(event)
            self.position = notification.id
        return events, len(notifications) == self.batch_size

    def head(self) -> int:
        """The last position stored right now (0 for an empty log)."""
        return self.log.recorder.max_notification_id() or 0


class EventReader:
    """Every partition's reader; a read takes one batch from each in turn."""

    def __init__(self, store: RunStore, after: After, batch_size: int = BATCH_SIZE) -> None:
        start = start_positions(store, after)
        self.logs = [LogReader(log, start[log.partition], batch_size) for log in store.partitions]

    def read(self) -> tuple[list[RunEvent], bool]:
        """The next batch of each partition, partition by partition, and whether more
        may follow at once."""
        events: list[RunEvent] = []
        more = False
        for log in self.logs:
            found, full = log.read()
            events.extend(found)
            more = more or full
        return events, more


class Tail:
    """Wakes a follower when new events may be stored; ``stop()`` ends every wait."""

    def __init__(self, store: RunStore, poll_interval: float = POLL_INTERVAL) -> None:
        self.poll_interval = poll_interval
        self.stopped = asyncio.Event()
        #: The notify channels to LISTEN on, grouped by the database they are in.
        self._channels: dict[str, tuple[dict[str, Any], list[str]]] = {}
        #: Whether a partition cannot be listened to (SQLite, memory, or behind a
        #: transaction pooler with no direct server named): then the wait polls.
        self._polls = False
        for log in store.partitions:
            recorder = log.recorder
            params = _listen_params(log)
            if isinstance(recorder, PostgresApplicationRecorder) and params is not None:
                where = repr(sorted(params.items()))
                self._channels.setdefault(where, (params, []))[1].append(recorder.channel_name)
            else:
                self._polls = True
        self._listeners: list[psycopg.AsyncConnection[Any]] = []

    async def __aenter__(self) -> Tail:
        # LISTEN before the first read, so a save during that read still wakes us.
        if self._channels:
            await self._listen()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._drop_listeners()

    async def _listen(self) -> None:
        try:
            for params, channels in self._channels.values():
                listener = await psycopg.AsyncConnection.connect(**params, autocommit=True)
                self._listeners.append(listener)
                for channel in channels:
                    await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        except BaseException:
            await self._drop_listeners()
            raise

    async def _drop_listeners(self) -> None:
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            with contextlib.suppress(psycopg.Error):
                await listener.close()

    def stop(self) -> None:
        self.stopped.set()

    async def wait(self) -> None:
        """Return when new events may have been stored, or once stopped."""
        if self.stopped.is_set():
            return
        stop = asyncio.ensure_future(self.stopped.wait())
        try:
            if not self._channels:
                await asyncio.wait({stop}, timeout=self.poll_interval)
                return
            notified = asyncio.ensure_future(self._notified())
            try:
                await asyncio.wait(
                    {stop, notified},
                    timeout=self.poll_interval if self._polls else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                notified.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await notified
        finally:
            stop.cancel()

    async def _notified(self) -> None:
        try:
            if not self._listeners:  # lost: listen again, then read (a NOTIFY may be missed)
                await self._listen()
                return
            # The timeout is a safety net against a lost notification, not the mechanism.
            waits = [asyncio.ensure_future(_one_notify(listener)) for listener in self._listeners]
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
                await asyncio.gather(*waits, return_exceptions=True)
            for wait in done:
                wait.result()
        except psycopg.Error:  # a server went away: poll until it is back
            await self._drop_listeners()
            await asyncio.sleep(self.poll_interval)


async def _one_notify(listener: psycopg.AsyncConnection[Any]) -> None:
    async for _ in listener.notifies(timeout=1.0, stop_after=1):
        break


def _listen_params(log: RunLog) -> dict[str, Any] | None:
    """libpq's parameters of a connection that may LISTEN for the log's saves (a
    dedicated one, outside the store's pools: it holds a server session), with
    keepalives so that a vanished server is noticed; None: poll."""
    address = log.address
    if not isinstance(address, PostgresAddress):
        return None
    params = address.listen_params()
    return None if params is None else {**KEEPALIVES, **params}


async def follow(
    store: RunStore, after: After = None, *, poll_interval: float = POLL_INTERVAL
) -> AsyncIterator[RunEvent]:
    """Every public run event after ``after`` (None: from the first; a position; or
    ``{partition: position}``), in order within each partition.

    Never ends by itself: after the last stored event it waits for the next one
    (break out of the loop to stop). Raises ``InvalidArgumentError`` for a bad
    ``after``.
    """
    reader = EventReader(store, after)
    async with Tail(store, poll_interval) as tail:
        while True:
            events, more = await asyncio.to_thread(reader.read)
            for event in events:
                yield event
            if not more:
                await tail.wait()
