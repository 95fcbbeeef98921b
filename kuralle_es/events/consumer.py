"""``Consumer``: a named follower that keeps its own position (public API).

A handler is ``handler(event)`` or ``handler(event, tx)``, sync or async
(a sync handler runs in a worker thread, off the event loop).

- ``handler(event, tx)`` on PostgreSQL or SQLite: ``tx`` is the driver
  connection (``psycopg.Connection`` / ``sqlite3.Connection``) inside the open
  transaction that records the consumer's new position (the psycopg one
  comes from the store's pool and returns rows as dicts). What the handler
  writes through it commits together with the position, or not at all: those
  writes apply exactly once, across crashes and even with two instances of
  the same consumer running. Up to ``batch_size`` events (100) share one
  transaction when several are waiting; if a handler raises, the batch is
  rolled back and applied again one event per transaction, so only the failing
  event is left unapplied (effects a handler has outside ``tx`` may therefore
  happen again). Keep such handlers short: the transaction is open while they
  run (on SQLite it holds the database's single write lock).
- ``handler(event)`` (and every handler on a memory store, where ``tx`` is
  None): the handler runs, then the position is recorded. A crash between the
  two delivers that one event again on restart: at-least-once, so its effect
  should be idempotent (key it by ``event.position``).

A handler that raises stops the consumer with that error, its position left
before the failed event, so the next run retries it.

In a store of several partitions (docs/scaling.md) the consumer keeps a
position per partition (under ``name`` for partition 0, ``name@i`` for
partition i), each in its partition's own database, and applies each
partition's events in their order, exactly once per partition with ``tx``:
there ``tx`` is a transaction of the database of the event's partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from .._callables import wants_call as _wants_tx
from .._journal.store import RunStore
from ..errors import AlreadyApplied, InvalidArgumentError
from .follow import POLL_INTERVAL, EventReader, LogReader, Tail
from .positions import Batch, PositionBook
from .types import RunEvent

__all__ = ["BATCH_SIZE", "Consumer", "Handler"]

#: Events applied per transaction by a ``handler(event, tx)``.
BATCH_SIZE = 100

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
        batch_size: int = BATCH_SIZE,
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
        if not isinstance(batch_size, int) or batch_size < 1:
            msg = f"batch_size must be a positive int, got {batch_size!r}"
            raise InvalidArgumentError(msg)
        self.batch_size = batch_size
        #: Each partition's position book, and the name its position is kept under.
        self._books = {log.partition: PositionBook(log) for log in store.partitions}
        self._names = {p: name if p == 0 else f"{name}@{p}" for p in self._books}
        self._wants_tx = _wants_tx(handler)
        self._async = _is_async(handler)
        self._tail: Tail | None = None
        self._stop_requested = False

    async def position(self) -> int | dict[int, int | None] | None:
        """The position of the last event this consumer applied (None: none yet); in a
        store of several partitions, ``{partition: position}`` (as ``follow`` takes it)."""
        positions = await asyncio.to_thread(self._positions)
        return positions[0] if len(positions) == 1 else positions

    def _positions(self) -> dict[int, int | None]:
        return {p: book.position(self._names[p]) for p, book in self._books.items()}

    async def run_until_caught_up(self) -> int:
        """Apply every event stored so far; returns how many were applied."""
        reader = EventReader(self.store, await asyncio.to_thread(self._positions))
        applied = 0
        for log in reader.logs:
            target = await asyncio.to_thread(log.head)
            while log.position < target:
                events, more = await asyncio.to_thread(log.read, target)
                applied += await self._apply_all(events)
                if not more or self._stop_requested:
                    break
        return applied

    async def run(self) -> None:
        """Apply events as they are stored, until ``stop()``."""
        self._stop_requested = False
        reader = EventReader(self.store, await asyncio.to_thread(self._positions))
        async with Tail(self.store, self.poll_interval) as tail:
            self._tail = tail
            try:
                while not self._stop_requested:
                    more = False
                    for log in reader.logs:
                        more = await self._apply_next(log) or more
                    if not more:
                        await tail.wait()
            finally:
                self._tail = None

    async def _apply_next(self, log: LogReader) -> bool:
        """Apply the next batch of one partition; whether more may follow at once."""
        if self._stop_requested:
            return False
        events, more = await asyncio.to_thread(log.read)
        await self._apply_all(events)
        return more

    def stop(self) -> None:
        """Make ``run()`` return after the event in flight (call it from the event loop)."""
        self._stop_requested = True
        if self._tail is not None:
            self._tail.stop()

    # -------------------------------------------------------------- applying
    async def _apply_all(self, events: list[RunEvent]) -> int:
        """Apply events in order until done or stopped; how many were applied."""
        applied = 0
        for partition, group in itertools.groupby(events, key=lambda e: e.partition):
            applied += await self._apply_partition(partition, list(group))
        return applied

    async def _apply_partition(self, partition: int, events: list[RunEvent]) -> int:
        transactional = self._wants_tx and self._books[partition].transactional
        size = self.batch_size if transactional else 1
        applied = 0
        for start in range(0, len(events), size):
            if self._stop_requested:
                break
            chunk = events[start : start + size]
            if transactional:
                applied += await self._apply_batch(chunk)
            else:
                applied += await self._apply_alone(chunk[0])
        return applied

    async def _apply_batch(self, chunk: list[RunEvent]) -> int:
        """Apply ``chunk`` in one transaction; if a handler fails, again one event at a
        time, so the events before the failing one are kept and it raises alone."""
        try:
            if self._async:
                return await self._batch_async(chunk)
            return await asyncio.to_thread(self._batch_sync, chunk)
        except Exception:
            if len(chunk) == 1:
                raise
        applied = 0
        for event in chunk:
            applied += await self._apply_batch([event])
        return applied

    def _begin(self, chunk: list[RunEvent]) -> contextlib.AbstractContextManager[Batch]:
        partition = chunk[0].partition
        return self._books[partition].begin(self._names[partition])

    def _batch_sync(self, chunk: list[RunEvent]) -> int:
        with self._begin(chunk) as batch:
            todo = _after(chunk, batch.position)
            for event in todo:
                self.handler(event, batch.tx)
            if todo:
                batch.advance(todo[-1].position)
            return len(todo)

    async def _batch_async(self, chunk: list[RunEvent]) -> int:
        # The handler runs on the loop, inside a transaction entered and left in
        # worker threads.
        stack = contextlib.ExitStack()
        batch = await asyncio.to_thread(stack.enter_context, self._begin(chunk))
        try:
            todo = _after(chunk, batch.position)
            for event in todo:
                await self.handler(event, batch.tx)
            if todo:
                await asyncio.to_thread(batch.advance, todo[-1].position)
        except BaseException:
            await asyncio.to_thread(stack.__exit__, *sys.exc_info())
            raise
        await asyncio.to_thread(stack.close)
        return len(todo)

    async def _apply_alone(self, event: RunEvent) -> int:
        """Run the handler, then record the position: at-least-once."""
        args = (event, None) if self._wants_tx else (event,)
        try:
            if self._async:
                await self.handler(*args)
                await asyncio.to_thread(self._record, event)
            else:  # both in one worker-thread hop
                await asyncio.to_thread(self._call_and_record, args, event)
        except AlreadyApplied:  # another instance of this consumer got further
            return 0
        return 1

    def _call_and_record(self, args: tuple[Any, ...], event: RunEvent) -> None:
        self.handler(*args)
        self._record(event)

    def _record(self, event: RunEvent) -> None:
        self._books[event.partition].record(self._names[event.partition], event.position)


def _after(events: list[RunEvent], position: int | None) -> list[RunEvent]:
    return events if position is None else [e for e in events if e.position > position]
