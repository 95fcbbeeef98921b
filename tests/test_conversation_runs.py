"""Conversation runs and run addressing (docs/concepts.md: keys; docs/contract.md:
turns): one conversation run per session, a new epoch per user turn,
``kind="flow"`` minting runs, ``run_id`` winning over ``kind``, fail-closed
addressing, inbound idempotency keys and streaming.
"""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

import pytest
from pydantic import BaseModel

from kuralle_es import (
    ModelRequest,
    ModelResponse,
    RunNotFoundError,
    RunStore,
    Runtime,
    SignalDelivery,
    ToolCall,
    ToolCallRequest,
    action,
    collect,
    define_agent,
    define_flow,
    define_tool,
    end,
    idempotency_key,
)
from kuralle_es.testing import ScriptedModel

SESSION = "s-conv"
PINGS: list[ToolCall] = []
REFUNDS: list[ToolCall] = []
GATE: dict[str, asyncio.Event] = {}


@pytest.fixture(autouse=True)
def _reset() -> None:
    PINGS.clear()
    REFUNDS.clear()
    GATE.clear()


class PingArgs(BaseModel):
    n: int


class RefundArgs(BaseModel):
    amount_cents: int


class Name(BaseModel):
    name: str | None = None


def ping(args: PingArgs, call: ToolCall) -> dict[str, int]:
    PINGS.append(call)
    return {"pong": args.n}


def refund(args: RefundArgs, call: ToolCall) -> dict[str, int]:
    REFUNDS.append(call)
    return {"refunded": args.amount_cents}


PING = define_tool("ping", "Ping the server", PingArgs, ping)
REFUND = define_tool("refund", "Refund", RefundArgs, refund, needs_approval=True)


async def gated(state: dict[str, Any], ctx: Any) -> Any:
    await asyncio.wait_for(GATE["open"].wait(), 10)
    return end("opened")


GATED = define_flow("gated", "waits for the test", "wait", [action("wait", gated)])
INTAKE = define_flow(
    "intake",
    "asks for a name",
    "name",
    [collect("name", Name, ["name"], ask=lambda m: "Your name?", on_complete=lambda d: end("ok"))],
)


def pinging(request: ModelRequest) -> ModelResponse | str:
    """Every user turn: ping once (a fresh call id each time), then reply."""
    last = request.messages[-1]
    if request.purpose == "extract":
        said = " ".join(m.content or "" for m in request.messages if m.role == "user")
        return ModelResponse(data={"name": said.split("name=")[1]} if "name=" in said else {})
    if last.role == "user":
        turn = sum(1 for m in request.messages if m.role == "user")
        return ModelResponse(tool_calls=[ToolCallRequest(f"ping-{turn}", "ping", {"n": 1})])
    return f"pong after {sum(1 for m in request.messages if m.role == 'user')} turn(s)"


def runtime_for(store: RunStore, model: Any = None, tools: Any = (PING,)) -> Runtime:
    agent = define_agent(
        "main", "Ping when asked.", model or ScriptedModel(pinging), list(tools), [GATED, INTAKE]
    )
    return Runtime([agent], store=store)


def ping_key(run_id: str, epoch: int, callsite: int = 1) -> str:
    return idempotency_key(f"{run_id}#{epoch}", callsite, {"name": "ping", "args": {"n": 1}})


# ---------------------------------------------------------- conversation
async def test_plain_calls_run_the_sessions_one_conversation_run(open_store: Any) -> None:
    runtime = runtime_for(open_store())
    first = await runtime.run(SESSION, input="ping").result()
    second = await runtime.run(SESSION, input="ping again").result()
    other = await runtime.run("another-session", input="ping").result()

    assert first.run_id == second.run_id
    assert other.run_id != first.run_id
    assert first.output == "pong after 1 turn(s)"
    assert second.output == "pong after 2 turn(s)"
    state = await runtime.get_run(first.run_id, SESSION)
    assert state is not None
    assert state.kind == "conversation"
    assert state.status == "finished"
    assert [m.content for m in state.messages if m.role == "user"] == ["ping", "ping again"]
    assert runtime.store.session_run_ids(SESSION) == [first.run_id]


async def test_each_user_turn_is_a_new_epoch_so_ping_runs_once_per_turn_with_its_own_key(
    open_store: Any,
) -> None:
    runtime = runtime_for(open_store())
    results = [await runtime.run(SESSION, input=f"ping {i}").result() for i in range(3)]
    run_id = results[0].run_id

    assert len(PINGS) == 3
    keys = [call.idempotency_key for call in PINGS]
    assert len(set(keys)) == 3
    assert keys == [ping_key(run_id, epoch) for epoch in range(3)]
    assert all(call.run_id == run_id and call.session_id == SESSION for call in PINGS)
    steps = await runtime.get_steps(run_id, SESSION)
    assert [s.key for s in steps if s.kind == "tool"] == keys


async def test_a_model_reusing_a_tool_call_id_in_a_later_turn_still_runs_the_tool(
    open_store: Any,
) -> None:
    """Call ids are the model's, not unique across turns (a scripted model
    naturally says "c1" every turn): each user turn's ping must still run."""

    def same_id(request: ModelRequest) -> ModelResponse | str:
        if request.messages[-1].role == "user":
            return ModelResponse(tool_calls=[ToolCallRequest("c1", "ping", {"n": 1})])
        return "pong"

    model = ScriptedModel(same_id)
    runtime = runtime_for(open_store(), model)
    first = await runtime.run(SESSION, input="ping").result()
    second = await runtime.run(SESSION, input="ping").result()

    assert first.output == second.output == "pong"
    assert len(PINGS) == 2
    assert [c.idempotency_key for c in PINGS] == [ping_key(first.run_id, e) for e in (0, 1)]
    last_request = model.requests[-1]
    assert last_request.messages[-1].role == "tool"
    assert last_request.messages[-1].tool_call_id == "c1"


async def test_a_signal_resume_stays_in_the_user_turns_epoch(open_store: Any) -> None:
    model = ScriptedModel(
        [
            ModelResponse(tool_calls=[ToolCallRequest("p", "ping", {"n": 1})]),
            ModelResponse(tool_calls=[ToolCallRequest("r", "refund", {"amount_cents": 300})]),
            "refunded",
        ]
    )
    runtime = runtime_for(open_store(), model, tools=(PING, REFUND))
    paused = await runtime.run(SESSION, input="ping then refund").result()
    assert paused.status == "paused"

    fresh = runtime_for(open_store(), model, tools=(PING, REFUND))
    approval = SignalDelivery(signal_id="y", name="__approval", payload={"approved": True})
    done = await fresh.run(SESSION, run_id=paused.run_id, signal_delivery=approval).result()

    assert done.status == "finished"
    assert done.output == "refunded"
    assert len(PINGS) == 1  # the ping before the pause was replayed, not re-run
    assert len(REFUNDS) == 1
    assert len(model.requests) == 3
    # model@0, ping@1, model@2, refund@3: all in the user turn's epoch 0.
    expected = idempotency_key(
        f"{paused.run_id}#0", 3, {"name": "refund", "args": {"amount_cents": 300}}
    )
    assert REFUNDS[0].idempotency_key == expected


# ------------------------------------------------------------- flow runs
async def test_kind_flow_mints_a_new_run_whose_id_resolves_before_the_result(
    open_store: Any,
) -> None:
    runtime = runtime_for(open_store())
    conversation = await runtime.run(SESSION, input="ping").result()

    GATE["open"] = asyncio.Event()
    handle = runtime.run(SESSION, input="go", kind="flow", flow_name="gated")
    run_id = await asyncio.wait_for(handle.run_id, 10)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(handle.result()), 0.1)
    in_flight = await runtime.get_run(run_id, SESSION)
    assert in_flight is not None
    assert in_flight.kind == "flow"
    assert in_flight.status == "running"
    assert in_flight.lease_holder == runtime.holder
    GATE["open"].set()
    result = await handle.result()

    assert result.run_id == run_id
    assert result.status == "finished"
    second = await runtime.run(SESSION, input="go", kind="flow", flow_name="gated").result()
    assert len({conversation.run_id, run_id, second.run_id}) == 3
    assert set(runtime.store.session_run_ids(SESSION)) == {
        conversation.run_id,
        run_id,
        second.run_id,
    }


async def test_run_id_wins_over_kind_and_flow_name(open_store: Any) -> None:
    runtime = runtime_for(open_store())
    conversation = await runtime.run(SESSION, input="ping").result()
    flow_run = await runtime.run(SESSION, input="hi", kind="flow", flow_name="intake").result()
    assert flow_run.status == "paused"
    runs_before = runtime.store.session_run_ids(SESSION)

    GATE["open"] = asyncio.Event()
    GATE["open"].set()
    again = await runtime.run(
        SESSION, run_id=conversation.run_id, input="ping", kind="flow", flow_name="gated"
    ).result()
    assert again.run_id == conversation.run_id
    assert again.output == "pong after 2 turn(s)"

    resumed = await runtime.run(
        SESSION, run_id=flow_run.run_id, input="name=Ann", kind="flow", flow_name="gated"
    ).result()
    assert resumed.run_id == flow_run.run_id
    assert resumed.status == "finished"
    state = await runtime.get_run(flow_run.run_id, SESSION)
    assert state is not None
    assert state.outcome == "ok"
    assert state.state["name"] == "Ann"
    assert runtime.store.session_run_ids(SESSION) == runs_before


# ------------------------------------------------------------ addressing
@pytest.mark.parametrize("run_id", [str(uuid4()), "not-a-uuid", ""])
async def test_an_unknown_run_id_is_run_not_found_and_creates_nothing(
    open_store: Any, run_id: str
) -> None:
    model = ScriptedModel(pinging)
    runtime = runtime_for(open_store(), model)
    handle = runtime.run(SESSION, run_id=run_id, input="ping")
    with pytest.raises(RunNotFoundError) as caught:
        await handle.result()
    assert caught.value.run_id == run_id
    with pytest.raises(RunNotFoundError):
        await handle.run_id
    assert runtime.store.session_run_ids(SESSION) == []
    assert model.requests == []
    assert PINGS == []


async def test_another_sessions_run_id_is_run_not_found_and_nothing_is_written(
    open_store: Any,
) -> None:
    model = ScriptedModel(pinging)
    runtime = runtime_for(open_store(), model)
    owned = await runtime.run("owner", input="ping").result()
    paused = await runtime.run("owner", input="hi", kind="flow", flow_name="intake").result()
    before = {rid: await runtime.get_run(rid, "owner") for rid in (owned.run_id, paused.run_id)}
    asked = len(model.requests)

    attempts = [
        runtime.run("intruder", run_id=owned.run_id, input="ping"),
        runtime.run("intruder", run_id=paused.run_id, input="name=Eve"),
        runtime.run("intruder", run_id=paused.run_id),
        runtime.run(
            "intruder",
            run_id=paused.run_id,
            signal_delivery=SignalDelivery(signal_id="x", name="__input", payload="name=Eve"),
        ),
    ]
    for handle in attempts:
        with pytest.raises(RunNotFoundError) as caught:
            await handle.result()
        assert caught.value.session_id == "intruder"

    assert runtime.store.session_run_ids("intruder") == []
    assert await runtime.get_run(owned.run_id, "intruder") is None
    assert await runtime.get_steps(owned.run_id, "intruder") == []
    for rid, state in before.items():
        now = await runtime.get_run(rid, "owner")
        assert now is not None
        assert state is not None
        assert now.version == state.version
    assert len(model.requests) == asked
    assert len(PINGS) == 1


# ---------------------------------------------------- inbound idempotency
async def test_an_inbound_idempotency_key_seen_before_returns_the_earlier_result(
    open_store: Any,
) -> None:
    model = ScriptedModel(pinging)
    runtime = runtime_for(open_store(), model)
    first = await runtime.run(SESSION, input="ping", idempotency_key="hook-1").result()
    assert first.status == "finished"
    assert len(PINGS) == 1
    asked = len(model.requests)
    earlier = await runtime.get_run(first.run_id, SESSION)
    assert earlier is not None

    retry = await runtime.run(SESSION, input="ping", idempotency_key="hook-1").result()

    assert retry == first
    assert len(PINGS) == 1
    assert len(model.requests) == asked
    state = await runtime.get_run(first.run_id, SESSION)
    assert state is not None
    assert state.version == earlier.version
    assert [m.content for m in state.messages if m.role == "user"] == ["ping"]

    fresh = runtime_for(open_store(), model)
    from_elsewhere = await fresh.run(SESSION, input="ping", idempotency_key="hook-1").result()
    assert from_elsewhere == first
    assert len(PINGS) == 1

    new_key = await runtime.run(SESSION, input="ping", idempotency_key="hook-2").result()
    assert new_key.output == "pong after 2 turn(s)"
    assert len(PINGS) == 2


# ------------------------------------------------------------- streaming
async def test_streaming_a_turn_yields_tool_and_text_parts_then_finished() -> None:
    runtime = runtime_for(RunStore.memory())
    handle = runtime.run(SESSION, input="ping")
    streamed = [part async for part in handle]
    deltas = [p.delta for p in streamed if p.type == "text-delta"]
    parts = [p for p in streamed if p.type != "text-delta"]

    assert [p.type for p in parts] == ["tool-call", "tool-result", "text", "finished"]
    assert "".join(d or "" for d in deltas) == "pong after 1 turn(s)"
    assert [p.offset for p in streamed] == list(range(1, len(streamed) + 1))
    assert parts[0].tool_name == "ping"
    assert parts[0].args == {"n": 1}
    assert parts[1].result == {"pong": 1}
    assert parts[2].text == "pong after 1 turn(s)"
    result = await handle.result()
    assert result.output == "pong after 1 turn(s)"
    assert parts[3].data["run_id"] == result.run_id
    assert parts[3].data["status"] == "finished"
