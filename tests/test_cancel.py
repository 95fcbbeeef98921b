"""``runtime.cancel`` and the operator helpers (README: Cancelling a run), on every backend.

A cancel lands whoever holds the lease; a turn driving the run elsewhere
loses its next save and executes nothing further; a cancelled run refuses
deliveries and executes nothing when re-addressed; a conversation stays
usable. ``approve``/``deny``/``signal`` are exactly ``run(..., signal_delivery=...)``.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import StoreFactory
from procs import control
from procs.child import Child, until
from pydantic import BaseModel
from test_retries import crashing

from kuralle_es import (
    InvalidArgumentError,
    ModelResponse,
    RunNotFoundError,
    Runtime,
    SignalDelivery,
    SignalMismatchError,
    StaleWriteError,
    ToolCall,
    ToolCallRequest,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es.cli import main as cli_main
from kuralle_es.testing import Crash, CrashPlan, ScriptedModel

SESSION = "cancel"


class Empty(BaseModel):
    pass


class Ledger:
    """What the tools really executed, outside the journal."""

    def __init__(self) -> None:
        self.entries: list[str] = []
        self.started = asyncio.Event()


def flows_runtime(store: Any, ledger: Ledger, **options: Any) -> Runtime:
    """Flows: ``approval`` (approve, then ``after``), ``slow`` (``slow`` then ``after``),
    ``signal`` (wait for ``go``), ``quick`` (ends at once)."""

    async def slow(args: Empty) -> Any:
        ledger.entries.append("slow-start")
        ledger.started.set()
        await asyncio.sleep(0.5)
        ledger.entries.append("slow-done")
        return {"slow": True}

    def after(args: Empty) -> Any:
        ledger.entries.append("after")
        return {"after": True}

    async def approval(state: dict[str, Any], ctx: Any) -> Any:
        decision = await ctx.approve("ok?")
        state["decision"] = decision.model_dump()
        await ctx.tool("after", {})
        return end("approved" if decision.approved else "denied")

    async def slow_then_after(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("slow", {})
        await ctx.tool("after", {})
        return end("done")

    async def wait_signal(state: dict[str, Any], ctx: Any) -> Any:
        state["payload"] = await ctx.signal("go")
        return end("signalled")

    async def quick(state: dict[str, Any], ctx: Any) -> Any:
        return end("quick")

    tools = [define_tool("slow", "slow", Empty, slow), define_tool("after", "after", Empty, after)]
    flows = [
        define_flow("approval", "approve first", "n", [action("n", approval)]),
        define_flow("slow", "slow then after", "n", [action("n", slow_then_after)]),
        define_flow("signal", "wait for go", "n", [action("n", wait_signal)]),
        define_flow("quick", "ends at once", "n", [action("n", quick)]),
    ]
    return Runtime([define_agent("a", "cancel tests", None, tools, flows)], store=store, **options)


async def start(runtime: Runtime, flow: str) -> Any:
    return await runtime.run(SESSION, input="go", kind="flow", flow_name=flow).result()


# ------------------------------------------------------------------- flows
async def test_cancelling_a_paused_run_aborts_it_and_it_then_executes_nothing(
    open_store: StoreFactory,
) -> None:
    ledger = Ledger()
    runtime = flows_runtime(open_store(), ledger)
    paused = await start(runtime, "approval")
    assert paused.status == "paused"
    state = await runtime.cancel(paused.run_id, SESSION, "customer left")
    assert (state.status, state.outcome, state.waiting_for) == (
        "aborted", "cancelled: customer left", None,
    )  # fmt: skip
    assert state.lease_holder is None
    with pytest.raises(SignalMismatchError, match="cancelled: customer left"):
        await runtime.approve(paused.run_id, SESSION, by="alice")
    again = await runtime.run(SESSION, run_id=paused.run_id).result()
    typed = await runtime.run(SESSION, run_id=paused.run_id, input="hello?").result()
    assert again.status == typed.status == "aborted"
    assert ledger.entries == []
    (summary,) = await runtime.views.list_runs(session_id=SESSION)
    assert (summary.status, summary.waiting_for, summary.lease_holder) == ("aborted", None, None)
    # Cancelling again is a no-op: nothing is written.
    repeat = await runtime.cancel(paused.run_id, SESSION, "twice")
    assert (repeat.outcome, repeat.version) == ("cancelled: customer left", state.version)


async def test_cancelling_a_finished_flow_run_is_refused_and_writes_nothing(
    open_store: StoreFactory,
) -> None:
    runtime = flows_runtime(open_store(), Ledger())
    done = await start(runtime, "quick")
    before = await runtime.get_run(done.run_id, SESSION)
    with pytest.raises(InvalidArgumentError, match="nothing to cancel"):
        await runtime.cancel(done.run_id, SESSION, "too late")
    after = await runtime.get_run(done.run_id, SESSION)
    assert before is not None and after is not None
    assert (after.status, after.outcome, after.version) == ("finished", "quick", before.version)


async def test_cancelling_an_unknown_or_foreign_run_is_run_not_found(
    open_store: StoreFactory,
) -> None:
    runtime = flows_runtime(open_store(), Ledger())
    paused = await start(runtime, "approval")
    with pytest.raises(RunNotFoundError):
        await runtime.cancel(paused.run_id, "another-session", "x")
    with pytest.raises(RunNotFoundError):
        await runtime.cancel("00000000-0000-0000-0000-000000000000", SESSION, "x")
    with pytest.raises(InvalidArgumentError):
        await runtime.cancel(paused.run_id, SESSION, "  ")
    state = await runtime.get_run(paused.run_id, SESSION)
    assert state is not None and state.status == "paused"


async def test_cancelling_an_orphan_aborts_it_despite_its_stale_lease(
    open_store: StoreFactory,
) -> None:
    ledger = Ledger()
    # The worker dies right after saving the slow tool's intent: an orphan.
    store = crashing(open_store, CrashPlan("after_intent", nth=1))
    worker = flows_runtime(store, ledger, lease_ttl=0.2)
    handle = worker.run(SESSION, input="go", kind="flow", flow_name="slow")
    run_id = await handle.run_id
    with pytest.raises(Crash):
        await handle.result()
    store.plan = None
    runtime = flows_runtime(open_store() if open_store.backend != "memory" else store, ledger)
    await asyncio.sleep(0.3)
    orphan = await runtime.get_run(run_id, SESSION)
    assert orphan is not None and orphan.status == "running"
    assert orphan.lease_expires_at is not None and orphan.lease_expires_at < datetime.now(UTC)
    state = await runtime.cancel(run_id, SESSION, "stuck")
    assert (state.status, state.outcome) == ("aborted", "cancelled: stuck")
    assert state.lease_holder is None
    assert (await runtime.run(SESSION, run_id=run_id).result()).status == "aborted"
    assert ledger.entries == []


async def test_a_turn_driving_the_run_loses_its_next_save_and_executes_nothing_further(
    open_store: StoreFactory,
) -> None:
    ledger = Ledger()
    worker = flows_runtime(open_store(), ledger)  # another worker, with a live lease
    operator = flows_runtime(open_store(), Ledger())
    handle = worker.run(SESSION, input="go", kind="flow", flow_name="slow")
    run_id = await handle.run_id
    turn = asyncio.ensure_future(handle.result())
    await asyncio.wait_for(ledger.started.wait(), 30)
    held = await operator.get_run(run_id, SESSION)
    assert held is not None and held.lease_holder == worker.holder
    cancelled = await operator.cancel(run_id, SESSION, "operator stop")
    with pytest.raises(StaleWriteError, match="outcome is recorded") as lost:
        await turn
    assert lost.value.recorded
    assert ledger.entries == ["slow-start", "slow-done"]  # "after" never executed
    final = await operator.get_run(run_id, SESSION)
    assert final is not None
    # The slow tool ran: its outcome is recorded after the cancel, and nothing else.
    assert (final.status, final.outcome, final.version) == (
        "aborted", "cancelled: operator stop", cancelled.version + 1,
    )  # fmt: skip
    steps = await operator.get_steps(run_id, SESSION)
    assert [(s.name, s.status) for s in steps] == [("slow", "finished")]


async def test_a_cancel_lands_while_a_turn_saves_as_fast_as_it_can(
    open_store: StoreFactory,
) -> None:
    executed: list[int] = []
    started = asyncio.Event()

    async def tick(args: Empty) -> Any:
        executed.append(len(executed))
        started.set()
        await asyncio.sleep(0.005)  # a fast tool: the turn saves about every 5 ms
        return len(executed)

    async def busy(state: dict[str, Any], ctx: Any) -> Any:
        for _ in range(2000):  # two saves per step
            await ctx.tool("tick", {"n": 0})
        return end("done")

    class N(BaseModel):
        n: int

    tool = define_tool("tick", "t", N, tick, replay=False)
    flow = define_flow("busy", "saves", "n", [action("n", busy)])
    agent = define_agent("a", "x", None, [tool], [flow])
    worker = Runtime([agent], store=open_store())
    operator = Runtime([agent], store=open_store())
    handle = worker.run(SESSION, input="go", kind="flow", flow_name="busy")
    run_id = await handle.run_id
    turn = asyncio.ensure_future(handle.result())
    await asyncio.wait_for(started.wait(), 30)
    state = await operator.cancel(run_id, SESSION, "enough")
    with pytest.raises(StaleWriteError):
        await turn
    assert state.outcome == "cancelled: enough" and len(executed) < 2000
    final = await operator.get_run(run_id, SESSION)
    # A tick that executed when the cancel landed has its outcome recorded after it.
    assert final is not None and final.status == "aborted"
    assert final.version in (state.version, state.version + 1)
    steps = await operator.get_steps(run_id, SESSION)
    if final.version == state.version + 1:
        assert steps[-1].status == "finished"
    else:  # the cancel landed with no tick in flight
        assert steps[-1].status in ("finished", "running")
    ran = len(executed)
    assert (await operator.run(SESSION, run_id=run_id).result()).status == "aborted"
    assert len(executed) == ran


SHARED_BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.mark.parametrize("backend", SHARED_BACKENDS)
async def test_a_turn_in_another_process_stops_at_its_next_save_after_a_cancel(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    assert open_store.target is not None
    ledger = tmp_path / "ledger.jsonl"
    with Child(
        "control", open_store.backend, open_store.target, ledger, SESSION,
        "start", control.SLOW_THEN_AFTER, env={"KT_SLOW": "1.5", "KT_LEASE_TTL": "30"},
    ) as child:  # fmt: skip
        run_id = await child.opened()
        await until(
            lambda: any(e["tool"] == "slow-start" for e in control.read_ledger(ledger)),
            "the child started its slow tool",
        )
        runtime = Runtime([control.make_agent(ledger)], store=open_store())
        held = await runtime.get_run(run_id, SESSION)
        assert held is not None and held.lease_holder not in (None, runtime.holder)
        cancelled = await runtime.cancel(run_id, SESSION, "from the shell")
        code, report = await asyncio.to_thread(child.wait, 60)
    assert report is not None, (child.stdout, child.stderr)
    assert code == 2 and report["error"]["type"] == "StaleWriteError", (child.stdout, child.stderr)
    assert [e["tool"] for e in control.read_ledger(ledger)] == ["slow-start", "slow-done"]
    final = await runtime.get_run(run_id, SESSION)
    assert final is not None
    # The slow tool ran in the other process: its outcome is recorded after the cancel.
    assert (final.status, final.outcome, final.version) == (
        "aborted", "cancelled: from the shell", cancelled.version + 1,
    )  # fmt: skip


# ------------------------------------------------------------- conversation
async def test_a_cancelled_conversation_ends_its_turn_and_stays_usable(
    open_store: StoreFactory,
) -> None:
    ledger = Ledger()

    def pay(args: Empty, call: ToolCall) -> Any:
        ledger.entries.append(call.idempotency_key)
        return {"paid": True}

    def answer(request: Any) -> Any:
        last = request.messages[-1]
        if last.role == "user" and last.content == "pay":
            return ModelResponse(tool_calls=[ToolCallRequest(id="c", name="pay", args={})])
        return f"ok: {last.content}"

    tool = define_tool("pay", "pay", Empty, pay, needs_approval=True)
    agent = define_agent("a", "x", ScriptedModel(answer), [tool])
    runtime = Runtime([agent], store=open_store())
    paused = await runtime.run(SESSION, input="pay").result()
    assert paused.status == "paused"
    state = await runtime.cancel(paused.run_id, SESSION, "changed my mind")
    assert (state.kind, state.status, state.outcome, state.waiting_for) == (
        "conversation", "finished", "cancelled: changed my mind", None,
    )  # fmt: skip
    with pytest.raises(SignalMismatchError, match="finished \\(cancelled: changed my mind\\)"):
        await runtime.approve(paused.run_id, SESSION, by="alice")
    assert (await runtime.cancel(paused.run_id, SESSION, "again")).version == state.version
    nxt = await runtime.run(SESSION, input="hello").result()
    assert (nxt.run_id, nxt.status, nxt.output) == (paused.run_id, "finished", "ok: hello")
    assert ledger.entries == []
    # A conversation whose last turn finished normally has nothing to cancel.
    with pytest.raises(InvalidArgumentError):
        await runtime.cancel(paused.run_id, SESSION, "late")


# ------------------------------------------------------------------ helpers
def _comparable(result: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = result.model_dump(mode="json")
    dumped.pop("run_id")
    if dumped.get("waiting_for"):
        dumped["waiting_for"].pop("request_id")
    return dumped


async def _journal(runtime: Runtime, run_id: str) -> list[tuple[Any, ...]]:
    state = await runtime.get_run(run_id, SESSION)
    assert state is not None
    steps = await runtime.get_steps(run_id, SESSION)
    return [(s.kind, s.name, s.status, s.result) for s in steps] + [
        (state.status, state.outcome, json.dumps(state.state, sort_keys=True))
    ]


@pytest.mark.parametrize(
    ("helper", "payload"),
    [
        ("approve", {"approved": True, "by": "alice", "reason": "fine"}),
        ("deny", {"approved": False, "by": "alice", "reason": "no"}),
        ("approve_without_reason", {"approved": True, "by": "alice"}),
    ],
)
async def test_approve_and_deny_are_exactly_the_equivalent_delivery(
    open_store: StoreFactory, helper: str, payload: dict[str, Any]
) -> None:
    runtime = flows_runtime(open_store(), Ledger())
    by_helper = await start(runtime, "approval")
    by_run = await start(runtime, "approval")
    reason = payload.get("reason")
    if helper == "deny":
        got = await runtime.deny(
            by_helper.run_id, SESSION, by="alice", reason=reason, signal_id="h"
        )
    else:
        got = await runtime.approve(
            by_helper.run_id, SESSION, by="alice", reason=reason, signal_id="h"
        )
    delivery = SignalDelivery(signal_id="h", name="__approval", payload=payload, actor="alice")
    want = await runtime.run(SESSION, run_id=by_run.run_id, signal_delivery=delivery).result()
    assert _comparable(got) == _comparable(want)
    assert await _journal(runtime, by_helper.run_id) == await _journal(runtime, by_run.run_id)
    state = await runtime.get_run(by_helper.run_id, SESSION)
    assert state is not None and state.state["decision"]["by"] == "alice"
    # The same signal_id again is a no-op that returns the current state.
    repeat = await runtime.approve(by_helper.run_id, SESSION, by="alice", signal_id="h")
    assert repeat.status == got.status


async def test_signal_is_exactly_the_equivalent_delivery_with_a_fresh_signal_id(
    open_store: StoreFactory,
) -> None:
    runtime = flows_runtime(open_store(), Ledger())
    by_helper = await start(runtime, "signal")
    by_run = await start(runtime, "signal")
    got = await runtime.signal(by_helper.run_id, SESSION, "go", {"n": 1}, actor="ops")
    delivery = SignalDelivery(signal_id="fixed", name="go", payload={"n": 1}, actor="ops")
    want = await runtime.run(SESSION, run_id=by_run.run_id, signal_delivery=delivery).result()
    assert _comparable(got) == _comparable(want)
    assert await _journal(runtime, by_helper.run_id) == await _journal(runtime, by_run.run_id)
    # A fresh signal_id each call: a second delivery is a new one, refused by the ended run.
    with pytest.raises(SignalMismatchError):
        await runtime.signal(by_helper.run_id, SESSION, "go", {"n": 2})


async def test_helpers_raise_the_refusals_of_the_equivalent_delivery(
    open_store: StoreFactory,
) -> None:
    runtime = flows_runtime(open_store(), Ledger())
    paused = await start(runtime, "signal")
    with pytest.raises(SignalMismatchError):
        await runtime.approve(paused.run_id, SESSION, by="alice")
    with pytest.raises(RunNotFoundError):
        await runtime.signal(paused.run_id, "elsewhere", "go", None)


# ---------------------------------------------------------------------- CLI
@pytest.mark.parametrize("backend", SHARED_BACKENDS)
async def test_kuralle_es_cancel_reads_the_session_from_the_store(
    open_store: StoreFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    runtime = flows_runtime(open_store(), Ledger())
    paused = await start(runtime, "approval")
    done = await start(runtime, "quick")
    url = f"sqlite:///{open_store.target}" if open_store.backend == "sqlite" else open_store.target
    # No --app: cancelling never imports the application.
    argv = ["--store", str(url), "--app", "no_such_module:nothing", "cancel"]
    code = await asyncio.to_thread(cli_main, [*argv, paused.run_id, "--reason", "ops"])
    assert code == 0
    assert capsys.readouterr().out.strip() == f"run {paused.run_id} is aborted (cancelled: ops)"
    state = await runtime.get_run(paused.run_id, SESSION)
    assert state is not None and state.outcome == "cancelled: ops"
    code = await asyncio.to_thread(cli_main, [*argv, done.run_id, "--reason", "ops"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("kuralle-es: InvalidArgumentError:") and "\n" not in err
    code = await asyncio.to_thread(cli_main, [*argv, "nope", "--reason", "ops"])
    assert code == 1 and "no run nope" in capsys.readouterr().err
