"""Changes made to a run from outside its turns: cancel, erase, migrate, abandon, post (internal).

Each is one compare-and-set save of the run as stored, made whoever holds
its lease (docs/operators.md): a turn driving the run elsewhere loses its
next save, and its heartbeat finds the lease record gone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .._clock import back_off
from .._journal.leases import Lease, LeaseOp
from .._journal.run import Run
from .._journal.store import RunStore
from ..errors import LeaseHeldError, RunNotFoundError, StaleWriteError

__all__ = [
    "ERASED",
    "Abandon",
    "Cancel",
    "Erase",
    "MigrateTo",
    "Post",
    "RunChange",
    "change_run",
]


class RunChange(ABC):
    """A change made to a run from outside its turns (cancel, migrate, abandon, a message)."""

    #: Whether the change takes the run away from whoever holds its lease (a
    #: stop does; a message waits in the mailbox and leaves the holder be).
    clears_lease: ClassVar[bool] = True

    @abstractmethod
    def apply(self, run: Run, lease: Lease | None) -> bool:
        """Trigger the change on ``run`` (whose lease is ``lease``); False when it
        already holds it (nothing to save), or a refusal."""


@dataclass(frozen=True)
class Cancel(RunChange):
    """Stop the run for good (a conversation: end its turn), whoever holds the lease."""

    reason: str

    def apply(self, run: Run, lease: Lease | None) -> bool:
        return run.cancel(self.reason)


#: The outcome of a run aborted because its subject was erased (docs/privacy.md).
ERASED = "erased"


@dataclass(frozen=True)
class Erase(RunChange):
    """Abort, with outcome ``"erased"``, a run of an erased subject that could still
    execute something (running, paused, errored; a conversation, which a new
    message would carry on), whoever holds its lease."""

    @staticmethod
    def applies(status: str, kind: str) -> bool:
        return status in ("running", "paused", "error") or (
            kind == "conversation" and status != "aborted"
        )

    def apply(self, run: Run, lease: Lease | None) -> bool:
        if not self.applies(run.status, run.kind):
            return False
        run.abort(ERASED)
        return True


@dataclass(frozen=True)
class MigrateTo(RunChange):
    """Stop the run for good: it moved to its fork ``fork_id`` (``runtime.migrate``)."""

    fork_id: str
    at_step: int

    def apply(self, run: Run, lease: Lease | None) -> bool:
        return run.migrate(self.fork_id, self.at_step)


@dataclass(frozen=True)
class Abandon(RunChange):
    """End a live run with ``outcome``, unless another holder's live lease has it."""

    holder: str
    outcome: str

    def apply(self, run: Run, lease: Lease | None) -> bool:
        if run.status in ("finished", "aborted"):
            return False
        if lease is not None and lease.holder != self.holder and lease.live:
            raise LeaseHeldError(run.run_id, lease.holder, lease.expires_at)
        run.abort(self.outcome)
        return True


@dataclass(frozen=True)
class Post(RunChange):
    """Put a message in the run's mailbox (``runtime.send``), whatever the run is
    doing, its lease left alone: a turn driving the run takes the message into
    its next save (``mail.take_in_mail``). ``screen`` may refuse the run as
    stored, raising before anything is triggered; a ``message_id`` the run
    already has is a no-op."""

    message_id: str
    name: str
    payload: Any
    actor: str | None
    screen: Callable[[Run], None]
    clears_lease: ClassVar[bool] = False

    def apply(self, run: Run, lease: Lease | None) -> bool:
        if self.message_id in run.mail_ids:
            return False
        self.screen(run)
        run.receive_mail(self.message_id, self.name, self.payload, self.actor)
        return True


async def change_run(store: RunStore, run_id: str, session_id: str, change: RunChange) -> Run:
    """Apply ``change`` to the run as stored and save it with the run's lease record
    cleared (unless the change leaves the holder be: ``clears_lease``): one
    compare-and-set that wins over whoever holds the lease (a turn driving the
    run elsewhere loses its next save, and its heartbeat finds the record gone).
    A save that loses to a turn's reloads what the turn wrote and tries again,
    until it lands, so a busy turn cannot starve it. Returns the run as it
    stands after; ``RunNotFoundError`` for an unknown or foreign run.
    """
    attempt = 0
    while True:
        run = await store.load_async(run_id)
        if run is None or run.session_id != session_id:
            raise RunNotFoundError(run_id, session_id)
        lease = run.lease(await store.lease_async(run_id))
        if not change.apply(run, lease):
            return run
        try:
            await store.save_run_async(run, LeaseOp.clear(run.id) if change.clears_lease else None)
        except StaleWriteError:
            await back_off(attempt)
            attempt += 1
            continue
        return run
