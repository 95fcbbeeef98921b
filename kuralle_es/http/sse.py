"""A run's stored stream as Server-Sent Events (internal; docs/streaming.md).

Each part is one event whose ``id`` is its offset and whose ``data`` is the
part as JSON (its ``type`` inside, so a browser's ``EventSource.onmessage``
gets every part). A client that reconnects sends the last id it saw as
``Last-Event-ID`` and is answered from the next part on: nothing twice,
nothing missed. Once the run is at rest and every part was sent, an ``end``
event says so (a browser client closes its ``EventSource`` on it, which
would otherwise reconnect). A comment line every ``KEEPALIVE`` seconds keeps
proxies from closing a quiet stream. The dashboard serves the same events.
The wire format is FastAPI's (``fastapi.sse``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi.sse import KEEPALIVE_COMMENT, format_sse_event
from starlette.responses import StreamingResponse

from ..errors import InvalidArgumentError
from ..shapes import StreamPart

__all__ = ["KEEPALIVE", "EventStream", "last_event_id", "sse_events"]

#: Seconds of quiet after which a comment line is sent.
KEEPALIVE = 15.0
#: How long a browser waits before it reconnects a dropped stream (ms).
RETRY_MS = 1000


class EventStream(StreamingResponse):
    """``text/event-stream``, never cached nor buffered by a proxy on the way."""

    media_type = "text/event-stream"

    def __init__(self, parts: AsyncIterator[StreamPart]) -> None:
        super().__init__(
            sse_events(parts),
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )


def last_event_id(header: str | None, after: int) -> int:
    """Where a stream resumes: after the ``Last-Event-ID`` a reconnecting client
    sends, else after ``after``; ``InvalidArgumentError`` for an id that is not
    an offset this server gave."""
    if header is None or header == "":
        return after
    if not header.isdigit() or len(header) > 18:
        msg = f"Last-Event-ID must be an offset of the run's stream, got {header[:40]!r}"
        raise InvalidArgumentError(msg)
    return int(header)


async def sse_events(parts: AsyncIterator[StreamPart]) -> AsyncIterator[bytes]:
    """The events of ``parts``, then ``end``; comments while nothing comes."""
    yield format_sse_event(retry=RETRY_MS)
    iterator = aiter(parts)
    next_part: asyncio.Task[StreamPart] | None = None
    try:
        while True:
            if next_part is None:
                next_part = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({next_part}, timeout=KEEPALIVE)
            if not done:
                yield KEEPALIVE_COMMENT
                continue
            try:
                part = next_part.result()
            except StopAsyncIteration:
                break
            finally:
                next_part = None
            body = part.model_dump_json(exclude_none=True)
            yield format_sse_event(data_str=body, id=str(part.offset))
        yield format_sse_event(event="end", data_str="{}")
    finally:
        if next_part is not None:
            next_part.cancel()
            with contextlib.suppress(BaseException):
                await next_part
        closing = getattr(iterator, "aclose", None)
        if closing is not None:
            with contextlib.suppress(Exception):
                await closing()
