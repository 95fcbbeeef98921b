"""``follow``: the public events after a position, in order, waiting for new ones (public API).

Reading is a pull over the store's notification log (``select_notifications``
after the last position seen, filtered to the stored topics that have a public
meaning). That pull is the whole correctness argument: notification ids only
grow in commit order (PostgreSQL saves lock the events table; SQLite has one
writer), so reading strictly after the last id seen never skips an event and
never repeats one, whatever gaps the ids have. Waiting is only a wake-up: on
PostgreSQL a ``LISTEN`` on the store's notify channel, on SQLite and memory a
short poll; a missed wake-up costs at most one poll interval, never an event.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from eventsourcing.postgres import PostgresApplicationRecorder
from psycopg import sql

from .._journal.store import RunStore
from ..errors import InvalidArgumentError
from .translate import PUBLIC_TOPICS, Translator
from .types import RunEvent

__all__ = ["EventReader", "Tail", "follow"]

#: Notifications read per query.
BATCH_SIZE = 500
#: Seconds between polls (SQLite, memory), and the safety net of a PostgreSQL wait.
POLL_INTERVAL = 0.1


class EventReader:
    """A position in the log and the translator that goes with it (blocking calls)."""

    def __init__(self, store: RunStore, after: int | None, batch_size: int = BATCH_SIZE) -> None:
        if after is not None and (not isinstance(after, int) or after < 0):
            msg = f"after must be a notification position (an int >= 0) or None, got {after!r}"
            raise InvalidArgumentError(msg)
        self.store = store
        self.position = after or 0
        self.batch_size = batch_size
        self._translator = Translator(store)

    def read(self, stop: int | None = None) -> tuple[list[RunEvent], bool]:
        """The next batch of public events (up to ``stop``), and whether more may follow at once."""
        notifications = self.store.recorder.select_notifications(
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
        """The last position stored right now (0 for an empty store)."""
        return self.store.recorder.max_notification_id() or 0


class Tail:
    """Wakes a follower when new events may be stored; ``stop()`` ends every wait."""

    def __init__(self, store: RunStore, poll_interval: float = POLL_INTERVAL) -> None:
        self.store = store
        self.poll_interval = poll_interval
        self.stopped = asyncio.Event()
        self._listener: psycopg.AsyncConnection[Any] | None = None

    async def __aenter__(self) -> Tail:
        # LISTEN before the first read, so a save during that read still wakes us.
        if isinstance(self.store.recorder, PostgresApplicationRecorder):
            await self._listen(self.store.recorder)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._drop_listener()

    async def _listen(self, recorder: PostgresApplicationRecorder) -> None:
        kwargs = recorder.datastore.pool.kwargs or {}
        params: dict[str, Any] = dict(kwargs() if callable(kwargs) else kwargs)
        params.pop("row_factory", None)
        self._listener = await psycopg.AsyncConnection.connect(**params, autocommit=True)
        channel = sql.Identifier(recorder.channel_name)
        await self._listener.execute(sql.SQL("LISTEN {}").format(channel))

    async def _drop_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
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
            if not isinstance(self.store.recorder, PostgresApplicationRecorder):
                await asyncio.wait({stop}, timeout=self.poll_interval)
                return
            notified = asyncio.ensure_future(self._notified(self.store.recorder))
            try:
                await asyncio.wait({stop, notified}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                notified.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await notified
        finally:
            stop.cancel()

    async def _notified(self, recorder: PostgresApplicationRecorder) -> None:
        try:
            if self._listener is None:  # lost: listen again, then read (a NOTIFY may be missed)
                await self._listen(recorder)
                return
            # The timeout is a safety net against a lost notification, not the mechanism.
            async for _ in self._listener.notifies(timeout=1.0, stop_after=1):
                break
        except psycopg.Error:  # the server went away: poll until it is back
            await self._drop_listener()
            await asyncio.sleep(self.poll_interval)


async def follow(
    store: RunStore, after: int | None = None, *, poll_interval: float = POLL_INTERVAL
) -> AsyncIterator[RunEvent]:
    """Every public run event after position ``after`` (None: from the first), in order.

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
