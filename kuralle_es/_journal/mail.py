"""Messages that arrive while a turn drives the run: taken in, never a lost save (internal).

``runtime.send`` puts a message in a run's mailbox whatever the run is
doing: it appends ``MailReceived`` to the run's stream by compare-and-set,
without the run's lease. A turn that drives the run meanwhile holds the run
at the version it last saved, so its next save clashes with that append.
That clash is not a conflict: a message changes nothing the turn decided
(it only waits in the mailbox), so the turn takes the message into its own
state and saves its unsaved events after it (``take_in_mail``), instead of
stopping with ``StaleWriteError`` and leaving a step in doubt. Any other
event appended meanwhile (a cancel, a takeover) is a real conflict and
still stops the turn. A turn whose closing save pauses it in a ``receive``
that such a message answers wakes the run in that same save (its lease
kept), so the message is taken even if the process dies right after.
docs/messages.md tells the whole story.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from . import catalogue as stored
from .run import Run

__all__ = ["receive_step", "take_in_mail"]


def receive_step(mail: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The args and the result of the ``receive`` step that takes ``mail`` (one of
    ``Run.mailbox``): the args name the message (the fold marks it read), the
    result is what the receive returns on every pass."""
    message_id = mail["message_id"]
    return {"message_id": message_id}, {"message_id": message_id, "payload": mail["payload"]}


def take_in_mail(run: Run, arrived: Sequence[Any], unsaved: Sequence[Any]) -> bool:
    """Put ``run``'s ``unsaved`` events after the events that ``arrived`` in the store
    since they were triggered, if every one of those is a message; whether it did.

    ``unsaved`` are the run's events not stored yet (the ones a clashing save
    collected, or still pending), already applied to ``run``; ``arrived`` are
    the stored events that follow the run's last stored version, in order.
    Each message is folded into ``run`` (it only lands in the mailbox, whatever
    the unsaved events did) and the unsaved events are numbered after them
    and pending again, so the next save appends them there.
    """
    if not arrived or any(type(event) not in stored.MAIL_EVENTS for event in arrived):
        return False
    stored_version = run.version - len(unsaved)
    expected = list(range(stored_version + 1, stored_version + len(arrived) + 1))
    if [event.originator_version for event in arrived] != expected:
        return False
    for event in arrived:
        run.fold(event)
    shift = len(arrived)
    run.pending_events.clear()
    run.pending_events.extend(
        dataclasses.replace(event, originator_version=event.originator_version + shift)
        for event in unsaved
    )
    run.version += shift
    return True
