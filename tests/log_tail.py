"""A reader tailing a notification log while writers save, as a catch-up projection reads it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def tail_while(recorder: Any, write: Callable[[], None]) -> list[int]:
    """Run ``write`` while a thread reads ``recorder``'s notification log after the
    last id it saw; the ids it saw, in order, once ``write`` returned and the log is
    read to its end. The reader's error, if any, is raised here."""
    done = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def tail() -> None:
        last: int | None = None
        try:
            while True:
                finished = done.is_set()
                page = recorder.select_notifications(start=last, limit=50, inclusive_of_start=False)
                seen.extend(n.id for n in page)
                if page:
                    last = page[-1].id
                elif finished:
                    return
        except BaseException as e:  # pragma: no cover - raised below
            errors.append(e)

    reader = threading.Thread(target=tail)
    reader.start()
    try:
        write()
    finally:
        done.set()
        reader.join()
    if errors:
        raise errors[0]
    return seen
