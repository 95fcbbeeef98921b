"""The guarantees hold when node code misbehaves (docs/node-code.md).

One named regression test per habit found breaking them, each on memory,
SQLite and PostgreSQL: a suspension caught by a broad ``except`` (or a
``finally`` that goes on, or ``gather(return_exceptions=True)``) never lets
the effect it guarded run; a blocking sync tool runs on a thread, so the
lease heartbeat keeps a second worker out; args computed from an unrecorded
value refuse to re-execute under a new key; a task the node left running
cannot call effects; a run another worker holds answers ``LeaseHeldError``
whatever the call delivers; a fork point inside a ``gather`` is refused on
every backend alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel

from kuralle_es import (
    InvalidArgumentError,
    KuralleError,
    LeaseHeldError,
    ModelResponse,
    NonDeterminismError,
    RunContext,
    Runtime,
    SignalMismatchError,
    SuspendError,
    ToolCall,
    ToolExecutionError,
    TurnClosedError,
    action,
    collect,
    define_agent,
    define_flow,
    define_tool,
    end,
    recover_orphaned_runs,
)
from kuralle_es._definitions import tool_threads as threads_module
from kuralle_es.testing import ScriptedModel, replay_check

SESSION = "s-misbehaving"


class Charge(BaseModel):
    amount: int
    nonce: str = ""


class NoArgs(BaseModel):
    pass


class Ledger:
    """What the tools really did, in order (thread-safe: sync tools run on threads)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.keys: Counter[str] = Counter()
        self._lock = threading.Lock()

    def note(self, line: str, key: str | None = None) -> None:
        with self._lock:
            self.lines.append(line)
            if key is not None:
                self.keys[key] += 1


def charge_tool(ledger: Ledger, **options: Any) -> Any:
    def charge(args: Charge, call: ToolCall) -> dict[str, Any]:
        ledger.note(f"charge {args.amount}", call.idempotency_key)
        return {"charged": args.amount}

    return define_tool("charge", "charges a card", Charge, charge, **options)


def runtime_with(store: Any, flows: list[Any], tools: list[Any], **options: Any) -> Runtime:
    agent = define_agent("agent", "misbehaving nodes", None, tools, flows)
    return Runtime([agent], store=store, **options)


async def start(runtime: Runtime, flow: str) -> Any:
    return await runtime.run(SESSION, kind="flow", flow_name=flow).result()


# ------------------------------------------------------ swallowed suspensions
async def swallow_with_except_exception(ctx: RunContext) -> None:
    try:  # noqa: SIM105 - the habit under test, written as users write it
        await ctx.approve("Charge 10?")
    except Exception:
        pass  # "log and go on"


async def swallow_with_except_base_exception(ctx: RunContext) -> None:
    try:  # noqa: SIM105 - the habit under test
        await ctx.approve("Charge 10?")
    except BaseException:
        pass


async def swallow_with_a_finally_that_goes_on(ctx: RunContext) -> None:
    with contextlib.suppress(SuspendError):
        try:
            await ctx.approve("Charge 10?")
        finally:
            await ctx.tool("charge", {"amount": 10})  # the finally charges anyway


async def swallow_with_gather_return_exceptions(ctx: RunContext) -> None:
    await asyncio.gather(ctx.approve("Charge 10?"), return_exceptions=True)


SWALLOWERS = {
    "except Exception": swallow_with_except_exception,
    "except BaseException": swallow_with_except_base_exception,
    "finally goes on": swallow_with_a_finally_that_goes_on,
    "gather(return_exceptions=True)": swallow_with_gather_return_exceptions,
}


@pytest.mark.parametrize("habit", list(SWALLOWERS))
async def test_a_swallowed_approval_never_lets_the_charge_it_guards_run(
    open_store: Any, habit: str
) -> None:
    ledger = Ledger()
    swallow = SWALLOWERS[habit]
    caught: list[BaseException] = []

    async def pay(state: dict[str, Any], ctx: RunContext) -> Any:
        await swallow(ctx)
        try:
            await ctx.tool("charge", {"amount": 10})
        except SuspendError as again:
            caught.append(again)
            return end("charged anyway")  # discarded: the run pauses on its first wait
        return end("charged")

    runtime = runtime_with(
        open_store(),
        [define_flow("pay", "pay", "pay", [action("pay", pay)])],
        [charge_tool(ledger)],
    )
    paused = await start(runtime, "pay")

    assert paused.status == "paused"
    assert paused.waiting_for is not None and paused.waiting_for.name == "__approval"
    assert ledger.lines == [], "a charge ran with no approval"
    assert caught and isinstance(caught[0], SuspendError)
    steps = await runtime.get_steps(paused.run_id, SESSION)
    assert [s.kind for s in steps] == []  # nothing was journaled past the suspension

    done = await runtime.approve(paused.run_id, SESSION, by="supervisor")
    assert done.status == "finished"
    # Approved, each charge the code asks for runs once (the finally's too).
    charges = 2 if habit == "finally goes on" else 1
    assert ledger.lines == ["charge 10"] * charges


async def test_an_error_raised_after_a_suspension_is_discarded_and_the_run_pauses(
    open_store: Any,
) -> None:
    async def pay(state: dict[str, Any], ctx: RunContext) -> Any:
        try:
            await ctx.approve("Charge?")
        except SuspendError as e:
            raise RuntimeError("an approval is not a failure") from e
        return end("approved")

    runtime = runtime_with(
        open_store(), [define_flow("pay", "pay", "pay", [action("pay", pay)])], []
    )
    paused = await start(runtime, "pay")
    assert paused.status == "paused"
    state = await runtime.get_run(paused.run_id, SESSION)
    assert state is not None and state.error is None
    assert (await runtime.approve(paused.run_id, SESSION, by="b")).status == "finished"


async def test_a_second_wait_after_a_swallowed_one_pauses_on_the_first(open_store: Any) -> None:
    async def waits(state: dict[str, Any], ctx: RunContext) -> Any:
        with contextlib.suppress(SuspendError):
            await ctx.signal("first")
        await ctx.signal("second")
        return end("both")

    runtime = runtime_with(open_store(), [define_flow("w", "w", "w", [action("w", waits)])], [])
    paused = await start(runtime, "w")
    assert paused.waiting_for is not None and paused.waiting_for.name == "first"


# ------------------------------------------------------- blocking sync tools
def _sweep_until(stop: threading.Event, store: Any, flows: list[Any], tools: list[Any]) -> int:
    """A second worker on its own event loop: recovers orphans until stopped."""

    async def sweep() -> int:
        runtime = runtime_with(store, flows, tools, lease_ttl=0.3, holder="worker-b")
        drove = 0
        while not stop.is_set():
            drove += len(await recover_orphaned_runs(runtime))
            await asyncio.sleep(0.03)
        return drove

    return asyncio.run(sweep())


async def test_a_blocking_sync_tool_longer_than_the_lease_is_never_run_twice_at_once(
    open_store: Any,
) -> None:
    ledger = Ledger()

    def blocking(args: NoArgs, call: ToolCall) -> dict[str, Any]:
        ledger.note("start", call.idempotency_key)
        time.sleep(1.0)  # a slow payment API, called without a timeout
        ledger.note("end")
        return {"paid": True}

    tools = [define_tool("blocking", "blocks its thread", NoArgs, blocking)]

    async def pay(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("blocking")
        return end("paid")

    flows = [define_flow("pay", "pay", "pay", [action("pay", pay)])]
    first = runtime_with(open_store(), flows, tools, lease_ttl=0.3, holder="worker-a")
    stop = threading.Event()
    sweeper = asyncio.ensure_future(
        asyncio.to_thread(_sweep_until, stop, open_store(), flows, tools)
    )
    try:
        result = await start(first, "pay")
    finally:
        stop.set()
    drove = await sweeper

    assert result.status == "finished"
    assert ledger.lines == ["start", "end"]
    assert drove == 0, "the second worker took over a run whose tool was still running"
    steps = await first.get_steps(result.run_id, SESSION)
    assert [(s.name, s.attempts) for s in steps] == [("blocking", 1)]


def one_tool_runtime(store: Any, tool: Any) -> Runtime:
    """A runtime whose flow ``f`` calls ``tool`` once and ends."""

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool(tool.name)
        return end("ok")

    return runtime_with(store, [define_flow("f", "f", "n", [action("n", node)])], [tool])


async def test_a_sync_tool_runs_off_the_event_loop(open_store: Any) -> None:
    threads: list[str] = []

    def where(args: NoArgs) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return {}

    runtime = one_tool_runtime(open_store(), define_tool("where", "says where", NoArgs, where))
    assert (await start(runtime, "f")).status == "finished"
    assert threads and threads[0] != threading.current_thread().name


async def test_sync_tools_blocked_at_once_each_have_a_thread_which_ends_when_idle(
    open_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tool threads take calls from one queue, and a call is queued only when an
    idle thread is left to take it: calls that block together never wait for
    each other (each waits here for all the others to be running)."""
    monkeypatch.setattr(threads_module, "IDLE_SECONDS", 0.2)
    together = 6
    all_running = threading.Barrier(together, timeout=10)

    def meet(args: NoArgs) -> dict[str, Any]:
        all_running.wait()  # BrokenBarrierError if any call were kept waiting
        return {"met": True}

    runtime = one_tool_runtime(open_store(), define_tool("meet", "meets", NoArgs, meet))
    # Threads an earlier test left idle wait out their own (longer) idle time.
    earlier = {t for t in threading.enumerate() if t.name == "kuralle-tool"}
    results = await asyncio.gather(*(start(runtime, "f") for _ in range(together)))
    assert [r.status for r in results] == ["finished"] * together

    def tool_threads() -> int:
        return sum(t.name == "kuralle-tool" and t not in earlier for t in threading.enumerate())

    for _ in range(200):  # up to 10 s
        if not tool_threads():
            break
        await asyncio.sleep(0.05)
    assert tool_threads() == 0, "idle tool threads never ended"


# ------------------------------------------------- args from unrecorded values
async def test_args_from_an_unrecorded_value_refuse_to_run_again_under_a_new_key(
    open_store: Any,
) -> None:
    ledger = Ledger()

    async def pay(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("charge", {"amount": 10, "nonce": str(random.random())})
        await ctx.approve("Ship it?")
        return end("shipped")

    runtime = runtime_with(
        open_store(),
        [define_flow("pay", "pay", "pay", [action("pay", pay)])],
        [charge_tool(ledger)],
    )
    paused = await start(runtime, "pay")
    assert paused.status == "paused" and ledger.lines == ["charge 10"]
    before = await runtime.get_steps(paused.run_id, SESSION)

    with pytest.raises(NonDeterminismError) as refused:
        await runtime.approve(paused.run_id, SESSION, by="b")

    error = refused.value
    assert error.callsite == before[0].callsite
    assert error.recorded_key == before[0].key and error.requested_key != before[0].key
    assert "ctx.now()" in str(error) and "idempotency_key" in str(error)
    assert ledger.lines == ["charge 10"], "the charge ran again under a new key"
    after = await runtime.get_steps(paused.run_id, SESSION)
    assert [s.name for s in after if s.kind == "tool"] == ["charge"]


async def test_a_tool_with_a_key_override_is_matched_by_its_key(open_store: Any) -> None:
    ledger = Ledger()

    async def pay(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("charge", {"amount": 10, "nonce": datetime.now(UTC).isoformat()})
        await ctx.approve("Ship it?")
        return end("shipped")

    tool = charge_tool(ledger, idempotency_key=lambda args: f"order-{args.amount}")
    runtime = runtime_with(
        open_store(), [define_flow("pay", "pay", "pay", [action("pay", pay)])], [tool]
    )
    paused = await start(runtime, "pay")
    done = await runtime.approve(paused.run_id, SESSION, by="b")
    assert done.status == "finished"
    assert ledger.lines == ["charge 10"]
    assert ledger.keys == Counter({"order-10": 1})


# ------------------------------------------------------------ tasks left running
async def test_a_task_the_node_left_running_cannot_call_effects_after_its_turn(
    open_store: Any,
) -> None:
    ledger = Ledger()
    outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def later(ctx: RunContext) -> None:
        await asyncio.sleep(0.2)
        try:
            await ctx.tool("charge", {"amount": 99})
        except BaseException as e:
            outcome.set_result(e)
        else:
            outcome.set_result(None)

    async def leaves_a_task(state: dict[str, Any], ctx: RunContext) -> Any:
        state["task"] = asyncio.ensure_future(later(ctx)) is not None
        await ctx.tool("charge", {"amount": 1})
        return end("returned early")

    runtime = runtime_with(
        open_store(),
        [define_flow("t", "t", "n", [action("n", leaves_a_task)])],
        [charge_tool(ledger)],
    )
    result = await start(runtime, "t")
    assert result.status == "finished"
    version = (await runtime.get_run(result.run_id, SESSION)).version  # type: ignore[union-attr]

    error = await asyncio.wait_for(outcome, 5)
    assert isinstance(error, TurnClosedError)
    assert "await every effect before the node returns" in str(error)
    assert ledger.lines == ["charge 1"]
    state = await runtime.get_run(result.run_id, SESSION)
    assert state is not None and state.version == version, "a closed turn was written to"


async def test_an_unawaited_effect_awaited_after_the_node_returned_is_refused(
    open_store: Any,
) -> None:
    ledger = Ledger()
    kept: list[Any] = []

    async def keeps_an_awaitable(state: dict[str, Any], ctx: RunContext) -> Any:
        kept.append(ctx.tool("charge", {"amount": 5}))
        return end("returned")

    runtime = runtime_with(
        open_store(),
        [define_flow("k", "k", "n", [action("n", keeps_an_awaitable)])],
        [charge_tool(ledger)],
    )
    assert (await start(runtime, "k")).status == "finished"
    with pytest.raises(TurnClosedError):
        await kept[0]
    assert ledger.lines == []


# ----------------------------------------------------------- held runs
async def test_any_call_to_a_run_another_worker_holds_is_lease_held(open_store: Any) -> None:
    entered = asyncio.Event()
    gate = asyncio.Event()

    async def blocks(args: NoArgs) -> dict[str, Any]:
        entered.set()
        await gate.wait()
        return {}

    async def slow(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("blocks")
        return end("done")

    flows = [define_flow("held", "held", "slow", [action("slow", slow)])]
    tools = [define_tool("blocks", "waits for the test", NoArgs, blocks)]
    worker = runtime_with(open_store(), flows, tools, holder="worker-a")
    other = runtime_with(open_store(), flows, tools, holder="worker-b")
    handle = worker.run(SESSION, kind="flow", flow_name="held")
    run_id = await handle.run_id
    await asyncio.wait_for(entered.wait(), 10)
    # Whatever the call delivers, the held lease answers first (not a mismatch
    # with what the run waits for: it is running and waits for nothing).
    calls = {
        "input": lambda: other.run(SESSION, run_id=run_id, input="hello").result(),
        "signal": lambda: other.signal(run_id, SESSION, "go", {"n": 1}),
        "approval": lambda: other.approve(run_id, SESSION, by="ann"),
        "denial": lambda: other.deny(run_id, SESSION, by="ann", reason="no"),
        "plain call": lambda: other.run(SESSION, run_id=run_id).result(),
    }
    try:
        before = await other.get_run(run_id, SESSION)
        for what, call in calls.items():
            with pytest.raises(LeaseHeldError) as refused:
                await call()
            assert refused.value.holder == "worker-a", what
        after = await other.get_run(run_id, SESSION)
        assert before is not None and after is not None and after.version == before.version
    finally:
        gate.set()
    assert (await handle.result()).status == "finished"


# ------------------------------------------------------------ fork and batches
async def test_a_fork_inside_a_gather_of_sync_tools_is_refused_on_every_backend(
    open_store: Any,
) -> None:
    def instant(args: Charge) -> dict[str, Any]:
        return {"n": args.amount}

    async def batch(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.now()
        await asyncio.gather(ctx.tool("instant", {"amount": 1}), ctx.tool("instant", {"amount": 2}))
        await ctx.now()
        return end("batched")

    runtime = runtime_with(
        open_store(),
        [define_flow("b", "b", "n", [action("n", batch)])],
        [define_tool("instant", "returns at once", Charge, instant)],
    )
    result = await start(runtime, "b")
    assert result.status == "finished"
    with pytest.raises(InvalidArgumentError, match=r"parallel batch.*fork at step 1"):
        await runtime.fork(result.run_id, SESSION, 2)
    for at_step in (1, 3):  # where the batch starts, and after it
        forked = await runtime.fork(result.run_id, SESSION, at_step)
        assert forked.status == "finished"


# ------------------------------------------------------------ careless callers
class Contact(BaseModel):
    email: str | None = None


async def test_a_signal_named_like_a_collect_nodes_input_wait_is_refused(
    open_store: Any,
) -> None:
    # Input goes in as text; a signal that names the input wait is refused, and
    # writes nothing (it used to journal a step of a kind no reader knew).
    model = ScriptedModel([ModelResponse(data={})])
    ask = collect("ask", Contact, ["email"], lambda missing: "Your email?", lambda d: end("ok"))
    agent = define_agent("agent", "collects", model, [], [define_flow("c", "c", "ask", [ask])])
    runtime = Runtime([agent], store=open_store())
    paused = await runtime.run(SESSION, kind="flow", flow_name="c", input="hi").result()
    assert paused.waiting_for is not None and paused.waiting_for.name == "__input"
    before = await runtime.get_run(paused.run_id, SESSION)

    with pytest.raises(SignalMismatchError, match="input=") as refused:
        await runtime.signal(paused.run_id, SESSION, "__input", {"text": "a@b.c"})

    assert isinstance(refused.value, KuralleError)
    after = await runtime.get_run(paused.run_id, SESSION)
    assert before is not None and after is not None and after.version == before.version
    assert [s.kind for s in await runtime.get_steps(paused.run_id, SESSION)] == ["model"]


async def test_replay_check_with_the_agents_finds_args_from_unrecorded_values(
    open_store: Any,
) -> None:
    ledger = Ledger()

    async def pay(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("charge", {"amount": 10, "nonce": str(random.random())})
        await ctx.approve("Ship it?")
        return end("shipped")

    flow = define_flow("pay", "pay", "pay", [action("pay", pay)])
    store = open_store()
    runtime = runtime_with(store, [flow], [charge_tool(ledger)])
    paused = await start(runtime, "pay")
    await runtime.views.wait_until_caught_up(10)

    findings = await replay_check(store, flow, agents=list(runtime.agents.values()))
    assert [(f.run_id, f.kind) for f in findings] == [(paused.run_id, "nondeterminism")]
    assert "idempotency_key" in findings[0].message
    assert ledger.lines == ["charge 10"]  # the check executed nothing


async def test_a_sync_tool_raising_stop_iteration_fails_its_step(open_store: Any) -> None:
    """An asyncio future refuses StopIteration: the step fails with it named, and the
    run does not hang on a result that never comes."""

    def exhausted(args: NoArgs) -> dict[str, Any]:
        return next(iter([]))  # raises StopIteration

    runtime = one_tool_runtime(open_store(), define_tool("exhausted", "", NoArgs, exhausted))
    turn = runtime.run(SESSION, kind="flow", flow_name="f")
    with pytest.raises(ToolExecutionError, match="StopIteration"):
        await asyncio.wait_for(turn.result(), timeout=10)
    steps = await runtime.get_steps(await turn.run_id, SESSION)
    assert [(s.name, s.status) for s in steps] == [("exhausted", "error")]
    assert steps[0].error is not None and "StopIteration" in steps[0].error.message
