"""The runtime's clock: where every time it dates comes from, except a lease's (internal).

``Runtime(clock=...)`` takes any object with ``now() -> datetime``. The runtime
reads it for ``ctx.now()``'s first recording, a durable sleep's wake time, a
wait's deadline, a retry's next attempt, and what the sweeps count as due or
expired; a lease's expiry is the store's clock's alone (docs/concepts.md,
"Leases"), so a clock set ahead can never take a run another worker holds.
The testing kit's ``TestClock`` is one whose time moves only when a test says
(docs/howto/testing.md).
"""

from __future__ import annotations

import asyncio
import math
import random
from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable

from .errors import InvalidArgumentError

__all__ = [
    "SYSTEM_CLOCK",
    "Clock",
    "FixedClock",
    "SystemClock",
    "TestClock",
    "as_utc",
    "back_off",
    "check_clock",
    "utc",
]


@runtime_checkable
class Clock(Protocol):
    """Anything with ``now()`` returning the current time (aware, or naive UTC)."""

    def now(self) -> datetime: ...


class SystemClock:
    """This machine's clock, in UTC: the runtime's default."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def __repr__(self) -> str:
        return "SystemClock()"


#: The clock of every runtime not given one.
SYSTEM_CLOCK = SystemClock()


class FixedClock:
    """A clock that always reads ``at``: what a sweep's ``now=`` means to the turns it drives."""

    def __init__(self, at: datetime) -> None:
        self.at = utc(at, "now")

    def now(self) -> datetime:
        return self.at

    def __repr__(self) -> str:
        return f"FixedClock({self.at.isoformat()})"


class TestClock:
    """A clock for tests whose time moves only when the test moves it
    (``kuralle_es.testing.TestClock``).

    ``TestClock(start=None)`` reads ``start`` (default: this machine's time
    when it is made) until ``advance`` or ``set`` moves it. Give it to
    ``Runtime(clock=...)``: a one-hour ``ctx.sleep`` is woken by
    ``clock.advance(hours=1)`` then ``await fire_timers(runtime)``, and a
    24-hour approval deadline denied by ``clock.advance(hours=24)`` then
    ``await sweep_deadlines(runtime)``, at once, with no real waiting.
    Leases stay on the store's clock, so a clock moved ahead never lets a
    sweep take a run another worker holds.
    """

    #: Not a test class, whatever pytest makes of its name.
    __test__ = False

    def __init__(self, start: datetime | None = None) -> None:
        self._now = datetime.now(UTC) if start is None else utc(start, "start")

    def now(self) -> datetime:
        """The clock's time (aware, UTC)."""
        return self._now

    def advance(self, seconds: float | timedelta | None = None, /, **delta: float) -> datetime:
        """Move the clock forward and return its new time.

        ``advance(3600)``, ``advance(timedelta(hours=1))`` and ``advance(hours=1)``
        (any ``timedelta`` keyword: ``days``, ``minutes``, ...) are the same; a
        positional amount and keywords add up. ``InvalidArgumentError`` for a
        negative or non-finite amount (use ``set`` to go back) or a bad keyword.
        """
        step = _length(seconds, delta)
        try:
            self._now = self._now + step
        except OverflowError:
            msg = f"advancing {self._now.isoformat()} by {step} lands past the year 9999"
            raise InvalidArgumentError(msg) from None
        return self._now

    def set(self, at: datetime) -> datetime:
        """Set the clock to ``at`` (earlier or later; a naive ``datetime`` is UTC);
        returns it."""
        self._now = utc(at, "at")
        return self._now

    def __repr__(self) -> str:
        return f"TestClock({self._now.isoformat()})"


def _length(seconds: float | timedelta | None, delta: dict[str, float]) -> timedelta:
    """What ``TestClock.advance`` was asked to move by."""
    if seconds is None and not delta:
        msg = "advance needs an amount: advance(60), advance(timedelta(...)) or advance(hours=2)"
        raise InvalidArgumentError(msg)
    total = timedelta()
    if isinstance(seconds, timedelta):
        total = seconds
    elif seconds is not None:
        if (
            not isinstance(seconds, int | float)
            or isinstance(seconds, bool)
            or not math.isfinite(seconds)
        ):
            msg = f"advance takes seconds (a finite number) or a timedelta, got {seconds!r}"
            raise InvalidArgumentError(msg)
        total = timedelta(seconds=seconds)
    if delta:
        bad = [v for v in delta.values() if isinstance(v, bool) or not isinstance(v, int | float)]
        if bad or not all(math.isfinite(v) for v in delta.values()):
            msg = f"advance's keywords take finite numbers, got {delta!r}"
            raise InvalidArgumentError(msg)
        try:
            total += timedelta(**delta)
        except (TypeError, OverflowError) as e:
            msg = f"advance takes timedelta's keywords (days, hours, minutes, ...): {e}"
            raise InvalidArgumentError(msg) from None
    if total < timedelta():
        msg = f"advance moves the clock forward, got {total}; use set() to go back"
        raise InvalidArgumentError(msg)
    return total


def utc(at: object, what: str) -> datetime:
    """``at`` as an aware UTC ``datetime`` (a naive one is taken as UTC, as the
    views take it); ``InvalidArgumentError`` naming ``what`` for anything else."""
    if not isinstance(at, datetime):
        msg = f"{what} must be a datetime, got {at!r}"
        raise InvalidArgumentError(msg)
    return as_utc(at)


def as_utc(at: datetime) -> datetime:
    """``at`` as an aware UTC ``datetime`` (a naive one is taken as UTC): the one
    way a time read from a store, a user or a clock is made comparable."""
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


async def back_off(attempt: int) -> None:
    """A short random pause before a lost compare-and-set is tried again (``attempt``
    counts from 0): it grows with the attempt up to 50 ms, so writers racing for
    one run spread out instead of clashing again in step."""
    await asyncio.sleep(random.uniform(0, min(0.05, 0.002 * (attempt + 1))))


class _Checked:
    """A user's clock whose readings are made aware UTC (a naive reading is UTC)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def now(self) -> datetime:
        return utc(self.clock.now(), f"{self.clock!r}.now()")

    def __repr__(self) -> str:
        return repr(self.clock)


def check_clock(clock: object) -> Clock:
    """The runtime's clock: the system's for None, else ``clock`` (an object with a
    callable ``now``), its readings made aware UTC; ``InvalidArgumentError`` otherwise."""
    if clock is None:
        return SYSTEM_CLOCK
    if isinstance(clock, SystemClock | FixedClock | TestClock | _Checked):
        return clock
    if not callable(getattr(clock, "now", None)):
        msg = (
            f"clock must have a now() method returning a datetime (UTC), got {clock!r}; "
            "use kuralle_es.testing.TestClock() in tests"
        )
        raise InvalidArgumentError(msg)
    return _Checked(clock)  # type: ignore[arg-type]
