"""``TurnHandle``: the caller's view of one turn in flight."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from ..shapes import StreamPart, TurnResult

__all__ = ["TurnHandle", "TurnSink"]


class TurnSink:
    """The driver's side of a handle: stream parts and the run id."""

    def __init__(self) -> None:
        self.parts: asyncio.Queue[StreamPart | None] = asyncio.Queue()
        self.run_id: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # A turn refused before opening may never have its run_id awaited.
        self.run_id.add_done_callback(_mark_retrieved)

    def emit(self, part: StreamPart) -> None:
        self.parts.put_nowait(part)

    def opened(self, run_id: str) -> None:
        if not self.run_id.done():
            self.run_id.set_result(run_id)

    def closed(self, error: BaseException | None) -> None:
        if not self.run_id.done():
            if error is None:
                self.run_id.set_exception(RuntimeError("the turn ended before opening a run"))
            else:
                self.run_id.set_exception(error)
        self.parts.put_nowait(None)


def _mark_retrieved(future: asyncio.Future[str]) -> None:
    if not future.cancelled():
        future.exception()


def _task_retrieved(task: asyncio.Task[TurnResult]) -> None:
    # Errors reach callers through result() and the stream; a caller that
    # awaits neither must not see "exception was never retrieved" noise.
    if not task.cancelled():
        task.exception()


class TurnHandle:
    """Returned at once by ``Runtime.run``; the turn runs as a task behind it."""

    def __init__(self, drive: Callable[[TurnSink], Coroutine[Any, Any, TurnResult]]) -> None:
        self._sink = TurnSink()
        self._task = asyncio.get_running_loop().create_task(self._main(drive))
        self._task.add_done_callback(_task_retrieved)

    async def _main(
        self, drive: Callable[[TurnSink], Coroutine[Any, Any, TurnResult]]
    ) -> TurnResult:
        error: BaseException | None = None
        try:
            return await drive(self._sink)
        except BaseException as e:
            error = e
            raise
        finally:
            self._sink.closed(error)

    @property
    def run_id(self) -> asyncio.Future[str]:
        """Resolves as soon as the run is opened; raises if it could not be."""
        return self._sink.run_id

    async def result(self) -> TurnResult:
        """The turn's result; its errors, refusals included, are raised here."""
        return await asyncio.shield(self._task)

    def __aiter__(self) -> AsyncIterator[StreamPart]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[StreamPart]:
        while True:
            part = await self._sink.parts.get()
            if part is None:
                break
            yield part
        await self.result()
