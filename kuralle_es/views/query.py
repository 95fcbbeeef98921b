"""The questions the views answer, stated once for every backend (internal).

``RunQuery`` is what ``RunViews`` asks; SQL backends turn it into a WHERE
clause with ``sql_where`` (served by the indexes in ``SQL_INDEXES``), the
memory backend tests rows with ``matches``. ``UsageQuery`` sums what model
and tool steps spent: ``sql_usage`` for SQL, ``usage_shares`` in memory.

``VIEWS_GENERATION`` names the shape and meaning of the view rows. Adding a
column (list it in ``ADDED_COLUMNS``) or changing what the fold writes means
bumping it: a SQL backend whose stored generation is older adds the missing
columns and empties its rows and position once, and the next catch-up
rebuilds them from the log.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any, Literal, TypeVar

from .._journal.leases import Lease
from .._journal.spending import ModelUsage, Prices, total
from ..shapes import Usage
from .fold import RunRow, StepRow
from .summaries import ToolStats

__all__ = [
    "ADDED_COLUMNS",
    "RUN_COLUMNS",
    "STEP_COLUMNS",
    "VIEWS_GENERATION",
    "RunQuery",
    "UsageGroup",
    "UsageQuery",
    "UsageShare",
    "last_step_running",
    "matches",
    "percentile",
    "prefix_bounds",
    "run_row",
    "run_values",
    "sort_key",
    "sql_order",
    "sql_runs",
    "sql_usage",
    "sql_where",
    "step_row",
    "step_values",
    "tool_stats",
    "usage_by_group",
    "usage_shares",
    "with_lease",
]

Order = Literal["recent", "oldest", "deadline", "lease"]


@dataclass(frozen=True)
class RunQuery:
    """A filter over run rows; every set field must hold."""

    status: str | None = None
    session_id: str | None = None
    flow: str | None = None
    wait_kind: str | None = None
    not_wait_kind: str | None = None
    lease_expired_before: datetime | None = None
    deadline_before: datetime | None = None
    deadline_inclusive: bool = False
    #: Run ids that start with this text (a whole id is its own prefix).
    run_id_prefix: str | None = None
    #: Runs last updated at or after ``updated_since`` and before ``updated_until``.
    updated_since: datetime | None = None
    updated_until: datetime | None = None
    #: Keyset pagination ("recent" order only): the rows after this one (its
    #: ``updated_at`` and ``run_id``), as ``RunSummary.cursor`` names it.
    after: tuple[datetime, str] | None = None
    #: Only runs whose last step was left ``running``: in doubt.
    in_doubt: bool = False
    #: The run's data subject (its session id unless it was given one).
    subject: str | None = None
    #: Only rows last changed before this time (an ended run: when it ended).
    updated_before: datetime | None = None
    order: Order = "recent"
    limit: int | None = None


RUN_COLUMNS = (
    "run_id", "session_id", "kind", "status", "flow", "active_flow", "active_node",
    "waiting_for", "wait_kind", "wait_deadline", "lease_holder", "lease_expires_at",
    "step_count", "created_at", "updated_at", "version", "event_count", "agent",
    "flow_version", "parent_run_id", "parent_step", "node", "outcome", "error_type",
    "subject",
)  # fmt: skip
STEP_COLUMNS = (
    "run_id", "idx", "kind", "name", "status", "started_at", "finished_at",
    "attempts", "error_type", "duration_ms", "agent", "input_tokens", "output_tokens",
    "total_tokens",
)  # fmt: skip

#: The generation of the view tables' shape and rows (see the module docstring).
#: 1: 0.1.0. 2: runs and steps carry their agent, steps their model usage.
#: 3: runs carry the version of their flow. 4: runs carry their parent run, their
#: last node, their outcome, the type of the error they ended in and their data
#: subject, and a wait's payload sealed as the events hold it (docs/privacy.md).
VIEWS_GENERATION = 4

#: Nullable columns added to a table after generation 1, by table ("runs",
#: "steps"), with a type both SQLite and PostgreSQL read: what an upgrade adds.
ADDED_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "runs": (
        ("agent", "text"),
        ("flow_version", "text"),
        ("parent_run_id", "text"),
        ("parent_step", "bigint"),
        ("node", "text"),
        ("outcome", "text"),
        ("error_type", "text"),
        ("subject", "text"),
    ),
    "steps": (
        ("agent", "text"),
        ("input_tokens", "bigint"),
        ("output_tokens", "bigint"),
        ("total_tokens", "bigint"),
    ),
}

#: (name, columns) of the indexes each SQL backend creates on the runs table.
SQL_INDEXES = (
    ("by_recent", "updated_at DESC, run_id DESC"),
    ("by_status", "status, updated_at DESC, run_id DESC"),
    ("by_session", "session_id, updated_at DESC, run_id DESC"),
    ("by_flow", "flow, updated_at DESC, run_id DESC"),
    ("by_lease", "status, lease_expires_at, run_id"),
    ("by_deadline", "status, wait_deadline, run_id"),
)

#: Orders an index above serves (scanned forwards or backwards), with no sort step.
_ORDER_SQL: dict[str, str] = {
    "recent": "updated_at DESC, run_id DESC",
    "oldest": "updated_at, run_id",
    "deadline": "wait_deadline, run_id",
    "lease": "lease_expires_at, run_id",
}


def sql_runs(runs: str, leases: str, run_id_of_lease: str) -> str:
    """The runs table as the queries read it: each row with its lease, the run's
    lease record where it has one, else the lease its journal recorded (0.1.0)
    while it is running. ``run_id_of_lease`` is how a run row's id compares
    with a lease record's (``?`` stands for the run row's id)."""
    columns = ", ".join(
        f"r.{c}" if c not in ("lease_holder", "lease_expires_at") else _lease_column(c)
        for c in RUN_COLUMNS
    )
    join = run_id_of_lease.replace("?", "r.run_id")
    return f"(SELECT {columns} FROM {runs} r LEFT JOIN {leases} l ON l.run_id = {join}) AS runs"


def _lease_column(column: str) -> str:
    record = "holder" if column == "lease_holder" else "expires_at"
    return (
        f"CASE WHEN l.run_id IS NOT NULL THEN l.{record} "
        f"WHEN r.status = 'running' THEN r.{column} END AS {column}"
    )


def with_lease(row: RunRow, record: Lease | None) -> RunRow:
    """The row as the queries read it (see ``sql_runs``), for the memory views."""
    if record is not None:
        return replace(row, lease_holder=record.holder, lease_expires_at=record.expires_at)
    if row.status != "running":
        return replace(row, lease_holder=None, lease_expires_at=None)
    return row


#: The highest code point: a prefix followed by it sorts after every text with that
#: prefix (byte order: PostgreSQL's "C" collation, SQLite's BINARY, Python's ``<``).
_TOP = "\U0010ffff"


def prefix_bounds(prefix: str) -> tuple[str, str]:
    """The texts ``[low, high)`` that hold exactly the texts starting with ``prefix``
    in byte order: a range an index on the column serves, unlike ``LIKE``."""
    return prefix, prefix + _TOP


def sql_where(
    q: RunQuery,
    placeholder: str,
    time: Callable[[datetime], Any],
    *,
    byte_order: str = "",
    steps: str | None = None,
) -> tuple[str, list[Any]]:
    """``" WHERE ..."`` (or ``""``) and its parameters for ``q``. ``byte_order`` is what
    makes the database compare ``run_id`` byte by byte (PostgreSQL: ``' COLLATE "C"'``;
    SQLite's default already does), for a prefix; ``steps`` names the steps table, for
    ``in_doubt``."""
    clauses: list[str] = []
    params: list[Any] = []

    def add(clause: str, *values: Any) -> None:
        clauses.append(clause.replace("?", placeholder))
        params.extend(values)

    for column in ("status", "session_id", "flow", "wait_kind", "subject"):
        value = getattr(q, column)
        if value is not None:
            add(f"{column} = ?", value)
    if q.updated_before is not None:
        add("updated_at < ?", time(q.updated_before))
    if q.not_wait_kind is not None:
        add("(wait_kind IS NULL OR wait_kind <> ?)", q.not_wait_kind)
    if q.lease_expired_before is not None:
        add("lease_expires_at < ?", time(q.lease_expired_before))
    if q.deadline_before is not None:
        add(f"wait_deadline {'<=' if q.deadline_inclusive else '<'} ?", time(q.deadline_before))
    if q.run_id_prefix is not None:
        column = f"run_id{byte_order}"
        add(f"{column} >= ? AND {column} < ?", *prefix_bounds(q.run_id_prefix))
    if q.updated_since is not None:
        add("updated_at >= ?", time(q.updated_since))
    if q.updated_until is not None:
        add("updated_at < ?", time(q.updated_until))
    if q.after is not None:
        add("(updated_at, run_id) < (?, ?)", time(q.after[0]), q.after[1])
    if q.in_doubt:
        if steps is None:
            raise ValueError("an in-doubt query needs the steps table")
        add(
            f"EXISTS (SELECT 1 FROM {steps} s WHERE s.run_id = runs.run_id "
            "AND s.status = 'running' "
            f"AND s.idx = (SELECT max(t.idx) FROM {steps} t WHERE t.run_id = runs.run_id))"
        )
    where = (" WHERE " + " AND ".join(clauses)) if clauses else ""
    return where, params


def last_step_running(steps: Iterable[StepRow]) -> set[str]:
    """The runs whose last step (by index) is ``running``: ``in_doubt`` in memory."""
    last: dict[str, StepRow] = {}
    for step in steps:
        if step.run_id not in last or step.index > last[step.run_id].index:
            last[step.run_id] = step
    return {run_id for run_id, step in last.items() if step.status == "running"}


def sql_order(q: RunQuery, placeholder: str) -> tuple[str, list[Any]]:
    order = f" ORDER BY {_ORDER_SQL[q.order]}"
    if q.limit is None:
        return order, []
    return order + f" LIMIT {placeholder}", [q.limit]


def matches(row: RunRow, q: RunQuery) -> bool:
    """Whether ``row`` answers ``q`` (the memory backend's WHERE)."""
    for column in ("status", "session_id", "flow", "wait_kind", "subject"):
        value = getattr(q, column)
        if value is not None and getattr(row, column) != value:
            return False
    if q.updated_before is not None and not row.updated_at < q.updated_before:
        return False
    if q.not_wait_kind is not None and row.wait_kind == q.not_wait_kind:
        return False
    if q.lease_expired_before is not None and (
        row.lease_expires_at is None or not row.lease_expires_at < q.lease_expired_before
    ):
        return False
    if q.deadline_before is not None:
        deadline = row.wait_deadline
        if deadline is None:
            return False
        bound = q.deadline_before
        if not (deadline <= bound if q.deadline_inclusive else deadline < bound):
            return False
    return _in_range(row, q)


def _in_range(row: RunRow, q: RunQuery) -> bool:
    """The id prefix, the time range and the page position of ``matches``."""
    if q.run_id_prefix is not None and not row.run_id.startswith(q.run_id_prefix):
        return False
    if q.updated_since is not None and row.updated_at < q.updated_since:
        return False
    if q.updated_until is not None and not row.updated_at < q.updated_until:
        return False
    return q.after is None or (row.updated_at, row.run_id) < q.after


def sort_key(q: RunQuery) -> Callable[[RunRow], Any]:
    """The memory backend's ORDER BY (``reverse`` for "recent")."""
    if q.order in ("recent", "oldest"):
        return lambda r: (r.updated_at, r.run_id)
    if q.order == "deadline":
        return lambda r: (r.wait_deadline, r.run_id)
    return lambda r: (r.lease_expires_at, r.run_id)


def run_values(row: RunRow, time: Callable[[datetime], Any]) -> tuple[Any, ...]:
    """The row's column values in ``RUN_COLUMNS`` order."""
    deadline = row.wait_deadline
    lease = row.lease_expires_at
    return (
        row.run_id, row.session_id, row.kind, row.status, row.flow, row.active_flow,
        row.active_node, None if row.waiting_for is None else json.dumps(row.waiting_for),
        row.wait_kind, None if deadline is None else time(deadline), row.lease_holder,
        None if lease is None else time(lease), row.step_count, time(row.created_at),
        time(row.updated_at), row.version, row.event_count, row.agent, row.flow_version,
        row.parent_run_id, row.parent_step, row.node, row.outcome, row.error_type,
        row.subject,
    )  # fmt: skip


def step_values(row: StepRow, time: Callable[[datetime], Any]) -> tuple[Any, ...]:
    """The step's column values in ``STEP_COLUMNS`` order."""
    finished = row.finished_at
    return (
        row.run_id, row.index, row.kind, row.name, row.status, time(row.started_at),
        None if finished is None else time(finished), row.attempts, row.error_type,
        row.duration_ms, row.agent, row.input_tokens, row.output_tokens, row.total_tokens,
    )  # fmt: skip


_Row = TypeVar("_Row", RunRow, StepRow)


#: The field names of each row class: most are read from the columns of those names.
_FIELDS: dict[type[RunRow | StepRow], tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls)) for cls in (RunRow, StepRow)
}


def _from_columns(cls: type[_Row], r: Any, **read: Any) -> _Row:
    """A row of ``cls`` from a database row: the fields in ``read`` as given (times,
    JSON, a renamed column), every other field from the column of its name."""
    return cls(**{name: r[name] for name in _FIELDS[cls] if name not in read}, **read)


def run_row(r: Any, time: Callable[[Any], datetime | None]) -> RunRow:
    """A run row from a database row (``r[column]``), ``time`` reading its times."""
    created, updated = time(r["created_at"]), time(r["updated_at"])
    assert created is not None and updated is not None
    waiting_for = r["waiting_for"]
    return _from_columns(
        RunRow,
        r,
        waiting_for=json.loads(waiting_for) if waiting_for is not None else None,
        lease_expires_at=time(r["lease_expires_at"]),
        created_at=created,
        updated_at=updated,
    )


def step_row(r: Any, time: Callable[[Any], datetime | None]) -> StepRow:
    """A step row from a database row (``r[column]``), ``time`` reading its times."""
    started = time(r["started_at"])
    assert started is not None
    return _from_columns(
        StepRow, r, index=r["idx"], started_at=started, finished_at=time(r["finished_at"])
    )


def percentile(sorted_values: list[float], fraction: float) -> float | None:
    """Linear interpolation between closest ranks (PostgreSQL's ``percentile_cont``)."""
    if not sorted_values:
        return None
    position = fraction * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def tool_stats(steps: Iterable[tuple[str, str, float | None]]) -> list[ToolStats]:
    """Per-tool statistics from ``(name, status, duration_ms)`` of tool steps."""
    counts: dict[str, int] = {}
    errors: dict[str, int] = {}
    durations: dict[str, list[float]] = {}
    for name, status, duration in steps:
        counts[name] = counts.get(name, 0) + 1
        errors[name] = errors.get(name, 0) + (status == "error")
        if duration is not None:
            durations.setdefault(name, []).append(duration)
    stats = []
    for name in sorted(counts):
        values = sorted(durations.get(name, []))
        stats.append(
            ToolStats(
                name=name,
                count=counts[name],
                errors=errors[name],
                p50_ms=percentile(values, 0.5),
                p95_ms=percentile(values, 0.95),
            )
        )
    return stats


# ------------------------------------------------------------------- usage
UsageGroup = Literal["run", "agent"]


@dataclass(frozen=True)
class UsageQuery:
    """Which model and tool steps a usage sum covers; every set field must hold.

    ``since`` compares a step's start time (inclusive). ``group`` splits the
    sum by run or by the agent a step ran under; ``limit`` (with ``group="run"``)
    keeps the runs that spent the most tokens.
    """

    run_id: str | None = None
    session_id: str | None = None
    agent: str | None = None
    since: datetime | None = None
    group: UsageGroup | None = None
    limit: int | None = None


@dataclass(frozen=True)
class UsageShare:
    """The steps of one group, kind and model (``""`` for tools): attempts and tokens."""

    group: str | None
    kind: str
    model: str
    calls: int
    input_tokens: int
    output_tokens: int
    total_tokens: int


_GROUP_SQL = {"run": "s.run_id", "agent": "s.agent", None: "CAST(NULL AS TEXT)"}


def sql_usage(
    q: UsageQuery, steps: str, runs: str, placeholder: str, time: Callable[[datetime], Any]
) -> tuple[str, list[Any]]:
    """One SELECT of ``UsageShare`` columns over the steps table ``steps`` (alias ``s``,
    joined to ``runs`` for a session), and its parameters."""
    clauses = ["s.kind IN ('model', 'tool')"]
    params: list[Any] = []
    join = ""
    if q.run_id is not None:
        clauses.append("s.run_id = ?")
        params.append(q.run_id)
    if q.session_id is not None:
        join = f" JOIN {runs} r ON r.run_id = s.run_id"
        clauses.append("r.session_id = ?")
        params.append(q.session_id)
    if q.agent is not None:
        clauses.append("s.agent = ?")
        params.append(q.agent)
    if q.since is not None:
        clauses.append("s.started_at >= ?")
        params.append(time(q.since))
    body = f" FROM {steps} s{join} WHERE " + " AND ".join(clauses)
    statement = (
        f"SELECT {_GROUP_SQL[q.group]} AS grp, s.kind AS kind, "
        "CASE WHEN s.kind = 'model' THEN s.name ELSE '' END AS model, "
        "SUM(s.attempts) AS calls, COALESCE(SUM(s.input_tokens), 0) AS input_tokens, "
        "COALESCE(SUM(s.output_tokens), 0) AS output_tokens, "
        "COALESCE(SUM(s.total_tokens), 0) AS total_tokens" + body
    )
    all_params = list(params)
    if q.group == "run" and q.limit is not None:
        statement += (
            f" AND s.run_id IN (SELECT s.run_id{body} GROUP BY s.run_id "
            "ORDER BY COALESCE(SUM(s.total_tokens), 0) DESC, SUM(s.attempts) DESC, s.run_id "
            "LIMIT ?)"
        )
        all_params += [*params, q.limit]
    statement += " GROUP BY 1, 2, 3"
    return statement.replace("?", placeholder), all_params


def usage_shares(
    steps: Iterable[StepRow], runs: dict[str, RunRow], q: UsageQuery
) -> list[UsageShare]:
    """``sql_usage`` over rows in memory (``runs`` by id, for the session filter)."""
    tally: dict[tuple[str | None, str, str], list[int]] = {}
    for s in steps:
        if s.kind not in ("model", "tool"):
            continue
        if q.run_id is not None and s.run_id != q.run_id:
            continue
        if q.session_id is not None and (
            s.run_id not in runs or runs[s.run_id].session_id != q.session_id
        ):
            continue
        if q.agent is not None and s.agent != q.agent:
            continue
        if q.since is not None and s.started_at < q.since:
            continue
        group = {"run": s.run_id, "agent": s.agent, None: None}[q.group]
        key = (group, s.kind, s.name if s.kind == "model" else "")
        counts = tally.setdefault(key, [0, 0, 0, 0])
        for i, value in enumerate((s.attempts, s.input_tokens, s.output_tokens, s.total_tokens)):
            counts[i] += value or 0
    shares = [UsageShare(g, kind, model, *counts) for (g, kind, model), counts in tally.items()]
    if q.group == "run" and q.limit is not None:
        kept = {g for g, _ in _ranked(shares)[: q.limit]}
        shares = [s for s in shares if s.group in kept]
    return shares


def _ranked(shares: Iterable[UsageShare]) -> list[tuple[str | None, tuple[int, int]]]:
    """Groups by tokens, then attempts, most first (then by name): the SQL's order."""
    spent: dict[str | None, tuple[int, int]] = {}
    for s in shares:
        tokens, calls = spent.get(s.group, (0, 0))
        spent[s.group] = (tokens + s.total_tokens, calls + s.calls)
    return sorted(spent.items(), key=lambda item: (-item[1][0], -item[1][1], item[0] or ""))


def usage_by_group(
    shares: Iterable[UsageShare], prices: Prices | None
) -> list[tuple[str | None, Usage]]:
    """Each group's ``Usage`` (cost under ``prices``), most tokens first."""
    shares = list(shares)
    models: dict[str | None, list[ModelUsage]] = {}
    tools: dict[str | None, int] = {}
    for s in shares:
        models.setdefault(s.group, [])
        tools.setdefault(s.group, 0)
        if s.kind == "tool":
            tools[s.group] += s.calls
        else:
            models[s.group].append(
                ModelUsage(
                    model=s.model,
                    calls=s.calls,
                    input_tokens=s.input_tokens,
                    output_tokens=s.output_tokens,
                    total_tokens=s.total_tokens,
                )
            )
    return [(g, total(models[g], tools[g], prices)) for g, _ in _ranked(shares)]
