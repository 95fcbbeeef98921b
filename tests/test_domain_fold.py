"""The ``Run`` aggregate is a pure fold: in memory, from stored events and from a
snapshot it is the same run.

Random command sequences drive a ``Run`` directly (no runtime), are saved
through ``RunStore.memory()`` or ``RunStore.sqlite(...)`` at random points, and
the reloaded aggregate must give the same ``to_state()`` and ``step_records()``.
Commands whose preconditions fail must raise ``ValueError`` and write nothing.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kuralle_es import (
    Message,
    RunStore,
    Runtime,
    SignalDelivery,
    StepError,
    WaitingFor,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es._journal import catalogue as stored
from kuralle_es._journal.leases import LeaseOp
from kuralle_es._journal.log import snapshot_due
from kuralle_es._journal.run import Run
from kuralle_es._journal.sites import Effect, Lane, Site
from kuralle_es._journal.wait import Wait

# ------------------------------------------------------------------ strategies
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=6,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
names = st.sampled_from(["charge", "refund", "lookup", "now", "uuid", "gpt-x", "__approval"])
kinds = st.sampled_from(["tool", "approval", "signal", "now", "uuid", "model"])
pick = st.integers(min_value=0, max_value=10_000)
short = st.text(max_size=10)
opt_short = st.none() | short
moments = st.datetimes(
    min_value=datetime(2020, 1, 1),
    max_value=datetime(2035, 1, 1),
    timezones=st.just(UTC),
)
step_errors = st.builds(
    StepError,
    type=st.sampled_from(["ValueError", "ConnectionError", "ToolResultTypeError"]),
    message=short,
    data=json_objects,
)
messages = st.builds(
    Message,
    role=st.sampled_from(["system", "user", "assistant", "tool"]),
    content=opt_short,
    tool_call_id=st.none() | st.just("call_1"),
    name=st.none() | st.just("charge"),
)
waits = st.builds(
    WaitingFor,
    name=st.sampled_from(["__approval", "__input", "payment-received"]),
    callsite=st.integers(0, 50),
    title=opt_short,
    description=opt_short,
    deadline=st.none() | moments,
    request_id=st.uuids().map(str),
    kind=st.sampled_from(["approval", "signal", "input"]),
)

# What only the runtime reads back from a pause (stored beside the public fields).
private_parts = st.fixed_dictionaries(
    {"logical_run": st.sampled_from(["r#0", "r#0#refund@d"])},
    optional={
        "lane": st.sampled_from([Lane.MAIN, Lane.APPROVAL]),
        "step_index": st.integers(0, 20),
        "schema_topic": st.none() | short,
    },
)

commands = st.one_of(
    st.tuples(
        st.just("start_step"),
        kinds,
        names,
        st.integers(0, 30),
        st.sampled_from(["r#0", "r#1", "r#0#f@d"]),
        st.sampled_from(["", "!approval", "!budget"]),
        json_values,
    ),
    st.tuples(st.just("finish_step"), pick, json_values),
    st.tuples(st.just("fail_step"), pick, step_errors),
    st.tuples(
        st.just("enter_node"),
        st.none() | st.just("refund"),
        st.none() | st.sampled_from(["check", "charge", "done"]),
        json_objects,
        st.integers(0, 40),
    ),
    st.tuples(st.just("append_message"), messages),
    st.tuples(st.just("pause"), waits, private_parts),
    st.tuples(st.just("accept_signal"), st.uuids().map(str), short, json_values, opt_short),
    st.tuples(st.just("accept_input"), messages),
    st.tuples(
        st.just("repin_flow"), st.just("refund"), st.sampled_from(["e" * 64, "f"]), short, opt_short
    ),
    st.tuples(st.just("allow_retry"), pick),
    st.tuples(st.just("resume")),
    st.tuples(st.just("start_turn"), st.integers(0, 5), st.none() | messages, opt_short),
    st.tuples(st.just("take_lease"), short, moments),
    st.tuples(st.just("release_lease")),
    st.tuples(st.just("record_turn"), short, json_objects),
    st.tuples(st.just("finish"), opt_short, json_values, opt_short, json_objects),
    st.tuples(st.just("fail"), step_errors),
    st.tuples(st.just("abort"), short),
    st.tuples(st.just("save")),
    st.tuples(st.just("snapshot")),
)


# ---------------------------------------------------------------- interpreter
def expect_refusal(run: Run, call: Any, *args: Any) -> None:
    """A command whose precondition fails raises ValueError and triggers nothing."""
    before = len(run.pending_events)
    version = run.version
    with pytest.raises(ValueError):
        call(*args)
    assert len(run.pending_events) == before
    assert run.version == version


def apply(run: Run, store: RunStore, command: tuple[Any, ...]) -> None:
    op = command[0]
    if op == "start_step":
        _, kind, name, callsite, logical, lane, args = command
        key = f"{run.step_count:064x}"
        effect = Effect(Site(logical, callsite, Lane(lane)), kind, name, args, override=key)
        if run.status == "running":
            index = run.start_step(effect)
            assert index == run.step_count - 1
            assert run.step(index)["status"] == "running"
        else:
            expect_refusal(run, lambda: run.start_step(effect))
    elif op in ("finish_step", "fail_step"):
        _, which, payload = command
        if not run.steps:
            return
        index = run.step_base + which % len(run.steps)  # a live step
        do = run.finish_step if op == "finish_step" else run.fail_step
        arg = json.dumps(payload) if op == "finish_step" else payload
        if run.step(index)["status"] == "running":
            do(index, arg)
        else:
            expect_refusal(run, do, index, arg)
    elif op == "enter_node":
        run.enter_node(*command[1:])
    elif op == "append_message":
        run.append_message(command[1])
    elif op == "pause":
        run.pause(Wait.of(command[1], **command[2]))
    elif op in ("accept_signal", "accept_input"):
        do = run.accept_signal if op == "accept_signal" else run.accept_input
        if run.status == "paused":
            do(*command[1:])
        else:
            expect_refusal(run, do, *command[1:])
    elif op == "repin_flow":
        run.repin_flow(*command[1:])
    elif op == "allow_retry":
        if not run.steps:
            return
        index = run.step_base + command[1] % len(run.steps)
        if run.step(index)["status"] == "running":
            run.allow_retry(index)
        else:
            expect_refusal(run, run.allow_retry, index)
    elif op == "resume":
        run.resume()
    elif op == "start_turn":
        run.start_turn(*command[1:])
    elif op == "take_lease":  # as 0.1.0 stored a lease: an event (still folded)
        holder, expires_at = command[1:]
        run.trigger_event(stored.LeaseTaken, holder=holder, expires_at=expires_at)
    elif op == "release_lease":
        run.trigger_event(stored.LeaseReleased)
    elif op == "record_turn":
        run.record_turn(*command[1:])
    elif op == "finish":
        run.finish(*command[1:])
    elif op == "fail":
        run.fail(command[1])
    elif op == "abort":
        run.abort(command[1])
    elif op == "save":
        store.save_run(run)
        assert not run.pending_events
    elif op == "snapshot":
        store.save_run(run)
        snapshot_at_head(store, run)
    else:  # pragma: no cover - the strategy only builds the ops above
        raise AssertionError(op)


def latest_snapshot_version(store: RunStore, run: Run) -> int | None:
    assert store.snapshots is not None
    latest = list(store.snapshots.get(run.id, desc=True, limit=1))
    return latest[0].originator_version if latest else None


def snapshot_at_head(store: RunStore, run: Run) -> None:
    """Snapshot the saved run at its current version (unless one is already there)."""
    if latest_snapshot_version(store, run) != run.version:
        store.partitions[0].take_snapshot(run.id)
    assert latest_snapshot_version(store, run) == run.version


def fold_stored_events(store: RunStore, run_id: UUID) -> Run:
    """Rebuild the run from its stored events alone, ignoring snapshots."""
    aggregate: Any = None
    for event in store.events.get(run_id):
        aggregate = event.mutate(aggregate)  # type: ignore[attr-defined]
    assert isinstance(aggregate, Run)
    return aggregate


def assert_same_run(a: Run, b: Run) -> None:
    assert a.to_state() == b.to_state()
    assert a.step_records() == b.step_records()
    assert a.version == b.version
    # Everything else the aggregate holds (args, private wait data, epoch,
    # callsite base, output, turn keys, signal ids ...) survives too.
    assert aggregate_data(a) == aggregate_data(b)


def aggregate_data(run: Run) -> dict[str, Any]:
    return {k: v for k, v in vars(run).items() if k != "_pending_events"}


def check_roundtrip(store: RunStore, run: Run) -> None:
    store.save_run(run)
    loaded = store.load(run.run_id)  # repository: snapshot (if any) + later events
    assert loaded is not None
    assert_same_run(run, loaded)
    assert_same_run(run, fold_stored_events(store, run.id))
    # The whole journal: every step, the archived ones first, then the live ones.
    history = store.load_history(run.run_id)
    assert history is not None
    assert history.to_state() == run.to_state()
    records = history.step_records()
    assert [r.index for r in records] == list(range(run.step_count))
    assert records[run.step_base :] == run.step_records()
    snapshot_at_head(store, run)  # and now strictly from a snapshot at head
    from_snapshot = store.load(run.run_id)
    assert from_snapshot is not None
    assert_same_run(run, from_snapshot)


def fresh_run() -> Run:
    return Run(uuid4(), "session-1", "flow", "agent", "refund", "d" * 64)


@contextmanager
def _memory() -> Iterator[RunStore]:
    yield RunStore.memory()


@contextmanager
def sqlite_store() -> Iterator[RunStore]:
    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore.sqlite(str(Path(tmp) / "runs.db"))
        try:
            yield store
        finally:
            store.close()


# ------------------------------------------------------------------- the folds
@settings(max_examples=150, deadline=None)
@given(st.lists(commands, max_size=60))
def test_memory_store_reloads_the_same_run_from_events_and_snapshots(
    program: list[tuple[Any, ...]],
) -> None:
    store = RunStore.memory()
    run = fresh_run()
    for command in program:
        apply(run, store, command)
    check_roundtrip(store, run)


def cheap_command(code: int, i: int) -> tuple[Any, ...]:
    """A command built from an op code and its position: cheap to generate in bulk."""
    when = datetime(2030, 1, 1, tzinfo=UTC) + timedelta(seconds=i)
    error = StepError(type="ConnectionError", message=f"down {i}", data={"i": i})
    wait = WaitingFor(name="payment", callsite=i, request_id=f"req-{i}", kind="signal")
    builders: list[tuple[Any, ...]] = [
        ("start_step", "tool", "charge", i % 7, "r#0", "", {"i": i, "l": [i, None]}),
        ("start_step", "now", "now", i % 5, "r#0#refund@d", "", None),
        ("finish_step", i, {"n": i, "s": "é" * (i % 3)}),
        ("finish_step", i * 7, [i, True]),
        ("fail_step", i, error),
        ("enter_node", "refund", f"node-{i % 3}", {"i": i, "deep": [{"k": str(i)}]}, i % 9),
        ("append_message", Message(role="tool", content=f"m{i}", tool_call_id=f"c{i}")),
        ("pause", wait, {"logical_run": "r#0"}),
        ("accept_signal", f"sig-{i}", "payment", {"paid": i}, None),
        ("take_lease", f"worker-{i % 2}", when),
        ("start_turn", i % 3, None, None),
        ("save",),
    ]
    return builders[code % len(builders)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 11), min_size=220, max_size=330))
def test_long_runs_cross_automatic_snapshots_and_still_reload_identically(
    codes: list[int],
) -> None:
    store = RunStore.memory()
    run = fresh_run()
    due: list[int] = []
    saved = 0

    def save() -> None:
        nonlocal saved
        store.save_run(run)
        # A save that crossed a multiple of the spacing its state's weight asks for.
        if snapshot_due(saved, run.version, run.snapshot_weight):
            due.append(run.version)
        saved = run.version

    for i, code in enumerate(codes):
        command = cheap_command(code, i)
        if command == ("save",) or i % 17 == 0:
            save()  # save often so that automatic snapshots fire mid-run
        else:
            apply(run, store, command)
    save()
    assert store.snapshots is not None
    taken = [s.originator_version for s in store.snapshots.get(run.id)]
    assert taken == due
    check_roundtrip(store, run)


@settings(max_examples=25, deadline=None)
@given(st.lists(commands, max_size=40))
def test_sqlite_store_reloads_the_same_run_even_from_a_new_store_instance(
    program: list[tuple[Any, ...]],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "runs.db")
        store = RunStore.sqlite(path)
        try:
            run = fresh_run()
            for command in program:
                apply(run, store, command)
            check_roundtrip(store, run)
        finally:
            store.close()
        reopened = RunStore.sqlite(path)
        try:
            loaded = reopened.load(run.run_id)
            assert loaded is not None
            assert_same_run(run, loaded)
        finally:
            reopened.close()


def test_automatic_snapshots_are_spaced_by_the_run_and_used_on_load() -> None:
    store = RunStore.memory()
    run = fresh_run()
    for i in range(130):
        index = run.start_step(
            Effect(Site("r#", i), "tool", "charge", {"i": i}, override=f"{i:064x}")
        )
        run.finish_step(index, json.dumps({"n": i}))
        store.save_run(run)  # one save per event pair: versions cross 100 and 200
    assert run.version == 261
    snapshots = list(store.snapshots.get(run.id, desc=True, limit=1))  # type: ignore[union-attr]
    assert len(snapshots) == 1
    assert snapshots[0].originator_version == 201  # 100 steps held: spacing 100
    loaded = store.load(run.run_id)
    assert loaded is not None
    assert_same_run(run, loaded)
    assert [s.result for s in loaded.step_records()] == [{"n": i} for i in range(130)]
    assert_same_run(run, fold_stored_events(store, run.id))


# ------------------------------------------------------------- refusals write nothing
@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
def test_finishing_a_step_twice_is_refused_and_writes_nothing(store_kind: str) -> None:
    with sqlite_store() if store_kind == "sqlite" else _memory() as store:
        run = fresh_run()
        index = run.start_step(Effect(Site("r#0", 0), "tool", "charge", {}, override="a" * 64))
        run.finish_step(index, json.dumps({"charged": 1}))
        store.save_run(run)
        version = run.version

        with pytest.raises(ValueError, match="already finished"):
            run.finish_step(index, json.dumps({"charged": 2}))
        with pytest.raises(ValueError, match="already finished"):
            run.fail_step(index, StepError(type="X", message="late"))
        assert not run.pending_events
        assert run.version == version
        store.save_run(run)

        loaded = store.load(run.run_id)
        assert loaded is not None
        assert loaded.version == version
        records = loaded.step_records()
        assert [(r.status, r.result, r.error) for r in records] == [
            ("finished", {"charged": 1}, None)
        ]


def test_a_failed_step_cannot_be_finished_afterwards() -> None:
    run = fresh_run()
    index = run.start_step(Effect(Site("r#0", 0), "tool", "charge", {}, override="b" * 64))
    run.fail_step(index, StepError(type="ConnectionError", message="down"))
    pending = len(run.pending_events)
    with pytest.raises(ValueError, match="already error"):
        run.finish_step(index, "1")
    assert len(run.pending_events) == pending
    assert run.step_records()[0].status == "error"


def test_steps_are_refused_unless_the_run_is_running() -> None:
    run = fresh_run()
    run.pause(
        Wait.of(
            WaitingFor(name="__approval", callsite=0, request_id="r1", kind="approval"),
            logical_run="r#0",
        )
    )
    pending = len(run.pending_events)
    with pytest.raises(ValueError, match="paused"):
        run.start_step(Effect(Site("r", 0), "now", "now", None, override="c" * 64))
    assert len(run.pending_events) == pending
    assert run.steps == []


def test_accepting_a_signal_is_refused_unless_the_run_is_paused() -> None:
    run = fresh_run()
    pending = len(run.pending_events)
    with pytest.raises(ValueError, match="running"):
        run.accept_signal("sig-1", "__approval", {"approved": True}, "alice")
    assert len(run.pending_events) == pending
    assert not run.signal_ids


# ----------------------------------------------- JSON that looks like a transcoder envelope
def test_state_bag_shaped_like_a_transcoder_envelope_survives_a_reload() -> None:
    """The flow state bag is user JSON; a dict that happens to have exactly the
    keys ``_type_`` and ``_data_`` must come back as that dict, not as a datetime."""
    store = RunStore.memory()
    run = fresh_run()
    bag = {"when": {"_type_": "datetime_iso", "_data_": "2020-01-01T00:00:00"}}
    run.enter_node("refund", "check", bag, 0)
    store.save_run(run)
    loaded = store.load(run.run_id)
    assert loaded is not None
    assert loaded.to_state().state == bag


def test_step_args_shaped_like_a_transcoder_envelope_keep_the_run_loadable() -> None:
    """Tool args are user JSON too: ``{"_type_": "x", "_data_": 1}`` as an argument
    must not make the run's stream impossible to load."""
    store = RunStore.memory()
    run = fresh_run()
    run.start_step(
        Effect(
            Site("r#0", 0),
            "tool",
            "charge",
            {"payload": {"_type_": "x", "_data_": 1}},
            override="d" * 64,
        )
    )
    store.save_run(run)
    loaded = store.load(run.run_id)
    assert loaded is not None
    assert loaded.steps[0]["args"] == {"payload": {"_type_": "x", "_data_": 1}}


def test_lease_times_and_deadlines_round_trip_exactly() -> None:
    store = RunStore.memory()
    run = fresh_run()
    expires = datetime(2030, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
    run.pause(
        Wait.of(
            WaitingFor(
                name="__approval",
                callsite=3,
                request_id="req-1",
                kind="approval",
                deadline=expires + timedelta(hours=1),
            ),
            logical_run="r#0",
        )
    )
    store.save_run(run, LeaseOp.take(run.id, "worker-1", "t", timedelta(days=3)))
    loaded = store.load(run.run_id)
    record = store.lease(run.run_id)
    assert loaded is not None and record is not None
    state = loaded.to_state(record)
    # The expiry is the store's (its clock plus the TTL), shown exactly as it holds it.
    assert state.lease_holder == "worker-1" and state.lease_expires_at == record.expires_at
    assert state.waiting_for is not None
    assert state.waiting_for.deadline == expires + timedelta(hours=1)
    assert state == run.to_state(store.lease(run.run_id))


async def test_a_tool_argument_shaped_like_a_transcoder_envelope_does_not_poison_the_run() -> None:
    """The user-visible consequence, through the public API: one tool call with
    valid JSON args must leave a run that ``get_run`` can still read."""

    class Free(BaseModel):
        payload: Any = None

    tool = define_tool("echo", "echo", Free, lambda a: {"ok": True})

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("echo", {"payload": {"_type_": "x", "_data_": 1}})
        return end("done")

    flow = define_flow("f", "d", "n", [action("n", node)])
    rt = Runtime([define_agent("a", "i", None, [tool], [flow])], store=RunStore.memory())
    handle = rt.run("s1", kind="flow", flow_name="f")
    result = await handle.result()
    assert result.status == "finished"
    state = await rt.get_run(await handle.run_id, "s1")
    assert state is not None
    assert state.status == "finished"


async def test_a_signal_payload_shaped_like_a_transcoder_envelope_does_not_poison_the_run() -> None:
    """A signal payload comes from outside the process (a webhook, a human): valid
    JSON in it must never make the run unreadable."""

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        payload = await ctx.signal("paid")
        return end(str(payload["_type_"]))

    flow = define_flow("f", "d", "n", [action("n", node)])
    rt = Runtime([define_agent("a", "i", None, [], [flow])], store=RunStore.memory())
    paused = await rt.run("s1", kind="flow", flow_name="f").result()
    assert paused.status == "paused"
    delivery = SignalDelivery(signal_id="sig-1", name="paid", payload={"_type_": "x", "_data_": 1})
    result = await rt.run("s1", run_id=paused.run_id, signal_delivery=delivery).result()
    assert result.status == "finished"
    state = await rt.get_run(paused.run_id, "s1")
    assert state is not None
    assert state.status == "finished"
    assert state.outcome == "x"
