"""Messages to a run, and the values a run publishes (internal; docs/messages.md).

``send_message`` puts a message in a run's mailbox whatever the run is
doing. A run paused in ``ctx.receive`` for that name is woken and driven on
within the call (a ``Send`` turn, like a signal delivery); any other live
run gets the message appended to its stream by compare-and-set, without its
lease, tried again until it lands (as a cancel is): a turn driving the run
meanwhile takes the message into its own next save (``mail.take_in_mail``),
so neither is lost. A repeated ``message_id`` is a no-op; an ended run
refuses the message and nothing is written.

``published`` and ``wait_published`` read what ``ctx.publish`` journaled:
the latest value of each key, folded into the run's state from its
``publish`` steps.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from .._clock import back_off
from .._durations import positive_seconds
from .._journal.run import Run
from ..errors import LeaseHeldError, NotPublishedError, StaleWriteError
from ..redaction import loads
from ..shapes import TurnResult
from .deliveries import journal_payload
from .handle import TurnHandle
from .input_checks import check_id, check_name
from .mail_calls import Mail, NotWaiting, ReceiveWaits, Send, addressed, ended, waits_in_receive
from .run_changes import Post, change_run
from .step_results import result_of
from .turn import drive_turn
from .turn_calls import TurnEnv

__all__ = ["published_values", "send_message", "wait_published"]

#: How many times a send is tried again after losing its compare-and-set.
_SEND_ATTEMPTS = 200
#: The longest pause between two reads of a run that ``wait_published`` waits on.
_POLL_MAX = 0.25


async def _addressed(env: TurnEnv, run_id: str, session_id: str) -> Run:
    """The run, fail-closed, its address checked as an id first."""
    return await addressed(env, check_id(run_id, "run_id"), check_id(session_id, "session_id"))


async def send_message(env: TurnEnv, run_id: str, session_id: str, mail: Mail) -> TurnResult:
    """Put ``mail`` in the run's mailbox; the woken turn's result, or the run's as it
    stands when no ``receive`` waited for it. Refusals write nothing."""
    check_id(mail.message_id, "message_id")
    check_name(mail.name, "message name")
    if mail.actor is not None:
        check_id(mail.actor, "actor")
    payload = journal_payload(mail.name, mail.payload, "message")
    mail = Mail(mail.message_id, mail.name, payload, mail.actor)
    await _addressed(env, run_id, session_id)  # an unknown or foreign run: refused first

    def screen(run: Run) -> None:
        refusal = ended(run, mail)
        if refusal is not None:
            raise refusal
        if waits_in_receive(run, mail.name, env.clock.now()):
            raise ReceiveWaits

    post = Post(mail.message_id, mail.name, payload, mail.actor, screen)
    for attempt in range(_SEND_ATTEMPTS):
        try:
            return result_of(await change_run(env.store, run_id, session_id, post))
        except ReceiveWaits:
            pass
        try:  # the run waits in a receive for it: wake it, and drive it on here
            send = functools.partial(drive_turn, env, Send(session_id, run_id, mail))
            return await TurnHandle(send).result()
        except (NotWaiting, LeaseHeldError, StaleWriteError):
            await back_off(attempt)  # it moved on (or another wakes it): once more
    raise StaleWriteError(run_id, f"message {mail.name!r} lost its save {_SEND_ATTEMPTS} times")


def _values(run: Run) -> dict[str, Any]:
    return {key: loads(text) for key, text in run.published.items()}


async def published_values(
    env: TurnEnv, run_id: str, session_id: str, key: str | None = None
) -> Any:
    """The latest value of each key the run published, or of ``key`` (None when it
    published none under it)."""
    run = await _addressed(env, run_id, session_id)
    if key is None:
        return _values(run)
    text = run.published.get(check_id(key, "key"))
    return None if text is None else loads(text)


async def wait_published(
    env: TurnEnv,
    run_id: str,
    session_id: str,
    key: str,
    timeout: float,  # noqa: ASYNC109 - the contract's name; a deadline the caller may extend
) -> Any:
    """The value the run published under ``key``, once it has; ``NotPublishedError``
    (a ``TimeoutError`` too) after ``timeout`` seconds, or at once when the run
    ended without publishing it."""
    check_id(key, "key")
    timeout = positive_seconds(timeout, "timeout")
    give_up = time.monotonic() + timeout
    pause = 0.01
    while True:
        run = await _addressed(env, run_id, session_id)
        if key in run.published:
            return loads(run.published[key])
        if run.status in ("finished", "aborted"):
            raise NotPublishedError(run_id, key, timeout, run.status)
        left = give_up - time.monotonic()
        if left <= 0:
            raise NotPublishedError(run_id, key, timeout, run.status)
        await asyncio.sleep(min(pause, left))
        pause = min(pause * 2, _POLL_MAX)
