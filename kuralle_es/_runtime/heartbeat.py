"""A lease heartbeat while effects execute, on a thread of its own (internal).

A tool (or a model call) may take longer than the lease. While at least one
effect of a turn executes, its ``Heartbeat`` renews the run's lease record
about every ``interval`` seconds, so another worker never sees the lease
lapse and take the run over mid-effect. The renewal must not depend on the
turn's event loop: an async tool that blocks the loop (``time.sleep`` in an
``async def``), or node code that misuses the loop, would stop a heartbeat
that ran there, and the run would execute twice at once. So the beats come
from one daemon thread per process (the pulse), and each is a blocking
store call of its own (one small statement on the lease record over a
connection of the store's pool, never the loop's; nothing is appended to
the journal).

An effect counts itself in and out (``enter``/``leave``: an entry in a
list, no lock); the pulse is only told of it when it would otherwise sleep
past the heartbeat's next beat. While a turn holds its lease the pulse
sleeps until the next beat is due, whether or not an effect is executing
at the moment it looks, and beats then if an effect executes or finished
since the last beat; so a step shorter than the interval costs no thread,
no lock and no wake-up of the pulse. An effect with a ``bound`` (a tool's
``timeout``) is kept alive that long at most: past it, the lease lapses as
if nothing executed. A renewal that finds the lease taken over (a
recovery, a cancel) ends the heartbeat and tells the writer, whose next save
then raises ``StaleWriteError``; one that fails otherwise (the database
unreachable) is tried again soon.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

from .observability import LOGGER_NAME

__all__ = ["Heartbeat"]

logger = logging.getLogger(LOGGER_NAME)

#: Seconds after a failed renewal before the next try (or the interval, if shorter).
RETRY_AFTER = 0.5


class Heartbeat:
    """One turn's lease heartbeat: renews while an effect is entered.

    ``renew`` makes one renewal, blocking, on the pulse thread; it returns
    False when the lease was taken over (then ``lost`` is called, once, and
    the heartbeat ends). The writer tells the heartbeat when a save of its
    own took or renewed the lease (``renewed``), so the pulse only beats
    once a renewal is ``interval`` old.
    """

    def __init__(
        self, renew: Callable[[], bool], lost: Callable[[], None], interval: float
    ) -> None:
        self._renew = renew
        self._lost = lost
        self.interval = interval
        self._guard = threading.Lock()
        #: The effects executing, as the monotonic time each one's bound ends at.
        #: Changed and read without the guard: an append, a remove and a copy of a
        #: list are each one step under the interpreter's lock, and ``enter`` and
        #: ``leave`` are on every step's path.
        self._effects: list[float] = []
        #: Effects that finished in all, and as many as the latest beat had seen:
        #: one that came and went between two looks of the pulse still earns a
        #: beat (one past its bound that never finished does not).
        self._finished = 0
        self._finished_at_beat = 0
        #: Whether the pulse watches this heartbeat yet.
        self._watched = False
        #: Monotonic time the latest renewal was sent (None: no lease held).
        self.renewed_at: float | None = None
        self._retry_at = 0.0
        self._over = False

    # ------------------------------------------------------------ the turn's
    def enter(self, bound: float | None = None) -> float:
        """An effect starts executing (kept alive ``bound`` seconds at most);
        returns its entry, for ``leave``. A step's cost: keep it to a few calls."""
        until = math.inf if bound is None else time.monotonic() + bound
        self._effects.append(until)
        renewed_at = self.renewed_at
        due = math.inf if renewed_at is None else renewed_at + self.interval
        # Read after the append: a pulse asleep until no later than ``due`` looks
        # again by then and finds this effect; one that is awake (its wake time
        # then reads infinite) or would sleep longer is told.
        if not self._watched or due < _PULSE.wakes_at:
            self._watched = True
            _PULSE.watch(self, due)
        return until

    def leave(self, entry: float) -> None:
        """The effect of ``entry`` is done executing (entries with the same bound
        are alike: any one of them goes)."""
        try:
            self._effects.remove(entry)
            self._finished += 1
        except ValueError:  # stopped meanwhile: a task the node left ran on past its turn
            pass

    def renewed(self, sent_at: float) -> None:
        """A take or renewal sent at ``sent_at`` (monotonic) committed: the lease
        lives at least a TTL from then, by any clock that runs at the same rate."""
        with self._guard:
            if self.renewed_at is None or sent_at > self.renewed_at:
                self.renewed_at = sent_at

    def released(self) -> None:
        """The lease was released: nothing to renew any more."""
        with self._guard:
            self.renewed_at = None

    def stop(self) -> None:
        """End the heartbeat (at the end of the turn). A renewal in flight is not
        waited for: it only moves the expiry of a record whose token it names, so
        after the turn's release it finds nothing to renew."""
        with self._guard:
            self._over = True
            self._effects.clear()
        _PULSE.forget(self)

    # ------------------------------------------------------------ the pulse's
    def due(self, now: float) -> float:
        """When the pulse should next look (monotonic; infinite while no beat is
        needed): the next beat's time while it is ahead; once it is reached, now
        if an effect executes (within its bound) or finished since the last beat,
        else never (the next ``enter`` tells the pulse)."""
        with self._guard:
            if self._over or self.renewed_at is None:
                return math.inf
            at = max(self.renewed_at + self.interval, self._retry_at)
            if (
                at > now
                or self._finished != self._finished_at_beat
                or any(until > now for until in self._effects.copy())
            ):
                return at
            return math.inf

    def beat(self) -> None:
        """Renew the lease (on the pulse thread). A failed renewal leaves the
        finished effects it was for counted, so it is tried again."""
        finished = self._finished
        sent_at = time.monotonic()
        try:
            held = self._renew()
        except Exception:
            with self._guard:
                self._retry_at = time.monotonic() + min(RETRY_AFTER, self.interval)
            logger.warning("a lease renewal failed; trying again", exc_info=True)
            return
        if held:
            self._finished_at_beat = finished
            self.renewed(sent_at)
            return
        with self._guard:
            if self._over:
                return
            self._over = True
        self._lost()

    @property
    def over(self) -> bool:
        return self._over


class _Pulse:
    """The process's heartbeat thread: sleeps until the earliest due beat of the
    heartbeats it watches, beats, and sleeps again (started at the first effect)."""

    def __init__(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._watched: set[Heartbeat] = set()
        #: When the thread will next look; infinite while it is awake (it looks
        #: again before it sleeps) or sleeps with nothing due.
        self.wakes_at = math.inf
        self._thread: threading.Thread | None = None

    def watch(self, heartbeat: Heartbeat, due: float) -> None:
        """Watch ``heartbeat``, whose next beat is due at ``due`` (monotonic): the
        thread is woken only if it would sleep past that."""
        with self._wake:
            self._watched.add(heartbeat)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kuralle-lease-heartbeat", daemon=True
                )
                self._thread.start()
            elif due < self.wakes_at:
                self._wake.notify()

    def forget(self, heartbeat: Heartbeat) -> None:
        with self._wake:
            self._watched.discard(heartbeat)

    def _run(self) -> None:
        while True:
            with self._wake:
                now = time.monotonic()
                self._watched = {h for h in self._watched if not h.over}
                dues = [(h.due(now), h) for h in self._watched]
                ready = [h for due, h in dues if due <= now]
                if not ready:
                    self.wakes_at = min((due for due, _ in dues), default=math.inf)
                    timeout = None if self.wakes_at == math.inf else self.wakes_at - now
                    self._wake.wait(timeout)
                    self.wakes_at = math.inf
                    continue
            # Beats go one after the other, outside the lock: an effect that starts
            # meanwhile is seen on the next look, which follows at once.
            for heartbeat in ready:
                heartbeat.beat()


_PULSE = _Pulse()


def _new_pulse_after_fork() -> None:
    """A forked child has none of its parent's threads: its first effect starts
    its own pulse (and the parent's heartbeats are not the child's to renew)."""
    global _PULSE
    _PULSE = _Pulse()


os.register_at_fork(after_in_child=_new_pulse_after_fork)
