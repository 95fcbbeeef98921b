"""An operator's approve or deny, delivered through the library's own path (internal).

A decision is a ``SignalDelivery`` given to ``Runtime.run``, so every check a
delivery gets from any other caller applies here too: a repeated
``signal_id`` is a no-op, the run must be paused on that very wait (its
``request_id``), an expired deadline refuses, the payload is validated. The
``signal_id`` is minted when the confirmation page is shown, so submitting
that page twice delivers once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from uuid import uuid4

from .._runtime.deliveries import approval_delivery
from .._runtime.runtime import Runtime
from ..errors import (
    InvalidSignalError,
    KuralleError,
    RunNotFoundError,
)
from ..shapes import SignalDelivery, TurnResult

__all__ = ["Decision", "deliver", "new_signal_id", "refusal_status", "valid_signal_id"]

_SIGNAL_ID = re.compile(r"^dash-[0-9a-f]{32}$")


def new_signal_id() -> str:
    return f"dash-{uuid4().hex}"


def valid_signal_id(signal_id: str) -> bool:
    return bool(_SIGNAL_ID.match(signal_id))


@dataclass(frozen=True)
class Decision:
    """What the operator confirmed: for which wait, as whom, and why."""

    run_id: str
    approved: bool
    operator: str
    signal_id: str
    request_id: str | None
    reason: str | None

    def delivery(self) -> SignalDelivery:
        return approval_delivery(
            approved=self.approved,
            by=self.operator,
            reason=self.reason or None,
            signal_id=self.signal_id,
            request_id=self.request_id,
        )


async def deliver(runtime: Runtime, session_id: str, decision: Decision) -> TurnResult:
    """Deliver the decision as the run's session; a refusal raises its ``KuralleError``."""
    handle = runtime.run(
        session_id=session_id, run_id=decision.run_id, signal_delivery=decision.delivery()
    )
    return await handle.result()


def refusal_status(error: KuralleError) -> int:
    """The HTTP status that says what kind of refusal this was."""
    if isinstance(error, RunNotFoundError):
        return 404
    if isinstance(error, InvalidSignalError):
        return 422
    return 409
