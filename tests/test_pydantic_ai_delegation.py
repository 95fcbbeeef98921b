"""Pydantic AI agent delegation on the journal: a tool that runs another agent
(``delegate(other).run(...)``) makes that agent's turn a child run of the
calling run, journaled step by step (docs/pydantic-ai.md, "Agent delegation").

``Travel`` is a booking agent whose ``find_flight`` tool delegates to a
``flight_search`` agent (typed output) whose ``list_flights`` tool is the
outside world (an ``ExactlyOnceLedger`` keyed by each call's key) and whose
``hold_seat`` tool needs a human's approval. Each resume is made on a fresh
runtime over a new store object, with the agents made durable anew: as
another process would.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import StoreFactory
from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from kuralle_es import ChildRunError, InvalidArgumentError, RunStore, Runtime, recover_orphaned_runs
from kuralle_es.integrations.pydantic_ai import DurableAgent, delegate, durable, tool_call
from kuralle_es.testing import Crash, CrashPlan, ExactlyOnceLedger

SESSION = "traveller-1"


class Flight(BaseModel):
    number: str
    cents: int


def _returns(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    """The tool results the model now reads (none when a user just spoke)."""
    parts = messages[-1].parts
    if any(isinstance(p, UserPromptPart) for p in parts):
        return []
    return [p for p in parts if isinstance(p, ToolReturnPart)]


class Travel:
    """A booking agent delegating to a flight search agent.

    ``seat=True``: the search agent also holds a seat, which needs approval.
    ``delegations``: how many searches ``find_flight`` delegates per call.
    """

    def __init__(self, *, seat: bool = False, delegations: int = 1) -> None:
        self.seat = seat
        self.delegations = delegations
        self.ledger = ExactlyOnceLedger()
        self.find_keys: list[str] = []
        self.seats: list[str] = []
        self.search = Agent(
            FunctionModel(self.search_model), name="flight_search", output_type=Flight
        )
        self.search.tool_plain(self.list_flights)
        self.search.tool_plain(requires_approval=True)(self.hold_seat)
        self.booking = Agent(FunctionModel(self.booking_model), name="booking")
        self.booking.tool(self.find_flight)

    def search_model(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = _returns(messages)
        if not returns:
            return ModelResponse(parts=[ToolCallPart("list_flights", {"route": "SFO-ANC"})])
        if returns[0].tool_name == "list_flights" and self.seat:
            return ModelResponse(parts=[ToolCallPart("hold_seat", {"number": "AK456"})])
        flight = {"number": "AK456", "cents": 32000}
        return ModelResponse(parts=[ToolCallPart(info.output_tools[0].name, flight)])

    def booking_model(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = _returns(messages)
        if not returns:
            return ModelResponse(parts=[ToolCallPart("find_flight", {"route": "SFO-ANC"})])
        return ModelResponse(parts=[TextPart(f"Booked: {returns[0].content}")])

    def list_flights(self, route: str) -> list[str]:
        """List the flights of a route."""
        call = tool_call()
        assert call is not None
        self.ledger.record(call, route)
        return ["AK456"]

    def hold_seat(self, number: str) -> str:
        """Hold a seat on a flight."""
        self.seats.append(number)
        return "12A"

    async def find_flight(self, ctx: RunContext[None], route: str) -> str:
        """Find a flight on a route."""
        call = tool_call()
        assert call is not None
        self.find_keys.append(call.idempotency_key)
        search = delegate(self.search)
        found = [await search.run(f"Find a flight {route}") for _ in range(self.delegations)]
        return " + ".join(f"{f.output.number} at {f.output.cents}" for f in found)


def on(store: RunStore, travel: Travel, **settings: Any) -> tuple[Runtime, DurableAgent]:
    """A runtime over ``store`` with both agents made durable on it."""
    runtime = Runtime([], store=store, holder=settings.pop("holder", "worker"), **settings)
    durable(travel.search, runtime)
    return runtime, durable(travel.booking, runtime)


async def _kinds(runtime: Runtime, run_id: str) -> list[tuple[str, str, str]]:
    return [(s.kind, s.name, s.status) for s in await runtime.get_steps(run_id, SESSION)]


async def test_a_delegating_tool_runs_the_other_agent_as_a_child_run_journaled_step_by_step(
    open_store: StoreFactory,
) -> None:
    travel = Travel()
    runtime, booking = on(open_store(), travel)

    done = await booking.run("Book me to Anchorage", session_id=SESSION)

    assert (done.status, done.output) == ("finished", "Booked: AK456 at 32000")
    parent = await runtime.get_run(done.run_id, SESSION)
    assert parent is not None
    (child_id,) = parent.children
    child = await runtime.get_run(child_id, SESSION)
    assert child is not None
    assert (child.kind, child.status, child.active_agent) == (
        "conversation", "finished", "flight_search"
    )  # fmt: skip
    tool = next(s for s in await runtime.get_steps(done.run_id, SESSION) if s.kind == "child")
    assert child.parent == {"run_id": done.run_id, "step": tool.index}
    assert await _kinds(runtime, done.run_id) == [
        ("model", "function:booking_model:", "finished"),
        ("tool", "find_flight", "finished"),
        ("child", "flight_search", "finished"),
        ("child", "__child", "finished"),
        ("model", "function:booking_model:", "finished"),
    ]
    assert await _kinds(runtime, child_id) == [
        ("model", "function:search_model:", "finished"),
        ("tool", "list_flights", "finished"),
        ("model", "function:search_model:", "finished"),
    ]
    assert child.messages[0].content == "Find a flight SFO-ANC"
    summaries = await runtime.views.list_runs(session_id=SESSION)
    assert {s.run_id: s.parent for s in summaries}[child_id] == child.parent


async def test_a_delegate_waiting_for_approval_pauses_its_parent_until_another_process_approves(
    open_store: StoreFactory,
) -> None:
    travel = Travel(seat=True)
    runtime, booking = on(open_store(), travel)
    paused = await booking.run("Book me to Anchorage", session_id=SESSION)
    wait = paused.waiting_for
    assert paused.status == "paused" and wait is not None and wait.kind == "child"
    child = await runtime.get_run(str(wait.child_run_id), SESSION)
    assert child is not None and child.waiting_for is not None
    assert child.waiting_for.operation is not None
    assert child.waiting_for.operation.tool_name == "hold_seat"
    waiting = {s.run_id for s in await runtime.views.waiting_runs()}
    assert waiting == {paused.run_id, child.run_id}
    assert travel.seats == []

    elsewhere, _ = on(open_store(), travel, holder="another-worker")
    approved = await elsewhere.approve(child.run_id, SESSION, by="ann")

    assert (approved.status, approved.output) == ("finished", '{"number":"AK456","cents":32000}')
    parent = await elsewhere.get_run(paused.run_id, SESSION)
    assert parent is not None and parent.status == "finished"
    assert parent.messages[-1].content == "Booked: AK456 at 32000"
    assert parent.children == [child.run_id]
    assert travel.seats == ["AK456"]
    # The delegating tool ran again when its run resumed: same key, same child.
    assert len(travel.find_keys) == 2 and len(set(travel.find_keys)) == 1
    find = next(s for s in await elsewhere.get_steps(paused.run_id, SESSION) if s.kind == "tool")
    assert (find.status, find.attempts) == ("finished", 2)
    travel.ledger.assert_exactly_once()
    assert len(travel.ledger.entries) == 1


#: Where a worker dies: (boundary, nth time a step reaches it, that step's name).
#: Steps reach a boundary in the order they get there: the child's start and
#: the delegating tool finish after the child's own steps, which run inside them.
CRASHES = [
    ("before_intent", 3, "flight_search"),
    ("after_intent", 3, "flight_search"),
    ("after_execute", 5, "flight_search"),
    ("after_finalize", 5, "flight_search"),
    ("after_intent", 5, "list_flights"),
    ("after_execute", 3, "list_flights"),
    ("after_execute", 7, "find_flight"),
]
#: Every point in memory; on PostgreSQL the three where a process dies inside an effect.
ON_POSTGRES = {("after_intent", 3), ("after_execute", 3), ("after_execute", 7)}
CRASH_CASES = [("memory", *crash) for crash in CRASHES] + [
    pytest.param("postgres", *crash, marks=pytest.mark.postgres)
    for crash in CRASHES
    if crash[:2] in ON_POSTGRES
]


@pytest.mark.parametrize(("backend", "boundary", "nth", "step"), CRASH_CASES)
async def test_a_crash_around_the_child_or_inside_it_recovered_leaves_one_child_and_one_effect(
    open_store: StoreFactory, boundary: str, nth: int, step: str
) -> None:
    travel = Travel()
    store = open_store.crashing()
    plan = store.plan = CrashPlan(boundary, nth=nth)  # type: ignore[arg-type]
    _, booking = on(store, travel, holder="doomed", lease_ttl=0.3)
    with pytest.raises(Crash):
        await booking.run("Book me to Anchorage", session_id=SESSION)
    store.plan = None
    await asyncio.sleep(0.35)  # the dead worker's lease expires

    rescuer, _ = on(open_store(), travel, holder="rescuer")
    await recover_orphaned_runs(rescuer)

    runs = await rescuer.views.list_runs(session_id=SESSION)
    (parent_id,) = [s.run_id for s in runs if s.parent is None]
    parent = await rescuer.get_run(parent_id, SESSION)
    assert parent is not None and parent.status == "finished"
    assert parent.messages[-1].content == "Booked: AK456 at 32000"
    assert len(runs) == 2 and len(parent.children) == 1
    if boundary != "before_intent":  # the crash hit the step the table names
        steps = [s for r in runs for s in await rescuer.get_steps(r.run_id, SESSION)]
        assert plan.key == next(s.key for s in steps if s.name == step)
    travel.ledger.assert_exactly_once()
    assert len(travel.ledger.effects()) == 1


async def test_two_delegations_of_one_call_are_two_children_found_again_when_it_runs_again() -> (
    None
):
    travel = Travel(seat=True, delegations=2)
    runtime, booking = on(RunStore.memory(), travel)
    paused = await booking.run("Book me to Anchorage", session_id=SESSION)
    first = str(paused.waiting_for.child_run_id)  # type: ignore[union-attr]
    await runtime.approve(first, SESSION, by="ann")  # the call runs again: its second child
    parent = await runtime.get_run(paused.run_id, SESSION)
    assert parent is not None and parent.status == "paused" and len(parent.children) == 2
    second = parent.children[1]
    assert parent.waiting_for is not None and parent.waiting_for.child_run_id == second

    await runtime.approve(second, SESSION, by="ann")

    parent = await runtime.get_run(paused.run_id, SESSION)
    assert parent is not None and parent.status == "finished"
    assert parent.messages[-1].content == "Booked: AK456 at 32000 + AK456 at 32000"
    assert parent.children == [first, second]
    assert travel.seats == ["AK456", "AK456"]
    assert len(set(travel.find_keys)) == 1 and len(travel.find_keys) == 3


async def test_a_cancelled_delegate_raises_child_run_error_in_the_tool_that_waits_for_it() -> None:
    travel = Travel(seat=True)
    caught: list[ChildRunError] = []

    async def find_flight(ctx: RunContext[None], route: str) -> str:
        """Find a flight on a route."""
        try:
            return str((await delegate(travel.search).run(f"Find a flight {route}")).output)
        except ChildRunError as stopped:
            caught.append(stopped)
            return f"no flight: the search was {stopped.status}"

    booking = Agent(FunctionModel(travel.booking_model), name="booking")
    booking.tool(find_flight)
    runtime = Runtime([], store=RunStore.memory())
    durable(travel.search, runtime)
    paused = await durable(booking, runtime).run("Book me", session_id=SESSION)

    await runtime.cancel(str(paused.waiting_for.child_run_id), SESSION, "no longer needed")  # type: ignore[union-attr]

    parent = await runtime.get_run(paused.run_id, SESSION)
    assert parent is not None and parent.status == "finished"
    assert parent.messages[-1].content == "Booked: no flight: the search was aborted"
    assert [e.status for e in caught] == ["aborted"]


async def test_cancelling_the_calling_run_cancels_its_delegate_and_the_next_turn_goes_on() -> None:
    travel = Travel(seat=True)
    runtime, booking = on(RunStore.memory(), travel)
    paused = await booking.run("Book me to Anchorage", session_id=SESSION)

    state = await runtime.cancel(paused.run_id, SESSION, "changed my mind")

    assert (state.status, state.outcome) == ("finished", "cancelled: changed my mind")
    child = await runtime.get_run(str(paused.waiting_for.child_run_id), SESSION)  # type: ignore[union-attr]
    assert child is not None and child.status == "finished" and child.waiting_for is None
    assert child.outcome is not None and child.outcome.startswith("cancelled: changed my mind")
    travel.seat = False  # the next turn's search holds no seat: it needs no approval
    again = await booking.run("Book me to Anchorage after all", session_id=SESSION)
    assert (again.status, again.output) == ("finished", "Booked: AK456 at 32000")
    assert travel.seats == []


async def test_delegating_outside_a_durable_tool_or_to_an_unnamed_agent_is_refused() -> None:
    travel = Travel()
    with pytest.raises(InvalidArgumentError, match="inside a tool of a durable agent"):
        delegate(travel.search).run("Find a flight")
    with pytest.raises(InvalidArgumentError, match="needs a name"):
        delegate(Agent(FunctionModel(travel.search_model)))
