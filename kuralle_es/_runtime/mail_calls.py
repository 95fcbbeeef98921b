"""The turn a message opens: a send that wakes a ``receive`` (internal).

A message goes into the run's mailbox whatever the run is doing
(``mailbox.send_message``). When the run is paused in ``ctx.receive`` for
that very name, the send is a turn: ``Send`` takes the run's lease in the
compare-and-set save that stores the message and wakes the run, then drives
it on within the sending call, like a signal delivery (docs/messages.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .._journal.leases import Lease
from .._journal.run import Run
from ..errors import RunNotFoundError, SignalMismatchError
from .deliveries import validate_payload
from .turn_calls import Command, Opening, TurnEnv, load_run, require_current_flow
from .writer import RunWriter

__all__ = [
    "Mail",
    "NotWaiting",
    "ReceiveWaits",
    "Send",
    "addressed",
    "ended",
    "waits_in_receive",
]


@dataclass(frozen=True)
class Mail:
    """One message to a run: its id (a resend with it is a no-op), name and payload."""

    message_id: str
    name: str
    payload: Any
    actor: str | None = None


class NotWaiting(Exception):
    """Internal: the run does not wait in a ``receive`` for this message (any more),
    so the message only goes into its mailbox."""


class ReceiveWaits(Exception):
    """Internal: the run waits in a ``receive`` for this message, so the message
    is a turn that wakes it (``Send``), not only a line in its mailbox."""


def ended(run: Run, mail: Mail) -> SignalMismatchError | None:
    """The refusal of a message to a run that ended, or None."""
    if run.status not in ("finished", "aborted"):
        return None
    outcome = f" ({run.outcome})" if run.outcome else ""
    return SignalMismatchError(
        run.run_id,
        f"run {run.run_id} is {run.status}{outcome} and takes no more messages; "
        f"message {mail.name!r} ({mail.message_id!r}) was not sent",
    )


def waits_in_receive(run: Run, name: str, now: datetime) -> bool:
    """Whether the run is paused in a ``receive`` of ``name`` whose deadline has not
    passed at ``now`` (the runtime's clock)."""
    wait = run.waiting
    return (
        run.status == "paused"
        and wait is not None
        and wait.kind == "message"
        and wait.name == name
        and (wait.deadline is None or wait.deadline > now)
    )


async def addressed(env: TurnEnv, run_id: str, session_id: str) -> Run:
    """The run, fail-closed: ``RunNotFoundError`` for an unknown or foreign one."""
    run = await load_run(env.store, run_id, session_id)
    if run is None:
        raise RunNotFoundError(run_id, session_id)
    return run


@dataclass
class _MailArrives(Opening):
    """The message, and the wake of the receive that waits for it (with the
    receive's step), in the turn's first save."""

    mail: Mail

    def apply(self, writer: RunWriter, env: TurnEnv) -> None:
        mail = self.mail
        writer.receive_mail(mail.message_id, mail.name, mail.payload, mail.actor)
        woken = writer.saver.wake_for_mail()
        assert woken, "a receive is woken only with a message for it"


@dataclass(frozen=True)
class Send(Command):
    """A message to a run paused in a ``receive`` for it: stored, and the run driven on.

    ``prepare`` raises ``NotWaiting`` when the run does not wait for it: the
    sender then only puts the message in the mailbox.
    """

    session_id: str
    run_id: str
    mail: Mail
    idempotency_key: str | None = None

    async def address(self, env: TurnEnv) -> tuple[Run, bool]:
        return await addressed(env, self.run_id, self.session_id), False

    def already_done(self, run: Run) -> bool:
        return self.mail.message_id in run.mail_ids

    def prepare(self, run: Run, fresh: bool, env: TurnEnv, held: Lease | None) -> Opening | None:
        refusal = ended(run, self.mail)
        if refusal is not None:
            raise refusal
        if not waits_in_receive(run, self.mail.name, env.clock.now()):
            raise NotWaiting
        require_current_flow(run, env.registry)
        wait = run.waiting
        assert wait is not None
        # A receive given a schema refuses a payload that does not fit it, as a signal.
        validate_payload(wait, self.mail.payload, env.registry.schemas, from_sweeper=False)
        return _MailArrives(self.mail)

    def won_elsewhere(self, latest: Run, fresh: bool, lease: Lease | None) -> bool:
        # The same message, sent twice at once: the winner's is the message.
        return self.mail.message_id in latest.mail_ids

    def log_fields(self) -> dict[str, str | None]:
        mail = self.mail
        return {"message": mail.name, "message_id": mail.message_id, "actor": mail.actor}
