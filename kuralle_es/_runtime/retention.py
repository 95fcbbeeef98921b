"""Retention: deleting runs that ended before a date (internal; ``Runtime.prune``).

The runs are picked from the views (status and the time of their last
event, which for an ended run is when it ended), then each is checked
again against the store (still ended, no live lease) before it goes: a run
that is running or paused is never deleted. Deletion is in batches, each
its own short transaction (``_journal.pruning``): events, snapshots, lease
records, then the runs' view rows. With ``keep_usage`` (the default) the
runs' step rows stay in the views, so ``views.usage()`` totals do not drop
(docs/privacy.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime

from pydantic import BaseModel, Field

from .._clock import as_utc
from .._journal.pruning import PRUNE_BATCH
from .._journal.store import RunStore
from ..errors import InvalidArgumentError
from ..views.api import RunViews
from ..views.query import RunQuery

__all__ = ["ENDED", "PruneReport", "prune_runs"]

#: The statuses of a run that ended (and so may be pruned).
ENDED = ("finished", "aborted", "error")


class PruneReport(BaseModel):
    """What ``prune`` deleted: the runs (ids), how many stored events went, and the
    cut-off and statuses it was asked for."""

    ended_before: datetime
    statuses: list[str]
    runs: list[str] = Field(default_factory=list)
    events: int = 0
    kept_usage: bool = True


def ended_before_of(value: object) -> datetime:
    """``value`` (a datetime or ISO-8601 text) as an aware UTC time."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            msg = (
                f"ended_before must be an ISO-8601 time such as 2025-01-31T00:00:00Z, got {value!r}"
            )
            raise InvalidArgumentError(msg) from None
    if not isinstance(value, datetime):
        msg = f"ended_before must be a datetime or ISO-8601 text, got {value!r}"
        raise InvalidArgumentError(msg)
    return as_utc(value)


def _statuses(statuses: Sequence[str]) -> list[str]:
    if isinstance(statuses, str) or not statuses:
        msg = f"statuses is a non-empty list of {list(ENDED)}, got {statuses!r}"
        raise InvalidArgumentError(msg)
    wrong = [s for s in statuses if s not in ENDED]
    if wrong:
        msg = f"only ended runs are pruned: statuses must be among {list(ENDED)}, got {wrong}"
        raise InvalidArgumentError(msg)
    return list(dict.fromkeys(statuses))


async def prune_runs(
    store: RunStore,
    views: RunViews,
    ended_before: object,
    statuses: Sequence[str] = ENDED,
    keep_usage: bool = True,
) -> PruneReport:
    """Delete the runs that ended (``statuses``) before ``ended_before`` (see the
    module docstring)."""
    cutoff = ended_before_of(ended_before)
    wanted = _statuses(statuses)
    rows = await views.run_rows(RunQuery(updated_before=cutoff, order="oldest"))
    candidates = [r.run_id for r in rows if r.status in wanted]
    report = PruneReport(ended_before=cutoff, statuses=wanted, kept_usage=bool(keep_usage))
    for start in range(0, len(candidates), PRUNE_BATCH):
        batch = [
            run_id
            for run_id in candidates[start : start + PRUNE_BATCH]
            if await _still_ended(store, run_id, wanted, cutoff)
        ]
        if not batch:
            continue
        report.events += await asyncio.to_thread(store.delete_runs, batch)
        await views.delete_rows(batch, keep_steps=bool(keep_usage))
        report.runs.extend(batch)
    return report


async def _still_ended(store: RunStore, run_id: str, wanted: list[str], cutoff: datetime) -> bool:
    """Whether the run, as stored now, ended before ``cutoff`` and nobody holds it."""
    run = await store.load_async(run_id)
    if run is None or run.status not in wanted or run.modified_on >= cutoff:
        return False
    lease = await store.lease_async(run_id)
    return lease is None or not lease.live
