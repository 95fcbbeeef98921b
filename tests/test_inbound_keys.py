"""Inbound keys survive crashes (docs/guarantees.md, "At the edges").

A call made with ``idempotency_key`` (a keyed user turn, a keyed flow start)
is answered from the run whatever became of its turn: cut off by a crash,
recovered by another worker, paused, finished or errored. It never delivers
the retry's input again, never raises ``SignalMismatchError`` for it, and the
same key with another request is ``IdempotencyConflictError`` that writes
nothing. Crashes here are the testing kit's ``Crash`` (what ``SIGKILL`` leaves:
the intent journaled, the dead worker's lease on the run); the same pattern
with real processes killed is ``tests/test_keyed_calls_killed.py``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from pydantic import BaseModel

from kuralle_es import (
    IdempotencyConflictError,
    LeaseHeldError,
    ModelRequest,
    ModelResponse,
    RunContext,
    Runtime,
    ToolCall,
    ToolCallRequest,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    recover_orphaned_runs,
)
from kuralle_es.testing import Crash, ScriptedModel

SESSION = "s-keys"
TTL = 0.4


class Seat(BaseModel):
    flight: str


class World:
    """The booking system: executions per idempotency key; the first ``dies`` die."""

    def __init__(self, dies: int = 0) -> None:
        self.executions: Counter[str] = Counter()
        self.dies = dies

    def book(self, args: Seat, call: ToolCall) -> dict[str, Any]:
        self.executions[call.idempotency_key] += 1
        if self.dies:
            self.dies -= 1
            raise Crash("the worker dies inside the booking tool")
        return {"booked": args.flight}


def agents(world: World) -> list[Any]:
    tool = define_tool("book", "book a seat", Seat, world.book)

    def model(request: ModelRequest) -> ModelResponse | str:
        last = request.messages[-1]
        if last.role == "tool":
            return f"booked you on {last.content}"
        flight = f"KL{len(request.messages)}"  # changes with every extra user turn
        return ModelResponse(
            tool_calls=[ToolCallRequest(id="t1", name="book", args={"flight": flight})]
        )

    async def book(state: dict[str, Any], ctx: RunContext) -> Any:
        state["seat"] = await ctx.tool("book", {"flight": "AF7"})
        decision = await ctx.approve("Confirm the seat?")
        return end("confirmed" if decision.approved else "declined")

    async def fail(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("book", {"flight": "BA1"})
        raise RuntimeError("the fare vanished")

    flows = [
        define_flow("book", "", "book", [action("book", book)]),
        define_flow("fail", "", "fail", [action("fail", fail)]),
    ]
    return [
        define_agent("desk", "", ScriptedModel(model), [tool], flows),
    ]


def runtime(world: World, store: Any, holder: str) -> Runtime:
    return Runtime(agents(world), store=store, lease_ttl=TTL, holder=holder)


async def crashed(call: Any) -> str:
    """Run ``call`` (a handle) into its crash; the id of the run it left behind."""
    with pytest.raises(Crash):
        await call.result()
    run_id: str = await call.run_id
    return run_id


def user_messages(state: Any) -> list[str]:
    return [m.content for m in state.messages if m.role == "user"]


# ------------------------------------------------------- keyed conversation turns
async def test_a_keyed_turn_retried_after_its_crash_was_recovered_runs_no_second_turn(
    open_store: Any,
) -> None:
    """The ported flight booking: a second user turn ran, the user message was stored
    twice and the tool executed a third time, offering another flight."""
    world = World(dies=1)
    store = open_store()
    dying = runtime(world, store, "dead")
    run_id = await crashed(dying.run(SESSION, input="a flight to Paris", idempotency_key="turn-1"))
    await asyncio.sleep(TTL + 0.1)
    rescuer = runtime(world, open_store(), "rescuer")
    assert await recover_orphaned_runs(rescuer) == [run_id]
    recovered = await rescuer.get_run(run_id, SESSION)
    assert recovered is not None and recovered.status == "finished"
    executions = dict(world.executions)

    retry = (
        await runtime(world, open_store(), "web")
        .run(SESSION, input="a flight to Paris", idempotency_key="turn-1")
        .result()
    )
    assert (retry.run_id, retry.status) == (run_id, "finished")
    after = await rescuer.get_run(run_id, SESSION)
    assert after is not None
    assert user_messages(after) == ["a flight to Paris"]
    assert after.version == recovered.version  # nothing written
    assert dict(world.executions) == executions
    assert list(world.executions.values()) == [2]  # the in-doubt retry under its key, once


async def test_a_keyed_turn_retried_before_anyone_recovered_it_recovers_it_first(
    open_store: Any,
) -> None:
    world = World(dies=1)
    store = open_store()
    run_id = await crashed(
        runtime(world, store, "dead").run(SESSION, input="to Rome", idempotency_key="turn-1")
    )
    retrier = runtime(world, open_store(), "web")
    with pytest.raises(LeaseHeldError):  # the dead worker's lease is still live
        await retrier.run(SESSION, input="to Rome", idempotency_key="turn-1").result()
    await asyncio.sleep(TTL + 0.1)
    retry = await retrier.run(SESSION, input="to Rome", idempotency_key="turn-1").result()
    assert (retry.run_id, retry.status) == (run_id, "finished")
    assert retry.output is not None and "booked you on" in retry.output
    again = await retrier.run(SESSION, input="to Rome", idempotency_key="turn-1").result()
    assert again == retry
    state = await retrier.get_run(run_id, SESSION)
    assert state is not None and user_messages(state) == ["to Rome"]
    assert list(world.executions.values()) == [2]


async def test_the_same_key_with_another_input_is_refused_and_writes_nothing(
    open_store: Any,
) -> None:
    world = World()
    rt = runtime(world, open_store(), "w")
    done = await rt.run(SESSION, input="to Oslo", idempotency_key="turn-1").result()
    before = await rt.get_run(done.run_id, SESSION)
    with pytest.raises(IdempotencyConflictError, match="turn-1") as refused:
        await rt.run(SESSION, input="to Lima", idempotency_key="turn-1").result()
    assert "new key" in str(refused.value)
    after = await rt.get_run(done.run_id, SESSION)
    assert before is not None and after is not None and after.version == before.version
    assert sum(world.executions.values()) == 1


# ---------------------------------------------------------------- keyed flow starts
async def test_a_keyed_flow_start_retried_after_its_crash_was_recovered_to_a_pause_returns_it(
    open_store: Any,
) -> None:
    """A retried start raised ``SignalMismatchError: ... waits for '__approval', not
    for input``."""
    world = World(dies=1)
    store = open_store()
    start = {"input": "seat 12A", "kind": "flow", "flow_name": "book", "idempotency_key": "b-1"}
    run_id = await crashed(runtime(world, store, "dead").run(SESSION, **start))
    await asyncio.sleep(TTL + 0.1)
    rescuer = runtime(world, open_store(), "rescuer")
    assert await recover_orphaned_runs(rescuer) == [run_id]
    retry = await runtime(world, open_store(), "web").run(SESSION, **start).result()
    assert (retry.run_id, retry.status) == (run_id, "paused")
    assert retry.waiting_for is not None and retry.waiting_for.name == "__approval"
    state = await rescuer.get_run(run_id, SESSION)
    assert state is not None and user_messages(state) == ["seat 12A"]
    assert list(world.executions.values()) == [2]


async def test_a_keyed_flow_start_retried_on_a_crashed_run_nobody_recovered_recovers_it(
    open_store: Any,
) -> None:
    """On a crashed run nobody recovered, a retried start returned ``running``."""
    world = World(dies=1)
    store = open_store()
    start = {"input": "seat 3C", "kind": "flow", "flow_name": "book", "idempotency_key": "b-2"}
    run_id = await crashed(runtime(world, store, "dead").run(SESSION, **start))
    await asyncio.sleep(TTL + 0.1)
    retry = await runtime(world, open_store(), "web").run(SESSION, **start).result()
    assert (retry.run_id, retry.status) == (run_id, "paused")


async def test_a_keyed_flow_start_retried_after_it_ended_in_error_returns_the_error(
    open_store: Any,
) -> None:
    """A retried start raised "is error and is not waiting for input"."""
    world = World()
    start = {"input": "x", "kind": "flow", "flow_name": "fail", "idempotency_key": "f-1"}
    rt = runtime(world, open_store(), "w")
    with pytest.raises(RuntimeError, match="fare vanished"):
        await rt.run(SESSION, **start).result()
    retry = await rt.run(SESSION, **start).result()
    assert retry.status == "error"
    assert sum(world.executions.values()) == 1


@pytest.mark.parametrize(
    "change",
    [{"input": "seat 9F"}, {"flow_name": "fail"}, {"session_id": "s-other"}],
    ids=["other-input", "other-flow", "other-session"],
)
async def test_a_flow_start_key_reused_for_another_request_is_refused(
    open_store: Any, change: dict[str, Any]
) -> None:
    world = World()
    rt = runtime(world, open_store(), "w")
    first = {"input": "seat 1A", "kind": "flow", "flow_name": "book", "idempotency_key": "b-9"}
    paused = await rt.run(SESSION, **first).result()
    request = {"session_id": SESSION, **first, **change}
    with pytest.raises(IdempotencyConflictError, match="b-9"):
        await rt.run(**request).result()
    state = await rt.get_run(paused.run_id, SESSION)
    assert state is not None and state.status == "paused"
    assert sum(world.executions.values()) == 1
