"""A lease heartbeat while effects execute (internal).

A tool (or a model call) may take longer than the lease. While at least one
effect of a turn executes, ``Heartbeat`` calls ``beat`` about every
``interval`` seconds; the journal's beat renews the lease with a
compare-and-set save, so another worker never sees the lease lapse and take
the run over mid-effect. A beat that fails (another writer won) stops the
heartbeat; the journal remembers the failure and the turn's next save raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from types import TracebackType

__all__ = ["Heartbeat"]


class Heartbeat:
    """Runs ``beat`` every ``interval`` seconds while entered (re-entrant, counted)."""

    def __init__(self, beat: Callable[[], Awaitable[None]], interval: float) -> None:
        self._beat = beat
        self._interval = interval
        self._depth = 0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def __aenter__(self) -> None:
        self._depth += 1
        if self._task is None:
            self._stop = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(self._stop))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._depth -= 1
        if self._depth == 0 and self._task is not None:
            # Never cancel a beat mid-save: its save runs on in a thread, and
            # the run's next save must not overlap it. Ask it to stop instead.
            task, self._task = self._task, None
            self._stop.set()
            await asyncio.shield(task)

    async def _loop(self, stop: asyncio.Event) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
            if stop.is_set():
                return
            try:
                await self._beat()
            except Exception:
                # The journal keeps the failure and raises it at the next save.
                return
