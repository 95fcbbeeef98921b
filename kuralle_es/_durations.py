"""What the public API accepts as a length of time or a deadline (internal).

A deadline, a durable sleep, a lease's TTL, a tool's timeout, retry
intervals, a sweeper's interval and their command-line flags all refuse the
same values in the same way (docs/guarantees.md, "At the edges"): NaN,
infinities, booleans (Python counts them as ints), strings, values that are
not above zero, and values that would land past the year 9999, where
``datetime`` arithmetic overflows. One function says it for lengths of time
and one for deadlines, so no door can let through what another refuses.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from .errors import InvalidArgumentError

__all__ = ["LATEST", "deadline_at", "positive_seconds"]

#: The latest moment a deadline or a wake time may name.
LATEST = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)


def positive_seconds(value: object, what: str, *, zero_ok: bool = False) -> float:
    """``value`` as a finite number of seconds above 0 (0 too with ``zero_ok``), that
    added to now stays before the year 10000; else ``InvalidArgumentError`` naming
    ``what``. A ``timedelta`` counts as its seconds."""
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    least = "0 or more" if zero_ok else "above 0"
    if (
        not isinstance(seconds, int | float)
        or isinstance(seconds, bool)
        or not math.isfinite(seconds)
        or seconds < 0
        or (seconds == 0 and not zero_ok)
    ):
        msg = f"{what} must be a finite number of seconds {least}, got {value!r}"
        raise InvalidArgumentError(msg)
    if seconds > (LATEST - datetime.now(UTC)).total_seconds():
        msg = f"{what} of {value!r} seconds lands past the year 9999; give a shorter time"
        raise InvalidArgumentError(msg)
    return float(seconds)


def deadline_at(value: datetime | timedelta | float | None, now: datetime) -> datetime | None:
    """The absolute UTC moment a ``deadline=`` names: a timezone-aware ``datetime``
    as is, a ``timedelta`` or a number of seconds from ``now``; None for None.
    ``InvalidArgumentError`` for anything else (see ``positive_seconds``)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            msg = "deadline must be timezone-aware (e.g. datetime.now(UTC) + timedelta(...))"
            raise InvalidArgumentError(msg)
        try:
            return value.astimezone(UTC)
        except OverflowError:
            msg = f"deadline {value!r} lands past the year 9999; give an earlier one"
            raise InvalidArgumentError(msg) from None
    seconds = positive_seconds(value, "deadline")
    try:
        return now + timedelta(seconds=seconds)
    except OverflowError:
        msg = f"deadline of {value!r} seconds lands past the year 9999; give a shorter one"
        raise InvalidArgumentError(msg) from None
