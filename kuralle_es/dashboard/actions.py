"""What an operator does to a run from its page, besides approving and denying: cancel it,
answer its input, deliver its signal, answer a step in doubt, send it a message, resume
it, settle its drift (internal).

Each action is one call of the library's own API, on behalf of the run's session
(the dashboard's login is an operator's, not a session's), so every check any
other caller gets applies: a refusal writes nothing and is shown as the HTTP
API's status. Each form carries an id minted when its page was shown (the
delivery's ``signal_id``, the input turn's idempotency key, the message's
``message_id``), so a form submitted twice acts once. The operator is journaled where
the journal has room for it: as the ``actor`` of a signal, of an answer to a step in
doubt and of a message, and in the reason of a cancel (the outcome reads
``cancelled: <reason> (by <operator>)``). A node that raises once the action
opened the run has journaled its failure: the run's page shows it, as the run's
error, like any other turn that ended in error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._journal.json_data import decode_json
from .._runtime.deliveries import NO_RESULT, in_doubt_delivery
from .._runtime.handle import TurnHandle
from .._runtime.runtime import RECOVERIES, Runtime
from .._runtime.turn import drive_turn
from .._runtime.turn_calls import RestartFlow
from ..errors import FlowNotFoundError
from ..shapes import RunState, SignalDelivery

__all__ = ["ACTIONS", "ActionRefused", "Done", "drifted", "perform"]

#: The actions, by the last part of their path (``POST /runs/RUN_ID/<action>``).
ACTIONS = ("cancel", "input", "signal", "in-doubt", "message", "resume", "resolve-drift")
#: The longest text a form field may send (a reason, an answer, a payload).
FIELD_MAX = 100_000


class ActionRefused(ValueError):
    """The form itself is wrong (an empty reason, a payload that is not JSON): 422,
    said before the library is asked anything."""


@dataclass(frozen=True)
class Done:
    """What the run's page says after an action."""

    notice: str


def _text(fields: Mapping[str, str], name: str, what: str) -> str:
    value = fields.get(name, "")
    if not value.strip():
        raise ActionRefused(f"The form needs {what}.")
    if len(value) > FIELD_MAX:
        raise ActionRefused(f"The {what} is longer than {FIELD_MAX} characters.")
    return value


def _opened(handle: TurnHandle) -> bool:
    run_id = handle.run_id
    return run_id.done() and not run_id.cancelled() and run_id.exception() is None


async def _turn(handle: TurnHandle) -> None:
    """Drive the turn; a refusal raises; a failure after the run opened was journaled."""
    try:
        await handle.result()
    except Exception:
        if not _opened(handle):
            raise


async def perform(
    runtime: Runtime, run: RunState, action: str, operator: str, fields: Mapping[str, str]
) -> Done:
    """Do ``action`` to ``run`` as ``operator`` with the form's ``fields``; a refusal
    raises its ``KuralleError`` (nothing written) or ``ActionRefused``."""
    session, run_id = run.session_id, run.run_id
    if action == "cancel":
        reason = _text(fields, "reason", "a reason").strip()
        state = await runtime.cancel(run_id, session, f"{reason} (by {operator})")
        return Done(f"The run was cancelled: it is {state.status} ({state.outcome}).")
    if action == "input":
        text = _text(fields, "text", "the answer")
        key = fields.get("turn_id") or None
        await _turn(runtime.run(session, run_id=run_id, input=text, idempotency_key=key))
        return Done("Your answer was delivered.")
    if action == "signal":
        delivery = _signal(fields, operator)
        await _turn(runtime.run(session, run_id=run_id, signal_delivery=delivery))
        return Done(f"Signal {delivery.name!r} was delivered (signal {delivery.signal_id}).")
    if action == "in-doubt":
        delivery = _in_doubt(fields, operator)
        await _turn(runtime.run(session, run_id=run_id, signal_delivery=delivery))
        return Done(f"Your answer ({delivery.payload['action']}) to the step in doubt was "
                    "delivered.")  # fmt: skip
    if action == "message":
        name = _text(fields, "name", "the message's name").strip()
        await _send(runtime, run, name, _json(fields, "payload"), fields, operator)
        return Done(f"Message {name!r} was sent.")
    if action == "resume":
        await _turn(runtime.run(session, run_id=run_id))
        return Done("The run was resumed: recorded steps replayed, the rest ran again.")
    if action == "resolve-drift":
        choice = fields.get("choice", "")
        if choice not in RECOVERIES:
            raise ActionRefused(f"Choose one of {', '.join(RECOVERIES)}.")
        if choice == "abandon":
            await runtime.resolve_drift(run_id, session, "abandon")
            return Done("The run was abandoned (outcome 'abandoned: flow drift').")
        # ``Runtime.resolve_drift``'s restart through a handle, to tell a refusal from a
        # restarted node that raised (journaled; the page shows the run's error).
        restart = RestartFlow(session, run_id)
        await _turn(TurnHandle(lambda sink: drive_turn(runtime.env, restart, sink)))
        return Done("The run was restarted on the flow's current definition.")
    raise ActionRefused(f"There is no action {action!r}.")


def _json(fields: Mapping[str, str], name: str, empty: Any = None) -> Any:
    """A JSON field of the form (a payload, a result); ``empty`` when left empty."""
    raw = fields.get(name, "").strip()
    if not raw:
        return empty
    if len(raw) > FIELD_MAX:
        raise ActionRefused(f"The {name} is longer than {FIELD_MAX} characters.")
    try:
        return decode_json(raw)
    except ValueError as e:
        raise ActionRefused(f"The {name} is not JSON: {e}.") from None


def _signal(fields: Mapping[str, str], operator: str) -> SignalDelivery:
    name = _text(fields, "name", "the signal's name").strip()
    return SignalDelivery(
        signal_id=fields.get("signal_id", ""),
        name=name,
        payload=_json(fields, "payload"),
        request_id=fields.get("request_id") or None,
        actor=operator,
    )


def _in_doubt(fields: Mapping[str, str], operator: str) -> SignalDelivery:
    """The form's answer to a step in doubt: the chosen action, with the result of a
    ``resolve`` (JSON; needed) and the message of a ``fail`` (optional); the other
    fields the form always sends are left out."""
    choice = fields.get("choice", "")
    result = _json(fields, "result", empty=NO_RESULT) if choice == "resolve" else NO_RESULT
    if choice == "resolve" and result is NO_RESULT:
        raise ActionRefused("The form needs the result to record (JSON) to resolve the step.")
    message = fields.get("message", "").strip()[:FIELD_MAX] if choice == "fail" else ""
    return in_doubt_delivery(
        choice,
        by=operator,
        result=result,
        message=message or None,
        signal_id=fields.get("signal_id", ""),
        request_id=fields.get("request_id") or None,
    )


async def _send(
    runtime: Runtime,
    run: RunState,
    name: str,
    payload: Any,
    fields: Mapping[str, str],
    operator: str,
) -> None:
    """``Runtime.send`` as the operator; a node that failed once the message woke the
    run has journaled its failure (the page shows it), any other error is a refusal."""
    message_id = fields.get("message_id", "")
    try:
        await runtime.send(
            run.run_id, run.session_id, name, payload, message_id=message_id, actor=operator
        )
    except Exception:
        stored = await runtime.store.load_async(run.run_id)
        if stored is None or message_id not in stored.mail_ids or stored.status == "running":
            raise


def drifted(runtime: Runtime, run: RunState) -> bool:
    """Whether the run's flow changed since it started, as this runtime's agents define
    it: its next turn would be refused with ``FlowDriftError`` until it is settled."""
    if run.active_flow is None or run.status in ("finished", "aborted"):
        return False
    registry = runtime.env.registry
    try:
        registry.flow(run.active_flow)
    except FlowNotFoundError:
        return False
    return registry.pinned(run.active_flow, run.flow_digest, run.flow_version) is None
