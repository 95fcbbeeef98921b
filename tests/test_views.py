"""Views answer what a fold of the events says, on memory, SQLite and PostgreSQL.

Every query is checked against ``runtime.get_run`` (the aggregate's own fold)
after real turns left runs in every status; a view rebuilt from scratch must
equal the one kept up to date as the runs went; views survive a restart and
resume from their tracking position; unknown events are skipped but counted.
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import StoreFactory
from eventsourcing.utils import register_topic
from views_kit import SESSION, agent, expected_summary, leave_run, populate, start

from kuralle_es import InvalidArgumentError, RunStore, RunSummary, Runtime, RunViews, ToolStats
from kuralle_es._journal import catalogue as stored
from kuralle_es._journal.leases import LeaseOp
from kuralle_es.views import ProjectionIntegrityError
from kuralle_es.views.query import percentile


class SomethingNew(stored.Event):
    """A run event this version's views do not know (a later domain addition)."""

    TOPIC = "kuralle_es:Run.SomethingNew"
    note: str


register_topic(SomethingNew.TOPIC, SomethingNew)


async def _populated(open_store: StoreFactory) -> tuple[Runtime, dict[str, str]]:
    store = open_store()
    runtime = Runtime([agent()], store=store)
    drifted = Runtime([agent(2)], store=store)
    populated = await populate(runtime, drifted)
    return runtime, populated.by_case


def _ids(summaries: list[RunSummary]) -> set[str]:
    return {s.run_id for s in summaries}


async def test_each_query_answers_what_the_fold_of_the_runs_events_says(
    open_store: StoreFactory,
) -> None:
    runtime, runs = await _populated(open_store)
    views = runtime.views
    states = {}
    for case, run_id in runs.items():
        session = "conversation-session" if case == "conversation" else SESSION
        state = await runtime.get_run(run_id, session)
        assert state is not None
        states[case] = state
    assert {s.status for s in states.values()} == {
        "running", "paused", "finished", "error", "aborted",
    }  # fmt: skip
    waits = {s.waiting_for.kind for s in states.values() if s.waiting_for is not None}
    assert waits == {"approval", "signal", "input", "timer"}

    listed = await views.list_runs(limit=1000)
    assert {s.run_id: s.model_dump(mode="json") for s in listed} == {
        s.run_id: expected_summary(s) for s in states.values()
    }
    assert [s.updated_at for s in listed] == sorted((s.updated_at for s in listed), reverse=True)

    for status in ("running", "paused", "finished", "error", "aborted"):
        expected = {s.run_id for s in states.values() if s.status == status}
        assert _ids(await views.list_runs(status=status)) == expected, status
    assert _ids(await views.list_runs(session_id="conversation-session")) == {runs["conversation"]}
    # A finished flow run is still found by its flow.
    assert _ids(await views.list_runs(flow="quick")) >= {runs["quick"]}
    assert _ids(await views.list_runs(flow="approve")) == {runs["approve"]}
    assert len(await views.list_runs(limit=3)) == 3

    now = datetime.now(UTC)
    paused = {s.run_id for s in states.values() if s.status == "paused"}
    assert _ids(await views.waiting_runs()) == paused
    assert _ids(await views.orphaned_runs(now)) == {runs["orphan"]}
    assert _ids(await views.expired_deadlines(now)) == {runs["approve"]}
    assert _ids(await views.due_timers(now)) == {runs["timer"]}
    assert _ids(await views.due_timers(datetime(3000, 1, 1, tzinfo=UTC))) == {
        runs["timer"], runs["sleeping"],
    }  # fmt: skip


async def test_step_stats_count_calls_and_errors_per_tool_with_latency_percentiles(
    open_store: StoreFactory,
) -> None:
    runtime, runs = await _populated(open_store)
    durations: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    for case, run_id in runs.items():
        session = "conversation-session" if case == "conversation" else SESSION
        for step in await runtime.get_steps(run_id, session):
            if step.kind != "tool":
                continue
            assert step.started_at is not None and step.finished_at is not None
            ms = (step.finished_at - step.started_at).total_seconds() * 1000
            durations.setdefault(step.name, []).append(ms)
            errors[step.name] = errors.get(step.name, 0) + (step.status == "error")

    stats = {s.name: s for s in await runtime.views.step_stats()}
    assert set(stats) == {"ping", "boom"}
    for name, values in durations.items():
        values.sort()
        expected = ToolStats(
            name=name,
            count=len(values),
            errors=errors[name],
            p50_ms=percentile(values, 0.5),
            p95_ms=percentile(values, 0.95),
        )
        assert stats[name].count == expected.count
        assert stats[name].errors == expected.errors
        assert stats[name].p50_ms == pytest.approx(expected.p50_ms, abs=0.01)
        assert stats[name].p95_ms == pytest.approx(expected.p95_ms, abs=0.01)
    assert stats["boom"].errors == 1 and stats["ping"].errors == 0


async def test_a_view_rebuilt_from_scratch_equals_the_one_kept_up_to_date(
    open_store: StoreFactory,
) -> None:
    store = open_store()
    runtime = Runtime([agent()], store=store)
    live = runtime.views
    # Keep the live view current while the runs happen, batch by batch.
    for case in ("quick", "approve", "crash"):
        await start(runtime, case)
        await live.wait_until_caught_up(10)
    await populate(runtime, Runtime([agent(2)], store=store))
    await live.wait_until_caught_up(10)

    fresh = RunViews(store, name="rebuilt")
    assert await fresh.position() is None
    await fresh.wait_until_caught_up(30)
    assert await fresh.rows() == await live.rows()
    assert await fresh.position() == await live.position() == store.recorder.max_notification_id()

    before = await live.rows()
    applied = await live.rebuild()
    assert applied == store.recorder.max_notification_id()
    assert await live.rows() == before


async def test_views_survive_a_restart_and_resume_from_their_tracking_position(
    backend: str, open_store: StoreFactory
) -> None:
    if backend == "memory":
        pytest.skip("an in-memory store does not outlive its process")
    store = open_store()
    runtime = Runtime([agent()], store=store)
    await runtime.run(SESSION, input="go", kind="flow", flow_name="quick").result()
    await runtime.views.wait_until_caught_up(10)
    position = await runtime.views.position()
    store.close()

    store = open_store()
    leave_run(store)
    reopened = RunViews(store)
    assert await reopened.position() == position
    assert await reopened.catch_up() == store.recorder.max_notification_id() - position
    rows, _ = await reopened.rows()
    assert all(r.event_count == r.version for r in rows)
    assert len(rows) == 2


async def test_an_event_the_views_do_not_know_is_skipped_but_counted(
    open_store: StoreFactory,
) -> None:
    store: RunStore = open_store()
    run_id = leave_run(store)
    run = store.load(run_id)
    assert run is not None
    run.trigger_event(SomethingNew, note="from a later version")
    store.save_run(run, LeaseOp.clear(run.id))
    views = RunViews(store)
    [summary] = await views.list_runs()
    assert summary.status == "running"
    rows, _ = await views.rows()
    assert rows[0].version == rows[0].event_count == run.version
    assert await views.position() == store.recorder.max_notification_id()


async def test_list_runs_refuses_a_limit_that_is_not_a_positive_integer(
    open_store: StoreFactory,
) -> None:
    views = RunViews(open_store())
    bad: Any
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidArgumentError, match="limit"):
            await views.list_runs(limit=bad)


async def test_the_sweepers_queries_and_the_catch_up_wait_refuse_bad_arguments_naming_them(
    open_store: StoreFactory,
) -> None:
    """A time that is not a datetime, a timeout that is not a positive finite number:
    ``InvalidArgumentError`` naming the argument, not an ``AttributeError`` from
    deep inside or a ``TimeoutError`` that says nothing of the argument."""
    views = RunViews(open_store())
    bad: Any
    for query in (views.orphaned_runs, views.expired_deadlines, views.due_timers):
        for bad in ("yesterday", 5, 1.5):
            with pytest.raises(InvalidArgumentError, match="now"):
                await query(bad)
    with pytest.raises(InvalidArgumentError, match="before"):
        await views.in_doubt_runs("x")  # type: ignore[arg-type]
    for bad in (float("nan"), float("inf"), -1, 0, "5", True):
        with pytest.raises(InvalidArgumentError, match="timeout"):
            await views.wait_until_caught_up(bad)
    await views.wait_until_caught_up(5)  # a good one still waits


async def test_events_applied_again_without_their_position_are_refused_not_counted_twice(
    backend: str, open_store: StoreFactory
) -> None:
    """If the tracking position were ever lost, replaying the log into the same
    rows must stop at the first doubled event, with nothing written."""
    if backend == "memory":
        pytest.skip("the memory views' position cannot be lost apart from their rows")
    store = open_store()
    leave_run(store)
    views = RunViews(store)
    await views.catch_up()
    before = await views.rows()
    target = open_store.target
    assert target is not None
    if backend == "sqlite":
        with sqlite3.connect(target) as conn:
            conn.execute("UPDATE runviews_tracking SET notification_id = NULL")
    else:
        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute("DELETE FROM runviews_tracking WHERE application_name = 'RunStore'")
    with pytest.raises(ProjectionIntegrityError, match="applied twice"):
        await views.catch_up()
    assert await views.rows() == before
    assert await views.position() is None


async def test_wait_until_caught_up_gives_up_after_its_timeout(tmp_path: Path) -> None:
    """Another process holding the database's write lock keeps the views from moving."""
    db = tmp_path / "runs.db"
    with RunStore.sqlite(str(db)) as store:
        leave_run(store)
        views = RunViews(store)
        blocker = sqlite3.connect(str(db), isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(TimeoutError):
                await views.wait_until_caught_up(0.3)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        await views.wait_until_caught_up(10)
        assert await views.position() == store.recorder.max_notification_id()
