"""The doors: what input from outside must look like before a turn touches a run.

Internal module. Ids, user input, signal payloads and model responses come
from callers, webhooks and models; each is checked here, once, before
anything is written, and refused with a ``KuralleError`` that names what was
wrong and what to do (docs/contract.md, "Bad input"). Tool arguments are
checked by the tool's own input model and then by ``keys.plain_json_problem``.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from .._journal.json_data import check_size, unicode_problem
from ..errors import InvalidArgumentError, InvalidSignalError
from ..shapes import SignalDelivery

__all__ = [
    "MAX_ID_LENGTH",
    "check_id",
    "check_name",
    "check_turn_args",
]

#: The longest id (session, signal, idempotency key, actor) the library accepts.
MAX_ID_LENGTH = 256


def _id_problem(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"is of type {type(value).__name__}, not a string"
    if not value.strip():
        return "is empty"
    if len(value) > MAX_ID_LENGTH:
        return f"is {len(value)} characters long, over {MAX_ID_LENGTH}"
    problem = unicode_problem(value)
    if problem is None and any(unicodedata.category(c) == "Cc" for c in value):
        problem = "holds a control character (NUL, newline, ...)"
    return problem


def _id_refusal(value: Any, what: str, problem: str) -> str:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return (
        f"{what} {shown} {problem}; pass a non-empty string of at most {MAX_ID_LENGTH} "
        "printable characters"
    )


def check_id(value: Any, what: str) -> str:
    """``value`` as an id: a non-empty string of printable characters, at most
    ``MAX_ID_LENGTH`` long; else ``InvalidArgumentError`` naming ``what``."""
    problem = _id_problem(value)
    if problem is not None:
        raise InvalidArgumentError(_id_refusal(value, what, problem))
    return str(value)


def check_name(value: Any, what: str) -> str:
    """A name users give (a message's, a published key): an id (``check_id``) that
    does not start with ``__``, which the library keeps for its own waits."""
    name = check_id(value, what)
    if name.startswith("__"):
        msg = f"{what} {name!r} starts with '__', which the library keeps for its own waits"
        raise InvalidArgumentError(msg)
    return name


def _check_text(value: Any, what: str) -> str:
    """``value`` as user text: a valid Unicode string within the payload bound."""
    if not isinstance(value, str):
        msg = f"{what} is of type {type(value).__name__}; pass the user's message as a string"
        raise InvalidArgumentError(msg)
    problem = unicode_problem(value)
    if problem is not None:
        msg = f"{what} {problem}; pass valid Unicode text"
        raise InvalidArgumentError(msg)
    check_size(value, what)
    return value


def check_turn_args(
    session_id: Any,
    input: Any,
    idempotency_key: Any,
    delivery: SignalDelivery | None,
) -> None:
    """Refuse a turn's bad arguments before the turn reads or writes anything."""
    check_id(session_id, "session_id")
    if input is not None:
        _check_text(input, "input")
    if idempotency_key is not None:
        check_id(idempotency_key, "idempotency_key")
    if delivery is not None:
        fields = {"signal_id": delivery.signal_id, "the signal name": delivery.name}
        if delivery.actor is not None:
            fields["actor"] = delivery.actor
        if delivery.request_id is not None:
            fields["request_id"] = delivery.request_id
        for what, value in fields.items():
            problem = _id_problem(value)
            if problem is not None:
                name = delivery.name if isinstance(delivery.name, str) else "?"
                raise InvalidSignalError(name, _id_refusal(value, what, problem))
