"""A lease heartbeat while effects execute (internal).

A tool (or a model call) may take longer than the lease. While at least one
effect of a turn executes, ``Heartbeat`` calls ``beat`` about every
``interval`` seconds; the journal's beat renews the lease with a
compare-and-set save, so another worker never sees the lease lapse and take
the run over mid-effect. A beat that fails (another writer won) stops the
heartbeat; the journal remembers the failure and the turn's next save raises it.

One task per turn wakes every ``interval``; an effect only counts itself in
and out (``enter``/``leave``), so a short effect costs two counter updates.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

__all__ = ["Heartbeat"]


class Heartbeat:
    """Calls ``beat`` every ``interval`` seconds while an effect is entered."""

    def __init__(self, beat: Callable[[], Awaitable[None]], interval: float) -> None:
        self._beat = beat
        self._interval = interval
        self._busy = 0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def enter(self) -> None:
        """An effect starts executing (the first one starts the heartbeat's task)."""
        self._busy += 1
        if self._task is None and not self._stop.is_set():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def leave(self) -> None:
        """An effect is done executing."""
        self._busy -= 1

    async def stop(self) -> None:
        """End the heartbeat (at the end of the turn); waits for a beat in progress.

        A beat is never cancelled mid-save: its save runs on in a thread, and
        the run's next save must not overlap it.
        """
        self._stop.set()
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self._interval)
            if self._stop.is_set():
                return
            if self._busy:
                try:
                    await self._beat()
                except Exception:
                    # The journal keeps the failure and raises it at the next save.
                    return
