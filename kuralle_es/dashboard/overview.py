"""What the front page and the tools page show, read from the run views (internal).

Every figure comes from the views (``RunViews``): the dashboard never scans
the runs' streams. Counts by status are read with one capped ``list_runs``
per status, so a store with millions of runs still answers quickly and a
count past the cap reads "N+".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from ..models import RunStatus
from ..views import RunSummary, RunViews, ToolStats

__all__ = ["COUNT_CAP", "Overview", "ToolBar", "ToolsOverview", "overview", "tool_overview"]

COUNT_CAP = 1_000
LIST_LIMIT = 200
STATUSES: tuple[str, ...] = get_args(RunStatus)


@dataclass(frozen=True)
class StatusCount:
    status: str
    count: int
    capped: bool


@dataclass(frozen=True)
class Overview:
    """The front page: counts, the filtered list, and what waits for a human."""

    counts: list[StatusCount]
    runs: list[RunSummary]
    approvals: list[RunSummary]
    signals: list[RunSummary]
    status: str | None
    session: str | None
    flow: str | None
    statuses: tuple[str, ...]
    limit: int = LIST_LIMIT


@dataclass(frozen=True)
class ToolBar:
    """One tool's row and its bars in the chart (widths in percent of the widest)."""

    stats: ToolStats
    error_rate: float
    p50_width: float
    p95_width: float
    error_width: float
    y: int


@dataclass(frozen=True)
class ToolsOverview:
    bars: list[ToolBar]
    max_ms: float
    chart_height: int


async def overview(
    views: RunViews, status: str | None = None, session: str | None = None, flow: str | None = None
) -> Overview:
    counts = []
    for each in STATUSES:
        found = await views.list_runs(status=each, limit=COUNT_CAP + 1)
        counts.append(StatusCount(each, min(len(found), COUNT_CAP), len(found) > COUNT_CAP))
    chosen = status if status in STATUSES else None
    runs = await views.list_runs(status=chosen, session_id=session, flow=flow, limit=LIST_LIMIT)
    waiting = await views.waiting_runs()  # oldest first
    return Overview(
        counts=counts,
        runs=runs,
        approvals=[r for r in waiting if r.waiting_for and r.waiting_for.kind == "approval"],
        signals=[r for r in waiting if r.waiting_for and r.waiting_for.kind == "signal"],
        status=chosen,
        session=session,
        flow=flow,
        statuses=STATUSES,
    )


async def tool_overview(views: RunViews) -> ToolsOverview:
    stats = sorted(await views.step_stats(), key=lambda s: s.name)
    slowest = max((s.p95_ms or 0.0 for s in stats), default=0.0) or 1.0
    bars = [
        ToolBar(
            stats=s,
            error_rate=s.errors / s.count if s.count else 0.0,
            p50_width=100.0 * (s.p50_ms or 0.0) / slowest,
            p95_width=100.0 * (s.p95_ms or 0.0) / slowest,
            error_width=100.0 * (s.errors / s.count if s.count else 0.0),
            y=i * 34,
        )
        for i, s in enumerate(stats)
    ]
    return ToolsOverview(bars=bars, max_ms=slowest, chart_height=max(34, 34 * len(bars)))
