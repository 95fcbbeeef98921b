"""Pause, signals, approval and denial (docs/contract.md: deliveries), on memory,
SQLite and PostgreSQL.

Every test goes through the public API: ``Runtime.run`` / ``TurnHandle`` /
``get_run`` / ``get_steps``. A refused delivery must leave the run exactly as
it was (same status, version, step count and ``waiting_for``).

The in-doubt tests make a step left ``running`` honestly: a child OS process
(``tests/procs/child.py``) runs the flow and its tool SIGKILLs that process
after the step's intent is journaled.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from procs import flows as procs_flows
from procs.child import KILLED, run_child, wait_lease_expired
from pydantic import BaseModel

from kuralle_es import (
    InvalidSignalError,
    LeaseHeldError,
    RunNotFoundError,
    RunState,
    Runtime,
    SignalDelivery,
    SignalMismatchError,
    StaleWriteError,
    StepRecord,
    StreamPart,
    ToolApprovalDeniedError,
    ToolCall,
    TurnResult,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
    idempotency_key,
)

SESSION = "session-pause"
APPROVAL = "__approval"

# How often each tool / node really ran, and every transfer's key and args.
CALLS: Counter[str] = Counter()
TRANSFERS: list[dict[str, Any]] = []
# The module-level switches the nodes read (reset for every test).
CFG: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _reset_switches() -> None:
    CALLS.clear()
    TRANSFERS.clear()
    CFG.clear()
    CFG.update(amount=100, deadline=None, spent=0)


# ------------------------------------------------------------------ tools
class Empty(BaseModel):
    pass


class Transfer(BaseModel):
    amount: int
    to: str


class Label(BaseModel):
    label: str


class Amount(BaseModel):
    amount: int


class Address(BaseModel):
    street: str
    zip: str


def _prep(args: Empty) -> dict[str, Any]:
    CALLS["prep"] += 1
    return {"prepped": True}


def _transfer(args: Transfer, call: ToolCall) -> dict[str, Any]:
    CALLS["transfer"] += 1
    TRANSFERS.append({"key": call.idempotency_key, "args": args.model_dump()})
    return {"transferred": args.amount, "to": args.to}


def _labelled(name: str) -> Any:
    async def execute(args: Label) -> dict[str, Any]:
        CALLS[name] += 1
        await asyncio.sleep(0.01)  # still in flight when the batch's approval suspends
        return {"tool": name, "label": args.label}

    return execute


def _guarded(args: Amount) -> dict[str, Any]:
    CALLS["guarded"] += 1
    return {"guarded": args.amount}


def _guard_policy(name: str, args: Any, call: ToolCall | None) -> str:
    if args.amount < 100:
        return "allow"
    return "ask" if args.amount < 1000 else "deny"


def _spend(args: Amount) -> dict[str, Any]:
    CALLS["spend"] += 1
    CFG["spent"] += args.amount
    return {"spent": args.amount}


def _budget_policy(name: str, args: Any, call: ToolCall | None) -> str:
    # A policy over outside state that the tool's own execution changes.
    return "allow" if CFG["spent"] + args.amount <= 100 else "deny"


async def _block(args: Empty) -> dict[str, Any]:
    CFG["entered"].set()
    await CFG["gate"].wait()
    return {"unblocked": True}


TOOLS = [
    define_tool("prep", "prepare", Empty, _prep),
    define_tool("transfer", "move money", Transfer, _transfer, needs_approval=True),
    define_tool("a", "first of a batch", Label, _labelled("a")),
    define_tool("c", "third of a batch", Label, _labelled("c")),
    define_tool("guarded", "policy-guarded", Amount, _guarded, policy=_guard_policy),
    define_tool("block", "blocks until the test opens the gate", Empty, _block),
    define_tool("spend", "spend from a budget of 100", Amount, _spend, policy=_budget_policy),
]


# ------------------------------------------------------------------ flows
async def _ask(state: dict[str, Any], ctx: Any) -> Any:
    CALLS["ask_node"] += 1
    await ctx.tool("prep")
    decision = await ctx.approve(
        "Ship order 42?", description="a human decides", deadline=CFG["deadline"]
    )
    state["decision_type"] = type(decision).__name__
    state["decision"] = decision.model_dump()
    return end("approved" if decision.approved else "declined")


async def _wait_shipment(state: dict[str, Any], ctx: Any) -> Any:
    CALLS["signal_node"] += 1
    await ctx.tool("prep")
    state["payload"] = await ctx.signal("shipment", deadline=CFG["deadline"])
    return end("signalled")


async def _wait_address(state: dict[str, Any], ctx: Any) -> Any:
    value = await ctx.signal("address", schema=Address)
    state["is_address"] = isinstance(value, Address)
    state["address"] = value.model_dump()
    return end("addressed")


async def _pay(state: dict[str, Any], ctx: Any) -> Any:
    CALLS["pay_node"] += 1
    try:
        receipt = await ctx.tool("transfer", {"amount": CFG["amount"], "to": "acct-1"})
    except ToolApprovalDeniedError as e:
        state["denied"] = {"tool_name": e.tool_name, "denied_by": e.denied_by, "reason": e.reason}
        return end("denied")
    state["receipt"] = receipt
    return end("paid")


async def _guarded_node(state: dict[str, Any], ctx: Any) -> Any:
    # A denial is not caught here: it fails the run.
    state["receipt"] = await ctx.tool("guarded", {"amount": CFG["amount"]})
    return end("guarded")


async def _batch(state: dict[str, Any], ctx: Any) -> Any:
    CALLS["batch_node"] += 1
    state["results"] = list(
        await asyncio.gather(
            ctx.tool("a", {"label": "first"}),
            ctx.tool("transfer", {"amount": CFG["amount"], "to": "acct-2"}),
            ctx.tool("c", {"label": "third"}),
        )
    )
    return end("batched")


async def _two_waits(state: dict[str, Any], ctx: Any) -> Any:
    CALLS["two_waits_node"] += 1
    state["approved"] = (await ctx.approve("first")).approved
    state["shipment"] = await ctx.signal("shipment")
    return end("both")


async def _budget(state: dict[str, Any], ctx: Any) -> Any:
    CALLS["budget_node"] += 1
    state["spend"] = await ctx.tool("spend", {"amount": 60})
    state["go"] = await ctx.signal("go")
    return end("spent")


async def _two_transfers(state: dict[str, Any], ctx: Any) -> Any:
    state["results"] = list(
        await asyncio.gather(
            ctx.tool("transfer", {"amount": 10, "to": "acct-a"}),
            ctx.tool("transfer", {"amount": 20, "to": "acct-b"}),
        )
    )
    return end("both")


async def _first(state: dict[str, Any], ctx: Any) -> Any:
    CALLS["first_node"] += 1
    await ctx.tool("prep")
    return goto("second")


async def _second(state: dict[str, Any], ctx: Any) -> Any:
    CALLS["second_node"] += 1
    state["approved"] = (await ctx.approve("second node asks")).approved
    return end("second")


async def _blocking(state: dict[str, Any], ctx: Any) -> Any:
    await ctx.tool("block")
    return end("unblocked")


FLOWS = {
    "approval": define_flow("approval", "approve", "ask", [action("ask", _ask)]),
    "shipment": define_flow("shipment", "signal", "wait", [action("wait", _wait_shipment)]),
    "address": define_flow("address", "typed signal", "wait", [action("wait", _wait_address)]),
    "pay": define_flow("pay", "approved tool", "pay", [action("pay", _pay)]),
    "guarded": define_flow("guarded", "policy tool", "g", [action("g", _guarded_node)]),
    "batch": define_flow("batch", "gather", "batch", [action("batch", _batch)]),
    "blocking": define_flow("blocking", "blocks", "b", [action("b", _blocking)]),
    "budget": define_flow("budget", "policy then wait", "b", [action("b", _budget)]),
    "two_transfers": define_flow("two_transfers", "two", "t", [action("t", _two_transfers)]),
    "two_nodes": define_flow(
        "two_nodes", "goto then wait", "first", [action("first", _first), action("second", _second)]
    ),
    "two_waits": define_flow("two_waits", "two waits", "w", [action("w", _two_waits)]),
}
AGENT = define_agent("pauser", "pause tests", None, TOOLS, list(FLOWS.values()))

# The waits of ``ctx.approve`` and ``ctx.signal``: flow, wait name, kind, a valid payload.
WAITS = {
    "approve": ("approval", APPROVAL, "approval", {"approved": True}),
    "signal": ("shipment", "shipment", "signal", {"tracking": "Z1"}),
}


# ---------------------------------------------------------------- helpers
@pytest.fixture
def runtime(open_store: Any) -> Runtime:
    return Runtime([AGENT], store=open_store())


async def start(
    runtime: Runtime, flow: str, session: str = SESSION
) -> tuple[str, TurnResult, list[StreamPart]]:
    handle = runtime.run(session, input="go", kind="flow", flow_name=flow)
    parts = [part async for part in handle]
    result = await handle.result()
    return await handle.run_id, result, parts


async def deliver(
    runtime: Runtime,
    run_id: str | None,
    signal_id: str,
    name: str,
    payload: Any = None,
    *,
    request_id: str | None = None,
    actor: str | None = None,
    session: str = SESSION,
) -> TurnResult:
    delivery = SignalDelivery(
        signal_id=signal_id, name=name, payload=payload, request_id=request_id, actor=actor
    )
    handle = runtime.run(session, run_id=run_id, signal_delivery=delivery)
    return await handle.result()


async def state_of(runtime: Runtime, run_id: str, session: str = SESSION) -> RunState:
    state = await runtime.get_run(run_id, session)
    assert state is not None, f"run {run_id} not found in {session}"
    return state


def fingerprint(state: RunState) -> tuple[Any, ...]:
    return (state.status, state.version, state.step_count, state.waiting_for)


async def assert_refused(
    runtime: Runtime,
    run_id: str,
    delivery: SignalDelivery,
    error: type[Exception],
    match: str | None = None,
    *,
    addressed_run_id: str | None = "same",
    session: str = SESSION,
) -> Exception:
    """The delivery raises ``error`` from result() and from the stream; the run is untouched."""
    before = await state_of(runtime, run_id)
    calls = Counter(CALLS)
    target = run_id if addressed_run_id == "same" else addressed_run_id
    handle = runtime.run(session, run_id=target, signal_delivery=delivery)
    with pytest.raises(error, match=match) as info:
        await handle.result()
    with pytest.raises(error):
        async for _ in handle:
            pass
    after = await state_of(runtime, run_id)
    assert fingerprint(after) == fingerprint(before), "a refused delivery wrote to the run"
    assert calls == CALLS, "a refused delivery executed something"
    return info.value


def steps_named(steps: list[StepRecord], name: str) -> list[StepRecord]:
    return [s for s in steps if s.name == name]


def assert_no_step_in(steps: list[StepRecord], *statuses: str) -> None:
    bad = [s for s in steps if s.status in statuses]
    assert not bad, f"steps left {statuses}: {bad}"


# ------------------------------------------------------------- 1. suspend
@pytest.mark.parametrize("wait", list(WAITS))
async def test_a_wait_suspends_the_run_cleanly_with_waiting_for_and_a_paused_part(
    runtime: Runtime, wait: str
) -> None:
    flow, name, kind, _ = WAITS[wait]
    run_id, result, parts = await start(runtime, flow)

    assert result.status == "paused"
    assert result.run_id == run_id
    waiting = result.waiting_for
    assert waiting is not None
    assert waiting.name == name
    assert waiting.kind == kind
    assert isinstance(waiting.request_id, str) and waiting.request_id
    assert waiting.operation is None
    if wait == "approve":
        assert waiting.title == "Ship order 42?"
        assert waiting.description == "a human decides"

    state = await state_of(runtime, run_id)
    assert state.status == "paused"
    assert state.waiting_for == waiting
    assert state.lease_holder is None, "a paused run must not keep its lease"

    types = [p.type for p in parts]
    assert "error" not in types
    assert "finished" not in types
    paused = [p for p in parts if p.type == "paused"]
    assert len(paused) == 1
    assert paused[0].waiting_for == waiting

    steps = await runtime.get_steps(run_id, SESSION)
    assert_no_step_in(steps, "error", "running")
    assert [s.name for s in steps] == ["prep"], "the wait itself is journaled only on delivery"


@pytest.mark.parametrize("wait", list(WAITS))
async def test_readdressing_a_paused_run_without_delivery_executes_nothing_and_keeps_request_id(
    runtime: Runtime, wait: str
) -> None:
    flow, _, _, _ = WAITS[wait]
    run_id, first, _ = await start(runtime, flow)
    assert first.waiting_for is not None
    before = await state_of(runtime, run_id)
    calls = Counter(CALLS)

    for _ in range(2):
        handle = runtime.run(SESSION, run_id=run_id)
        parts = [p async for p in handle]
        again = await handle.result()
        assert again.status == "paused"
        assert again.waiting_for is not None
        assert again.waiting_for.request_id == first.waiting_for.request_id
        assert again.waiting_for == first.waiting_for
        assert "error" not in [p.type for p in parts]

    assert calls == CALLS, "re-addressing a paused run re-executed its node"
    assert fingerprint(await state_of(runtime, run_id)) == fingerprint(before)


# ------------------------------------------------------- 2. valid delivery
async def test_approval_delivery_is_journaled_and_ctx_approve_returns_the_decision(
    runtime: Runtime,
) -> None:
    CFG["deadline"] = datetime.now(UTC) + timedelta(hours=1)  # not yet due
    run_id, paused, _ = await start(runtime, "approval")
    waiting = paused.waiting_for
    assert waiting is not None
    assert waiting.deadline == CFG["deadline"]
    payload = {"approved": True, "by": "alice", "reason": "looks fine", "ticket": "T-1"}

    handle = runtime.run(
        SESSION,
        run_id=run_id,
        signal_delivery=SignalDelivery(
            signal_id="sig-1",
            name=APPROVAL,
            payload=payload,
            request_id=waiting.request_id,
            actor="alice@ops",
        ),
    )
    parts = [p async for p in handle]
    result = await handle.result()

    assert result.status == "finished"
    assert result.waiting_for is None
    assert "error" not in [p.type for p in parts]
    assert [p.type for p in parts][-1] == "finished"
    state = await state_of(runtime, run_id)
    assert state.status == "finished"
    assert state.waiting_for is None
    assert state.outcome == "approved"
    assert state.state["decision_type"] == "ApprovalDecision"
    assert state.state["decision"] == {
        "approved": True,
        "by": "alice",
        "reason": "looks fine",
        "data": {"ticket": "T-1"},
    }
    steps = await runtime.get_steps(run_id, SESSION)
    approvals = [s for s in steps if s.kind == "approval"]
    assert len(approvals) == 1
    assert approvals[0].name == APPROVAL
    assert approvals[0].callsite == waiting.callsite
    assert approvals[0].status == "finished"
    assert approvals[0].result == payload
    assert_no_step_in(steps, "error", "running")
    assert CALLS["prep"] == 1, "the effect before the wait replayed, not re-executed"
    assert CALLS["ask_node"] == 2


async def test_a_denied_approval_reads_as_a_decision_with_approved_false(runtime: Runtime) -> None:
    run_id, _, _ = await start(runtime, "approval")
    result = await deliver(
        runtime, run_id, "no-1", APPROVAL, {"approved": False, "by": "bob", "reason": "no"}
    )
    assert result.status == "finished"
    state = await state_of(runtime, run_id)
    assert state.outcome == "declined"
    assert state.state["decision"] == {"approved": False, "by": "bob", "reason": "no", "data": {}}


async def test_signal_delivery_is_journaled_and_ctx_signal_returns_the_payload(
    runtime: Runtime,
) -> None:
    run_id, paused, _ = await start(runtime, "shipment")
    assert paused.waiting_for is not None
    payload = {"tracking": "Z1", "items": [1, 2, {"sku": "é"}]}

    result = await deliver(runtime, run_id, "ship-1", "shipment", payload, actor="carrier")

    assert result.status == "finished"
    state = await state_of(runtime, run_id)
    assert state.state["payload"] == payload
    assert state.waiting_for is None
    signal_steps = [s for s in await runtime.get_steps(run_id, SESSION) if s.kind == "signal"]
    assert len(signal_steps) == 1
    assert signal_steps[0].name == "shipment"
    assert signal_steps[0].callsite == paused.waiting_for.callsite
    assert signal_steps[0].status == "finished"
    assert signal_steps[0].result == payload
    assert CALLS["prep"] == 1


async def test_a_typed_signal_validates_its_payload_and_returns_the_model(
    runtime: Runtime,
) -> None:
    run_id, paused, _ = await start(runtime, "address")
    assert paused.waiting_for is not None and paused.waiting_for.name == "address"

    for i, bad in enumerate([{"street": "Main St"}, {"street": 1, "zip": "x"}, "Main St", None]):
        await assert_refused(
            runtime,
            run_id,
            SignalDelivery(signal_id=f"bad-{i}", name="address", payload=bad),
            InvalidSignalError,
        )

    result = await deliver(runtime, run_id, "good", "address", {"street": "Main St", "zip": "1"})
    assert result.status == "finished"
    state = await state_of(runtime, run_id)
    assert state.state["is_address"] is True
    assert state.state["address"] == {"street": "Main St", "zip": "1"}


async def test_a_typed_signal_whose_schema_is_defined_in_a_function_works_each_time_it_is_made(
    open_store: Any,
) -> None:
    """A schema class defined in a function (a test's, a factory's) is a new class
    each time the function runs, under one module path: each run waits on the
    class its flow was made with, and a second one is not refused as a
    duplicate."""

    def make_flow() -> Any:
        class Parcel(BaseModel):
            weight: int

        async def wait(state: dict[str, Any], ctx: Any) -> Any:
            parcel = await ctx.signal("parcel", schema=Parcel)
            assert isinstance(parcel, Parcel)
            return end(f"weighs {parcel.weight}")

        return define_flow("parcel", "typed signal", "wait", [action("wait", wait)])

    for weight in (1, 2):
        agent = define_agent("a", "i", None, [], [make_flow()])
        runtime = Runtime([agent], store=open_store())
        session = f"s-parcel-{weight}"
        paused = await runtime.run(session, kind="flow", flow_name="parcel").result()
        assert paused.status == "paused"
        done = await runtime.signal(paused.run_id, session, "parcel", {"weight": weight})
        assert (done.status, done.output) == ("finished", f"weighs {weight}")


async def test_a_delivery_reexecutes_the_active_node_not_the_flow_from_its_start(
    runtime: Runtime,
) -> None:
    run_id, paused, _ = await start(runtime, "two_nodes")
    assert paused.status == "paused"
    assert (await state_of(runtime, run_id)).active_node == "second"

    result = await deliver(runtime, run_id, "ok", APPROVAL, {"approved": True})

    assert result.status == "finished"
    assert (CALLS["first_node"], CALLS["prep"], CALLS["second_node"]) == (1, 1, 2)
    assert (await state_of(runtime, run_id)).state == {"approved": True}


# ---------------------------------------------------- 2. refusals, in order
@pytest.mark.parametrize("wait", list(WAITS))
async def test_a_duplicate_signal_id_is_a_noop_returning_the_current_state(
    runtime: Runtime, wait: str
) -> None:
    flow, name, _, payload = WAITS[wait]
    run_id, _, _ = await start(runtime, flow)
    first = await deliver(runtime, run_id, "sig-1", name, payload)
    assert first.status == "finished"
    before = await state_of(runtime, run_id)
    calls = Counter(CALLS)

    # The same id again, even with a wrong name or an invalid payload: check 1 comes first.
    retries = [(name, payload), ("some-other-name", payload), (name, {"approved": "maybe"})]
    for retry_name, retry_payload in retries:
        again = await deliver(runtime, run_id, "sig-1", retry_name, retry_payload)
        assert again.status == "finished"
        assert again.run_id == run_id
        assert again == first

    assert fingerprint(await state_of(runtime, run_id)) == fingerprint(before)
    assert calls == CALLS


async def test_a_retried_delivery_does_not_touch_the_runs_next_wait(runtime: Runtime) -> None:
    run_id, first_wait, _ = await start(runtime, "two_waits")
    assert first_wait.waiting_for is not None and first_wait.waiting_for.name == APPROVAL
    second = await deliver(runtime, run_id, "sig-1", APPROVAL, {"approved": True})
    assert second.status == "paused"
    assert second.waiting_for is not None and second.waiting_for.name == "shipment"
    before = await state_of(runtime, run_id)

    again = await deliver(runtime, run_id, "sig-1", APPROVAL, {"approved": True})

    assert again.status == "paused"
    assert again.waiting_for == second.waiting_for
    assert fingerprint(await state_of(runtime, run_id)) == fingerprint(before)
    assert CALLS["two_waits_node"] == 2
    done = await deliver(runtime, run_id, "sig-2", "shipment", {"n": 1})
    assert done.status == "finished"
    assert (await state_of(runtime, run_id)).state == {"approved": True, "shipment": {"n": 1}}


async def test_two_concurrent_identical_deliveries_exactly_one_wins(
    open_store: Any,
) -> None:
    rt1 = Runtime([AGENT], store=open_store())
    rt2 = Runtime([AGENT], store=open_store())

    # A reference run, delivered once: how far one delivery moves the version.
    ref_id, _, _ = await start(rt1, "pay")
    ref_before = (await state_of(rt1, ref_id)).version
    await deliver(rt1, ref_id, "ref", APPROVAL, {"approved": True})
    one_delivery = (await state_of(rt1, ref_id)).version - ref_before

    for round_no in range(3):
        CALLS.clear()
        run_id, _, _ = await start(rt1, "pay")
        version_before = (await state_of(rt1, run_id)).version
        delivery = SignalDelivery(
            signal_id=f"race-{round_no}", name=APPROVAL, payload={"approved": True}
        )
        h1 = rt1.run(SESSION, run_id=run_id, signal_delivery=delivery)
        h2 = rt2.run(SESSION, run_id=run_id, signal_delivery=delivery)
        results = await asyncio.gather(h1.result(), h2.result())

        statuses = sorted(r.status for r in results)
        assert "finished" in statuses, statuses
        assert set(statuses) <= {"running", "finished"}, statuses
        assert CALLS["transfer"] == 1, "the approved action ran more than once"
        state = await state_of(rt1, run_id)
        assert state.status == "finished"
        assert state.version - version_before == one_delivery, "the loser's write was stored"
        steps = await rt1.get_steps(run_id, SESSION)
        assert len([s for s in steps if s.kind == "approval"]) == 1
        assert len(steps_named(steps, "transfer")) == 1


async def test_two_concurrent_different_deliveries_store_exactly_one_decision(
    open_store: Any,
) -> None:
    rt1 = Runtime([AGENT], store=open_store())
    rt2 = Runtime([AGENT], store=open_store())
    for round_no in range(3):
        CALLS.clear()
        run_id, _, _ = await start(rt1, "pay")
        yes = SignalDelivery(signal_id=f"yes-{round_no}", name=APPROVAL, payload={"approved": True})
        no = SignalDelivery(signal_id=f"no-{round_no}", name=APPROVAL, payload={"approved": False})
        h1 = rt1.run(SESSION, run_id=run_id, signal_delivery=yes)
        h2 = rt2.run(SESSION, run_id=run_id, signal_delivery=no)
        outcomes = await asyncio.gather(h1.result(), h2.result(), return_exceptions=True)

        errors = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(errors) == 1, f"exactly one of two different deliveries must lose: {outcomes}"
        # The loser lost the save, found the winner's lease live (refused before
        # its delivery is looked at), or found the run no longer waiting.
        assert isinstance(errors[0], StaleWriteError | LeaseHeldError | SignalMismatchError), (
            errors[0]
        )
        state = await state_of(rt1, run_id)
        assert state.status == "finished"
        approvals = [s for s in await rt1.get_steps(run_id, SESSION) if s.kind == "approval"]
        assert len(approvals) == 1
        approved = approvals[0].result["approved"]
        assert state.outcome == ("paid" if approved else "denied")
        assert CALLS["transfer"] == (1 if approved else 0)


async def test_a_delivery_with_the_wrong_name_is_refused(runtime: Runtime) -> None:
    run_id, _, _ = await start(runtime, "shipment")
    error = await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id="x", name="invoice", payload={}),
        SignalMismatchError,
    )
    assert "shipment" in str(error)
    # ... and an approval to a run waiting on a plain signal.
    await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id="y", name=APPROVAL, payload={"approved": True}),
        SignalMismatchError,
    )
    # The refused signal_ids were not consumed: a proper delivery with one still works.
    assert (await deliver(runtime, run_id, "x", "shipment", {"ok": 1})).status == "finished"


async def test_a_delivery_with_the_wrong_request_id_is_refused(runtime: Runtime) -> None:
    run_id, paused, _ = await start(runtime, "approval")
    assert paused.waiting_for is not None
    await assert_refused(
        runtime,
        run_id,
        SignalDelivery(
            signal_id="x", name=APPROVAL, payload={"approved": True}, request_id="stale-request"
        ),
        SignalMismatchError,
        "request_id",
    )
    result = await deliver(
        runtime, run_id, "y", APPROVAL, {"approved": True}, request_id=paused.waiting_for.request_id
    )
    assert result.status == "finished"


async def test_a_new_signal_to_a_finished_run_is_refused(runtime: Runtime) -> None:
    run_id, _, _ = await start(runtime, "shipment")
    await deliver(runtime, run_id, "first", "shipment", {"n": 1})
    assert (await state_of(runtime, run_id)).status == "finished"
    await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id="second", name="shipment", payload={"n": 2}),
        SignalMismatchError,
    )


async def test_a_signal_to_a_run_another_worker_drives_is_refused_as_lease_held(
    open_store: Any,
) -> None:
    # The live lease is checked before what the call delivers: a held run is
    # not the caller's to address yet (README.md, "Leases and recovery").
    worker = Runtime([AGENT], store=open_store())
    other = Runtime([AGENT], store=open_store())
    CFG["gate"] = asyncio.Event()
    CFG["entered"] = asyncio.Event()
    handle = worker.run(SESSION, input="go", kind="flow", flow_name="blocking")
    run_id = await handle.run_id
    await asyncio.wait_for(CFG["entered"].wait(), timeout=10)
    try:
        assert (await state_of(other, run_id)).status == "running"
        await assert_refused(
            other,
            run_id,
            SignalDelivery(signal_id="early", name="anything", payload={"approved": True}),
            LeaseHeldError,
        )
    finally:
        CFG["gate"].set()
    assert (await handle.result()).status == "finished"


@pytest.mark.parametrize("deadline", ["elapsed-50ms", "past-datetime"])
@pytest.mark.parametrize("wait", list(WAITS))
async def test_a_delivery_after_the_deadline_is_refused_as_expired(
    runtime: Runtime, wait: str, deadline: str
) -> None:
    flow, name, _, payload = WAITS[wait]
    if deadline == "past-datetime":
        CFG["deadline"] = datetime(2020, 1, 1, tzinfo=UTC)
    else:
        CFG["deadline"] = datetime.now(UTC) + timedelta(milliseconds=50)
    run_id, paused, _ = await start(runtime, flow)
    assert paused.waiting_for is not None
    assert paused.waiting_for.deadline == CFG["deadline"]
    await asyncio.sleep(max(0.0, (CFG["deadline"] - datetime.now(UTC)).total_seconds()) + 0.02)

    await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id="late", name=name, payload=payload),
        SignalMismatchError,
        "expired before delivery",
    )
    assert (await state_of(runtime, run_id)).status == "paused"


async def test_refusal_order_name_and_request_id_before_deadline_before_payload(
    runtime: Runtime,
) -> None:
    CFG["deadline"] = datetime(2020, 1, 1, tzinfo=UTC)
    run_id, _, _ = await start(runtime, "approval")

    # 2 before 3: a wrong name to an expired wait is a name mismatch, not an expiry.
    e = await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id="a", name="shipment", payload={"approved": True}),
        SignalMismatchError,
    )
    assert "expired" not in str(e)
    # 2 before 3: a wrong request_id to an expired wait.
    e = await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id="b", name=APPROVAL, payload={"approved": True}, request_id="r"),
        SignalMismatchError,
        "request_id",
    )
    assert "expired" not in str(e)
    # 3 before 4: an invalid payload to an expired wait is refused as expired.
    await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id="c", name=APPROVAL, payload={"approved": "yes"}),
        SignalMismatchError,
        "expired before delivery",
    )


async def test_refusal_order_name_before_payload(runtime: Runtime) -> None:
    run_id, _, _ = await start(runtime, "approval")
    await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id="a", name="shipment", payload="not an approval"),
        SignalMismatchError,
    )


async def test_invalid_approval_payloads_are_refused(runtime: Runtime) -> None:
    run_id, _, _ = await start(runtime, "approval")
    bad_payloads = [
        None,
        "yes",
        True,
        [{"approved": True}],
        {},
        {"approved": "yes"},
        {"approved": 1},
        {"by": "alice"},
        {"approved": True, "by": 5},
        {"approved": True, "reason": ["no"]},
    ]
    for i, bad in enumerate(bad_payloads):
        e = await assert_refused(
            runtime,
            run_id,
            SignalDelivery(signal_id=f"bad-{i}", name=APPROVAL, payload=bad),
            InvalidSignalError,
        )
        assert "approv" in str(e)
    assert (await deliver(runtime, run_id, "good", APPROVAL, {"approved": True})).status == (
        "finished"
    )


@pytest.mark.parametrize("signal_id", ["", "   "])
async def test_an_empty_signal_id_is_refused(runtime: Runtime, signal_id: str) -> None:
    run_id, _, _ = await start(runtime, "approval")
    await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id=signal_id, name=APPROVAL, payload={"approved": True}),
        InvalidSignalError,
        "signal_id",
    )


async def test_a_payload_over_the_size_bound_is_refused(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id, _, _ = await start(runtime, "shipment")
    monkeypatch.setenv("KURALLE_MAX_PAYLOAD_BYTES", "256")
    await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id="big", name="shipment", payload={"blob": "x" * 1000}),
        InvalidSignalError,
    )
    result = await deliver(runtime, run_id, "small", "shipment", {"blob": "x" * 10})
    assert result.status == "finished"
    monkeypatch.delenv("KURALLE_MAX_PAYLOAD_BYTES")


@pytest.mark.parametrize(
    "payload",
    [
        {"approved": True, "tags": {"a", "b"}},
        {"approved": True, "ratio": float("nan")},
        {"approved": True, "when": object()},
    ],
    ids=["set", "nan", "object"],
)
async def test_a_non_json_payload_is_refused(runtime: Runtime, payload: Any) -> None:
    run_id, _, _ = await start(runtime, "approval")
    await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id="odd", name=APPROVAL, payload=payload),
        InvalidSignalError,
    )


# -------------------------------------------------------------- addressing
async def test_a_delivery_without_run_id_finds_the_sessions_waiting_run(
    runtime: Runtime,
) -> None:
    approval_id, _, _ = await start(runtime, "approval")
    shipment_id, _, _ = await start(runtime, "shipment")
    approval_before = await state_of(runtime, approval_id)

    result = await deliver(runtime, None, "ship-1", "shipment", {"tracking": "Z9"})

    assert result.run_id == shipment_id
    assert result.status == "finished"
    assert (await state_of(runtime, shipment_id)).state["payload"] == {"tracking": "Z9"}
    assert fingerprint(await state_of(runtime, approval_id)) == fingerprint(approval_before)
    # A retry of that delivery, still without run_id, is a no-op.
    again = await deliver(runtime, None, "ship-1", "shipment", {"tracking": "Z9"})
    assert again.run_id == shipment_id
    assert again.status == "finished"
    assert CALLS["signal_node"] == 2


async def test_a_delivery_without_run_id_matching_two_runs_asks_for_run_id(
    runtime: Runtime,
) -> None:
    first, _, _ = await start(runtime, "shipment")
    second, _, _ = await start(runtime, "shipment")
    before = [await state_of(runtime, r) for r in (first, second)]

    handle = runtime.run(
        SESSION, signal_delivery=SignalDelivery(signal_id="s", name="shipment", payload={})
    )
    with pytest.raises(SignalMismatchError, match="run_id"):
        await handle.result()

    after = [await state_of(runtime, r) for r in (first, second)]
    assert [fingerprint(s) for s in after] == [fingerprint(s) for s in before]
    assert (await deliver(runtime, second, "s", "shipment", {})).status == "finished"
    assert (await state_of(runtime, first)).status == "paused"


async def test_a_delivery_to_a_run_of_another_session_is_run_not_found(
    runtime: Runtime,
) -> None:
    run_id, _, _ = await start(runtime, "approval", session="someone-else")
    before = await state_of(runtime, run_id, "someone-else")
    assert await runtime.get_run(run_id, SESSION) is None

    handle = runtime.run(
        SESSION,
        run_id=run_id,
        signal_delivery=SignalDelivery(signal_id="s", name=APPROVAL, payload={"approved": True}),
    )
    with pytest.raises(RunNotFoundError):
        await handle.result()
    with pytest.raises(RunNotFoundError):
        await handle.run_id

    after = await state_of(runtime, run_id, "someone-else")
    assert fingerprint(after) == fingerprint(before)
    assert CALLS["ask_node"] == 1


# ------------------------------------------------------ 3. tool approvals
async def test_an_approval_tool_pauses_before_execute_showing_the_operation(
    runtime: Runtime,
) -> None:
    run_id, result, parts = await start(runtime, "pay")

    assert result.status == "paused"
    waiting = result.waiting_for
    assert waiting is not None
    assert waiting.name == APPROVAL
    assert waiting.kind == "approval"
    assert waiting.operation is not None
    assert waiting.operation.tool_name == "transfer"
    assert waiting.operation.args == {"amount": 100, "to": "acct-1"}
    assert len(waiting.operation.args_hash) == 64
    assert set(waiting.operation.args_hash) <= set("0123456789abcdef")
    assert CALLS["transfer"] == 0
    assert "tool-call" not in [p.type for p in parts]
    steps = await runtime.get_steps(run_id, SESSION)
    assert steps_named(steps, "transfer") == [], "nothing of the tool is journaled before approval"
    assert_no_step_in(steps, "error", "running")


async def test_an_approved_tool_executes_once_with_the_frozen_args(runtime: Runtime) -> None:
    run_id, paused, _ = await start(runtime, "pay")
    assert paused.waiting_for is not None and paused.waiting_for.operation is not None
    frozen = paused.waiting_for.operation.args
    CFG["amount"] = 999  # the node now computes other args

    result = await deliver(runtime, run_id, "ok-1", APPROVAL, {"approved": True, "by": "alice"})

    assert result.status == "finished"
    assert CALLS["transfer"] == 1
    assert TRANSFERS[0]["args"] == frozen == {"amount": 100, "to": "acct-1"}
    state = await state_of(runtime, run_id)
    assert state.outcome == "paid"
    assert state.state["receipt"] == {"transferred": 100, "to": "acct-1"}
    steps = await runtime.get_steps(run_id, SESSION)
    (tool_step,) = steps_named(steps, "transfer")
    assert tool_step.kind == "tool"
    assert tool_step.status == "finished"
    flow = FLOWS["pay"]
    logical = f"{run_id}#0#{flow.name}@{flow.digest}"
    expected_key = idempotency_key(logical, 0, {"name": "transfer", "args": frozen})
    assert tool_step.key == TRANSFERS[0]["key"] == expected_key
    assert_no_step_in(steps, "error", "running")

    # Re-addressing the finished run executes nothing.
    assert (await runtime.run(SESSION, run_id=run_id).result()).status == "finished"
    assert CALLS["transfer"] == 1


async def test_a_denied_tool_raises_tool_approval_denied_in_the_node_and_never_executes(
    runtime: Runtime,
) -> None:
    run_id, _, _ = await start(runtime, "pay")
    handle = runtime.run(
        SESSION,
        run_id=run_id,
        signal_delivery=SignalDelivery(
            signal_id="no-1",
            name=APPROVAL,
            payload={"approved": False, "by": "bob", "reason": "too much"},
        ),
    )
    parts = [p async for p in handle]
    result = await handle.result()

    assert result.status == "finished"
    assert "error" not in [p.type for p in parts]
    state = await state_of(runtime, run_id)
    assert state.outcome == "denied"
    assert state.state["denied"] == {
        "tool_name": "transfer",
        "denied_by": "bob",
        "reason": "too much",
    }
    assert CALLS["transfer"] == 0
    steps = await runtime.get_steps(run_id, SESSION)
    assert steps_named(steps, "transfer") == []
    # Re-addressing does not execute it either.
    await runtime.run(SESSION, run_id=run_id).result()
    assert CALLS["transfer"] == 0


async def test_policy_allow_executes_without_pausing(runtime: Runtime) -> None:
    CFG["amount"] = 5
    run_id, result, parts = await start(runtime, "guarded")
    assert result.status == "finished"
    assert "paused" not in [p.type for p in parts]
    assert CALLS["guarded"] == 1
    steps = await runtime.get_steps(run_id, SESSION)
    assert [s.kind for s in steps] == ["tool"]


async def test_policy_ask_pauses_and_executes_once_on_approval(runtime: Runtime) -> None:
    CFG["amount"] = 500
    run_id, result, _ = await start(runtime, "guarded")
    assert result.status == "paused"
    assert result.waiting_for is not None and result.waiting_for.operation is not None
    assert result.waiting_for.operation.tool_name == "guarded"
    assert result.waiting_for.operation.args == {"amount": 500}
    assert CALLS["guarded"] == 0
    assert (await deliver(runtime, run_id, "ok", APPROVAL, {"approved": True})).status == (
        "finished"
    )
    assert CALLS["guarded"] == 1


async def test_policy_deny_denies_without_pausing(runtime: Runtime) -> None:
    CFG["amount"] = 5000
    handle = runtime.run(SESSION, input="go", kind="flow", flow_name="guarded")
    parts: list[StreamPart] = []
    with pytest.raises(ToolApprovalDeniedError) as info:
        async for part in handle:
            parts.append(part)
    assert info.value.tool_name == "guarded"
    assert info.value.denied_by == "policy"
    assert "paused" not in [p.type for p in parts]
    assert CALLS["guarded"] == 0
    run_id = await handle.run_id
    state = await state_of(runtime, run_id)
    assert state.status == "error"
    assert state.waiting_for is None
    assert state.error is not None and state.error.type == "ToolApprovalDeniedError"
    assert steps_named(await runtime.get_steps(run_id, SESSION), "guarded") == []


async def test_a_policy_allowed_tool_replays_its_result_even_if_the_policy_now_denies(
    runtime: Runtime,
) -> None:
    """The policy decided when the call was made; a replay must not ask it again.

    Here the policy reads a budget that the tool's own execution used up: on
    the node's re-execution after the signal, it would now answer "deny".
    """
    run_id, paused, _ = await start(runtime, "budget")
    assert paused.status == "paused"
    assert paused.waiting_for is not None and paused.waiting_for.name == "go"
    assert CALLS["spend"] == 1

    result = await deliver(runtime, run_id, "go-1", "go", {"ok": True})

    assert result.status == "finished", (await state_of(runtime, run_id)).error
    state = await state_of(runtime, run_id)
    assert state.state["spend"] == {"spent": 60}
    assert state.state["go"] == {"ok": True}
    assert CALLS["spend"] == 1
    assert CALLS["budget_node"] == 2


async def test_two_approvals_in_one_batch_are_asked_in_turn_and_each_executes_once(
    runtime: Runtime,
) -> None:
    run_id, first, _ = await start(runtime, "two_transfers")
    assert first.waiting_for is not None and first.waiting_for.operation is not None
    assert first.waiting_for.operation.args == {"amount": 10, "to": "acct-a"}

    second = await deliver(runtime, run_id, "ok-a", APPROVAL, {"approved": True})

    assert second.status == "paused"
    assert second.waiting_for is not None and second.waiting_for.operation is not None
    assert second.waiting_for.operation.args == {"amount": 20, "to": "acct-b"}
    assert second.waiting_for.request_id != first.waiting_for.request_id
    assert [t["args"]["amount"] for t in TRANSFERS] == [10]

    done = await deliver(runtime, run_id, "ok-b", APPROVAL, {"approved": True})

    assert done.status == "finished"
    assert [t["args"]["amount"] for t in TRANSFERS] == [10, 20]
    assert (await state_of(runtime, run_id)).state["results"] == [
        {"transferred": 10, "to": "acct-a"},
        {"transferred": 20, "to": "acct-b"},
    ]


# --------------------------------------------------- 4. suspend in a batch
async def test_a_suspend_inside_a_gather_batch_lets_the_others_settle(runtime: Runtime) -> None:
    run_id, result, parts = await start(runtime, "batch")

    assert result.status == "paused"
    assert result.waiting_for is not None and result.waiting_for.operation is not None
    assert result.waiting_for.operation.tool_name == "transfer"
    assert "error" not in [p.type for p in parts]
    steps = await runtime.get_steps(run_id, SESSION)
    assert_no_step_in(steps, "running", "error")
    assert sorted(s.name for s in steps if s.kind == "tool") == ["a", "c"]
    assert (CALLS["a"], CALLS["transfer"], CALLS["c"]) == (1, 0, 1)

    done = await deliver(runtime, run_id, "ok", APPROVAL, {"approved": True})

    assert done.status == "finished"
    state = await state_of(runtime, run_id)
    assert state.state["results"] == [
        {"tool": "a", "label": "first"},
        {"transferred": 100, "to": "acct-2"},
        {"tool": "c", "label": "third"},
    ]
    assert (CALLS["a"], CALLS["transfer"], CALLS["c"]) == (1, 1, 1), "something re-executed"
    steps = await runtime.get_steps(run_id, SESSION)
    assert_no_step_in(steps, "running", "error")
    assert sorted(s.name for s in steps if s.kind == "tool") == ["a", "c", "transfer"]
    assert len({s.callsite for s in steps if s.kind == "tool"}) == 3


# ---------------------------------------------------------- 5. in doubt
def _shared_db(open_store: Any) -> tuple[str, str]:
    if open_store.backend == "memory":
        pytest.skip(
            "in-doubt needs a crashed process: the memory store is not shared across processes"
        )
    return open_store.backend, open_store.target


async def _crash_in_tool(open_store: Any, tmp_path: Path, flow: str) -> tuple[Runtime, str, Path]:
    """A child runs ``flow``; its tool SIGKILLs the child after the intent is journaled."""
    backend, target = _shared_db(open_store)
    ledger = tmp_path / "ledger.jsonl"
    runtime = Runtime([procs_flows.make_agent(ledger)], store=open_store())
    code, report = run_child(
        "flows", backend, target, ledger, SESSION, "start", flow, env={"KT_DIE_AT": "tool"}
    )
    assert code == KILLED
    assert report is not None and "opened" in report
    run_id = str(report["opened"])
    state = await state_of(runtime, run_id)
    assert state.status == "running"
    steps = await runtime.get_steps(run_id, SESSION)
    assert [s.status for s in steps] == ["running"], "the crash must leave the intent only"
    assert [e["phase"] for e in procs_flows.read_ledger(ledger)] == ["attempt"]
    await wait_lease_expired(runtime, run_id, SESSION)
    return runtime, run_id, ledger


async def _pause_in_doubt(open_store: Any, tmp_path: Path) -> tuple[Runtime, str, Path, TurnResult]:
    runtime, run_id, ledger = await _crash_in_tool(
        open_store, tmp_path, procs_flows.IN_DOUBT_ASK_FLOW
    )
    handle = runtime.run(SESSION, run_id=run_id)
    parts = [p async for p in handle]
    result = await handle.result()
    assert result.status == "paused"
    assert "error" not in [p.type for p in parts]
    assert "tool-call" not in [p.type for p in parts]
    waiting = result.waiting_for
    assert waiting is not None
    assert waiting.name == "__in_doubt"
    assert waiting.operation is not None
    assert waiting.operation.tool_name == "pay_ask"
    assert waiting.operation.args == {"amount": 5}
    assert len(procs_flows.read_ledger(ledger)) == 1, "an in-doubt step executed without asking"
    state = await state_of(runtime, run_id)
    assert state.status == "paused"
    assert state.waiting_for == waiting
    return runtime, run_id, ledger, result


async def test_in_doubt_ask_pauses_without_executing_then_retry_executes_with_the_same_key(
    open_store: Any, tmp_path: Path
) -> None:
    runtime, run_id, ledger, paused = await _pause_in_doubt(open_store, tmp_path)
    assert paused.waiting_for is not None
    # Re-addressing again keeps the same request and still executes nothing.
    again = await runtime.run(SESSION, run_id=run_id).result()
    assert again.waiting_for is not None
    assert again.waiting_for.request_id == paused.waiting_for.request_id
    assert len(procs_flows.read_ledger(ledger)) == 1
    # A malformed answer is refused.
    await assert_refused(
        runtime,
        run_id,
        SignalDelivery(signal_id="bad", name="__in_doubt", payload={"action": "maybe"}),
        InvalidSignalError,
    )

    result = await deliver(runtime, run_id, "retry-1", "__in_doubt", {"action": "retry"})

    assert result.status == "finished"
    entries = procs_flows.read_ledger(ledger)
    assert [e["phase"] for e in entries] == ["attempt", "attempt", "done"]
    (step,) = await runtime.get_steps(run_id, SESSION)
    assert step.status == "finished"
    assert {e["key"] for e in entries} == {step.key}, "the retry changed the idempotency key"
    assert (await state_of(runtime, run_id)).state["receipt"] == {"charged": True, "amount": 5}


async def test_in_doubt_resolve_records_the_given_result_without_executing(
    open_store: Any, tmp_path: Path
) -> None:
    runtime, run_id, ledger, _ = await _pause_in_doubt(open_store, tmp_path)
    resolved = {"charged": True, "amount": 5, "by": "ops"}

    result = await deliver(
        runtime, run_id, "res-1", "__in_doubt", {"action": "resolve", "result": resolved}
    )

    assert result.status == "finished"
    assert len(procs_flows.read_ledger(ledger)) == 1, "resolve executed the tool"
    state = await state_of(runtime, run_id)
    assert state.outcome == "charged"
    assert state.state["receipt"] == resolved
    (step,) = await runtime.get_steps(run_id, SESSION)
    assert step.status == "finished"
    assert step.result == resolved


async def test_in_doubt_fail_makes_the_node_see_tool_execution_error(
    open_store: Any, tmp_path: Path
) -> None:
    runtime, run_id, ledger, _ = await _pause_in_doubt(open_store, tmp_path)

    result = await deliver(
        runtime, run_id, "fail-1", "__in_doubt", {"action": "fail", "message": "gateway says no"}
    )

    assert result.status == "finished"
    assert len(procs_flows.read_ledger(ledger)) == 1, "fail executed the tool"
    state = await state_of(runtime, run_id)
    assert state.outcome == "failed"
    failed = state.state["failed"]
    assert failed["type"] == "ToolExecutionError"
    assert failed["tool_name"] == "pay_ask"
    assert "gateway says no" in failed["message"]
    (step,) = await runtime.get_steps(run_id, SESSION)
    assert step.status == "error"


async def test_in_doubt_default_retry_executes_again_with_the_same_key_without_pausing(
    open_store: Any, tmp_path: Path
) -> None:
    runtime, run_id, ledger = await _crash_in_tool(
        open_store, tmp_path, procs_flows.IN_DOUBT_RETRY_FLOW
    )
    handle = runtime.run(SESSION, run_id=run_id)
    parts = [p async for p in handle]
    result = await handle.result()

    assert result.status == "finished"
    assert "paused" not in [p.type for p in parts]
    entries = procs_flows.read_ledger(ledger)
    assert [e["phase"] for e in entries] == ["attempt", "attempt", "done"]
    (step,) = await runtime.get_steps(run_id, SESSION)
    assert step.status == "finished"
    assert {e["key"] for e in entries} == {step.key}


async def test_in_doubt_ask_asks_again_when_the_retried_execution_also_crashes(
    open_store: Any, tmp_path: Path
) -> None:
    """A "retry" answer covers one execution: if that one dies too, nobody knows again."""
    runtime, run_id, ledger, _ = await _pause_in_doubt(open_store, tmp_path)
    backend, target = _shared_db(open_store)

    code, _ = run_child(
        "flows",
        backend,
        target,
        ledger,
        SESSION,
        "deliver",
        run_id,
        "retry-1",
        "__in_doubt",
        '{"action": "retry"}',
        env={"KT_DIE_AT": "tool"},
    )

    assert code == KILLED
    assert [e["phase"] for e in procs_flows.read_ledger(ledger)] == ["attempt", "attempt"]
    await wait_lease_expired(runtime, run_id, SESSION)
    handle = runtime.run(SESSION, run_id=run_id)
    parts = [p async for p in handle]
    result = await handle.result()

    assert result.status == "paused", "the second crash's step was re-executed without asking"
    assert result.waiting_for is not None and result.waiting_for.name == "__in_doubt"
    assert "tool-call" not in [p.type for p in parts]
    assert len(procs_flows.read_ledger(ledger)) == 2
