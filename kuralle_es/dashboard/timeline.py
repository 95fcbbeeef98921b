"""A run's journal shaped for the run page: one row per step (internal).

The page shows what an operator asks of a step: what it was, how it ended,
how often it was tried, how long it took, and who delivered it. Values are
rendered as JSON text; the templates escape them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..domain import Run
from ..models import StepRecord

__all__ = ["TimelineRow", "delivery_actors", "pretty_json", "timeline_rows"]

_SHORT = 240


@dataclass(frozen=True)
class TimelineRow:
    """One journal step as the page shows it."""

    index: int
    kind: str
    name: str
    status: str
    attempts: int
    started_at: datetime | None
    duration_ms: float | None
    outcome: str
    outcome_full: str
    failed: bool
    actor: str | None


def pretty_json(value: Any) -> str:
    """Indented JSON for a value the page shows in full (arguments, a result)."""
    return json.dumps(value, ensure_ascii=False, indent=2, default=str, sort_keys=True)


def delivery_actors(events: Iterable[object]) -> dict[int, str]:
    """Step index -> the ``actor`` of the delivery that journaled that step.

    An accepted delivery is stored as ``SignalAccepted`` and, in the same
    save, the wait's step (``StepStarted``); lease events may sit between.
    A delivery answering an in-doubt step starts no step, so anything else
    after it ends the match.
    """
    actors: dict[int, str] = {}
    pending: str | None = None
    for event in events:
        if isinstance(event, Run.SignalAccepted):
            pending = event.actor
        elif isinstance(event, Run.StepStarted) and pending is not None:
            actors[event.index] = pending
            pending = None
        elif not isinstance(event, Run.LeaseTaken | Run.LeaseReleased):
            pending = None
    return actors


def _actor(step: StepRecord, actors: dict[int, str]) -> str | None:
    """Who delivered a step's value: the delivery's actor, else an approval's ``by``."""
    if step.index in actors:
        return actors[step.index]
    if step.kind == "approval" and isinstance(step.result, dict):
        by = step.result.get("by")
        return by if isinstance(by, str) else None
    return None


def _duration_ms(step: StepRecord) -> float | None:
    if step.started_at is None or step.finished_at is None:
        return None
    return (step.finished_at - step.started_at).total_seconds() * 1000.0


def _row(step: StepRecord, actors: dict[int, str]) -> TimelineRow:
    if step.status == "error" and step.error is not None:
        full = f"{step.error.type}: {step.error.message}"
    elif step.status == "finished":
        full = json.dumps(step.result, ensure_ascii=False, default=str)
    else:
        full = "running (in doubt if its worker died)"
    short = full if len(full) <= _SHORT else full[: _SHORT - 1] + "…"
    return TimelineRow(
        index=step.index,
        kind=step.kind,
        name=step.name,
        status=step.status,
        attempts=step.attempts,
        started_at=step.started_at,
        duration_ms=_duration_ms(step),
        outcome=short,
        outcome_full=full,
        failed=step.status == "error",
        actor=_actor(step, actors),
    )


def timeline_rows(steps: list[StepRecord], actors: dict[int, str]) -> list[TimelineRow]:
    return [_row(step, actors) for step in steps]
