"""Tool retries and timeouts (README: Retries and timeouts), on memory, SQLite and PostgreSQL.

Each failed attempt is journaled and retried with the same idempotency key,
the error frozen only after the last one; non-retryable errors never are;
backoffs are waited out (measured); a SIGKILL during a backoff resumes the
count in another process; a timeout cancels an attempt and is retried.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import StoreFactory
from procs import control
from procs.child import Child, until, wait_lease_expired
from pydantic import BaseModel

from kuralle_es import (
    InvalidArgumentError,
    InvalidToolArgsError,
    LeaseHeldError,
    ModelResponse,
    RetryPolicy,
    Runtime,
    SuspendError,
    ToolApprovalDeniedError,
    ToolCall,
    ToolCallRequest,
    ToolExecutionError,
    ToolResultTypeError,
    ToolTimeoutError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es.dashboard.timeline import timeline_rows
from kuralle_es.events import StepFailed, StepStarted, follow
from kuralle_es.testing import Crash, CrashingStore, CrashPlan, ScriptedModel
from kuralle_es.views.timeline import format_timeline

SESSION = "retries"
FAST = RetryPolicy(max_attempts=3, initial_interval=0.01, backoff=1.0)


class Empty(BaseModel):
    pass


class Calls:
    """An external ledger: every execution of a tool, with its key and time."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.times: list[float] = []

    def record(self, call: ToolCall) -> int:
        self.keys.append(call.idempotency_key)
        self.times.append(time.monotonic())
        return len(self.keys)


def one_tool_runtime(
    store: Any,
    execute: Callable[..., Any],
    *,
    retry: RetryPolicy | None = FAST,
    timeout: float | None = None,
    catch: bool = False,
    **tool_options: Any,
) -> Runtime:
    """A flow ``use`` whose one node calls the tool ``t`` (catching its error if asked)."""

    async def use(state: dict[str, Any], ctx: Any) -> Any:
        try:
            state["result"] = await ctx.tool("t", {})
        except SuspendError:
            raise
        except Exception as e:
            if not catch:
                raise
            state["caught"] = {"type": type(e).__name__, "message": str(e)}
            return end("caught")
        return end("done")

    tool = define_tool("t", "a tool", Empty, execute, retry=retry, timeout=timeout, **tool_options)
    flow = define_flow("use", "call t", "use", [action("use", use)])
    return Runtime([define_agent("a", "retries", None, [tool], [flow])], store=store)


async def start(runtime: Runtime) -> Any:
    handle = runtime.run(SESSION, input="go", kind="flow", flow_name="use")
    return await handle.result()


async def start_failing(runtime: Runtime, error: type[Exception]) -> tuple[str, Exception]:
    """Start ``use`` when its turn is to raise ``error``: the run id and the error."""
    handle = runtime.run(SESSION, input="go", kind="flow", flow_name="use")
    run_id = await handle.run_id
    with pytest.raises(error) as raised:
        await handle.result()
    return run_id, raised.value


# ------------------------------------------------------------------ policy
def test_policy_intervals_grow_by_the_backoff_up_to_the_cap() -> None:
    policy = RetryPolicy(max_attempts=5, initial_interval=0.5, backoff=3.0, max_interval=2.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.5, 2.0, 2.0]
    assert policy.retries(ConnectionError(), 4) and not policy.retries(ConnectionError(), 5)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_attempts": 0},
        {"max_attempts": 1.5},
        {"initial_interval": -1},
        {"backoff": 0.5},
        {"max_interval": float("nan")},
        {"retry_on": ("not an error",)},
    ],
)
def test_a_bad_policy_is_refused_when_it_is_made(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        RetryPolicy(**bad)


def test_define_tool_refuses_a_bad_retry_or_timeout() -> None:
    with pytest.raises(InvalidArgumentError):
        define_tool("t", "t", Empty, lambda a: 1, retry=3)  # type: ignore[arg-type]
    for timeout in (0, -1, float("inf"), True):
        with pytest.raises(InvalidArgumentError):
            define_tool("t", "t", Empty, lambda a: 1, timeout=timeout)


def test_a_tool_without_retry_is_attempted_once_as_before() -> None:
    tool = define_tool("t", "t", Empty, lambda a: 1)
    assert tool.retry.max_attempts == 1 and tool.timeout is None


# ----------------------------------------------------------------- retries
async def test_a_tool_failing_twice_then_succeeding_runs_three_times_with_one_key(
    open_store: StoreFactory,
) -> None:
    calls = Calls()

    def flaky(args: Empty, call: ToolCall) -> Any:
        n = calls.record(call)
        if n < 3:
            raise ConnectionError(f"down ({n})")
        return {"ok": n}

    runtime = one_tool_runtime(open_store(), flaky)
    result = await start(runtime)
    assert result.status == "finished"
    assert len(calls.keys) == 3 and len(set(calls.keys)) == 1
    (step,) = await runtime.get_steps(result.run_id, SESSION)
    assert (step.status, step.attempts, step.result, step.error) == ("finished", 3, {"ok": 3}, None)
    assert step.key == calls.keys[0]
    state = await runtime.get_run(result.run_id, SESSION)
    assert state is not None and state.state["result"] == {"ok": 3}
    # The views count one call, no error: retried attempts are not failures of the step.
    (stats,) = await runtime.views.step_stats()
    assert (stats.name, stats.count, stats.errors) == ("t", 1, 0)


async def test_failing_past_the_limit_freezes_the_last_error_and_replays_it(
    open_store: StoreFactory,
) -> None:
    calls = Calls()

    def always(args: Empty, call: ToolCall) -> Any:
        raise ConnectionError(f"down ({calls.record(call)})")

    runtime = one_tool_runtime(open_store(), always)
    run_id, first = await start_failing(runtime, ToolExecutionError)
    assert len(calls.keys) == 3
    assert isinstance(first, ToolExecutionError)
    assert (first.error_type, first.message) == ("ConnectionError", "down (3)")
    (step,) = await runtime.get_steps(run_id, SESSION)
    assert (step.status, step.attempts) == ("error", 3)
    assert step.error is not None and step.error.message == "down (3)"
    # Re-addressed, the node runs again and the frozen error is replayed, not executed.
    with pytest.raises(ToolExecutionError) as replayed:
        await runtime.run(SESSION, run_id=run_id).result()
    assert (replayed.value.error_type, replayed.value.message) == ("ConnectionError", "down (3)")
    assert len(calls.keys) == 3
    (stats,) = await runtime.views.step_stats()
    assert (stats.name, stats.count, stats.errors) == ("t", 1, 1)


async def test_a_caught_final_failure_is_the_same_error_the_node_sees_on_replay(
    open_store: StoreFactory,
) -> None:
    calls = Calls()

    def always(args: Empty, call: ToolCall) -> Any:
        raise ConnectionError(f"down ({calls.record(call)})")

    runtime = one_tool_runtime(open_store(), always, catch=True)
    result = await start(runtime)
    state = await runtime.get_run(result.run_id, SESSION)
    assert state is not None and state.outcome == "caught"
    assert state.state["caught"]["type"] == "ToolExecutionError"
    assert len(calls.keys) == 3


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad input upstream"),
        InvalidToolArgsError("t", "amount: must be positive"),
        ToolApprovalDeniedError("t", "bank", "declined"),
    ],
    ids=["no_retry_on", "InvalidToolArgsError", "ToolApprovalDeniedError"],
)
async def test_errors_that_are_not_retryable_are_attempted_once(
    open_store: StoreFactory, error: Exception
) -> None:
    calls = Calls()

    def fails(args: Empty, call: ToolCall) -> Any:
        calls.record(call)
        raise error

    policy = RetryPolicy(max_attempts=5, initial_interval=0.01, no_retry_on=(ValueError,))
    runtime = one_tool_runtime(open_store(), fails, retry=policy, catch=True)
    result = await start(runtime)
    assert result.status == "finished" and len(calls.keys) == 1
    (step,) = await runtime.get_steps(result.run_id, SESSION)
    assert (step.status, step.attempts) == ("error", 1)


async def test_an_unrecordable_result_is_never_retried(open_store: StoreFactory) -> None:
    calls = Calls()

    def returns_a_set(args: Empty, call: ToolCall) -> Any:
        calls.record(call)
        return {1, 2}

    runtime = one_tool_runtime(open_store(), returns_a_set, catch=True)
    result = await start(runtime)
    state = await runtime.get_run(result.run_id, SESSION)
    assert state is not None and state.state["caught"]["type"] == ToolResultTypeError.__name__
    assert len(calls.keys) == 1


async def test_a_denied_approval_never_executes_or_retries_the_tool(
    open_store: StoreFactory,
) -> None:
    calls = Calls()

    def guarded(args: Empty, call: ToolCall) -> Any:
        calls.record(call)
        return {"ok": True}

    runtime = one_tool_runtime(open_store(), guarded, catch=True, needs_approval=True)
    paused = await start(runtime)
    assert paused.status == "paused"
    result = await runtime.deny(paused.run_id, SESSION, by="bob", reason="no")
    state = await runtime.get_run(result.run_id, SESSION)
    assert state is not None and state.state["caught"]["type"] == "ToolApprovalDeniedError"
    assert calls.keys == []


async def test_invalid_arguments_are_refused_before_any_attempt(open_store: StoreFactory) -> None:
    calls = Calls()

    class Amount(BaseModel):
        amount: int

    async def bad_args(state: dict[str, Any], ctx: Any) -> Any:
        try:
            await ctx.tool("t", {"amount": "lots"})
        except InvalidToolArgsError:
            return end("refused")
        return end("executed")

    tool = define_tool("t", "t", Amount, lambda a, c: calls.record(c), retry=FAST)
    flow = define_flow("use", "bad args", "use", [action("use", bad_args)])
    runtime = Runtime([define_agent("a", "x", None, [tool], [flow])], store=open_store())
    result = await start(runtime)
    state = await runtime.get_run(result.run_id, SESSION)
    assert state is not None and state.outcome == "refused"
    assert calls.keys == [] and await runtime.get_steps(result.run_id, SESSION) == []


async def test_backoff_intervals_are_waited_out(open_store: StoreFactory) -> None:
    calls = Calls()

    def always(args: Empty, call: ToolCall) -> Any:
        calls.record(call)
        raise ConnectionError("down")

    policy = RetryPolicy(max_attempts=4, initial_interval=0.2, backoff=2.0, max_interval=0.5)
    runtime = one_tool_runtime(open_store(), always, retry=policy, catch=True)
    await start(runtime)
    gaps = [b - a for a, b in zip(calls.times, calls.times[1:], strict=False)]
    assert len(gaps) == 3
    # 0.2, then 0.4, then 0.8 capped at 0.5; a loaded machine only adds time.
    for gap, wanted in zip(gaps, (0.2, 0.4, 0.5), strict=True):
        assert wanted - 0.01 <= gap < wanted + 1.5, (gaps, wanted)


async def test_each_failed_attempt_is_a_public_non_final_failure(
    open_store: StoreFactory,
) -> None:
    calls = Calls()

    def flaky(args: Empty, call: ToolCall) -> Any:
        if calls.record(call) < 3:
            raise ConnectionError("down")
        return {"ok": True}

    store = open_store()
    result = await start(one_tool_runtime(store, flaky))
    seen: list[Any] = []
    async for event in follow(store):
        if event.run_id == result.run_id and isinstance(event, StepStarted | StepFailed):
            seen.append(event)
        if getattr(event, "outcome", None) == "done":
            break
    assert [(type(e).__name__, getattr(e, "attempt", None)) for e in seen] == [
        ("StepStarted", 1), ("StepFailed", None), ("StepStarted", 2), ("StepFailed", None),
        ("StepStarted", 3),
    ]  # fmt: skip
    assert [e.final for e in seen if isinstance(e, StepFailed)] == [False, False]


async def test_model_requested_tool_calls_honour_the_same_policy(open_store: StoreFactory) -> None:
    calls = Calls()

    def flaky(args: Empty, call: ToolCall) -> Any:
        n = calls.record(call)
        if n < 3:
            raise ConnectionError("down")
        return {"ok": n}

    script = [
        ModelResponse(tool_calls=[ToolCallRequest(id="c1", name="t", args={})]),
        "done",
    ]
    tool = define_tool("t", "t", Empty, flaky, retry=FAST)
    agent = define_agent("a", "x", ScriptedModel(script), [tool])
    runtime = Runtime([agent], store=open_store())
    result = await runtime.run(SESSION, input="use t").result()
    assert (result.status, result.output) == ("finished", "done")
    assert len(calls.keys) == 3 and len(set(calls.keys)) == 1
    steps = await runtime.get_steps(result.run_id, SESSION)
    (tool_step,) = [s for s in steps if s.kind == "tool"]
    assert (tool_step.attempts, tool_step.result) == (3, {"ok": 3})


async def test_the_lease_is_kept_through_a_backoff_longer_than_the_lease(
    open_store: StoreFactory,
) -> None:
    calls = Calls()
    failed = asyncio.Event()

    def flaky(args: Empty, call: ToolCall) -> Any:
        if calls.record(call) == 1:
            failed.set()
            raise ConnectionError("down")
        return {"ok": True}

    policy = RetryPolicy(max_attempts=2, initial_interval=1.5)
    tool = define_tool("t", "a tool", Empty, flaky, retry=policy)

    async def use(state: dict[str, Any], ctx: Any) -> Any:
        state["result"] = await ctx.tool("t", {})
        return end("done")

    agent = define_agent(
        "a", "x", None, [tool], [define_flow("use", "t", "use", [action("use", use)])]
    )
    worker = Runtime([agent], store=open_store(), lease_ttl=0.3)
    rival = Runtime([agent], store=open_store(), lease_ttl=0.3)
    handle = worker.run(SESSION, input="go", kind="flow", flow_name="use")
    run_id = await handle.run_id
    turn = asyncio.ensure_future(handle.result())
    await asyncio.wait_for(failed.wait(), 30)
    await asyncio.sleep(0.9)  # three lease lengths into the backoff
    with pytest.raises(LeaseHeldError):
        await rival.run(SESSION, run_id=run_id).result()
    result = await turn
    assert result.status == "finished" and len(calls.keys) == 2


def crashing(open_store: StoreFactory, plan: CrashPlan) -> CrashingStore:
    """A store over the test's database whose saves die where ``plan`` says."""
    if open_store.backend == "memory":
        store = CrashingStore.memory()
    else:
        assert open_store.target is not None
        store = (
            CrashingStore.sqlite(open_store.target)
            if open_store.backend == "sqlite"
            else CrashingStore.postgres(open_store.target)
        )
        open_store.stores.append(store)
    store.plan = plan
    return store


async def test_a_crash_during_a_later_attempt_follows_on_in_doubt_and_keeps_the_count(
    open_store: StoreFactory,
) -> None:
    calls = Calls()

    def always(args: Empty, call: ToolCall) -> Any:
        raise ConnectionError(f"down ({calls.record(call)})")

    policy = RetryPolicy(max_attempts=2, initial_interval=0.01)
    # The 2nd intent saved is attempt 2's start: the worker dies before it runs.
    store = crashing(open_store, CrashPlan("after_intent", nth=2))
    runtime = one_tool_runtime(store, always, retry=policy, catch=True, on_in_doubt="ask")
    handle = runtime.run(SESSION, input="go", kind="flow", flow_name="use")
    run_id = await handle.run_id
    with pytest.raises(Crash):
        await handle.result()
    assert len(calls.keys) == 1
    store.plan = None
    if open_store.backend != "memory":  # a restarted worker: a new store, the same name
        runtime = Runtime(list(runtime.agents.values()), store=open_store(), holder=runtime.holder)
    paused = await runtime.run(SESSION, run_id=run_id).result()
    assert paused.waiting_for is not None and paused.waiting_for.name == "__in_doubt"
    assert len(calls.keys) == 1
    result = await runtime.signal(run_id, SESSION, "__in_doubt", {"action": "retry"})
    state = await runtime.get_run(result.run_id, SESSION)
    assert state is not None and state.outcome == "caught"
    # Attempt 3 (after the human's "retry") is the 2nd failed attempt: frozen.
    (step,) = await runtime.get_steps(run_id, SESSION)
    assert (step.status, step.attempts, len(calls.keys)) == ("error", 3, 2)
    assert step.error is not None and step.error.message == "down (2)"


async def test_each_pass_of_a_read_that_is_never_replayed_gets_all_its_attempts(
    open_store: StoreFactory,
) -> None:
    calls = Calls()

    def flaky_read(args: Empty, call: ToolCall) -> Any:
        n = calls.record(call)
        if n % 2 == 1:  # every pass: fails once, then reads
            raise ConnectionError("down")
        return {"read": n}

    async def read_then_approve(state: dict[str, Any], ctx: Any) -> Any:
        state["read"] = await ctx.tool("read", {})
        await ctx.approve("go on?")  # the node runs again after the approval: a 2nd pass
        return end("done")

    policy = RetryPolicy(max_attempts=2, initial_interval=0.01)
    tool = define_tool("read", "a read", Empty, flaky_read, retry=policy, replay=False)
    flow = define_flow("use", "read twice", "n", [action("n", read_then_approve)])
    runtime = Runtime([define_agent("a", "x", None, [tool], [flow])], store=open_store())
    paused = await start(runtime)
    done = await runtime.approve(paused.run_id, SESSION, by="ann")
    assert (paused.status, done.status, len(calls.keys)) == ("paused", "finished", 4)
    steps = [s for s in await runtime.get_steps(done.run_id, SESSION) if s.kind == "tool"]
    assert [(s.status, s.attempts, s.result) for s in steps] == [("finished", 4, {"read": 4})]


# ---------------------------------------------------------------- timeouts
async def test_a_timeout_cancels_an_async_attempt_and_it_is_retried(
    open_store: StoreFactory,
) -> None:
    calls = Calls()
    cancelled: list[int] = []

    async def hangs_once(args: Empty, call: ToolCall) -> Any:
        n = calls.record(call)
        if n == 1:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(n)
                raise
        return {"attempt": n}

    runtime = one_tool_runtime(open_store(), hangs_once, timeout=0.2)
    began = time.monotonic()
    result = await start(runtime)
    assert result.status == "finished" and time.monotonic() - began < 10
    assert cancelled == [1] and len(set(calls.keys)) == 1
    (step,) = await runtime.get_steps(result.run_id, SESSION)
    assert (step.attempts, step.result) == (2, {"attempt": 2})


async def test_a_timeout_past_the_last_attempt_is_a_tool_timeout_error_also_on_replay(
    open_store: StoreFactory,
) -> None:
    async def hangs(args: Empty) -> Any:
        await asyncio.sleep(30)

    runtime = one_tool_runtime(open_store(), hangs, retry=None, timeout=0.1)
    run_id, first = await start_failing(runtime, ToolTimeoutError)
    with pytest.raises(ToolTimeoutError) as replayed:
        await runtime.run(SESSION, run_id=run_id).result()
    assert str(first) == str(replayed.value)
    assert isinstance(first, ToolExecutionError) and first.tool_name == "t"


async def test_a_sync_attempt_past_its_timeout_is_abandoned_on_its_thread(
    open_store: StoreFactory,
) -> None:
    calls = Calls()
    finished: list[int] = []

    def blocks_once(args: Empty, call: ToolCall) -> Any:
        n = calls.record(call)
        if n == 1:
            time.sleep(1.0)  # cannot be interrupted: it runs on, its result ignored
            finished.append(n)
        return {"attempt": n}

    runtime = one_tool_runtime(open_store(), blocks_once, timeout=0.2)
    result = await start(runtime)
    (step,) = await runtime.get_steps(result.run_id, SESSION)
    assert (step.attempts, step.result) == (2, {"attempt": 2})
    assert finished == []  # the turn did not wait for the abandoned attempt


# --------------------------------------------------- crash between attempts
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_sigkill_during_a_backoff_resumes_the_count_in_another_process(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    assert open_store.target is not None
    ledger = tmp_path / "ledger.jsonl"
    with Child(
        "control", open_store.backend, open_store.target, ledger, SESSION,
        "start", control.ALWAYS_FAILING, env={"KT_INTERVAL": "1.5", "KT_LEASE_TTL": "0.6"},
    ) as child:  # fmt: skip
        run_id = await child.opened()
        store = open_store()

        def first_failure_journaled() -> bool:
            run = store.load(run_id)
            return run is not None and bool(run.steps) and run.steps[0].get("failures") == 1

        await until(first_failure_journaled, "the first failure is journaled")
        child.process.send_signal(signal.SIGKILL)  # mid-backoff: attempt 2 is 1.5 s away
        code, _ = await asyncio.to_thread(child.wait, 30)
        assert code == -signal.SIGKILL
    assert len(control.read_ledger(ledger)) == 1
    # Between attempts, `kuralle-es runs show` shows the step running with its last error.
    run = store.load(run_id)
    assert run is not None
    line = format_timeline(run.to_state(), run.step_records()).splitlines()[-1]
    assert "x1" in line and "retried after ConnectionError: the service is down" in line
    (row,) = timeline_rows(run.step_records(), [])
    assert row.outcome_full == "running, retried after ConnectionError: the service is down"
    runtime = Runtime([control.make_agent(ledger)], store=store)
    await wait_lease_expired(runtime, run_id, SESSION)
    with pytest.raises(ToolExecutionError):
        await runtime.run(SESSION, run_id=run_id).result()
    entries = control.read_ledger(ledger)
    assert len(entries) == control.MAX_ATTEMPTS and len({e["key"] for e in entries}) == 1
    # The backoff was waited out from the failed attempt's time, not restarted.
    assert entries[1]["at"] - entries[0]["at"] >= 1.5 - 0.05
    (step,) = await runtime.get_steps(run_id, SESSION)
    assert (step.status, step.attempts) == ("error", control.MAX_ATTEMPTS)
    (row,) = timeline_rows(await runtime.get_steps(run_id, SESSION), [])
    assert (row.attempts, row.failed) == (control.MAX_ATTEMPTS, True)  # the dashboard's row
    state = await runtime.get_run(run_id, SESSION)
    assert state is not None
    shown = format_timeline(state, [step])
    assert f"x{control.MAX_ATTEMPTS}  !! ConnectionError: the service is down" in shown
