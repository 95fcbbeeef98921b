"""``Consumer``: a named follower that keeps its own position (public API).

A handler is ``handler(event)`` or ``handler(event, tx)``, sync or async
(a sync handler runs in a worker thread, off the event loop).

- ``handler(event, tx)`` on PostgreSQL or SQLite: ``tx`` is the driver
  connection (``psycopg.Connection`` / ``sqlite3.Connection``) inside the open
  transaction that records the consumer's new position. What the handler
  writes through it commits together with the position, or not at all: those
  writes apply exactly once, across crashes and even with two instances of
  the same consumer running. Keep such handlers short: the transaction is
  open while they run (on SQLite it holds the database's single write lock).
- ``handler(event)`` (and every handler on a memory store, where ``tx`` is
  None): the handler runs, then the position is recorded. A crash between the
  two delivers that one event again on restart: at-least-once, so its effect
  should be idempotent (key it by ``event.position``).

A handler that raises stops the consumer with that error, its position left
before the failed event, so the next run retries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import InvalidArgumentError
from ..store import RunStore
from ..tools import wants_call as _wants_tx
from .follow import POLL_INTERVAL, EventReader, Tail
from .positions import AlreadyApplied, PositionBook
from .types import RunEvent

__all__ = ["Consumer", "Handler"]

Handler = Callable[..., Any] | Callable[..., Awaitable[Any]]


def _is_async(handler: Handler) -> bool:
    call = getattr(handler, "__call__", None)  # noqa: B004 - an async __call__ counts too
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)


class Consumer:
    """Applies ``handler`` to every public run event once, in order, remembering where it is.

    Raises ``InvalidArgumentError`` for an empty ``name`` or a handler that is not callable.
    """

    def __init__(
        self,
        store: RunStore,
        name: str,
        handler: Handler,
        *,
        poll_interval: float = POLL_INTERVAL,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            msg = f"a consumer needs a non-empty name to keep its position under, got {name!r}"
            raise InvalidArgumentError(msg)
        if not callable(handler):
            msg = f"handler must be handler(event) or handler(event, tx), got {handler!r}"
            raise InvalidArgumentError(msg)
        self.store = store
        self.name = name
        self.handler = handler
        self.poll_interval = poll_interval
        self._book = PositionBook(store)
        self._wants_tx = _wants_tx(handler)
        self._async = _is_async(handler)
        self._tail: Tail | None = None
        self._stop_requested = False

    async def position(self) -> int | None:
        """The position of the last event this consumer applied (None: none yet)."""
        return await asyncio.to_thread(self._book.position, self.name)

    async def run_until_caught_up(self) -> int:
        """Apply every event stored so far; returns how many were applied."""
        reader = EventReader(self.store, await self.position())
        target = await asyncio.to_thread(reader.head)
        applied = 0
        while reader.position < target:
            events, more = await asyncio.to_thread(reader.read, target)
            for event in events:
                applied += await self._apply(event)
            if not more:
                break
        return applied

    async def run(self) -> None:
        """Apply events as they are stored, until ``stop()``."""
        self._stop_requested = False
        reader = EventReader(self.store, await self.position())
        async with Tail(self.store, self.poll_interval) as tail:
            self._tail = tail
            try:
                while not self._stop_requested:
                    events, more = await asyncio.to_thread(reader.read)
                    for event in events:
                        if self._stop_requested:
                            return
                        await self._apply(event)
                    if not more:
                        await tail.wait()
            finally:
                self._tail = None

    def stop(self) -> None:
        """Make ``run()`` return after the event in flight (call it from the event loop)."""
        self._stop_requested = True
        if self._tail is not None:
            self._tail.stop()

    # -------------------------------------------------------------- applying
    async def _apply(self, event: RunEvent) -> int:
        """Apply one event; 0 if another instance of this consumer already had."""
        try:
            if not self._async:  # the whole application in one worker-thread hop
                await asyncio.to_thread(self._apply_sync, event)
            elif self._wants_tx and self._book.transactional:
                await self._apply_in_transaction(event)
            else:
                await self._call(event, None)
                await asyncio.to_thread(self._book.record, self.name, event.position)
        except AlreadyApplied:
            return 0
        return 1

    def _apply_sync(self, event: RunEvent) -> None:
        if self._wants_tx and self._book.transactional:
            with self._book.begin(self.name, event.position) as tx:
                self.handler(event, tx)
            return
        self.handler(*((event, None) if self._wants_tx else (event,)))
        self._book.record(self.name, event.position)

    async def _apply_in_transaction(self, event: RunEvent) -> None:
        # An async handler runs on the loop, between a transaction entered and
        # left in worker threads.
        stack = contextlib.ExitStack()
        tx = await asyncio.to_thread(
            stack.enter_context, self._book.begin(self.name, event.position)
        )
        try:
            await self._call(event, tx)
        except BaseException:
            await asyncio.to_thread(stack.__exit__, *sys.exc_info())
            raise
        await asyncio.to_thread(stack.close)

    async def _call(self, event: RunEvent, tx: Any) -> None:
        await self.handler(*((event, tx) if self._wants_tx else (event,)))
