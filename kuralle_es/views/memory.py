"""Views of an in-memory store: dicts under a lock (internal).

The lock plays the transaction: rows and the tracking position change
together, and one projector at a time. Like the store, they last as long as
the process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from uuid import UUID

from .._journal.leases import Lease
from .backend import StepKey, ViewBackend
from .fold import RunRow, StepRow
from .query import (
    RunQuery,
    UsageQuery,
    UsageShare,
    last_step_running,
    matches,
    sort_key,
    tool_stats,
    usage_shares,
    with_lease,
)
from .summaries import ToolStats

__all__ = ["MemoryViews"]


class MemoryViews(ViewBackend):
    """``leases`` gives the store's lease records, which the queries join."""

    def __init__(self, leases: Callable[[], Mapping[UUID, Lease]] = dict) -> None:
        self._leases = leases
        self._lock = threading.RLock()
        self._runs: dict[str, RunRow] = {}
        self._steps: dict[StepKey, StepRow] = {}
        self._position: int | None = None

    # -------------------------------------------------- ViewTransaction
    def position(self) -> int | None:
        return self._position

    def load_runs(self, run_ids: Collection[str]) -> dict[str, RunRow]:
        return {r: self._runs[r] for r in run_ids if r in self._runs}

    def load_steps(self, keys: Collection[StepKey]) -> dict[StepKey, StepRow]:
        return {k: self._steps[k] for k in keys if k in self._steps}

    def write(self, runs: Sequence[RunRow], steps: Sequence[StepRow], position: int) -> None:
        for run in runs:
            self._runs[run.run_id] = run
        for step in steps:
            self._steps[(step.run_id, step.index)] = step
        self._position = position

    # ------------------------------------------------------ ViewBackend
    @contextmanager
    def view_transaction(self) -> Iterator[MemoryViews]:
        # ``apply`` folds everything before its one ``write``, and a write
        # cannot fail half-way, so the lock alone makes a batch atomic.
        with self._lock:
            yield self

    def view_position(self) -> int | None:
        with self._lock:
            return self._position

    def select_runs(self, query: RunQuery) -> list[RunRow]:
        leases = self._leases()
        with self._lock:
            every = [with_lease(r, leases.get(UUID(r.run_id))) for r in self._runs.values()]
            in_doubt = last_step_running(self._steps.values()) if query.in_doubt else None
        rows = [
            r for r in every if matches(r, query) and (in_doubt is None or r.run_id in in_doubt)
        ]
        rows.sort(key=sort_key(query), reverse=query.order == "recent")
        return rows if query.limit is None else rows[: query.limit]

    def select_tool_stats(self) -> list[ToolStats]:
        with self._lock:
            steps = list(self._steps.values())
        return tool_stats((s.name, s.status, s.duration_ms) for s in steps if s.kind == "tool")

    def select_usage(self, query: UsageQuery) -> list[UsageShare]:
        with self._lock:
            steps, runs = list(self._steps.values()), dict(self._runs)
        return usage_shares(steps, runs, query)

    def select_steps(self) -> list[StepRow]:
        with self._lock:
            return sorted(self._steps.values(), key=lambda s: (s.run_id, s.index))

    def delete_runs(self, run_ids: Sequence[str], *, keep_steps: bool) -> None:
        gone = set(run_ids)
        with self._lock:
            for run_id in gone:
                self._runs.pop(run_id, None)
            if not keep_steps:
                self._steps = {k: v for k, v in self._steps.items() if k[0] not in gone}

    def reset_views(self) -> None:
        with self._lock:
            self._runs, self._steps, self._position = {}, {}, None
