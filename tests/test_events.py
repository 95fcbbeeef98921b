"""Run events (``kuralle_es.events``): the public stream, ``follow`` and its schema.

On memory, SQLite and PostgreSQL: a run's stream equals its journal, in order;
``follow`` resumes from any position (public or not) with neither gaps nor
repeats and produces the same events as a follower that started at the
beginning; it wakes for events saved while it waits; and the JSON schema of
every public event is pinned by a golden file.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any
from uuid import uuid4

import psycopg
import pytest
from conftest import BACKENDS_AND_PGBOUNCER
from events_kit import dumps, everything, refund_run, take
from pydantic import BaseModel

from kuralle_es import (
    RunStore,
    Runtime,
    StaleWriteError,
    ToolExecutionError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es._journal.run import Run
from kuralle_es._journal.sites import Effect, Site
from kuralle_es.events import (
    RunEvent,
    RunFinished,
    RunOpened,
    RunPaused,
    RunResumed,
    SignalAccepted,
    StepFailed,
    StepFinished,
    StepStarted,
    events_json_schema,
    follow,
    parse_event,
)
from kuralle_es.examples import refund
from kuralle_es.testing import ScriptedModel


@pytest.fixture(params=BACKENDS_AND_PGBOUNCER)
def backend(request: pytest.FixtureRequest) -> str:
    """Every backend, and PostgreSQL through PgBouncer in transaction mode."""
    return str(request.param)


#: Each published revision of the version-1 schema, oldest first: history, never edited.
GOLDENS = sorted((Path(__file__).resolve().parent / "golden").glob("run_events_v1*.schema.json"))
#: The newest revision, which the current schema must equal.
GOLDEN = Path(__file__).resolve().parent / "golden" / "run_events_v1.4.schema.json"


class Nothing(BaseModel):
    pass


def explode(args: Nothing) -> None:
    raise RuntimeError("the payment API is down")


async def stamp_then_fail(state: dict[str, Any], ctx: Any) -> Any:
    await ctx.now()
    await ctx.uuid()
    try:
        await ctx.tool("explode", {})
    except ToolExecutionError:
        return end("gave up")
    return end("impossible")


def failing_agent() -> Any:
    flow = define_flow("fails", "a flow whose tool fails", "go", [action("go", stamp_then_fail)])
    tool = define_tool("explode", "always fails", Nothing, explode)
    return define_agent("ops", "ops", ScriptedModel([]), [tool], [flow])


@pytest.fixture(autouse=True)
def _ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(refund.LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    monkeypatch.delenv(refund.MODEL_ENV, raising=False)


# ------------------------------------------------------------------ tests
async def test_a_runs_stream_equals_its_journal_in_order(open_store: Any) -> None:
    store = open_store()
    runtime = Runtime([refund.build_agent(), failing_agent()], store=store)
    approved = await refund_run(runtime, "s1", approve=True)
    failed = (await runtime.run("s2", input="go", kind="flow", flow_name="fails").result()).run_id

    events = await everything(store)
    positions = [e.position for e in events]
    assert positions == sorted(set(positions)), "positions are unique and increasing"

    for run_id, session in ((approved, "s1"), (failed, "s2")):
        mine = [e for e in events if e.run_id == run_id]
        assert all(e.session_id == session and e.schema_version == 1 for e in mine)
        assert isinstance(mine[0], RunOpened) and mine[0].kind == "flow"
        steps = await runtime.get_steps(run_id, session)
        started = [e for e in mine if isinstance(e, StepStarted)]
        assert [(e.index, e.key, e.kind, e.name, e.attempt) for e in started] == [
            (s.index, s.key, s.kind, s.name, 1) for s in steps
        ]
        ended = [e for e in mine if isinstance(e, StepFinished | StepFailed)]
        assert [e.index for e in ended] == [s.index for s in steps]
        for event, step in zip(ended, steps, strict=True):
            assert event.name == step.name
            if isinstance(event, StepFinished):
                assert step.status == "finished" and event.result == step.result
            else:
                assert step.status == "error" and step.error is not None
                assert (event.error.type, event.error.message, event.final) == (
                    step.error.type, step.error.message, True,
                )  # fmt: skip
        # every step's intent comes before its result
        order = [(type(e).__name__, getattr(e, "index", None)) for e in mine]
        for step in steps:
            assert order.index(("StepStarted", step.index)) < order.index(
                ("StepFailed" if step.status == "error" else "StepFinished", step.index)
            )

    story = [type(e).__name__ for e in events if e.run_id == approved]
    assert [s for s in story if not s.startswith("Step")] == [
        "RunOpened", "RunPaused", "RunResumed", "RunPaused", "SignalAccepted", "RunFinished",
    ]  # fmt: skip
    mine = [e for e in events if e.run_id == approved]
    pauses = [e for e in mine if isinstance(e, RunPaused)]
    assert [p.waiting_for.kind for p in pauses] == ["input", "approval"]
    assert pauses[1].waiting_for.title == "Refund $42.50?"
    resumed = next(e for e in mine if isinstance(e, RunResumed))
    assert resumed.reason == "input"
    accepted = next(e for e in mine if isinstance(e, SignalAccepted))
    assert (accepted.name, accepted.actor) == ("__approval", "supervisor")
    assert isinstance(mine[-1], RunFinished) and mine[-1].outcome == "approved"
    state = await runtime.get_run(failed, "s2")
    assert state is not None and state.outcome == "gave up"


async def test_follow_resumes_from_any_position_without_gaps_or_repeats(open_store: Any) -> None:
    store = open_store()
    runtime = Runtime([refund.build_agent()], store=store)
    for i in range(3):
        await refund_run(runtime, f"s{i}", approve=[True, False, None][i])
    full = await everything(store)
    head = store.recorder.max_notification_id()
    # public positions, the ids just before them (often a skipped stored event), and 0
    cuts = sorted({0, *(e.position for e in full), *(e.position - 1 for e in full)})
    for after in cuts:
        # a fresh follower per cut: its context comes from the store, not from a cache
        expected = [e for e in full if e.position > after]
        stream = follow(store, after=after)
        got = await take(stream, len(expected))
        await stream.aclose()
        assert dumps(got) == dumps(expected), f"after={after}"
    stream = follow(store, after=head)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(stream), 0.3)
    await stream.aclose()


async def test_follow_from_none_starts_at_the_first_event(open_store: Any) -> None:
    store = open_store()
    await refund_run(Runtime([refund.build_agent()], store=store), "s", approve=None)
    full = await everything(store)
    stream = follow(store)
    assert dumps(await take(stream, len(full))) == dumps(full)
    await stream.aclose()


async def test_follow_wakes_for_events_saved_while_it_waits(open_store: Any) -> None:
    """Runs written concurrently by another store while a follower waits: all arrive, once."""
    reader_store = open_store()
    writer_store = open_store()
    runtime = Runtime([refund.build_agent()], store=writer_store)
    got: list[RunEvent] = []
    expected = asyncio.Event()
    want = [0]

    async def tail() -> None:
        async for event in follow(reader_store, poll_interval=0.05):
            got.append(event)
            if want[0] and len(got) >= want[0]:
                expected.set()

    task = asyncio.create_task(tail())
    await asyncio.sleep(0.3)  # the follower is waiting on an empty store
    assert got == []
    await asyncio.gather(*(refund_run(runtime, f"w{i}", approve=True) for i in range(4)))
    full = await everything(writer_store)
    want[0] = len(full)
    if len(got) < len(full):
        await asyncio.wait_for(expected.wait(), 10)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert dumps(got) == dumps(full)


async def test_follow_refuses_a_position_that_is_not_one(open_store: Any) -> None:
    from kuralle_es import InvalidArgumentError

    stream = follow(open_store(), after=-1)
    with pytest.raises(InvalidArgumentError, match="notification position"):
        await anext(stream)


def test_every_event_round_trips_through_json() -> None:
    opened = RunOpened(
        position=7, run_id="r", session_id="s", occurred_at="2026-01-01T00:00:00Z",
        kind="flow", flow="refund",
    )  # fmt: skip
    again = parse_event(opened.model_dump_json())
    assert again == opened and again.type == "RunOpened" and again.schema_version == 1
    with pytest.raises(ValueError, match="schema_version"):
        parse_event({**opened.model_dump(), "schema_version": 2})


def test_the_public_schema_is_the_pinned_version_1() -> None:
    current = events_json_schema()
    if os.environ.get("KURALLE_UPDATE_GOLDEN") == "1" and not GOLDEN.exists():
        # A deliberate revision: a new file, never an old one rewritten.
        GOLDEN.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    pinned = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert current == pinned, (
        "the public run events' shape changed. Consumers parse this schema: keep it, or "
        "publish a new revision (only optional fields added) in a new tests/golden file, "
        "or a new schema_version"
    )


def _kept(old: Any, new: Any) -> bool:
    """Whether the schema ``new`` accepts all ``old`` accepts, by the changes a
    revision may make to a field: values appended to an enum (a new wait kind),
    and alternatives added to what it accepts (an erased payload, ``Redacted``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        widened = "anyOf" in new and len(new["anyOf"]) != len(old.get("anyOf", []))
        if set(old) != set(new) or widened:
            return _widened(old, new)
        for key, value in old.items():
            if key == "enum":
                if new[key][: len(value)] != value:
                    return False
            elif not _kept(value, new[key]):
                return False
        return True
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(_kept(o, n) for o, n in zip(old, new, strict=True))
    return bool(old == new)


def _widened(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether ``new`` is ``old`` with alternatives added: each of old's (or old
    itself) is kept by one of new's ``anyOf``, the rest of new as old has it."""
    if "anyOf" not in new:
        return False
    outer = {k: v for k, v in new.items() if k != "anyOf"}
    if any(old.get(k) != v for k, v in outer.items()):
        return False
    rest = {k: v for k, v in old.items() if k not in outer}
    olds = rest["anyOf"] if set(rest) == {"anyOf"} else [rest]
    return all(any(_kept(o, n) for n in new["anyOf"]) for o in olds)


@pytest.mark.parametrize("older", GOLDENS, ids=[g.name for g in GOLDENS])
def test_every_published_revision_of_version_1_still_parses(older: Path) -> None:
    """A revision only adds optional fields, event types and values of an enum
    (a step kind, a wait kind, a reason to resume): each event type of an older
    revision keeps every field with its schema (an enum keeping its values),
    requires nothing more, and an event written to it (no ``partition``) parses
    today, in partition 0."""
    old = json.loads(older.read_text(encoding="utf-8"))["schema"]["$defs"]
    new = events_json_schema()["schema"]["$defs"]
    for name, shape in old.items():
        assert name in new, f"{name} of {older.name} is gone"
        for field_name, field_schema in shape["properties"].items():
            assert _kept(field_schema, new[name]["properties"].get(field_name)), (
                f"field {field_name} of {name} changed since {older.name}"
            )
        assert new[name].get("required", []) == shape.get("required", []), name
        for added in set(new[name]["properties"]) - set(shape["properties"]):
            assert "default" in new[name]["properties"][added], f"{name}.{added} is required"
    written = {
        "type": "RunFinished", "schema_version": 1, "position": 3, "run_id": "r",
        "session_id": "s", "occurred_at": "2026-01-01T00:00:00Z", "outcome": "done",
    }  # fmt: skip
    assert parse_event(written).partition == 0


async def test_a_re_executed_step_is_a_new_attempt_even_for_a_follower_started_after_it(
    open_store: Any,
) -> None:
    """A step left running by a crash and executed again: StepStarted with attempt 2,
    with the key and name of the first start, read back from the store by a follower
    that never saw that first start."""
    store = open_store()
    run = Run(uuid4(), "s-retry", "flow", "agent", "ship", "digest")
    run.start_turn(0, None, None)
    index = run.start_step(Effect(Site("r#0", 0), "tool", "ship", {}, override="k" * 64))
    store.create_run(run)
    run.retry_step(index)
    run.finish_step(index, json.dumps({"shipped": True}))
    store.save_run(run)

    full = await everything(store)
    steps = [e for e in full if isinstance(e, StepStarted | StepFinished)]
    assert [(type(e).__name__, getattr(e, "attempt", None)) for e in steps] == [
        ("StepStarted", 1), ("StepStarted", 2), ("StepFinished", None),
    ]  # fmt: skip
    retried = steps[1]
    assert isinstance(retried, StepStarted)
    assert (retried.key, retried.name, retried.session_id) == ("k" * 64, "ship", "s-retry")
    stream = follow(store, after=steps[0].position)
    assert dumps(await take(stream, 2)) == dumps(steps[1:])
    await stream.aclose()


async def test_follow_reads_across_the_gap_a_refused_write_leaves(
    open_store: Any, backend: str
) -> None:
    """A write that loses its compare-and-set burns notification ids on PostgreSQL:
    followers read across the gap, from before it, inside it and after it."""
    store = open_store()
    runtime = Runtime([refund.build_agent()], store=store)
    run_id = await refund_run(runtime, "gap", approve=None)
    winner, loser = store.load(run_id), store.load(run_id)
    assert winner is not None and loser is not None
    winner.start_turn(5, None, None)
    store.save_run(winner)
    loser.start_turn(9, None, None)  # a public event that must never appear
    with pytest.raises(StaleWriteError):
        store.save_run(loser)
    await refund_run(runtime, "after-gap", approve=True)

    ids = [n.id for n in store.recorder.select_notifications(start=None, limit=10_000)]
    if backend == "postgres":
        assert ids[-1] > len(ids), "the refused write left a gap in the ids"
    full = await everything(store)
    assert not any(e.position not in ids for e in full)
    for after in sorted({0, *range(ids[0], ids[-1] + 1)}):
        expected = [e for e in full if e.position > after]
        stream = follow(store, after=after)
        assert dumps(await take(stream, len(expected))) == dumps(expected), f"after={after}"
        await stream.aclose()


@pytest.mark.postgres
@pytest.mark.direct_only(
    "kills the follower's LISTEN connection: behind a transaction pooler a follower "
    "polls and has none (test_connections covers that route)"
)
async def test_a_follower_outlives_its_listen_connection(pg_dsn: str) -> None:
    """The server drops the follower's LISTEN connection: it listens again and goes on."""
    store = RunStore.postgres(pg_dsn)
    try:
        runtime = Runtime([refund.build_agent()], store=store)
        await refund_run(runtime, "before", approve=None)
        full = await everything(store)
        stream = follow(store)
        assert dumps(await take(stream, len(full))) == dumps(full)
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND query LIKE 'LISTEN%'"
            ).fetchall()
        assert killed, "the follower had a LISTEN connection"
        waiting = asyncio.ensure_future(anext(stream))  # survives the dropped connection
        await asyncio.sleep(0.3)
        await refund_run(runtime, "after", approve=True)
        now = await everything(store)
        got = [await asyncio.wait_for(waiting, 10), *await take(stream, len(now) - len(full) - 1)]
        assert dumps(got) == dumps(now[len(full) :])
        await stream.aclose()
    finally:
        store.close()
