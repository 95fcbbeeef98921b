"""Where sync tools run: threads of their own, never the event loop (docs/node-code.md).

A sync ``execute`` may block (a payment API called without a timeout), so it
runs on a tool thread while the loop goes on with the lease heartbeat and the
process's other turns. The hop there and back is paid on every sync tool
step, so both directions are kept cheap under load: threads take calls from
one queue (one that finished a call takes the next without sleeping), and
results go back to each loop in batches (one wake-up of the loop for all the
results that came in meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["IDLE_SECONDS", "in_tool_thread"]

#: Seconds a tool thread with nothing to do waits for another call before it ends.
IDLE_SECONDS = 30.0


async def in_tool_thread(fn: Callable[[], Any]) -> Any:
    """Run a sync tool on a tool thread (awaiting an awaitable it returns).

    Not the loop's default executor: an abandoned attempt would hold one of
    its threads, and ``asyncio.run`` waits for that executor at exit. The
    tool runs in a copy of the caller's context (as ``asyncio.to_thread``).
    """
    loop = asyncio.get_running_loop()
    results = _Results.of(loop)
    context = contextvars.copy_context()
    future: asyncio.Future[Any] = loop.create_future()

    def work() -> None:
        try:
            value, error = context.run(fn), None
        except BaseException as exc:  # handed to the awaiting task
            value, error = None, exc
        results.put(future, value, error)

    _TOOL_THREADS.submit(work)
    outcome = await future
    if inspect.isawaitable(outcome):
        outcome = await outcome
    return outcome


class _Results:
    """The outcomes of one loop's tool calls, handed back to it in batches.

    ``call_soon_threadsafe`` for each result would wake the loop (a write to
    its self-pipe) once a call; a busy loop gets one callback for all the
    results that came in since it last took them.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._guard = threading.Lock()
        self._waiting: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Results:
        """The loop's results (made on the loop's own thread, so never twice)."""
        results = _RESULTS_OF_LOOP.get(loop)
        if results is None:
            results = _RESULTS_OF_LOOP[loop] = cls(loop)
        return results

    def put(self, future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
        """From a tool thread: settle ``future`` on the loop, with the others waiting."""
        with self._guard:
            self._waiting.append((future, value, error))
            first = len(self._waiting) == 1
        if first:
            # RuntimeError: the loop is gone, nobody waits for these attempts any more.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._settle)

    def _settle(self) -> None:
        with self._guard:
            waiting, self._waiting = self._waiting, []
        for future, value, error in waiting:
            if future.done():  # abandoned after a timeout
                continue
            if error is None:
                future.set_result(value)
            elif isinstance(error, StopIteration):  # a future refuses StopIteration
                future.set_exception(RuntimeError(f"the tool raised {error!r}"))
            else:
                future.set_exception(error)


_RESULTS_OF_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Results] = (
    weakref.WeakKeyDictionary()
)


class _ToolThreads:
    """Daemon threads for sync tools, taking calls from one queue.

    Starting a thread costs more than a short tool call, and so does waking a
    sleeping one: a thread that finished a call takes the next queued one
    without sleeping, and an idle thread waits up to ``IDLE_SECONDS`` for
    more. A blocking call never delays another: a call is queued only when an
    idle thread is left to take it, otherwise a new thread starts for it (so a
    call that outlives its timeout keeps its thread to itself).

    Invariant, whenever ``_guard`` is free: ``_unclaimed <= _idle`` (every
    queued call has an idle thread to take it).
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0  # threads not running a call
        self._unclaimed = 0  # calls queued that no thread has taken yet

    def submit(self, work: Callable[[], None]) -> None:
        with self._guard:
            self._unclaimed += 1
            start = self._unclaimed > self._idle
            if start:
                self._idle += 1  # the new thread, idle until it takes a call
        self._calls.put(work)
        if start:
            threading.Thread(target=self._serve, name="kuralle-tool", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                work = self._calls.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._guard:
                    if self._unclaimed < self._idle:  # the others cover every queued call
                        self._idle -= 1
                        return
                continue  # a queued call may count on this thread
            with self._guard:
                self._idle -= 1
                self._unclaimed -= 1
            work()
            with self._guard:
                self._idle += 1


_TOOL_THREADS = _ToolThreads()
