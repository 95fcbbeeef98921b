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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from .._journal.wait import BUDGET
from .._runtime.deliveries import approval_delivery
from .._runtime.runtime import Runtime
from ..shapes import RunState, SignalDelivery, TurnResult

__all__ = [
    "RAISABLE",
    "Decision",
    "budget_limits",
    "deliver",
    "new_signal_id",
    "raise_to_of",
    "valid_signal_id",
]

#: The budget limits an approval of a spent budget may raise (docs/usage.md),
#: and the number each is read as from the confirmation form.
RAISABLE: dict[str, type[int] | type[float]] = {
    "max_total_tokens": int,
    "max_cost": float,
    "max_model_calls": int,
}

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
    #: New budget limits, when approving a run paused on its budget.
    raise_to: dict[str, int | float] | None = None

    def delivery(self) -> SignalDelivery:
        return approval_delivery(
            approved=self.approved,
            by=self.operator,
            reason=self.reason or None,
            signal_id=self.signal_id,
            request_id=self.request_id,
            raise_to=dict(self.raise_to) if self.raise_to else None,
        )


def budget_limits(run: RunState) -> dict[str, Any] | None:
    """The limits a run paused on its budget was held to (what the confirmation
    form offers to raise), or None for any other run."""
    wait = run.waiting_for
    if wait is None or wait.name != BUDGET or wait.operation is None:
        return None
    limits = wait.operation.args.get("budget")
    return dict(limits) if isinstance(limits, Mapping) else {}


def raise_to_of(fields: Mapping[str, str]) -> dict[str, int | float] | None:
    """The limits the operator filled in (``raise_<limit>`` fields), or None.

    Raises ``ValueError`` naming the field when one is not a number; the
    delivery's own check refuses a limit that is not a valid budget.
    """
    raised: dict[str, int | float] = {}
    for name, number in RAISABLE.items():
        text = fields.get(f"raise_{name}", "").strip()
        if not text:
            continue
        try:
            if not text.isascii():  # int() would read other scripts' digits ("٣" as 3)
                raise ValueError(text)
            raised[name] = number(text)
        except ValueError:
            kind = "a whole number" if number is int else "a number"
            msg = f"The new {name} must be {kind}, not {text!r}."
            raise ValueError(msg) from None
    return raised or None


async def deliver(runtime: Runtime, session_id: str, decision: Decision) -> TurnResult:
    """Deliver the decision as the run's session; a refusal raises its ``KuralleError``."""
    handle = runtime.run(
        session_id=session_id, run_id=decision.run_id, signal_delivery=decision.delivery()
    )
    return await handle.result()
