"""Live pages: the run events as server-sent events, for the pages' script (internal).

``GET /events`` streams ``kuralle_es.events.follow`` from the positions the
page was rendered at (``?after=``; a reconnecting browser's ``Last-Event-ID``
moves its partition on), so no event between the page and its stream is lost:
one ``run`` event (its data ``{"run_id", "type"}``,
its id the event's partition and position) per public run event, only for one
run with ``?run=RUN_ID``. The page's script (``static/live.js``) answers one by
fetching its own page again and swapping the parts marked ``data-live``, so a
page changes in place when its runs do, without a reload, and a form being
filled in is left alone. A stream lasts ``STREAM_SECONDS`` at most: the browser
reconnects by itself (the ``retry`` field), and a server being stopped never
waits long for an open stream. A comment line every ``KEEPALIVE_SECONDS``
keeps proxies from closing a quiet stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

from .._journal.store import RunStore
from ..events import RunEvent, follow

__all__ = [
    "KEEPALIVE_SECONDS",
    "STREAM_SECONDS",
    "heads",
    "positions_text",
    "read_positions",
    "run_events",
]

STREAM_SECONDS = 30.0
KEEPALIVE_SECONDS = 10.0
#: How often a follower over SQLite or memory looks for new events.
POLL_SECONDS = 0.25
#: What the browser waits before it reconnects a stream that ended (milliseconds).
RETRY_MS = 500
#: Events waiting to be sent to one browser; past it, more are dropped (a page
#: fetches itself once for many events anyway).
QUEUE_SIZE = 100


async def heads(store: RunStore) -> dict[int, int]:
    """Each partition's last position now: where the stream of a page rendered now starts."""
    found = await asyncio.gather(
        *(asyncio.to_thread(log.recorder.max_notification_id) for log in store.partitions)
    )
    return {log.partition: head or 0 for log, head in zip(store.partitions, found, strict=True)}


def positions_text(positions: dict[int, int]) -> str:
    """Positions as a page's stream URL carries them: ``partition:position,...``."""
    return ",".join(f"{partition}:{position}" for partition, position in sorted(positions.items()))


def read_positions(text: str | None, partitions: int) -> dict[int, int]:
    """The positions ``positions_text`` wrote (or a ``Last-Event-ID``, one of them); what
    is not one of the store's partitions and a position is left out."""
    found: dict[int, int] = {}
    for part in (text or "").split(",")[:partitions]:
        partition, _, position = part.partition(":")
        if partition.isdigit() and position.isdigit() and int(partition) < partitions:
            found[int(partition)] = int(position)
    return found


async def run_events(
    store: RunStore,
    run_id: str | None = None,
    after: dict[int, int] | None = None,
    seconds: float = STREAM_SECONDS,
) -> AsyncIterator[str]:
    """The text of an event stream: the run events stored after ``after`` (each
    partition's position; a partition left out: from now on), of ``run_id`` only when
    given, for ``seconds`` at most."""
    yield f"retry: {RETRY_MS}\n\n"
    queue: asyncio.Queue[RunEvent] = asyncio.Queue(QUEUE_SIZE)
    start = {**await heads(store), **(after or {})}

    async def pump() -> None:
        # A task of its own: waiting for the next event is never cut short, so the
        # follower is never left half-read by a keepalive's timeout.
        async for event in follow(store, after=start, poll_interval=POLL_SECONDS):
            if run_id is None or event.run_id == run_id:
                with contextlib.suppress(asyncio.QueueFull):  # a page refetches once anyway
                    queue.put_nowait(event)

    pumping = asyncio.create_task(pump())
    ends = time.monotonic() + seconds
    try:
        while (left := ends - time.monotonic()) > 0 and not pumping.done():
            try:
                event = await asyncio.wait_for(queue.get(), min(left, KEEPALIVE_SECONDS))
            except TimeoutError:
                yield ": still here\n\n"
                continue
            data = json.dumps({"run_id": event.run_id, "type": event.type})
            yield f"id: {event.partition}:{event.position}\nevent: run\ndata: {data}\n\n"
    finally:
        pumping.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await pumping
