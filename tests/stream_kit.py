"""What the streaming tests share: the text a consumer shows, and a turn driven
from a thread of its own (as another process would drive it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from kuralle_es import StreamPart


def shown(parts: list[StreamPart], step: int | None = None) -> str:
    """The text a consumer shows: each attempt's deltas, minus retracted attempts
    (of model step ``step`` only, when given)."""
    attempts: dict[tuple[int, int], list[str]] = {}
    for part in parts:
        if step is not None and part.step != step:
            continue
        key = (part.step or 0, part.attempt or 0)
        if part.type == "text-delta":
            attempts.setdefault(key, []).append(part.delta or "")
        elif part.type == "retract":
            attempts.pop(key, None)
    return "".join("".join(pieces) for _, pieces in sorted(attempts.items()))


@contextmanager
def in_thread(
    main: Callable[[], Coroutine[Any, Any, None]], release: Callable[[], None]
) -> Iterator[list[BaseException]]:
    """Run ``main()`` on an event loop of its own thread while the block runs; the
    list holds what it raised. Leaving the block calls ``release`` (whatever the
    turn waits for) and waits for the thread."""
    failures: list[BaseException] = []

    def drive() -> None:
        try:
            asyncio.run(main())
        except BaseException as failure:  # reported by the test
            failures.append(failure)

    thread = threading.Thread(target=drive)
    thread.start()
    try:
        yield failures
    finally:
        release()
        thread.join(60)
