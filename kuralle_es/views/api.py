"""``RunViews``: the questions operators and sweeps ask about runs.

Freshness rule: every query first applies every event stored before it
started (a catch-up over the notification log, usually a no-op), so a query
made after a turn returned sees that turn. ``wait_until_caught_up`` does the
same with a deadline, for callers that only want the views current.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from .._clock import as_utc, utc
from .._durations import positive_seconds
from .._journal.log import RunLog, retry_schema_setup
from .._journal.recorders import (
    LeasingPOPORecorder,
    LeasingSQLiteRecorder,
    OneTripPostgresRecorder,
)
from .._journal.sealing import open_sealed_json
from .._journal.spending import Prices, total, validate_prices
from .._journal.store import RunStore
from ..errors import InvalidArgumentError
from ..shapes import Usage
from .backend import ViewBackend
from .fold import RunRow, StepRow
from .memory import MemoryViews
from .postgres import PostgresViews
from .projector import DEFAULT_BATCH, catch_up
from .query import RunQuery, UsageGroup, UsageQuery, sort_key, tool_stats, usage_by_group
from .sqlite import SQLiteViews
from .summaries import RunSummary, ToolStats, read_cursor, summary

__all__ = ["RunViews", "open_backend"]

_T = TypeVar("_T")

#: Views of in-memory logs live as long as their log.
_MEMORY: weakref.WeakKeyDictionary[RunLog, dict[str, MemoryViews]] = weakref.WeakKeyDictionary()


def open_backend(log: RunLog, name: str = "RunViews") -> ViewBackend:
    """The view tables of one log (a partition of a store) named ``name``, created
    if missing: ``name``'s own tables for the first log of a database, with the
    partition's suffix (``_p1``, ...) for another log of the same database."""
    prefix = (name + log.views_name.removeprefix("RunViews")).lower()
    recorder = log.recorder
    if isinstance(recorder, OneTripPostgresRecorder):
        leases = recorder.leases_table
        return retry_schema_setup(lambda: _created(PostgresViews(
            recorder.datastore, tracking_table_name=f"{prefix}_tracking",
            leases_table_name=leases,
        )))  # fmt: skip
    if isinstance(recorder, LeasingSQLiteRecorder):
        return _created(SQLiteViews(recorder.datastore, prefix, recorder.leases_table))
    if isinstance(recorder, LeasingPOPORecorder):
        views = _MEMORY.setdefault(log, {})
        return views.setdefault(prefix, MemoryViews(recorder.leases))
    msg = f"no views for a store recorded by {type(recorder).__name__}"
    raise TypeError(msg)


_V = TypeVar("_V", PostgresViews, SQLiteViews)


def _created(views: _V) -> _V:
    views.create_table()
    return views


def _now_or(now: object, what: str = "now") -> datetime:
    """``now`` as aware UTC (a naive one is UTC), or the current time for None; any
    other value is refused (``InvalidArgumentError`` naming ``what``)."""
    return datetime.now(UTC) if now is None else utc(now, what)


class RunViews:
    """Queries over the views of a ``RunStore``'s runs (see the module's freshness rule).

    ``name`` names the view tables (``<name>_runs``, ``<name>_steps``,
    ``<name>_tracking``, ``<name>_meta``); a second name builds an independent
    copy. ``prices`` (``{"model-name": (input_per_1k, output_per_1k)}``) turn
    the tokens ``usage`` sums into a cost.
    """

    def __init__(
        self,
        store: RunStore,
        *,
        name: str = "RunViews",
        batch: int = DEFAULT_BATCH,
        prices: Prices | None = None,
    ):
        self.store = store
        self.name = name
        self.batch = batch
        self.prices = validate_prices(prices)
        #: The view tables of each partition, opened (created or upgraded if need be)
        #: on first use, on a worker thread when they live in a database: never on
        #: the event loop.
        self._backends: list[tuple[RunLog, ViewBackend]] | None = None
        self._opening = asyncio.Lock()
        self._blocking = store.saves_block

    # ---------------------------------------------------------- queries
    async def list_runs(
        self,
        status: str | None = None,
        session_id: str | None = None,
        flow: str | None = None,
        limit: int = 100,
        *,
        run_id: str | None = None,
        since: datetime | str | None = None,
        until: datetime | str | None = None,
        after: str | None = None,
    ) -> list[RunSummary]:
        """Runs, most recently updated first; ``flow`` matches finished runs of it too.

        ``run_id`` keeps the runs whose id starts with it (a whole id finds its
        run); ``since`` and ``until`` (datetimes, naive taken as UTC, or ISO-8601
        text) keep the runs last updated at or after ``since`` and before
        ``until``; ``after`` (a ``RunSummary.cursor``) starts the list after that
        run: the next page. Each is answered by an index of the view tables.
        ``InvalidArgumentError`` for a bad value.
        """
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            msg = f"limit must be a positive integer, got {limit!r}"
            raise InvalidArgumentError(msg)
        for label, value in (("status", status), ("session_id", session_id), ("flow", flow),
                             ("run_id", run_id)):  # fmt: skip
            if value is not None and not isinstance(value, str):
                msg = f"{label} must be a string or None, got {value!r}"
                raise InvalidArgumentError(msg)
        if after is not None and not isinstance(after, str):
            msg = f"after must be a RunSummary.cursor, got {after!r}"
            raise InvalidArgumentError(msg)
        query = RunQuery(
            status=status,
            session_id=session_id,
            flow=flow,
            limit=limit,
            run_id_prefix=run_id or None,
            updated_since=_time("since", since),
            updated_until=_time("until", until),
            after=read_cursor(after) if after is not None else None,
        )
        return await self._runs(query)

    async def waiting_runs(self) -> list[RunSummary]:
        """Paused runs (waiting for an approval, a signal, input or a timer), oldest first."""
        return await self._runs(RunQuery(status="paused", order="oldest"))

    async def child_waits(self) -> list[RunSummary]:
        """Paused runs waiting for a child run to end (``waiting_for.kind == "child"``),
        oldest first: what ``recover_orphaned_runs`` checks, for a child whose end
        nobody handed to its parent (docs/child-runs.md)."""
        return await self._runs(RunQuery(status="paused", wait_kind="child", order="oldest"))

    async def orphaned_runs(self, now: datetime | None = None) -> list[RunSummary]:
        """Running runs whose lease expired before ``now``: their worker is gone."""
        at = _now_or(now)
        return await self._runs(RunQuery(status="running", lease_expired_before=at, order="lease"))

    async def expired_deadlines(self, now: datetime | None = None) -> list[RunSummary]:
        """Paused runs whose wait's deadline is before ``now`` (timers excluded)."""
        at = _now_or(now)
        return await self._runs(
            RunQuery(status="paused", not_wait_kind="timer", deadline_before=at, order="deadline")
        )

    async def due_timers(self, now: datetime | None = None) -> list[RunSummary]:
        """Paused runs whose durable sleep's wake time is at or before ``now``."""
        at = _now_or(now)
        return await self._runs(
            RunQuery(
                status="paused",
                wait_kind="timer",
                deadline_before=at,
                deadline_inclusive=True,
                order="deadline",
            )
        )

    async def in_doubt_runs(self, before: datetime | None = None) -> list[RunSummary]:
        """Runs in ``error`` whose last step was left ``running`` (in doubt: a model
        call that failed, whose answer was never recorded), last updated before
        ``before`` (default: now), least recently updated first."""
        at = _now_or(before, "before")
        return await self._runs(
            RunQuery(status="error", in_doubt=True, updated_until=at, order="oldest")
        )

    async def step_stats(self) -> list[ToolStats]:
        """Per tool (by name): calls, failed calls, p50/p95 latency in ms."""
        await self.catch_up()
        return await self._tool_stats()

    async def usage(
        self,
        run_id: str | None = None,
        session_id: str | None = None,
        agent_id: str | None = None,
        since: datetime | str | None = None,
    ) -> Usage:
        """What the model and tool steps matching every given filter spent.

        ``model_calls`` and ``tool_calls`` count attempts (a call re-run after
        a crash counts again); tokens add up over the attempts that reported
        them; ``cost`` is None without a price (``prices``) for every model
        that reported tokens. ``agent_id`` is the agent the run had when the
        step started; ``since`` (a datetime, naive taken as UTC, or ISO-8601
        text) keeps the steps started at or after it.
        """
        query = _usage_query(run_id, session_id, agent_id, since)
        found = await self._usage(query)
        return found[0][1] if found else total([], 0, self.prices)

    async def usage_by(
        self,
        group: UsageGroup,
        *,
        run_id: str | None = None,
        session_id: str | None = None,
        agent_id: str | None = None,
        since: datetime | str | None = None,
        limit: int | None = None,
    ) -> list[tuple[str | None, Usage]]:
        """``usage`` split by ``"run"`` (run id) or ``"agent"`` (None: runs without
        one), the groups that spent the most tokens first; ``limit`` keeps that many
        runs (``"run"`` only)."""
        if group not in ("run", "agent"):
            msg = f"group must be 'run' or 'agent', got {group!r}"
            raise InvalidArgumentError(msg)
        if limit is not None and (
            group != "run" or not isinstance(limit, int) or isinstance(limit, bool) or limit < 1
        ):
            msg = f"limit must be a positive integer, with group='run'; got {limit!r}"
            raise InvalidArgumentError(msg)
        query = _usage_query(run_id, session_id, agent_id, since)
        return await self._usage(replace(query, group=group, limit=limit))

    # --------------------------------------------------------- upkeep
    async def catch_up(self) -> int:
        """Apply every event stored so far; returns how many this call applied."""
        applied = await self._each(lambda log, b: catch_up(log, b, self.batch))
        return sum(applied)

    async def wait_until_caught_up(self, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Return once every event stored before the call is in the views.

        Raises ``TimeoutError`` if that takes longer than ``timeout`` seconds
        (another projector holding the views' lock, or a backlog).
        """
        seconds = positive_seconds(timeout, "timeout")
        await asyncio.wait_for(self.catch_up(), seconds)

    async def rebuild(self) -> int:
        """Empty the views and apply the whole log again; returns the events applied."""
        await self._each(lambda log, b: b.reset_views())
        return await self.catch_up()

    async def position(self) -> int | None:
        """The notification id of the last event in the views (of the first partition)."""
        return (await self.positions())[0]

    async def positions(self) -> dict[int, int | None]:
        """Each partition's last notification id in the views, by partition number."""
        found = await self._each(lambda log, b: (log.partition, b.view_position()))
        return dict(found)

    async def rows(self) -> tuple[list[RunRow], list[StepRow]]:
        """Every run and step row as stored, for checks (no catch-up, no index)."""
        runs = await self._each(lambda log, b: b.select_runs(RunQuery(order="oldest")))
        steps = await self._each(lambda log, b: b.select_steps())
        return sorted(_flat(runs), key=lambda r: r.run_id), _flat(steps)

    # --------------------------------------------------------- helpers
    async def _runs(self, query: RunQuery) -> list[RunSummary]:
        await self.catch_up()
        found = _flat(await self._each(lambda log, b: b.select_runs(query)))
        if len(await self.backends()) > 1:  # each partition answered: merge them
            found.sort(key=sort_key(query), reverse=query.order == "recent")
            found = found if query.limit is None else found[: query.limit]
        return [summary(self._opened(r)) for r in found]

    def _opened(self, row: RunRow) -> RunRow:
        """The row with its wait's sealed payload opened (``Redacted`` once erased)."""
        if row.waiting_for is None:
            return row
        log = self.store.partitions[0]
        opened = open_sealed_json(row.waiting_for, log.mapper.transcoder, log.keys)
        return replace(row, waiting_for=opened)

    async def delete_rows(self, run_ids: list[str], *, keep_steps: bool) -> None:
        """Delete these runs' view rows in every partition (``prune``)."""
        await self._each(lambda log, b: b.delete_runs(run_ids, keep_steps=keep_steps))

    async def run_rows(self, query: RunQuery) -> list[RunRow]:
        """The run rows ``query`` matches, of every partition, after a catch-up (their
        payloads sealed): what erasure and retention select runs by."""
        await self.catch_up()
        found: list[RunRow] = _flat(await self._each(lambda log, b: b.select_runs(query)))
        return found

    async def _usage(self, query: UsageQuery) -> list[tuple[str | None, Usage]]:
        await self.catch_up()
        shares = _flat(await self._each(lambda log, b: b.select_usage(query)))
        groups = usage_by_group(shares, self.prices)
        return groups if query.limit is None else groups[: query.limit]

    async def _tool_stats(self) -> list[ToolStats]:
        backends = await self.backends()
        if len(backends) == 1:
            stats: list[ToolStats] = await self._each(
                lambda log, b: b.select_tool_stats(), single=True
            )
            return stats
        steps = _flat(await self._each(lambda log, b: b.select_steps()))
        return tool_stats((s.name, s.status, s.duration_ms) for s in steps if s.kind == "tool")

    async def backends(self) -> list[tuple[RunLog, ViewBackend]]:
        """Each partition's view tables, opened on first use (off the event loop on
        SQLite and PostgreSQL, where opening may create or upgrade them)."""
        if self._backends is None:
            async with self._opening:
                if self._backends is None:
                    logs = self.store.partitions
                    if self._blocking:
                        opened = await asyncio.gather(
                            *(asyncio.to_thread(open_backend, log, self.name) for log in logs)
                        )
                    else:
                        opened = [open_backend(log, self.name) for log in logs]
                    self._backends = list(zip(logs, opened, strict=True))
        return self._backends

    async def backend(self) -> ViewBackend:
        """The first partition's view tables (see ``backends``)."""
        return (await self.backends())[0][1]

    async def _each(self, fn: Callable[[RunLog, ViewBackend], _T], *, single: bool = False) -> Any:
        """``fn`` on each partition's views (at once, off the loop where they block);
        their answers in partition order, or the one answer with ``single``."""
        backends = await self.backends()
        if self._blocking:
            found = await asyncio.gather(*(asyncio.to_thread(fn, log, b) for log, b in backends))
        else:
            found = [fn(log, b) for log, b in backends]
        return found[0] if single else list(found)


def _flat(parts: list[list[_T]]) -> list[_T]:
    return [item for part in parts for item in part]


def _usage_query(run_id: Any, session_id: Any, agent_id: Any, since: Any) -> UsageQuery:
    for label, value in (("run_id", run_id), ("session_id", session_id), ("agent_id", agent_id)):
        if value is not None and not isinstance(value, str):
            msg = f"{label} must be a string or None, got {value!r}"
            raise InvalidArgumentError(msg)
    return UsageQuery(
        run_id=run_id, session_id=session_id, agent=agent_id, since=_time("since", since)
    )


def _time(label: str, value: Any) -> datetime | None:
    """A time a query was given (a datetime, naive taken as UTC, or ISO-8601 text)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            msg = f"{label} must be an ISO-8601 time such as 2025-01-31T09:00:00Z, got {value!r}"
            raise InvalidArgumentError(msg) from None
    if not isinstance(value, datetime):
        msg = f"{label} must be a datetime or ISO-8601 text, got {value!r}"
        raise InvalidArgumentError(msg)
    return as_utc(value)
