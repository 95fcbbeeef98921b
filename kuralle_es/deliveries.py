"""An approve or deny as the ``SignalDelivery`` it is (internal; the dashboard and the HTTP API).

``Runtime.approve``/``deny`` deliver exactly this through ``Runtime.run``; a
caller that needs the turn's handle (to tell a refusal, which wrote nothing,
from a failure the turn journaled) builds the delivery here and calls
``Runtime.run`` itself, so the approval's shape is written once.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from .models import SignalDelivery
from .waits import APPROVAL

__all__ = ["approval_delivery"]


def approval_delivery(
    *,
    approved: bool,
    by: str,
    reason: str | None = None,
    signal_id: str | None = None,
    request_id: str | None = None,
    raise_to: dict[str, Any] | None = None,
) -> SignalDelivery:
    """The ``__approval`` delivery of a decision by ``by`` (the journaled actor); a fresh
    ``signal_id`` unless one is given (give one to make a retry a no-op). It answers
    any approval, a budget's too; ``raise_to`` raises a budget's limits."""
    payload: dict[str, Any] = {"approved": approved, "by": by}
    if reason is not None:
        payload["reason"] = reason
    if raise_to is not None:
        payload["raise_to"] = raise_to
    return SignalDelivery(
        signal_id=signal_id or uuid4().hex,
        name=APPROVAL,
        payload=payload,
        request_id=request_id,
        actor=by,
    )
