"""The store contract: one body of tests, run against memory, SQLite and PostgreSQL.

Every test drives real runs through ``Runtime`` over a ``RunStore`` from the
``open_store`` fixture, which opens a NEW store over the same database on each
call (memory: the one shared POPO store). "Re-entering from a fresh runtime"
below always means a new ``Runtime`` over a newly opened store.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest
from conftest import BACKENDS_AND_PGBOUNCER, StoreFactory
from eventsourcing.application import project_aggregate
from procs import crashy
from procs.child import Child
from pydantic import BaseModel

from kuralle_es import (
    Agent,
    Message,
    NonDeterminismError,
    RunContext,
    RunNotFoundError,
    RunStore,
    Runtime,
    StaleWriteError,
    StepRecord,
    ToolCall,
    ToolExecutionError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    idempotency_key,
)
from kuralle_es._journal.log import snapshot_spacing
from kuralle_es.testing import Crash

HEX64 = re.compile(r"[0-9a-f]{64}")


@pytest.fixture(params=BACKENDS_AND_PGBOUNCER)
def backend(request: pytest.FixtureRequest) -> str:
    """Every backend, and PostgreSQL through PgBouncer in transaction mode."""
    return str(request.param)


SESSION = "session-1"

NodeFn = Callable[[dict[str, Any], RunContext], Awaitable[Any]]


class Amount(BaseModel):
    x: int


class Nothing(BaseModel):
    pass


class Slow(BaseModel):
    i: int
    delay: float


class Counter:
    """Counts executions of a tool and remembers the calls it saw."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    @property
    def count(self) -> int:
        return len(self.calls)


def charge_tool(counter: Counter) -> Any:
    def charge(args: Amount, call: ToolCall) -> dict[str, Any]:
        counter.calls.append(call)
        return {"charged": args.x, "execution": counter.count}

    return define_tool("charge", "charge a card", Amount, charge)


def one_node_agent(node: NodeFn, tools: list[Any], flow_name: str = "f") -> Agent:
    """An agent with one flow ``flow_name`` of one action node ``s1``.

    Two agents built with different ``node`` code have the same flow digest
    (the digest covers node ids and kinds), like a redeploy of changed code.
    """
    flow = define_flow(flow_name, "test flow", "s1", [action("s1", node)])
    return define_agent("a", "test agent", None, tools, [flow])


def fail_first_pass(attempts: list[int], error: str = "crash after the effects") -> None:
    """Count a pass of a node; raise on the first one (the run then errors)."""
    attempts.append(len(attempts) + 1)
    if len(attempts) == 1:
        raise RuntimeError(error)


async def start_flow(runtime: Runtime, flow_name: str = "f") -> tuple[str, Any]:
    """Start a flow run; returns (run_id, the turn's result or the exception it raised)."""
    handle = runtime.run(SESSION, input="hi", kind="flow", flow_name=flow_name)
    try:
        outcome: Any = await handle.result()
    except BaseException as e:
        outcome = e
    return await handle.run_id, outcome


async def reenter(runtime: Runtime, run_id: str) -> Any:
    """Re-address an existing run; returns its result or the exception it raised."""
    handle = runtime.run(session_id=SESSION, run_id=run_id)
    try:
        return await handle.result()
    except BaseException as e:
        return e


def full_fold(store: RunStore, run_id: str) -> Any:
    """The run rebuilt from ALL its events, ignoring snapshots."""
    return project_aggregate(None, store.events.get(UUID(run_id)))


# ---------------------------------------------------------------- replay
async def test_tool_now_and_uuid_replay_identically_when_reentered_from_a_fresh_runtime(
    open_store: StoreFactory,
) -> None:
    counter = Counter()
    attempts: list[int] = []
    seen: list[tuple[Any, datetime, str]] = []

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        receipt = await ctx.tool("charge", {"x": 5})
        when = await ctx.now()
        ident = await ctx.uuid()
        seen.append((receipt, when, ident))
        fail_first_pass(attempts)
        return end("done")

    agent = one_node_agent(node, [charge_tool(counter)])
    run_id, first = await start_flow(Runtime([agent], store=open_store()))

    assert isinstance(first, RuntimeError)
    assert str(first) == "crash after the effects"
    runtime2 = Runtime([agent], store=open_store())
    errored = await runtime2.get_run(run_id, SESSION)
    assert errored is not None
    assert errored.status == "error"
    assert errored.error is not None
    assert errored.error.type == "RuntimeError"
    assert counter.count == 1

    second = await reenter(runtime2, run_id)

    assert not isinstance(second, BaseException), second
    assert second.status == "finished"
    assert second.output == "done"
    assert attempts == [1, 2]
    assert counter.count == 1, "the tool ran again instead of replaying"
    assert seen[1] == seen[0]
    receipt, when, ident = seen[0]
    assert receipt == {"charged": 5, "execution": 1}
    assert when.tzinfo is not None
    assert when.utcoffset() == UTC.utcoffset(None)
    assert UUID(ident).version == 4
    steps = await runtime2.get_steps(run_id, SESSION)
    assert [(s.kind, s.status) for s in steps] == [
        ("tool", "finished"),
        ("now", "finished"),
        ("uuid", "finished"),
    ]
    final = await runtime2.get_run(run_id, SESSION)
    assert final is not None
    assert final.status == "finished"
    assert final.outcome == "done"


async def test_a_run_recovered_from_an_error_finishes_without_its_old_error(
    open_store: StoreFactory,
) -> None:
    attempts: list[int] = []

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.uuid()
        fail_first_pass(attempts)
        return end("done")

    agent = one_node_agent(node, [])
    run_id, first = await start_flow(Runtime([agent], store=open_store()))
    assert isinstance(first, RuntimeError)

    runtime2 = Runtime([agent], store=open_store())
    second = await reenter(runtime2, run_id)

    assert not isinstance(second, BaseException), second
    final = await runtime2.get_run(run_id, SESSION)
    assert final is not None
    assert final.status == "finished"
    assert final.error is None, "a finished run must not still report the old failure"


async def test_reentered_errored_run_executes_effects_beyond_its_journal(
    open_store: StoreFactory,
) -> None:
    """After a node failed, a re-entry replays what was recorded AND can go on with
    new effects (e.g. the fixed code calls one more tool)."""
    counter = Counter()
    attempts: list[int] = []

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        first = await ctx.tool("charge", {"x": 5})
        fail_first_pass(attempts)
        second = await ctx.tool("charge", {"x": 6})
        state["receipts"] = [first, second]
        return end("done")

    agent = one_node_agent(node, [charge_tool(counter)])
    run_id, first = await start_flow(Runtime([agent], store=open_store()))
    assert isinstance(first, RuntimeError)

    runtime2 = Runtime([agent], store=open_store())
    second = await reenter(runtime2, run_id)

    assert not isinstance(second, BaseException), f"re-entry failed: {second!r}"
    assert second.status == "finished"
    assert [c.callsite for c in counter.calls] == [0, 1]
    state = await runtime2.get_run(run_id, SESSION)
    assert state is not None
    assert state.state["receipts"] == [
        {"charged": 5, "execution": 1},
        {"charged": 6, "execution": 2},
    ]


# ---------------------------------------------------------- frozen errors
async def test_tool_failure_is_frozen_and_reraised_identically_on_replay_without_reexecution(
    open_store: StoreFactory,
) -> None:
    executions: list[ToolCall] = []
    caught: list[ToolExecutionError] = []

    def decline(args: Amount, call: ToolCall) -> None:
        executions.append(call)
        raise ValueError(f"card declined for {args.x}")

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        try:
            await ctx.tool("decline", {"x": 9})
        except ToolExecutionError as e:
            caught.append(e)
            raise
        return end("unreachable")

    agent = one_node_agent(node, [define_tool("decline", "always fails", Amount, decline)])
    run_id, first = await start_flow(Runtime([agent], store=open_store()))

    runtime2 = Runtime([agent], store=open_store())
    second = await reenter(runtime2, run_id)

    assert isinstance(first, ToolExecutionError)
    assert isinstance(second, ToolExecutionError)
    fields = [(e.tool_name, e.error_type, e.message) for e in (first, second, *caught)]
    assert fields == [("decline", "ValueError", "card declined for 9")] * 4
    assert len(caught) == 2, "the node saw the error on both passes"
    assert len(executions) == 1, "a failed step was retried instead of re-raised"
    steps = await runtime2.get_steps(run_id, SESSION)
    assert len(steps) == 1
    (step,) = steps
    assert step.kind == "tool"
    assert step.name == "decline"
    assert step.status == "error"
    assert step.result is None
    assert step.error is not None
    assert step.error.type == "ValueError"
    assert step.error.message == "card declined for 9"
    assert step.finished_at is not None
    state = await runtime2.get_run(run_id, SESSION)
    assert state is not None
    assert state.status == "error"
    assert state.error is not None
    assert state.error.type == "ToolExecutionError"


# -------------------------------------------------------- non-determinism
class _Refund(BaseModel):
    x: int


@pytest.mark.parametrize("changed_effect", ["another-tool", "now-instead-of-tool"])
async def test_reentry_asking_for_a_different_effect_at_a_recorded_callsite_raises_nondeterminism(
    open_store: StoreFactory, changed_effect: str
) -> None:
    counter = Counter()
    refunds: list[ToolCall] = []

    def refund(args: _Refund, call: ToolCall) -> dict[str, Any]:
        refunds.append(call)
        return {"refunded": args.x}

    tools = [charge_tool(counter), define_tool("refund", "refund", _Refund, refund)]

    async def old_node(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("charge", {"x": 5})
        raise RuntimeError("crash after the charge")

    async def new_node(state: dict[str, Any], ctx: RunContext) -> Any:
        if changed_effect == "another-tool":
            await ctx.tool("refund", {"x": 5})
        else:
            await ctx.now()
        return end("done")

    old_agent, new_agent = one_node_agent(old_node, tools), one_node_agent(new_node, tools)
    assert old_agent.flows["f"].digest == new_agent.flows["f"].digest
    run_id, first = await start_flow(Runtime([old_agent], store=open_store()))
    assert isinstance(first, RuntimeError)
    before = await Runtime([old_agent], store=open_store()).get_steps(run_id, SESSION)

    runtime2 = Runtime([new_agent], store=open_store())
    second = await reenter(runtime2, run_id)

    assert isinstance(second, NonDeterminismError), second
    assert second.callsite == 0
    assert "tool" in second.expected
    assert "charge" in second.expected
    if changed_effect == "another-tool":
        assert "tool" in second.actual
        assert "refund" in second.actual
    else:
        assert "now" in second.actual
        assert "charge" not in second.actual
    assert counter.count == 1
    assert refunds == [], "nothing may execute on a non-deterministic replay"
    after = await runtime2.get_steps(run_id, SESSION)
    assert after == before, "nothing may be journaled on a non-deterministic replay"


# ------------------------------------------------------------------ gather
async def test_gathered_tools_record_each_call_once_at_its_own_callsite_and_replay(
    open_store: StoreFactory,
) -> None:
    delays = [0.20, 0.0, 0.12, 0.05, 0.28]
    executed: dict[int, int] = {}
    completion_order: list[int] = []
    attempts: list[int] = []
    results: list[list[Any]] = []

    async def slow(args: Slow) -> dict[str, Any]:
        await asyncio.sleep(args.delay)
        executed[args.i] = executed.get(args.i, 0) + 1
        completion_order.append(args.i)
        return {"i": args.i, "square": args.i * args.i}

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        calls = [ctx.tool("slow", {"i": i, "delay": d}) for i, d in enumerate(delays)]
        results.append(list(await asyncio.gather(*calls)))
        fail_first_pass(attempts)
        return end("done")

    agent = one_node_agent(node, [define_tool("slow", "sleeps", Slow, slow)])
    run_id, first = await start_flow(Runtime([agent], store=open_store()))
    assert isinstance(first, RuntimeError)

    runtime2 = Runtime([agent], store=open_store())
    second = await reenter(runtime2, run_id)

    assert not isinstance(second, BaseException), second
    assert second.status == "finished"
    expected = [{"i": i, "square": i * i} for i in range(len(delays))]
    assert results == [expected, expected]
    assert executed == dict.fromkeys(range(len(delays)), 1)
    assert completion_order != list(range(len(delays))), "completions were not shuffled"
    flow = agent.flows["f"]
    logical = f"{run_id}#0#f@{flow.digest}"
    steps = await runtime2.get_steps(run_id, SESSION)
    assert sorted(s.callsite for s in steps) == list(range(len(delays)))
    assert sorted(s.index for s in steps) == list(range(len(delays)))
    for step in steps:
        i = step.callsite
        payload = {"name": "slow", "args": {"i": i, "delay": delays[i]}}
        assert step.key == idempotency_key(logical, i, payload)
        assert step.status == "finished"
        assert step.result == expected[i]


# --------------------------------------------------------------- in doubt
@pytest.mark.timeout(120)
async def test_step_left_running_by_a_killed_process_executes_again_with_the_same_key(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    """A real crash: a child process SIGKILLs itself inside the tool, after the
    intent is journaled; a fresh runtime here takes the run over once the dead
    worker's lease expires."""
    if open_store.backend == "memory":
        pytest.skip("a memory store cannot be shared with another OS process")
    assert open_store.target is not None
    ledger = tmp_path / "ledger.jsonl"
    with Child(
        "crashy", open_store.backend, open_store.target, ledger, SESSION,
        "start", crashy.CRASH_FLOW, "pay",
    ) as child:  # fmt: skip
        code, _ = await asyncio.to_thread(child.wait, 90)
    assert code == -signal.SIGKILL, f"child did not die in the tool: {child.stderr!r}"
    (killed,) = crashy.read_ledger(ledger)
    run_id = killed["run_id"]

    agent = crashy.crash_agent(ledger, die_in_tool=False)
    runtime2 = Runtime([agent], store=open_store(), holder="recovering-worker")
    orphan = await runtime2.get_run(run_id, SESSION)
    assert orphan is not None
    assert orphan.status == "running"
    (in_doubt,) = await runtime2.get_steps(run_id, SESSION)
    assert in_doubt.status == "running", "the crash must land between intent and result"
    assert in_doubt.key == killed["key"]
    assert orphan.lease_expires_at is not None
    await _sleep_until(orphan.lease_expires_at)

    second = await reenter(runtime2, run_id)

    assert not isinstance(second, BaseException), second
    assert second.status == "finished"
    assert second.output == "charged"
    killed_exec, retried_exec = crashy.read_ledger(ledger)
    assert retried_exec["key"] == killed_exec["key"], "a retry must reuse the idempotency key"
    assert retried_exec["pid"] != killed_exec["pid"]
    (step,) = await runtime2.get_steps(run_id, SESSION)
    assert step.index == in_doubt.index
    assert step.key == in_doubt.key
    assert step.status == "finished"
    assert step.result == {"charged": 5, "pid": retried_exec["pid"]}


class _SimulatedCrash(Crash):
    """Stands in for a process death: the testing kit's ``Crash`` (a tool's other
    ``BaseException``s fail its attempt; only a ``Crash`` kills the turn)."""


async def test_step_left_running_by_an_interrupted_turn_executes_again_with_the_same_key(
    open_store: StoreFactory,
) -> None:
    """In-process stand-in for a crash (works on every backend, memory too): a
    BaseException escapes the tool after its intent is journaled, so neither a
    result nor an error is recorded and the turn never closes."""
    calls: list[ToolCall] = []

    def charge(args: Amount, call: ToolCall) -> dict[str, Any]:
        calls.append(call)
        if len(calls) == 1:
            raise _SimulatedCrash
        return {"charged": args.x}

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        state["receipt"] = await ctx.tool("charge", {"x": 5})
        return end("charged")

    agent = one_node_agent(node, [define_tool("charge", "charge", Amount, charge)])
    run_id, first = await start_flow(Runtime([agent], store=open_store(), lease_ttl=0.3))
    assert isinstance(first, _SimulatedCrash)

    runtime2 = Runtime([agent], store=open_store())
    (in_doubt,) = await runtime2.get_steps(run_id, SESSION)
    assert in_doubt.status == "running"
    orphan = await runtime2.get_run(run_id, SESSION)
    assert orphan is not None
    assert orphan.lease_expires_at is not None
    await _sleep_until(orphan.lease_expires_at)

    second = await reenter(runtime2, run_id)

    assert not isinstance(second, BaseException), second
    assert second.status == "finished"
    assert len(calls) == 2
    assert calls[1].idempotency_key == calls[0].idempotency_key
    assert calls[1].callsite == calls[0].callsite == 0
    (step,) = await runtime2.get_steps(run_id, SESSION)
    assert step.key == in_doubt.key == calls[0].idempotency_key
    assert step.status == "finished"
    assert step.result == {"charged": 5}


async def _sleep_until(moment: datetime) -> None:
    remaining = (moment - datetime.now(UTC)).total_seconds()
    if remaining > 0:
        await asyncio.sleep(remaining + 0.05)


# ------------------------------------------------------------------- steps
async def test_steps_are_journaled_with_index_callsite_kind_status_times_and_the_spec_key(
    open_store: StoreFactory,
) -> None:
    counter = Counter()

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("charge", {"x": 5})
        await ctx.now()
        await ctx.uuid()
        await ctx.tool("charge", {"x": 7})
        return end("done")

    agent = one_node_agent(node, [charge_tool(counter)], flow_name="billing")
    runtime = Runtime([agent], store=open_store())
    run_id, result = await start_flow(runtime, "billing")
    assert not isinstance(result, BaseException), result

    steps = await Runtime([agent], store=open_store()).get_steps(run_id, SESSION)

    assert all(isinstance(s, StepRecord) for s in steps)
    digest = agent.flows["billing"].digest
    logical = f"{run_id}#0#billing@{digest}"
    expected = [
        (0, "tool", "charge", {"name": "charge", "args": {"x": 5}}, {"charged": 5, "execution": 1}),
        (1, "now", "now", "now", None),
        (2, "uuid", "uuid", "uuid", None),
        (3, "tool", "charge", {"name": "charge", "args": {"x": 7}}, {"charged": 7, "execution": 2}),
    ]
    assert len(steps) == len(expected)
    for step, (site, kind, name, payload, result_value) in zip(steps, expected, strict=True):
        assert step.index == site
        assert step.callsite == site
        assert step.kind == kind
        assert step.name == name
        assert HEX64.fullmatch(step.key)
        assert step.key == idempotency_key(logical, site, payload)
        assert step.status == "finished"
        assert step.error is None
        assert step.started_at is not None
        assert step.finished_at is not None
        assert step.started_at <= step.finished_at
        if result_value is not None:
            assert step.result == result_value
    assert [c.idempotency_key for c in counter.calls] == [steps[0].key, steps[3].key]
    assert datetime.fromisoformat(steps[1].result) <= datetime.now(UTC)
    assert UUID(steps[2].result).version == 4
    assert len({s.key for s in steps}) == len(steps)
    assert [s.started_at for s in steps] == sorted(s.started_at for s in steps)


# -------------------------------------------------------------- stale writes
async def _finished_run(open_store: StoreFactory) -> str:
    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        return end("done")

    run_id, result = await start_flow(Runtime([one_node_agent(node, [])], store=open_store()))
    assert not isinstance(result, BaseException), result
    return run_id


async def test_two_writers_racing_on_one_run_exactly_one_gets_stale_write_and_stores_nothing(
    open_store: StoreFactory,
) -> None:
    run_id = await _finished_run(open_store)
    store_a, store_b = open_store(), open_store()
    run_a, run_b = store_a.load(run_id), store_b.load(run_id)
    assert run_a is not None
    assert run_b is not None
    assert run_a is not run_b
    base_version = run_a.version
    assert run_b.version == base_version
    run_a.start_turn(1, Message(role="user", content="from A"), None)
    run_b.start_turn(1, Message(role="user", content="from B"), None)

    barrier = threading.Barrier(2)
    outcomes: dict[str, str] = {}

    def save(name: str, store: RunStore, run: Any) -> None:
        barrier.wait(timeout=30)
        try:
            store.save_run(run)
            outcomes[name] = "saved"
        except StaleWriteError as e:
            assert e.run_id == run_id
            outcomes[name] = "stale"

    threads = [
        threading.Thread(target=save, args=("A", store_a, run_a)),
        threading.Thread(target=save, args=("B", store_b, run_b)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)

    assert sorted(outcomes.values()) == ["saved", "stale"], outcomes
    (winner,) = [name for name, outcome in outcomes.items() if outcome == "saved"]
    loser = "B" if winner == "A" else "A"
    reloaded = open_store().load(run_id)
    assert reloaded is not None
    assert reloaded.version == base_version + 1
    contents = [m["content"] for m in reloaded.messages]
    assert f"from {winner}" in contents
    assert f"from {loser}" not in contents
    events = list(open_store().events.get(UUID(run_id)))
    assert [e.originator_version for e in events] == list(range(1, base_version + 2))
    assert events[-1].message == {"role": "user", "content": f"from {winner}"}


async def test_a_stale_writer_stores_none_of_a_multi_event_write(
    open_store: StoreFactory,
) -> None:
    run_id = await _finished_run(open_store)
    store_a, store_b = open_store(), open_store()
    run_a, run_b = store_a.load(run_id), store_b.load(run_id)
    assert run_a is not None
    assert run_b is not None
    base_version = run_a.version
    run_a.append_message(Message(role="user", content="A1"))
    store_a.save_run(run_a)
    for n in range(3):
        run_b.append_message(Message(role="user", content=f"B{n}"))

    with pytest.raises(StaleWriteError):
        store_b.save_run(run_b)

    reloaded = open_store().load(run_id)
    assert reloaded is not None
    assert reloaded.version == base_version + 1
    assert [m["content"] for m in reloaded.messages][-1] == "A1"
    assert not any(str(m["content"]).startswith("B") for m in reloaded.messages)


# --------------------------------------------------------------- addressing
async def test_unknown_run_and_run_of_another_session_raise_the_same_run_not_found(
    open_store: StoreFactory,
) -> None:
    counter = Counter()

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("charge", {"x": 1})
        return end("done")

    agent = one_node_agent(node, [charge_tool(counter)])
    run_id, result = await start_flow(Runtime([agent], store=open_store()))
    assert not isinstance(result, BaseException), result
    runtime2 = Runtime([agent], store=open_store())
    before = await runtime2.get_run(run_id, SESSION)
    assert before is not None
    unknown = str(uuid4())

    errors: dict[str, tuple[RunNotFoundError, RunNotFoundError]] = {}
    for label, session, rid in [
        ("other-session", "intruder-session", run_id),
        ("unknown-id", SESSION, unknown),
        ("not-a-uuid", SESSION, "not-a-run-id"),
    ]:
        handle = runtime2.run(session_id=session, run_id=rid, input="hello?")
        with pytest.raises(RunNotFoundError) as from_result:
            await handle.result()
        with pytest.raises(RunNotFoundError) as from_run_id:
            await handle.run_id
        assert from_result.value.run_id == rid
        assert from_result.value.session_id == session
        assert from_run_id.value.run_id == rid
        errors[label] = (from_result.value, from_run_id.value)
        assert await runtime2.get_run(rid, session) is None

    def masked(e: RunNotFoundError) -> str:
        return str(e).replace(e.run_id, "<run>").replace(e.session_id, "<session>")

    assert masked(errors["other-session"][0]) == masked(errors["unknown-id"][0])
    assert counter.count == 1
    after = await runtime2.get_run(run_id, SESSION)
    assert after is not None
    assert after.version == before.version, "a refused address must write nothing"


async def test_a_finished_run_readdressed_returns_its_final_state_and_executes_nothing(
    open_store: StoreFactory,
) -> None:
    counter = Counter()
    passes: list[int] = []

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        passes.append(1)
        state["receipt"] = await ctx.tool("charge", {"x": 3})
        return end("done")

    agent = one_node_agent(node, [charge_tool(counter)])
    run_id, first = await start_flow(Runtime([agent], store=open_store()))
    assert not isinstance(first, BaseException), first
    assert first.status == "finished"
    runtime2 = Runtime([agent], store=open_store())
    before = await runtime2.get_run(run_id, SESSION)
    steps_before = await runtime2.get_steps(run_id, SESSION)

    handle = runtime2.run(session_id=SESSION, run_id=run_id, input="again")
    again = await handle.result()

    assert await handle.run_id == run_id
    assert again.run_id == run_id
    assert again.status == "finished"
    assert again.output == first.output == "done"
    assert again.waiting_for is None
    assert counter.count == 1
    assert passes == [1], "the node must not run again"
    after = await runtime2.get_run(run_id, SESSION)
    assert after == before
    assert after is not None
    assert after.state["receipt"] == {"charged": 3, "execution": 1}
    assert await runtime2.get_steps(run_id, SESSION) == steps_before


# --------------------------------------------------------------- snapshots
class _Echo(BaseModel):
    n: int


@pytest.mark.timeout(120)
async def test_a_long_run_loads_back_from_snapshots_with_identical_state_and_steps(
    open_store: StoreFactory,
) -> None:
    pairs = 130  # 260 steps, over 520 events: several snapshots

    def echo(args: _Echo) -> dict[str, int]:
        return {"n": args.n}

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        values: list[Any] = []
        for n in range(pairs):
            values.append(await ctx.tool("echo", {"n": n}))
            values.append(await ctx.uuid())
        state["values"] = values
        return end("long")

    agent = one_node_agent(node, [define_tool("echo", "echo", _Echo, echo)])
    started = time.monotonic()
    run_id, result = await start_flow(Runtime([agent], store=open_store()))
    assert not isinstance(result, BaseException), result
    assert time.monotonic() - started < 60

    store = open_store()
    snapshots = list(store.snapshots.get(UUID(run_id))) if store.snapshots else []
    from_snapshot = store.load(run_id)
    from_events = full_fold(store, run_id)

    assert snapshots, "a run this long must have been snapshotted"
    assert from_snapshot is not None
    assert from_snapshot.version > 2 * 2 * pairs
    # Snapshots spaced by what the run holds (its steps, all in one node), so the
    # load replays at most one spacing of events after the latest one.
    spacing = snapshot_spacing(from_snapshot.snapshot_weight)
    assert from_snapshot.version - snapshots[-1].originator_version <= spacing + 3
    assert store.snapshots is not None
    sizes = [len(s.state) for s in store.snapshots.recorder.select_events(UUID(run_id))]
    assert sum(sizes) < 2 * sizes[-1]
    assert from_snapshot.to_state() == from_events.to_state()
    assert from_snapshot.step_records() == from_events.step_records()
    state = from_snapshot.to_state()
    assert state.status == "finished"
    assert state.step_count == 2 * pairs
    records = from_snapshot.step_records()
    assert [r.index for r in records] == list(range(2 * pairs))
    assert [r.result for r in records] == state.state["values"]
    via_runtime = await Runtime([agent], store=open_store()).get_steps(run_id, SESSION)
    assert via_runtime == records
