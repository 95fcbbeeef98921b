"""Child runs (docs/child-runs.md) on memory, SQLite and PostgreSQL.

A parent starts a child flow run exactly once (one step of its journal; the
child's id derives from that step's key) and waits for it on a ``child``
wait that no operator can answer; the child's end resumes the parent within
the call that ended the child, and ``ctx.child`` returns the child's output,
or raises ``ChildRunError``. A crash between the child's start and the
parent's save, recovered, leaves exactly one child; a cancel cascades; a
child whose end nobody handed over is found by the recovery sweep.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from conftest import StoreFactory
from events_kit import everything
from pydantic import BaseModel

from kuralle_es import (
    ChildRunError,
    FlowNotFoundError,
    InvalidArgumentError,
    ModelRequest,
    ModelResponse,
    RunStore,
    Runtime,
    SignalMismatchError,
    ToolCall,
    ToolCallRequest,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    flow_tool,
    recover_orphaned_runs,
)
from kuralle_es.testing import Crash, CrashPlan, ScriptedModel

SESSION = "family"
EXECUTED: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _clear() -> None:
    EXECUTED.clear()


class Topic(BaseModel):
    topic: str


class Note(BaseModel):
    text: str


def write_note(args: Note, call: ToolCall) -> dict[str, str]:
    EXECUTED[f"note:{args.text}"] += 1
    return {"wrote": args.text}


# -------------------------------------------------------------- the flows
async def research(state: dict[str, Any], ctx: Any) -> Any:
    """A child: asks a human, writes a note, ends with its answer."""
    decision = await ctx.approve(f"Research {ctx.input.topic}?")
    if not decision.approved:
        return end("declined")
    await ctx.tool("write_note", {"text": ctx.input.topic})
    return end(f"notes on {ctx.input.topic}")


async def quick(state: dict[str, Any], ctx: Any) -> Any:
    """A child that ends within its first turn."""
    await ctx.tool("write_note", {"text": "quick"})
    return end("quick answer")


async def broken(state: dict[str, Any], ctx: Any) -> Any:
    raise ValueError("the child broke")


async def asks(state: dict[str, Any], ctx: Any) -> Any:
    """A parent: one child, waited for; then a note of its own."""
    answer = await ctx.child("research", {"topic": "tea"})
    await ctx.tool("write_note", {"text": f"parent read {answer}"})
    return end(f"parent: {answer}")


async def asks_quick(state: dict[str, Any], ctx: Any) -> Any:
    return end(f"parent: {await ctx.child('quick')}")


async def asks_broken(state: dict[str, Any], ctx: Any) -> Any:
    try:
        await ctx.child("broken")
    except ChildRunError as error:
        assert error.error is not None
        EXECUTED["caught"] += 1
        return end(f"child {error.status}: {error.error.type}: {error.error.message}")
    return end("unreachable")


async def fans_out(state: dict[str, Any], ctx: Any) -> Any:
    """Two children started without waiting, then waited for in the other order."""
    first = await ctx.start_child("research", {"topic": "a"})
    second = await ctx.start_child("research", Topic(topic="b"))
    later = await ctx.wait_child(second)
    earlier = await ctx.wait_child(first)
    return end(f"{earlier} | {later}")


async def grandparent(state: dict[str, Any], ctx: Any) -> Any:
    return end(f"grand: {await ctx.child('parent')}")


async def cancel_aware(state: dict[str, Any], ctx: Any) -> Any:
    try:
        return end(f"parent: {await ctx.child('research', {'topic': 'x'})}")
    except ChildRunError as error:
        return end(f"child {error.status}: {error.outcome}")


FLOWS = [
    define_flow("research", "", "go", [action("go", research)], input=Topic),
    define_flow("quick", "", "go", [action("go", quick)]),
    define_flow("broken", "", "go", [action("go", broken)]),
    define_flow("parent", "", "go", [action("go", asks)]),
    define_flow("parent_quick", "", "go", [action("go", asks_quick)]),
    define_flow("parent_broken", "", "go", [action("go", asks_broken)]),
    define_flow("fans_out", "", "go", [action("go", fans_out)]),
    define_flow("grandparent", "", "go", [action("go", grandparent)]),
    define_flow("cancel_aware", "", "go", [action("go", cancel_aware)]),
]
NOTE = define_tool("write_note", "write a note", Note, write_note)
AGENTS = [define_agent("lab", "", None, [NOTE], FLOWS)]


def runtime(store: RunStore, **options: Any) -> Runtime:
    return Runtime(AGENTS, store=store, **options)


async def started(rt: Runtime, flow: str) -> str:
    result = await rt.run(SESSION, kind="flow", flow_name=flow).result()
    return result.run_id


async def state(rt: Runtime, run_id: str, session: str = SESSION) -> Any:
    found = await rt.get_run(run_id, session)
    assert found is not None
    return found


# ------------------------------------------------------------------ tests
async def test_a_parent_waits_for_its_child_and_goes_on_within_the_call_that_ends_it(
    open_store: StoreFactory,
) -> None:
    rt = runtime(open_store())
    parent_id = await started(rt, "parent")
    parent = await state(rt, parent_id)
    assert parent.status == "paused" and parent.waiting_for.kind == "child"
    assert parent.waiting_for.name == "__child"
    (child_id,) = parent.children
    assert parent.waiting_for.child_run_id == child_id
    child = await state(rt, child_id)
    assert child.parent == {"run_id": parent_id, "step": 0}
    assert (child.status, child.waiting_for.kind) == ("paused", "approval")

    # The views list both waits, and the child's approval like any other.
    waiting = {s.run_id: s for s in await rt.views.waiting_runs()}
    assert waiting[child_id].waiting_for.name == "__approval"
    assert waiting[child_id].parent == {"run_id": parent_id, "step": 0}
    assert waiting[parent_id].waiting_for.child_run_id == child_id
    assert [s.run_id for s in await rt.views.child_waits()] == [parent_id]

    # Nobody answers the parent's wait by hand: refused, nothing written.
    with pytest.raises(SignalMismatchError, match=f"child run {child_id}"):
        await rt.approve(parent_id, SESSION, by="ann")
    with pytest.raises(SignalMismatchError, match="runs show"):
        await rt.signal(parent_id, SESSION, "__child", {"status": "finished"})
    assert (await state(rt, parent_id)).version == parent.version

    # The approval reaches the child; the parent goes on within that call.
    done = await rt.approve(child_id, SESSION, by="ann")
    assert (done.run_id, done.status, done.output) == (child_id, "finished", "notes on tea")
    parent = await state(rt, parent_id)
    assert (parent.status, parent.outcome) == ("finished", "parent: notes on tea")
    assert EXECUTED == {"note:tea": 1, "note:parent read notes on tea": 1}
    steps = await rt.get_steps(parent_id, SESSION)
    assert [(s.kind, s.name) for s in steps] == [
        ("child", "research"), ("child", "__child"), ("tool", "write_note"),
    ]  # fmt: skip
    assert steps[1].result["status"] == "finished"

    # The public run events tell the same story, the child's end as a delivery.
    events = [e for e in await everything(rt.store) if e.run_id == parent_id]
    told = [(e.type, getattr(e, "kind", None), getattr(e, "name", None)) for e in events]
    assert ("StepStarted", "child", "research") in told
    assert ("StepStarted", "child", "__child") in told
    assert ("SignalAccepted", None, "__child") in told
    paused = next(e for e in events if e.type == "RunPaused")
    assert paused.waiting_for.child_run_id == child_id  # type: ignore[union-attr]


async def test_a_child_that_ends_in_its_first_turn_returns_or_raises_without_a_pause(
    open_store: StoreFactory,
) -> None:
    rt = runtime(open_store())
    result = await rt.run(SESSION, kind="flow", flow_name="parent_quick").result()
    assert (result.status, result.output) == ("finished", "parent: quick answer")
    (child_id,) = (await state(rt, result.run_id)).children
    assert (await state(rt, child_id)).status == "finished"
    assert EXECUTED == {"note:quick": 1}

    # A child that errors: ChildRunError in its parent, which may catch it.
    result = await rt.run(SESSION, kind="flow", flow_name="parent_broken").result()
    assert (result.status, result.output) == (
        "finished", "child error: ValueError: the child broke",
    )  # fmt: skip
    (child_id,) = (await state(rt, result.run_id)).children
    child = await state(rt, child_id)
    assert (child.status, child.error.type) == ("error", "ValueError")
    assert EXECUTED == {"note:quick": 1, "caught": 1}


async def test_start_child_and_wait_child_wait_in_any_order(open_store: StoreFactory) -> None:
    rt = runtime(open_store())
    parent_id = await started(rt, "fans_out")
    parent = await state(rt, parent_id)
    first, second = parent.children
    assert parent.waiting_for.child_run_id == second
    # The first child ends: its parent waits for the second, and stays.
    await rt.approve(first, SESSION, by="ann")
    assert (await state(rt, parent_id)).waiting_for.child_run_id == second
    await rt.approve(second, SESSION, by="ann")
    parent = await state(rt, parent_id)
    assert (parent.status, parent.outcome) == ("finished", "notes on a | notes on b")
    assert [s.name for s in await rt.get_steps(parent_id, SESSION)] == [
        "research", "research", "__child", "__child",
    ]  # fmt: skip


async def test_a_bad_child_is_refused_when_asked_and_reserves_nothing(
    open_store: StoreFactory,
) -> None:
    async def asks_badly(state: dict[str, Any], ctx: Any) -> Any:
        for bad in (
            lambda: ctx.child("nowhere"),
            lambda: ctx.child("research", {"subject": "tea"}),
            lambda: ctx.child("quick", {"not": "text"}),
            lambda: ctx.wait_child("not-a-child"),
        ):
            with pytest.raises((FlowNotFoundError, InvalidArgumentError)) as refused:
                bad()
            EXECUTED[type(refused.value).__name__] += 1
        return end(f"parent: {await ctx.child('quick')}")

    agents = [define_agent("lab", "", None, [NOTE], [*FLOWS, define_flow(
        "careless", "", "go", [action("go", asks_badly)])])]  # fmt: skip
    rt = Runtime(agents, store=open_store())
    result = await rt.run(SESSION, kind="flow", flow_name="careless").result()
    assert (result.status, result.output) == ("finished", "parent: quick answer")
    steps = await rt.get_steps(result.run_id, SESSION)
    assert [(s.callsite, s.name) for s in steps] == [(0, "quick"), (0, "__child")]
    assert EXECUTED == {"FlowNotFoundError": 1, "InvalidArgumentError": 3, "note:quick": 1}


async def test_a_cancel_cascades_to_live_children_and_a_cancelled_child_wakes_its_parent(
    open_store: StoreFactory,
) -> None:
    rt = runtime(open_store())
    top = await started(rt, "grandparent")
    (middle,) = (await state(rt, top)).children
    (bottom,) = (await state(rt, middle)).children
    assert (await state(rt, bottom)).waiting_for.kind == "approval"
    cancelled = await rt.cancel(top, SESSION, "no longer needed")
    assert (cancelled.status, cancelled.outcome) == ("aborted", "cancelled: no longer needed")
    for run_id in (middle, bottom):
        child = await state(rt, run_id)
        assert child.status == "aborted" and child.waiting_for is None
        assert child.outcome.startswith("cancelled: no longer needed (its parent run")
    assert EXECUTED == {}

    # A cancelled child: its waiting parent goes on within the cancel, with the error.
    parent_id = await started(rt, "cancel_aware")
    (child_id,) = (await state(rt, parent_id)).children
    await rt.cancel(child_id, SESSION, "wrong topic")
    parent = await state(rt, parent_id)
    assert (parent.status, parent.outcome) == ("finished", "child aborted: cancelled: wrong topic")


async def test_a_child_in_its_own_session_is_its_parents_child(open_store: StoreFactory) -> None:
    async def elsewhere(state: dict[str, Any], ctx: Any) -> Any:
        return end(await ctx.child("research", {"topic": "t"}, session_id="lab-session"))

    agents = [define_agent("lab", "", None, [NOTE], [*FLOWS, define_flow(
        "elsewhere", "", "go", [action("go", elsewhere)])])]  # fmt: skip
    rt = Runtime(agents, store=open_store())
    parent_id = await started(rt, "elsewhere")
    (child_id,) = (await state(rt, parent_id)).children
    assert await rt.get_run(child_id, SESSION) is None  # another session's run
    assert (await state(rt, child_id, "lab-session")).parent["run_id"] == parent_id
    await rt.approve(child_id, "lab-session", by="ann")
    assert (await state(rt, parent_id)).outcome == "notes on t"


@pytest.mark.parametrize("boundary", ["after_intent", "after_execute"])
async def test_a_crash_around_the_child_start_recovered_leaves_exactly_one_child(
    open_store: StoreFactory, boundary: str
) -> None:
    """``after_intent``: the start step is saved, the child not made. ``after_execute``:
    the child is made and paused on its approval, the parent's step not finished."""
    store = open_store.crashing()
    store.plan = CrashPlan(boundary)  # type: ignore[arg-type]
    doomed = runtime(store, lease_ttl=0.5, holder="doomed")
    with pytest.raises(Crash):
        await doomed.run(SESSION, kind="flow", flow_name="parent").result()
    store.plan = None
    parent_id = store.session_run_ids(SESSION)[0]
    await asyncio.sleep(0.6)  # the dead worker's lease expires

    rescuer = runtime(open_store(), holder="rescuer")
    assert parent_id in await recover_orphaned_runs(rescuer)
    parent = await state(rescuer, parent_id)
    (child_id,) = parent.children
    assert parent.waiting_for.child_run_id == child_id
    assert [s.run_id for s in await rescuer.views.list_runs(flow="research")] == [child_id]
    start = (await rescuer.get_steps(parent_id, SESSION))[0]
    assert (start.kind, start.attempts) == ("child", 2)  # in doubt: executed again, same key

    await rescuer.approve(child_id, SESSION, by="ann")
    assert (await state(rescuer, parent_id)).outcome == "parent: notes on tea"
    assert [s.run_id for s in await rescuer.views.list_runs(flow="research")] == [child_id]
    assert EXECUTED == {"note:tea": 1, "note:parent read notes on tea": 1}


async def test_a_childs_end_that_died_on_its_way_to_the_parent_is_handed_over_by_recovery(
    open_store: StoreFactory,
) -> None:
    store = open_store.crashing()
    rt = runtime(store, holder="worker")
    parent_id = await started(rt, "parent")
    (child_id,) = (await state(rt, parent_id)).children
    # The child's approval and note are the 1st and 2nd intents; the parent's
    # record of the child's end is the 3rd: the process dies right before it.
    store.plan = CrashPlan("before_intent", nth=3)
    with pytest.raises(Crash):
        await rt.approve(child_id, SESSION, by="ann")
    store.plan = None
    survivor = runtime(open_store(), holder="survivor")
    assert (await state(survivor, child_id)).status == "finished"
    assert (await state(survivor, parent_id)).status == "paused"

    assert await recover_orphaned_runs(survivor) == [parent_id]
    assert (await state(survivor, parent_id)).outcome == "parent: notes on tea"
    assert await recover_orphaned_runs(survivor) == []


def _scripted_researcher(request: ModelRequest) -> ModelResponse | str:
    """The model asks for research once, then reads the tool's result back."""
    last = request.messages[-1]
    if last.role == "tool":
        return f"Here is what I found: {last.content}"
    call = ToolCallRequest(id="call-1", name="research", args={"topic": "oolong"})
    return ModelResponse(tool_calls=[call])


async def test_a_flow_tool_called_by_the_model_is_a_child_run_whose_output_is_the_result(
    open_store: StoreFactory,
) -> None:
    tool = flow_tool("research", "research a topic", "research", Topic)
    agents = [
        define_agent("helper", "help", ScriptedModel(_scripted_researcher), [tool]),
        define_agent("lab", "", None, [NOTE], FLOWS),
    ]
    rt = Runtime(agents, store=open_store())
    paused = await rt.run("chat", input="tell me about oolong").result()
    assert paused.status == "paused" and paused.waiting_for.kind == "child"
    conversation = await state(rt, paused.run_id, "chat")
    (child_id,) = conversation.children
    child = await state(rt, child_id, "chat")
    assert child.parent["run_id"] == paused.run_id and child.kind == "flow"

    await rt.approve(child_id, "chat", by="ann")
    conversation = await state(rt, paused.run_id, "chat")
    assert conversation.status == "finished"
    tool_message, reply = conversation.messages[-2:]
    assert (tool_message.role, tool_message.content) == ("tool", '"notes on oolong"')
    assert reply.content == 'Here is what I found: "notes on oolong"'
    assert EXECUTED == {"note:oolong": 1}


@pytest.mark.postgres
async def test_children_in_other_partitions_of_a_4_partition_store_are_found(
    pg_dsn: str,
) -> None:
    """Each child in a session of its own: the router puts them where their sessions
    hash, across the partitions, and their parent still finds, waits for and is
    resumed by each of them; a new store over the database sees the same."""

    async def many(state: dict[str, Any], ctx: Any) -> Any:
        ids = [
            await ctx.start_child("research", {"topic": f"t{n}"}, session_id=f"lab-{n}")
            for n in range(8)
        ]
        answers = [await ctx.wait_child(child_id) for child_id in ids]
        return end(" / ".join(answers))

    agents = [define_agent("lab", "", None, [NOTE], [*FLOWS, define_flow(
        "many", "", "go", [action("go", many)])])]  # fmt: skip
    with RunStore.postgres(pg_dsn, partitions=4) as store:
        rt = Runtime(agents, store=store)
        parent_id = await started(rt, "many")
        children = (await state(rt, parent_id)).children
        where = {store.partition_of(child_id) for child_id in children}
        assert len(where) > 1 and None not in where
        assert store.partition_of(parent_id) is not None
    with RunStore.postgres(pg_dsn) as reopened:
        rt = Runtime(agents, store=reopened)
        for n, child_id in enumerate(children):
            child = await state(rt, child_id, f"lab-{n}")
            assert child.parent == {"run_id": parent_id, "step": n}
            await rt.approve(child_id, f"lab-{n}", by="ann")
        parent = await state(rt, parent_id)
        assert parent.outcome == " / ".join(f"notes on t{n}" for n in range(8))
        summaries = await rt.views.list_runs(flow="research", limit=100)
        assert {s.run_id: s.parent["run_id"] for s in summaries} == dict.fromkeys(
            children, parent_id
        )
