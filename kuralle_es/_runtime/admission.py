"""Which effects node code may still request in a turn, and how many are in flight (internal).

Once an effect has suspended the turn, every effect node code requests
afterwards is refused (``SuspendError`` again, on the first wait); once the
turn has ended every effect is refused (``TurnClosedError``). So node code
that catches a suspension, or a task it left running, cannot execute
anything the journal did not admit (docs/node-code.md).
"""

from __future__ import annotations

import asyncio
from typing import NoReturn

from .._journal.wait import Wait
from ..errors import NonDeterminismError, SuspendError, TurnClosedError

__all__ = ["RunStopped", "TurnAdmission"]


class RunStopped(Exception):
    """The turn ends the run here with ``outcome`` (internal: a budget a human
    refused to raise). Like a suspension, it cannot be swallowed: every later
    effect of the turn is refused and the turn finishes the run."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        super().__init__(f"the run ends here: {outcome}")


class TurnAdmission:
    """The turn's gate: open, stopped (on a wait, an outcome or a replay
    mismatch) or closed; and the count of its effects still executing."""

    def __init__(self, run_id: str) -> None:
        self._run_id = run_id
        #: What stopped the turn first: the wait it suspended on, the outcome it
        #: ended the run with, or the replay mismatch that refused an effect.
        self._stopped: Wait | str | NonDeterminismError | None = None
        self.closed = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def suspend(self, wait: Wait) -> NoReturn:
        """Suspend the turn on ``wait``, or on its first wait if it already suspended.

        The first suspension is the one the run pauses on, whatever the node
        does with the exception afterwards.
        """
        self._stop_first(wait)

    def stop(self, outcome: str) -> NoReturn:
        """End the run with ``outcome`` at the end of this turn (``RunStopped``)."""
        self._stop_first(outcome)

    def refuse_replay(self, mismatch: NonDeterminismError) -> NoReturn:
        """Refuse an effect that does not match the journal, and every effect of
        the turn after it: node code that catches the ``NonDeterminismError`` and
        goes on would otherwise take the next recorded callsite for another effect
        (an approval given for one question read as the answer to another)."""
        self._stop_first(mismatch)

    def _stop_first(self, reason: Wait | str | NonDeterminismError) -> NoReturn:
        if self._stopped is None:
            self._stopped = reason
        raise self._stop_error()

    def _stop_error(self) -> Exception:
        stopped = self._stopped
        assert stopped is not None
        if isinstance(stopped, Wait):
            return SuspendError(stopped)
        if isinstance(stopped, NonDeterminismError):
            return stopped
        return RunStopped(stopped)

    def require_open(self, what: str) -> None:
        """Refuse every effect once the turn ended (``TurnClosedError``)."""
        if self.closed:
            raise TurnClosedError(self._run_id, what)

    def admit(self, what: str) -> None:
        """Let node code request an effect, or refuse it: ``TurnClosedError``
        once the turn ended, ``SuspendError`` (its first wait) once it
        suspended, ``RunStopped`` once it ended the run, the
        ``NonDeterminismError`` once a replay did not match.

        Checked when the effect is requested: the rest of a ``gather`` batch,
        requested before one of its effects suspended, still runs and settles.
        """
        self.require_open(what)
        self.raise_if_stopped()

    def raise_if_stopped(self) -> None:
        """After node code returned or raised: a turn that suspended (or ended
        the run) stops there, and what the node returned or raised is discarded."""
        if self._stopped is not None:
            raise self._stop_error()

    async def settle(self) -> None:
        """Wait until no effect of this turn is still executing or journaling."""
        await self._idle.wait()

    def enter(self) -> None:
        """An effect starts executing or journaling."""
        self._inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()
