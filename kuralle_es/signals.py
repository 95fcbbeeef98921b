"""Delivering a signal to a paused run: the checks of SPEC §6, in order.

Every refusal raises before anything is written. Acceptance only triggers
events; the turn saves them with its lease in one compare-and-set, so of two
racing identical deliveries exactly one is stored.
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Any

from .domain import Run
from .errors import InvalidSignalError, SignalMismatchError
from .journal import Journal
from .models import SignalDelivery
from .waits import APPROVAL_LANE, IN_DOUBT, validate_payload

__all__ = ["Duplicate", "accept", "check"]


class Duplicate(Enum):
    """A delivery whose ``signal_id`` the run already has: a no-op."""

    DELIVERED = "delivered"


def check(run: Run, delivery: SignalDelivery, now: datetime, *, from_sweeper: bool = False) -> Any:
    """The payload to journal, ``Duplicate.DELIVERED``, or a refusal."""
    if not isinstance(delivery.signal_id, str) or not delivery.signal_id.strip():
        raise InvalidSignalError(
            delivery.name, "signal_id must be a non-empty string; give each delivery a stable id"
        )
    if delivery.signal_id in run.signal_ids:
        return Duplicate.DELIVERED
    waiting = run.waiting_for
    if run.status != "paused" or waiting is None:
        raise SignalMismatchError(
            run.run_id,
            f"run {run.run_id} is {run.status} and waits for no signal; "
            f"signal {delivery.name!r} was not delivered",
        )
    if delivery.name != waiting["name"]:
        raise SignalMismatchError(
            run.run_id,
            f"run {run.run_id} waits for {waiting['name']!r}, not {delivery.name!r}; "
            "deliver the signal it waits for",
        )
    if delivery.request_id is not None and delivery.request_id != waiting["request_id"]:
        raise SignalMismatchError(
            run.run_id,
            f"request_id {delivery.request_id!r} does not match the pending request "
            f"{waiting['request_id']!r} of run {run.run_id}; read waiting_for again",
        )
    deadline = waiting.get("deadline")
    if deadline and not from_sweeper and now > datetime.fromisoformat(deadline):
        raise SignalMismatchError(
            run.run_id,
            f"signal {delivery.name!r} to run {run.run_id} expired before delivery "
            f"(deadline {deadline}); the deadline sweeper will deny it",
        )
    return validate_payload(waiting, delivery.payload, from_sweeper=from_sweeper)


async def accept(journal: Journal, delivery: SignalDelivery, payload: Any) -> None:
    """Journal an accepted delivery: the payload and actor, and the wait's step.

    The wait's step is journaled through the funnel at the callsite that
    suspended, so re-executing the node finds the payload there.
    """
    run = journal.run
    waiting = dict(run.waiting_for or {})
    run.accept_signal(delivery.signal_id, delivery.name, payload, delivery.actor)
    journal.begin_visit(str(waiting["logical_run"]), journal.next_callsite)
    if waiting["name"] == IN_DOUBT:
        answer = dict(payload)
        if "action" not in answer:  # the deadline sweeper's deny
            answer = {"action": "fail", "message": str(answer.get("reason", "denied"))}
        journal.answer_in_doubt(int(waiting["step_index"]), answer)
        await journal.persist()
        return
    lane = str(waiting.get("lane", ""))
    callsite = int(waiting["callsite"])
    operation = waiting.get("operation")
    await journal.record_value(
        callsite=callsite,
        kind=str(waiting["kind"]),
        name=str(waiting["name"]),
        key=journal.key_for(callsite, waiting["name"]),
        args={"operation": operation} if lane == APPROVAL_LANE else None,
        make=lambda: payload,
        lane=lane,
    )
