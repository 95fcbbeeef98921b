"""What the front page, the tools page and the usage page show, read from the run views
(internal).

Every figure comes from the views (``RunViews``): the dashboard never scans
the runs' streams. Counts by status are read with one capped ``list_runs``
per status, so a store with millions of runs still answers quickly and a
count past the cap reads "N+"; the list is one page of a search (``search``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import get_args

from ..shapes import RunStatus, Usage
from ..views import RunSummary, RunViews, ToolStats
from .search import PAGE_SIZE, RunsPage, Search, search_runs

__all__ = [
    "COUNT_CAP",
    "USAGE_WINDOWS",
    "WAIT_SECTIONS",
    "Overview",
    "Pending",
    "ToolBar",
    "ToolsOverview",
    "UsageBar",
    "UsageOverview",
    "overview",
    "pending_sections",
    "tool_overview",
    "usage_overview",
]

COUNT_CAP = 1_000
STATUSES: tuple[str, ...] = get_args(RunStatus)


@dataclass(frozen=True)
class StatusCount:
    status: str
    count: int
    capped: bool


#: The pending sections of the front page, by the kind of wait, in this order;
#: a kind not named here (a later library's) gets a section of its own after them.
WAIT_SECTIONS: dict[str, str] = {
    "approval": "Pending approvals",
    "input": "Waiting for input",
    "signal": "Waiting for signals",
    "message": "Waiting for messages",
    "child": "Waiting for child runs",
    "timer": "Sleeping (durable timers)",
}


@dataclass(frozen=True)
class Pending:
    """One pending section: the runs waiting for one kind of thing, oldest first."""

    kind: str
    title: str
    runs: list[RunSummary]
    #: A kind of wait this dashboard knows (``WAIT_SECTIONS``): its section shows even
    #: when nothing waits for it, where it says so.
    known: bool = True


@dataclass(frozen=True)
class Overview:
    """The front page: counts, what waits (one section per kind of wait, every kind
    the views report), and one page of the runs the search finds."""

    counts: list[StatusCount]
    pending: list[Pending]
    page: RunsPage
    statuses: tuple[str, ...]


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


async def overview(views: RunViews, search: Search, page_size: int = PAGE_SIZE) -> Overview:
    counts = []
    for each in STATUSES:
        found = await views.list_runs(status=each, limit=COUNT_CAP + 1)
        counts.append(StatusCount(each, min(len(found), COUNT_CAP), len(found) > COUNT_CAP))
    return Overview(
        counts=counts,
        pending=pending_sections(await views.waiting_runs()),  # oldest first
        page=await search_runs(views, search, page_size),
        statuses=STATUSES,
    )


def pending_sections(waiting: list[RunSummary]) -> list[Pending]:
    """The paused runs by the kind of their wait: the known kinds always (an empty
    section says nothing waits for that), any other kind when a run waits for it."""
    by_kind: dict[str, list[RunSummary]] = {kind: [] for kind in WAIT_SECTIONS}
    for run in waiting:
        if run.waiting_for is not None:
            by_kind.setdefault(run.waiting_for.kind, []).append(run)
    return [
        Pending(kind, WAIT_SECTIONS.get(kind, f"Waiting for {kind}"), runs, kind in WAIT_SECTIONS)
        for kind, runs in by_kind.items()
    ]


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


#: The usage page's time windows: a step counts if it started within one.
USAGE_WINDOWS: dict[str, timedelta] = {
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
    "30d": timedelta(days=30),
}
#: The runs the usage page lists: those that spent the most tokens.
USAGE_RUNS = 50
_BAR_ROW = 26


@dataclass(frozen=True)
class UsageBar:
    """One agent's or run's usage and its bar (width in percent of the largest)."""

    key: str | None
    usage: Usage
    width: float
    y: int


@dataclass(frozen=True)
class UsageOverview:
    total: Usage
    agents: list[UsageBar]
    runs: list[UsageBar]
    window: str | None
    windows: tuple[str, ...]
    priced: bool
    limit: int = USAGE_RUNS

    @property
    def agents_height(self) -> int:
        return max(_BAR_ROW, _BAR_ROW * len(self.agents))

    @property
    def runs_height(self) -> int:
        return max(_BAR_ROW, _BAR_ROW * len(self.runs))


def _bars(groups: list[tuple[str | None, Usage]]) -> list[UsageBar]:
    """Bars of total tokens (of model calls where no tokens were reported)."""
    by_tokens = any(u.total_tokens for _, u in groups)

    def size(u: Usage) -> int:
        return u.total_tokens if by_tokens else u.model_calls

    largest = max((size(u) for _, u in groups), default=0) or 1
    return [
        UsageBar(key=key, usage=u, width=100.0 * size(u) / largest, y=i * _BAR_ROW)
        for i, (key, u) in enumerate(groups)
    ]


async def usage_overview(views: RunViews, window: str | None, now: datetime) -> UsageOverview:
    chosen = window if window in USAGE_WINDOWS else None
    since = now - USAGE_WINDOWS[chosen] if chosen is not None else None
    return UsageOverview(
        total=await views.usage(since=since),
        agents=_bars(await views.usage_by("agent", since=since)),
        runs=_bars(await views.usage_by("run", since=since, limit=USAGE_RUNS)),
        window=chosen,
        windows=tuple(USAGE_WINDOWS),
        priced=views.prices is not None,
    )
