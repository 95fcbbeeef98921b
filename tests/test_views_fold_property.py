"""The views equal the fold: a Hypothesis property over random programs.

Each example builds a store's runs from a random program of flows and things
that happen to them, on memory, SQLite and PostgreSQL: a flow's node is a
random list of effects (a tool that succeeds, one that fails and is retried,
one that fails for good, a clock read, an approval, a signal, a durable
sleep), and the program starts runs, approves and denies them, delivers
signals, fires their timers, cancels them, forks them at a random step,
resumes errored ones, and kills turns at a journal boundary so that
``recover_orphaned_runs`` takes them over. Afterwards every run's row in the
views (``list_runs``) must say what the fold of its events says
(``runtime.get_run``), lease included, and every step row (its kind, name,
status and attempts) what ``get_steps`` says; the views rebuilt from the log
must equal the ones kept up to date.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kuralle_es import (
    RetryPolicy,
    RunContext,
    RunState,
    RunStore,
    Runtime,
    RunViews,
    ToolExecutionError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    fire_timers,
    recover_orphaned_runs,
)
from kuralle_es.testing import Crash, CrashingStore, CrashPlan, crash_plans

EFFECTS = ("ok", "retried", "fails", "now", "approve", "signal", "sleep")
EXAMPLES = {"memory": 60, "sqlite": 20, "postgres": 10}
SESSIONS = itertools.count()
LEASE_TTL = 0.2


class Step(BaseModel):
    n: int


def _flaky() -> Callable[[Step], dict[str, int]]:
    seen: dict[int, int] = {}

    def flaky(args: Step) -> dict[str, int]:
        seen[args.n] = seen.get(args.n, 0) + 1
        if seen[args.n] == 1:
            raise ConnectionError("a first attempt that fails")
        return {"n": args.n}

    return flaky


def _fails(args: Step) -> dict[str, int]:
    raise ValueError(f"step {args.n} fails")


def build_agent(program: list[str]) -> Any:
    """A flow whose one node makes the program's effects, in order."""

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        for n, effect in enumerate(program):
            if effect == "ok":
                await ctx.tool("ok", {"n": n})
            elif effect == "retried":
                await ctx.tool("retried", {"n": n})
            elif effect == "fails":
                with contextlib.suppress(ToolExecutionError):
                    await ctx.tool("fails", {"n": n})
            elif effect == "now":
                await ctx.now()
            elif effect == "approve":
                await ctx.approve(f"step {n}?")
            elif effect == "signal":
                await ctx.signal(f"go-{n}")
            else:
                await ctx.sleep(30)
        return end("done")

    tools = [
        define_tool("ok", "", Step, lambda args: {"n": args.n}),
        define_tool(
            "retried",
            "",
            Step,
            _flaky(),
            retry=RetryPolicy(max_attempts=3, initial_interval=0.001, backoff=1.0),
        ),
        define_tool("fails", "", Step, _fails),
    ]
    return define_agent("views", "", None, tools, [define_flow("f", "", "n", [action("n", node)])])


happenings = st.sampled_from(["approve", "deny", "signal", "wake", "cancel", "fork", "resume"])
programs = st.lists(st.sampled_from(EFFECTS), min_size=0, max_size=5)
examples = st.tuples(
    st.lists(st.tuples(programs, st.none() | crash_plans(max_nth=3)), min_size=1, max_size=3),
    st.lists(st.tuples(st.integers(0, 2), happenings, st.integers(0, 9)), max_size=8),
)


async def happen(runtime: Runtime, run_id: str, session: str, what: str, pick: int) -> None:
    """One thing that happens to a run; a refusal is a valid outcome, not a failure."""
    state = await runtime.get_run(run_id, session)
    assert state is not None
    wait = state.waiting_for
    with contextlib.suppress(Exception):
        if what == "approve" and wait is not None:
            await runtime.approve(run_id, session, by="ops")
        elif what == "deny" and wait is not None:
            await runtime.deny(run_id, session, by="ops", reason="no")
        elif what == "signal" and wait is not None:
            await runtime.signal(run_id, session, wait.name, {"n": pick})
        elif what == "wake" and wait is not None and wait.kind == "timer":
            await fire_timers(runtime, now=datetime.now(UTC) + timedelta(minutes=5))
        elif what == "cancel":
            await runtime.cancel(run_id, session, "changed our mind")
        elif what == "fork":
            await runtime.fork(run_id, session, pick % (state.step_count + 1))
        elif what == "resume":
            await runtime.run(session, run_id=run_id).result()


def summary_of(state: RunState) -> dict[str, Any]:
    dumped = state.model_dump(mode="json")
    keys = (
        "run_id", "session_id", "kind", "status", "active_flow", "active_node",
        "waiting_for", "lease_holder", "lease_expires_at", "step_count", "updated_at",
        "flow_version", "outcome",
    )  # fmt: skip
    error = state.error.type if state.error is not None else None
    return {**{k: dumped[k] for k in keys}, "error_type": error}


async def check(
    program: tuple[list[tuple[list[str], CrashPlan | None]], list[tuple[int, str, int]]],
    open_store: Callable[[], RunStore],
    open_crashing: Callable[[], CrashingStore],
    opened: list[RunStore],
) -> None:
    flows, happenings_ = program
    store = open_store()
    opened.append(store)
    runs: list[tuple[Runtime, str, str]] = []
    for effects, plan in flows:
        agent = build_agent(effects)
        session = f"s-{next(SESSIONS)}"
        runtime = Runtime([agent], store=store, lease_ttl=LEASE_TTL, holder="views-worker")
        if plan is None:
            with contextlib.suppress(Exception):
                result = await runtime.run(session, kind="flow", flow_name="f").result()
                runs.append((runtime, result.run_id, session))
            continue
        crashing = open_crashing()
        opened.append(crashing)
        crashing.plan = plan
        dying = Runtime([agent], store=crashing, lease_ttl=LEASE_TTL, holder="a-worker-that-dies")
        handle = dying.run(session, kind="flow", flow_name="f")
        with contextlib.suppress(Crash, Exception):
            await handle.result()
        crashing.plan = None
        with contextlib.suppress(Exception):
            runs.append((runtime, await handle.run_id, session))
    if not runs:
        return
    await asyncio.sleep(LEASE_TTL + 0.05)  # the killed turns' leases expire
    with contextlib.suppress(Exception):
        await recover_orphaned_runs(runs[0][0])
    for which, what, pick in happenings_:
        runtime, run_id, session = runs[which % len(runs)]
        await happen(runtime, run_id, session, what, pick)

    views = RunViews(store)
    expected: dict[str, dict[str, Any]] = {}
    steps_expected: dict[str, list[tuple[int, str, str, str, int]]] = {}
    every = await RunViews(store).list_runs(limit=1000)
    for summary in every:
        runtime = runs[0][0]
        state = await runtime.get_run(summary.run_id, summary.session_id)
        assert state is not None
        expected[summary.run_id] = summary_of(state)
        journal = await runtime.get_steps(summary.run_id, summary.session_id)
        steps_expected[summary.run_id] = [
            (s.index, s.kind, s.name, s.status, s.attempts) for s in journal
        ]
    found = {s.run_id: s.model_dump(mode="json") for s in every}
    for run_id, want in expected.items():
        got = {k: found[run_id][k] for k in want}
        assert got == want, run_id
    _, step_rows = await views.rows()
    by_run: dict[str, list[tuple[int, str, str, str, int]]] = {}
    for row in step_rows:
        by_run.setdefault(row.run_id, []).append(
            (row.index, row.kind, row.name, row.status, row.attempts)
        )
    for run_id, want_steps in steps_expected.items():
        assert sorted(by_run.get(run_id, [])) == sorted(want_steps), run_id
    kept = await views.rows()
    rebuilt_views = RunViews(store, name="rebuilt")
    await rebuilt_views.rebuild()
    assert await rebuilt_views.rows() == kept


def run_property(backend: str, target: str | None) -> None:
    memory = CrashingStore.memory()

    def open_store() -> RunStore:
        if backend == "memory":
            return memory
        assert target is not None
        return RunStore.sqlite(target) if backend == "sqlite" else RunStore.postgres(target)

    def open_crashing() -> CrashingStore:
        if backend == "memory":
            return memory
        assert target is not None
        if backend == "sqlite":
            return CrashingStore.sqlite(target)
        return CrashingStore.postgres(target)

    @settings(
        max_examples=EXAMPLES[backend],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(program=examples)
    def prop(program: Any) -> None:
        opened: list[RunStore] = []
        try:
            asyncio.run(check(program, open_store, open_crashing, opened))
        finally:
            if backend != "memory":
                for store in opened:
                    with contextlib.suppress(Exception):
                        store.close()

    prop()


def test_the_views_equal_the_fold_for_random_programs_memory() -> None:
    run_property("memory", None)


def test_the_views_equal_the_fold_for_random_programs_sqlite(tmp_path: Path) -> None:
    run_property("sqlite", str(tmp_path / "runs.db"))


@pytest.mark.postgres
def test_the_views_equal_the_fold_for_random_programs_postgres(pg_dsn: str) -> None:
    run_property("postgres", pg_dsn)
