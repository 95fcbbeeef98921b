"""The views find runs as an operator searches for them, on memory, SQLite and PostgreSQL.

By id (a prefix, or the whole id), by the time of their last change, page by
page (a cursor that later changes above it do not move), with what an ended
run ended in (its last flow and node, its outcome, the type of its error),
and the errored runs whose last step is in doubt.
"""

from __future__ import annotations

import pytest
from conftest import StoreFactory
from views_kit import SESSION, agent, populate

from kuralle_es import InvalidArgumentError, ModelRequest, Runtime, define_agent
from kuralle_es.testing import ScriptedModel


def _outage(request: ModelRequest) -> str:
    raise ConnectionError("the model provider is down")


async def test_a_search_by_id_prefix_time_range_and_pages_finds_each_run_once(
    open_store: StoreFactory,
) -> None:
    runtime = Runtime([agent()], store=open_store())
    runs = (await populate(runtime)).by_case
    views = runtime.views
    every = await views.list_runs(limit=1000)
    assert len(every) == len(runs)

    target = runs["approve"]
    assert [s.run_id for s in await views.list_runs(run_id=target)] == [target]
    found = await views.list_runs(run_id=target[:6])
    assert target in [s.run_id for s in found]
    assert all(s.run_id.startswith(target[:6]) for s in found)
    assert await views.list_runs(run_id=target + "x") == []

    # Pages of two, each after the last run of the one before: every run once, in order.
    paged: list[str] = []
    after: str | None = None
    while True:
        page = await views.list_runs(limit=2, after=after)
        paged += [s.run_id for s in page]
        if len(page) < 2:
            break
        after = page[-1].cursor
    assert paged == [s.run_id for s in every]
    # A page of one status goes on within that status.
    paused = await views.list_runs(status="paused", limit=1000)
    second = await views.list_runs(status="paused", after=paused[0].cursor)
    assert [s.run_id for s in second] == [s.run_id for s in paused[1:]]

    # The time range: at or after ``since``, before ``until``.
    middle = every[len(every) // 2]
    since = [s.run_id for s in await views.list_runs(since=middle.updated_at, limit=1000)]
    assert since == [s.run_id for s in every if s.updated_at >= middle.updated_at]
    until = await views.list_runs(until=middle.updated_at.isoformat(), limit=1000)
    before = [s.run_id for s in every if s.updated_at < middle.updated_at]
    assert [s.run_id for s in until] == before
    assert await views.list_runs(since=middle.updated_at, until=middle.updated_at) == []


async def test_an_ended_run_keeps_its_flow_and_node_and_says_how_it_ended(
    open_store: StoreFactory,
) -> None:
    runtime = Runtime([agent()], store=open_store())
    runs = (await populate(runtime)).by_case
    by_id = {s.run_id: s for s in await runtime.views.list_runs(limit=1000)}
    quick = by_id[runs["quick"]]
    assert (quick.status, quick.active_flow, quick.flow) == ("finished", None, "quick")
    assert quick.node == "go"
    assert quick.outcome == "done" and quick.error_type is None
    crash = by_id[runs["crash"]]
    assert (crash.status, crash.node, crash.error_type) == ("error", "go", "RuntimeError")
    cancelled = await runtime.cancel(runs["signal"], SESSION, "no shipment")
    assert cancelled.status == "aborted"
    [aborted] = await runtime.views.list_runs(run_id=runs["signal"])
    assert (aborted.flow, aborted.node) == ("signal", "wait")
    assert aborted.outcome == "cancelled: no shipment"


async def test_in_doubt_runs_are_the_errored_runs_whose_last_step_never_recorded(
    open_store: StoreFactory,
) -> None:
    store = open_store()
    runtime = Runtime([agent()], store=store)
    runs = (await populate(runtime)).by_case
    down = Runtime([define_agent("desk", "helps", ScriptedModel(_outage), [], [])], store=store)
    with pytest.raises(ConnectionError):
        await down.run("outage-session", input="hello").result()
    [outage] = await down.views.list_runs(session_id="outage-session")
    assert outage.status == "error" and outage.error_type == "ConnectionError"

    in_doubt = await runtime.views.in_doubt_runs()
    # The crashed node's run is in error too, but its last step finished: not in doubt.
    assert [s.run_id for s in in_doubt] == [outage.run_id]
    assert runs["crash"] not in {s.run_id for s in in_doubt}
    assert await runtime.views.in_doubt_runs(before=outage.updated_at) == []


async def test_a_bad_cursor_or_time_is_refused() -> None:
    from kuralle_es import RunStore

    with RunStore.memory() as store:
        views = Runtime([agent()], store=store).views
        for bad in ({"after": "not-a-cursor"}, {"since": "yesterday"}, {"until": 5},
                    {"run_id": 7}):  # fmt: skip
            with pytest.raises(InvalidArgumentError):
                await views.list_runs(**bad)  # type: ignore[arg-type]
