"""Forking a run at a step (``runtime.fork``) on memory, SQLite and PostgreSQL.

The refund example is forked at its approval (a denial gives a declined
fork while the original stays approved), after it (the refund runs again
under a key of the fork's own), at 0 (everything again) and at its end
(nothing again); a flow of counting tools shows exactly which effects a fork
executes; the original's stored events are compared byte for byte; every
refusal leaves the store's notification log as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from pydantic import BaseModel
from test_refund_example import ledger

from kuralle_es import (
    InvalidArgumentError,
    NonDeterminismError,
    RunContext,
    RunNotFoundError,
    RunStore,
    Runtime,
    SignalDelivery,
    ToolCall,
    ToolExecutionError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es._journal.log import parse_run_id
from kuralle_es.events import Consumer, RunEvent, RunOpened, RunPaused
from kuralle_es.examples import refund
from kuralle_es.testing import Crash, CrashingStore, CrashPlan, ScriptedModel

SESSION = "s-fork"
APPROVED_REPLY = "Good news: your refund was approved and is on its way."
DECLINED_REPLY = "Sorry, your refund was declined."


# ----------------------------------------------------------------- helpers
def stored_events(store: RunStore, run_id: str) -> list[tuple[int, str, bytes]]:
    """A run's stored events exactly as the recorder holds them."""
    aggregate_id = parse_run_id(run_id)
    assert aggregate_id is not None
    return [
        (e.originator_version, e.topic, bytes(e.state))
        for e in store.recorder.select_events(aggregate_id)
    ]


def log_head(store: RunStore) -> int:
    return store.recorder.max_notification_id() or 0


@pytest.fixture
def ledger_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(refund.LEDGER_ENV, str(path))
    monkeypatch.delenv(refund.MODEL_ENV, raising=False)
    return path


async def deliver(runtime: Runtime, run_id: str, name: str, payload: Any, **kw: Any) -> Any:
    delivery = SignalDelivery(
        signal_id=kw.pop("signal_id", uuid4().hex), name=name, payload=payload
    )
    return await runtime.run(
        kw.pop("session", SESSION), run_id=run_id, signal_delivery=delivery
    ).result()


async def approved_refund(open_store: Any) -> tuple[RunStore, Runtime, str]:
    """A refund run that asked for the amount, got it, was approved and refunded."""
    store = open_store()
    runtime = Runtime([refund.build_agent()], store=store)
    start = await runtime.run(
        SESSION, input="Hi, I'd like a refund.", kind="flow", flow_name="refund"
    ).result()
    assert start.status == "paused"
    asked = await runtime.run(SESSION, run_id=start.run_id, input="It was $42.50.").result()
    assert asked.waiting_for is not None and asked.waiting_for.kind == "approval"
    done = await deliver(
        runtime, start.run_id, "__approval", {"approved": True, "by": "supervisor"}
    )
    assert done.status == "finished"
    return store, runtime, start.run_id


# ------------------------------------------------------------- the refund
async def test_a_finished_refund_forked_at_its_approval_and_denied_ends_declined_while_the_original_stays_approved(  # noqa: E501
    open_store: Any, ledger_path: Path
) -> None:
    store, runtime, original = await approved_refund(open_store)
    steps = await runtime.get_steps(original, SESSION)
    assert [s.kind for s in steps] == ["model", "model", "approval", "tool", "model"]
    before = stored_events(store, original)
    original_state = await runtime.get_run(original, SESSION)
    assert original_state is not None

    forked = await runtime.fork(original, SESSION, 2)

    assert forked.run_id != original
    assert forked.status == "paused"
    assert forked.waiting_for is not None and forked.waiting_for.kind == "approval"
    assert forked.waiting_for.title == "Refund $42.50?"
    fork_state = await runtime.get_run(forked.run_id, SESSION)
    assert fork_state is not None
    assert fork_state.forked_from == {"run_id": original, "at_step": 2}
    assert fork_state.flow_digest == refund.refund_flow.digest
    # The messages and state bag the original had there: both user messages, one question.
    assert [(m.role, m.content) for m in fork_state.messages] == [
        (m.role, m.content) for m in original_state.messages[:3]
    ]
    assert fork_state.state == {"amount": 42.5}
    assert forked.run_id in store.session_run_ids(SESSION)

    denied = await deliver(
        runtime, forked.run_id, "__approval", {"approved": False, "by": "auditor", "reason": "no"}
    )
    assert denied.status == "finished"
    assert denied.output == DECLINED_REPLY
    fork_state = await runtime.get_run(forked.run_id, SESSION)
    assert fork_state is not None and fork_state.outcome == "declined"
    assert fork_state.state["declined_by"] == "auditor"

    after = await runtime.get_run(original, SESSION)
    assert after is not None and after.outcome == "approved"
    assert after.version == original_state.version
    assert stored_events(store, original) == before
    assert len(ledger(ledger_path)) == 1  # the fork refunded nothing

    fork_steps = await runtime.get_steps(forked.run_id, SESSION)
    assert [s.kind for s in fork_steps] == ["model", "model", "approval", "model"]
    for copied, source in zip(fork_steps[:2], steps[:2], strict=True):
        assert (copied.kind, copied.name, copied.callsite, copied.result) == (
            source.kind,
            source.name,
            source.callsite,
            source.result,
        )
        assert copied.key != source.key
    assert fork_steps[2].result["approved"] is False


async def test_a_refund_forked_after_its_approval_refunds_again_under_a_key_of_its_own(
    open_store: Any, ledger_path: Path
) -> None:
    store, runtime, original = await approved_refund(open_store)
    before = stored_events(store, original)

    forked = await runtime.fork(original, SESSION, 3)

    assert forked.status == "finished"
    assert forked.output == APPROVED_REPLY
    entries = ledger(ledger_path)
    assert len(entries) == 2
    assert entries[0]["key"] != entries[1]["key"]
    fork_steps = await runtime.get_steps(forked.run_id, SESSION)
    assert fork_steps[3].kind == "tool" and fork_steps[3].key == entries[1]["key"]
    assert fork_steps[2].result["by"] == "supervisor"  # the copied approval replayed
    assert stored_events(store, original) == before


async def test_a_refund_forked_at_0_starts_afresh_from_its_first_message(
    open_store: Any, ledger_path: Path
) -> None:
    _, runtime, original = await approved_refund(open_store)

    forked = await runtime.fork(original, SESSION, 0)

    # The first message named no amount: the fork asks for it, as the original did.
    assert forked.status == "paused"
    assert forked.waiting_for is not None and forked.waiting_for.kind == "input"
    state = await runtime.get_run(forked.run_id, SESSION)
    assert state is not None
    assert [m.content for m in state.messages] == [
        "Hi, I'd like a refund.",
        "How much should be refunded, in dollars?",
    ]
    fork_steps = await runtime.get_steps(forked.run_id, SESSION)
    assert len(fork_steps) == 1
    original_steps = await runtime.get_steps(original, SESSION)
    assert fork_steps[0].key != original_steps[0].key
    amount = await runtime.run(SESSION, run_id=forked.run_id, input="$10").result()
    assert amount.waiting_for is not None and amount.waiting_for.title == "Refund $10.00?"


async def test_a_refund_forked_at_its_end_replays_everything_and_executes_nothing(
    open_store: Any, ledger_path: Path
) -> None:
    _, runtime, original = await approved_refund(open_store)
    steps = await runtime.get_steps(original, SESSION)

    forked = await runtime.fork(original, SESSION, len(steps))

    assert forked.status == "finished"
    state, original_state = (
        await runtime.get_run(forked.run_id, SESSION),
        await runtime.get_run(original, SESSION),
    )
    assert state is not None and original_state is not None
    assert state.outcome == "approved"
    assert state.messages == original_state.messages  # the reply replayed, not asked again
    assert state.messages[-1].content == APPROVED_REPLY
    fork_steps = await runtime.get_steps(forked.run_id, SESSION)
    assert [(s.kind, s.result, s.attempts) for s in fork_steps] == [
        (s.kind, s.result, s.attempts) for s in steps
    ]
    assert len(ledger(ledger_path)) == 1


async def test_a_run_paused_for_input_forked_at_its_end_waits_for_input_too(
    open_store: Any, ledger_path: Path
) -> None:
    store = open_store()
    runtime = Runtime([refund.build_agent()], store=store)
    start = await runtime.run(
        SESSION, input="Hi, I'd like a refund.", kind="flow", flow_name="refund"
    ).result()
    assert start.waiting_for is not None

    forked = await runtime.fork(start.run_id, SESSION, 1, into_session="s-other")

    assert forked.status == "paused"
    assert forked.waiting_for is not None and forked.waiting_for.kind == "input"
    assert forked.waiting_for.request_id != start.waiting_for.request_id
    assert await runtime.get_run(forked.run_id, SESSION) is None  # it lives in s-other
    state = await runtime.get_run(forked.run_id, "s-other")
    assert state is not None and len(state.messages) == 2
    assert forked.run_id in store.session_run_ids("s-other")
    assert len(await runtime.get_steps(forked.run_id, "s-other")) == 1  # no new extraction
    amount = await runtime.run("s-other", run_id=forked.run_id, input="It was $7").result()
    assert amount.waiting_for is not None and amount.waiting_for.title == "Refund $7.00?"


# ------------------------------------------------- a flow of counting tools
class _Args(BaseModel):
    n: int


class _Effects:
    """The tools' own ledger: each execution with the key it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def tool(self, name: str, *, delay: float = 0.0, **options: Any) -> Any:
        async def execute(args: _Args, call: ToolCall) -> dict[str, Any]:
            if delay:
                await asyncio.sleep(delay)
            self.calls.append((name, call.idempotency_key))
            return {"tool": name, "n": args.n}

        return define_tool(name, f"counts {name}", _Args, execute, **options)


def counting_agent(effects: _Effects, *, second: str = "b") -> Any:
    async def steps(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("a", {"n": 1})
        stamp = await ctx.uuid()
        await ctx.tool(second, {"n": 2})
        await ctx.tool("c", {"n": 3})
        await ctx.tool("charge", {"n": 4})
        return end(f"done {stamp}")

    async def batch(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("a", {"n": 1})
        await asyncio.gather(ctx.tool("slow", {"n": 2}), ctx.tool("b", {"n": 3}))
        await ctx.tool("c", {"n": 4})
        return end("batched")

    tools = [
        effects.tool("a"),
        effects.tool("b"),
        effects.tool("c"),
        effects.tool("d"),
        effects.tool("slow", delay=0.05),
        effects.tool("charge", idempotency_key=lambda args: f"charge-{args.n}"),
    ]
    flows = [
        define_flow("steps", "four tools and a uuid", "steps", [action("steps", steps)]),
        define_flow("batch", "a gather", "batch", [action("batch", batch)]),
    ]
    return define_agent("counter", "counts", ScriptedModel(["unused"]), tools, flows)


async def counted_run(open_store: Any) -> tuple[RunStore, _Effects, Runtime, Any]:
    """A finished run of the ``steps`` flow, and the ledger of its tools."""
    store = open_store()
    effects = _Effects()
    runtime = Runtime([counting_agent(effects)], store=store)
    done = await runtime.run(SESSION, kind="flow", flow_name="steps").result()
    return store, effects, runtime, done


async def test_a_fork_executes_only_the_steps_from_its_point_each_with_a_key_of_its_own(
    open_store: Any,
) -> None:
    store, effects, runtime, done = await counted_run(open_store)
    assert done.status == "finished"
    original_keys = dict(effects.calls)
    before = stored_events(store, done.run_id)
    effects.calls.clear()

    forked = await runtime.fork(done.run_id, SESSION, 2)

    assert forked.status == "finished"
    assert forked.output == done.output  # the copied uuid replayed
    assert [name for name, _ in effects.calls] == ["b", "c", "charge"]  # never a again
    fork_keys = dict(effects.calls)
    assert fork_keys["b"] != original_keys["b"]
    assert fork_keys["c"] != original_keys["c"]
    # A tool's own idempotency_key is a business identity: the fork keeps it.
    assert fork_keys["charge"] == original_keys["charge"] == "charge-4"
    assert stored_events(store, done.run_id) == before

    effects.calls.clear()
    again = await runtime.fork(done.run_id, SESSION, 0)
    assert again.status == "finished"
    assert again.output != done.output  # a fresh uuid
    assert [name for name, _ in effects.calls] == ["a", "b", "c", "charge"]
    assert dict(effects.calls)["a"] != original_keys["a"]


async def test_a_fork_whose_copied_steps_no_longer_match_the_flow_is_a_nondeterminism_error(
    open_store: Any,
) -> None:
    store, effects, _, done = await counted_run(open_store)
    before = stored_events(store, done.run_id)
    effects.calls.clear()
    changed = Runtime([counting_agent(effects, second="d")], store=store)

    with pytest.raises(NonDeterminismError):
        await changed.fork(done.run_id, SESSION, 3)

    assert effects.calls == []
    assert stored_events(store, done.run_id) == before
    # The code before the fork point still matches: a fork there runs the new tool.
    forked = await changed.fork(done.run_id, SESSION, 2)
    assert forked.status == "finished"
    assert [name for name, _ in effects.calls] == ["d", "c", "charge"]


async def test_refusals_write_nothing(open_store: Any) -> None:
    store = open_store()
    effects = _Effects()
    agent = counting_agent(effects)
    runtime = Runtime([agent], store=store)
    flow_run = await runtime.run(SESSION, kind="flow", flow_name="steps").result()
    batch_run = await runtime.run(SESSION, kind="flow", flow_name="batch").result()
    assert batch_run.status == "finished"
    conversation = await runtime.run(SESSION, input="hello").result()
    head = log_head(store)
    step_count = len(await runtime.get_steps(flow_run.run_id, SESSION))

    refusals: list[tuple[type[Exception], str, str, Any]] = [
        (InvalidArgumentError, flow_run.run_id, SESSION, step_count + 1),
        (InvalidArgumentError, flow_run.run_id, SESSION, -1),
        (InvalidArgumentError, flow_run.run_id, SESSION, True),
        (InvalidArgumentError, flow_run.run_id, SESSION, "1"),
        (InvalidArgumentError, batch_run.run_id, SESSION, 2),  # b started while slow ran
        (InvalidArgumentError, conversation.run_id, SESSION, 0),
        (RunNotFoundError, flow_run.run_id, "another-session", 0),
        (RunNotFoundError, "00000000-0000-4000-8000-000000000000", SESSION, 0),
        (RunNotFoundError, "not-a-run-id", SESSION, 0),
    ]
    for error, run_id, session, at_step in refusals:
        with pytest.raises(error) as raised:
            await runtime.fork(run_id, session, at_step)
        assert log_head(store) == head, (run_id, at_step, raised.value)
    with pytest.raises(InvalidArgumentError, match=r"parallel batch.*fork at step 1"):
        await runtime.fork(batch_run.run_id, SESSION, 2)
    with pytest.raises(InvalidArgumentError, match="into_session"):
        await runtime.fork(flow_run.run_id, SESSION, 0, into_session="")
    assert log_head(store) == head

    # Where the batch starts, and after it, are fork points.
    effects.calls.clear()
    at_start = await runtime.fork(batch_run.run_id, SESSION, 1)
    after = await runtime.fork(batch_run.run_id, SESSION, 3)
    assert (at_start.status, after.status) == ("finished", "finished")
    assert sorted(name for name, _ in effects.calls) == ["b", "c", "c", "slow"]


async def test_a_fork_of_a_delivery_payload_replays_it_and_a_signal_after_is_the_forks_own(
    open_store: Any,
) -> None:
    async def waits(state: dict[str, Any], ctx: RunContext) -> Any:
        first = await ctx.signal("go")
        second = await ctx.signal("go")
        return end(f"{first}+{second}")

    agent = define_agent(
        "waiter",
        "waits",
        ScriptedModel(["unused"]),
        [],
        [define_flow("waits", "two signals", "w", [action("w", waits)])],
    )
    store = open_store()
    runtime = Runtime([agent], store=store)
    start = await runtime.run(SESSION, kind="flow", flow_name="waits").result()
    await deliver(runtime, start.run_id, "go", "x", signal_id="sig-1")
    done = await deliver(runtime, start.run_id, "go", "y", signal_id="sig-2")
    assert done.output == "x+y"

    forked = await runtime.fork(start.run_id, SESSION, 1)
    assert forked.status == "paused" and forked.waiting_for is not None
    assert forked.waiting_for.name == "go"
    # The original's signal ids are the original's: the same id is new to the fork.
    again = await deliver(runtime, forked.run_id, "go", "z", signal_id="sig-2")
    assert again.output == "x+z"


async def test_a_tool_approval_forks_like_any_step_and_a_fork_of_a_fork_knows_its_parent(
    open_store: Any,
) -> None:
    effects = _Effects()

    async def wire(state: dict[str, Any], ctx: RunContext) -> Any:
        with contextlib.suppress(ToolExecutionError):
            await ctx.tool("a", {"n": 0})  # fails: a frozen error the fork replays
        await ctx.tool("wire", {"n": 5})
        return end("sent")

    failures: list[int] = []

    def failing(args: _Args) -> Any:
        failures.append(args.n)
        raise RuntimeError("down")

    tools = [
        define_tool("a", "fails", _Args, failing),
        effects.tool("wire", needs_approval=True),
    ]
    agent = define_agent(
        "payer",
        "pays",
        ScriptedModel(["unused"]),
        tools,
        [define_flow("wire", "an approved wire", "w", [action("w", wire)])],
    )
    store = open_store()
    runtime = Runtime([agent], store=store)
    start = await runtime.run(SESSION, kind="flow", flow_name="wire").result()
    assert start.waiting_for is not None and start.waiting_for.operation is not None
    done = await deliver(runtime, start.run_id, "__approval", {"approved": True, "by": "ann"})
    assert done.status == "finished"
    steps = await runtime.get_steps(start.run_id, SESSION)
    assert [(s.kind, s.status) for s in steps] == [
        ("tool", "error"),
        ("approval", "finished"),
        ("tool", "finished"),
    ]

    after_approval = await runtime.fork(start.run_id, SESSION, 2)
    assert after_approval.status == "finished"  # the copied approval replayed: no new ask
    at_approval = await runtime.fork(start.run_id, SESSION, 1)
    assert at_approval.status == "paused" and at_approval.waiting_for is not None
    assert at_approval.waiting_for.operation == start.waiting_for.operation
    assert [name for name, _ in effects.calls] == ["wire", "wire"]
    assert failures == [0]  # the frozen failure replayed in both forks

    grandchild = await runtime.fork(after_approval.run_id, SESSION, 1)
    state = await runtime.get_run(grandchild.run_id, SESSION)
    assert state is not None
    assert state.forked_from == {"run_id": after_approval.run_id, "at_step": 1}
    assert grandchild.status == "paused"  # at the approval, again


async def test_a_point_after_a_step_left_in_doubt_by_a_crash_is_refused() -> None:
    effects = _Effects()
    store = CrashingStore.memory()
    store.plan = CrashPlan("after_intent")
    handle = Runtime([counting_agent(effects)], store=store).run(
        SESSION, kind="flow", flow_name="steps"
    )
    with pytest.raises(Crash):
        await handle.result()
    run_id = await handle.run_id
    store.plan = None
    runtime = Runtime([counting_agent(effects)], store=store)
    steps = await runtime.get_steps(run_id, SESSION)
    assert [s.status for s in steps] == ["running"]
    head = log_head(store)

    with pytest.raises(InvalidArgumentError, match="still running"):
        await runtime.fork(run_id, SESSION, 1)
    assert log_head(store) == head

    forked = await runtime.fork(run_id, SESSION, 0)  # before the step in doubt
    assert forked.status == "finished"


def stamped_agent(node: str) -> Any:
    async def stamp(state: dict[str, Any], ctx: RunContext) -> Any:
        stamp = await ctx.uuid()
        said = await ctx.signal("go")
        return end(f"{stamp}:{said}")

    flow = define_flow("stamp", "a uuid, then a signal", node, [action(node, stamp)])
    return define_agent("stamper", "stamps", ScriptedModel(["unused"]), [], [flow])


async def test_a_run_restarted_after_drift_forks_from_the_steps_of_its_current_pin(
    open_store: Any,
) -> None:
    store = open_store()
    old = Runtime([stamped_agent("s")], store=store)
    start = await old.run(SESSION, kind="flow", flow_name="stamp").result()
    runtime = Runtime([stamped_agent("t")], store=store)
    await runtime.resolve_drift(start.run_id, SESSION, "restart")
    done = await deliver(runtime, start.run_id, "go", "x")
    steps = await runtime.get_steps(start.run_id, SESSION)
    assert [s.kind for s in steps] == ["uuid", "uuid", "signal"]
    assert done.output == f"{steps[1].result}:x"

    forked = await runtime.fork(start.run_id, SESSION, 2)
    assert forked.status == "paused"
    again = await deliver(runtime, forked.run_id, "go", "y")
    assert again.output == f"{steps[1].result}:y"  # the uuid of the current pin replayed


async def test_a_fork_shows_in_the_views_and_opens_in_the_run_events_like_any_run(
    open_store: Any, ledger_path: Path
) -> None:
    store, runtime, original = await approved_refund(open_store)
    forked = await runtime.fork(original, SESSION, 2)

    await runtime.views.wait_until_caught_up(30)
    summaries = {s.run_id: s for s in await runtime.views.list_runs(session_id=SESSION)}
    assert summaries[forked.run_id].status == "paused"
    assert summaries[forked.run_id].step_count == 2
    assert summaries[original].status == "finished"

    seen: list[RunEvent] = []
    await Consumer(store, "fork-test", seen.append).run_until_caught_up()
    of_fork = [e for e in seen if e.run_id == forked.run_id]
    assert isinstance(of_fork[0], RunOpened)
    assert [type(e).__name__ for e in of_fork[1:5]] == [
        "StepStarted",
        "StepFinished",
        "StepStarted",
        "StepFinished",
    ]
    assert isinstance(of_fork[-1], RunPaused)
