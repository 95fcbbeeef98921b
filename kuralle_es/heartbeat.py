"""A lease heartbeat while effects execute (internal).

A tool (or a model call) may take longer than the lease. While at least one
effect of a turn executes, ``Heartbeat`` calls ``beat`` about every
``interval`` seconds; the journal's beat renews the lease with a
compare-and-set save, so another worker never sees the lease lapse and take
the run over mid-effect. A beat that fails (another writer won) stops the
heartbeat; the journal remembers the failure and the turn's next save raises it.

An effect shorter than ``interval`` costs one timer, armed and cancelled: no
task is started unless a beat is due.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType

__all__ = ["Heartbeat"]


class Heartbeat:
    """Runs ``beat`` every ``interval`` seconds while entered (re-entrant, counted)."""

    def __init__(self, beat: Callable[[], Awaitable[None]], interval: float) -> None:
        self._beat = beat
        self._interval = interval
        self._depth = 0
        self._timer: asyncio.TimerHandle | None = None
        self._beating: asyncio.Task[None] | None = None
        self._failed = False

    async def __aenter__(self) -> None:
        self._depth += 1
        self._arm()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._depth -= 1
        if self._depth:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._beating is not None:
            # Never cancel a beat mid-save: its save runs on in a thread, and
            # the run's next save must not overlap it. Let it finish instead.
            await asyncio.shield(self._beating)

    def _arm(self) -> None:
        if self._depth and not self._failed and self._timer is None and self._beating is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._interval, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._beating = asyncio.get_running_loop().create_task(self._run_beat())

    async def _run_beat(self) -> None:
        try:
            await self._beat()
        except Exception:
            # The journal keeps the failure and raises it at the next save.
            self._failed = True
        finally:
            self._beating = None
        self._arm()
