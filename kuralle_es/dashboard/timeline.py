"""A run's journal shaped for the run page: its steps and deliveries in time order (internal).

The page shows what an operator asks of a step: what it was, how it ended,
how often it was tried, how long it took; and of each delivery (a signal,
an approval, input) who sent it and what. Deliveries come from
``kuralle_es.timeline.read_deliveries``, as in ``kuralle-es runs show``.
Values are rendered as JSON text; the templates escape them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..shapes import StepRecord
from ..views.timeline import Delivery

__all__ = ["TimelineRow", "compact_json", "pretty_json", "timeline_rows"]

_SHORT = 240


@dataclass(frozen=True)
class TimelineRow:
    """One journal step, or one delivery, as the page shows it."""

    index: int | None  # None for a delivery
    kind: str
    name: str
    status: str
    attempts: int | None
    started_at: datetime | None
    duration_ms: float | None
    outcome: str
    outcome_full: str
    failed: bool
    actor: str | None


def pretty_json(value: Any) -> str:
    """Indented JSON for a value the page shows in full (arguments, a result)."""
    return json.dumps(value, ensure_ascii=False, indent=2, default=str, sort_keys=True)


def compact_json(value: Any) -> str:
    """One line of JSON for a value shown inline (a tool call's arguments, its result)."""
    return json.dumps(value, ensure_ascii=False, default=str)


def _shorten(full: str) -> str:
    return full if len(full) <= _SHORT else full[: _SHORT - 1] + "…"


#: The fields of a step's row that are the step's own, as they are.
_AS_IN_STEP = {"index", "kind", "name", "status", "attempts", "started_at"}


def _step_row(step: StepRecord) -> TimelineRow:
    if step.status == "error" and step.error is not None:
        full = f"{step.error.type}: {step.error.message}"
    elif step.status == "finished":
        full = json.dumps(step.result, ensure_ascii=False, default=str)
    elif step.error is not None:  # a retried tool between attempts
        full = f"running, retried after {step.error.type}: {step.error.message}"
    else:
        full = "running (in doubt if its worker died)"
    duration_ms = None
    if step.started_at is not None and step.finished_at is not None:
        duration_ms = (step.finished_at - step.started_at).total_seconds() * 1000.0
    return TimelineRow(
        **step.model_dump(include=_AS_IN_STEP),
        duration_ms=duration_ms,
        outcome=_shorten(full),
        outcome_full=full,
        failed=step.status == "error",
        actor=None,
    )


def _delivery_row(delivery: Delivery) -> TimelineRow:
    full = json.dumps(delivery.payload, ensure_ascii=False, default=str)
    return TimelineRow(
        index=None,
        kind=f"{delivery.kind} delivery",
        name=delivery.name,
        status="accepted",
        attempts=None,
        started_at=delivery.at,
        duration_ms=None,
        outcome=_shorten(full),
        outcome_full=full,
        failed=False,
        actor=delivery.actor,
    )


def timeline_rows(steps: Sequence[StepRecord], deliveries: Sequence[Delivery]) -> list[TimelineRow]:
    """Steps and deliveries by time; a delivery sorts before the step it journaled."""
    rows = [(d.at, 0, _delivery_row(d)) for d in deliveries]
    rows += [(s.started_at or _NEVER, 1, _step_row(s)) for s in steps]
    return [row for _, _, row in sorted(rows, key=lambda r: (r[0], r[1]))]


_NEVER = datetime.max.replace(tzinfo=UTC)
