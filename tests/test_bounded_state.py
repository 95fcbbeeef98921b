"""A loaded run holds only the steps a resume can replay (docs/concepts.md, "What
a run holds"), on every backend, driven through the runtime.

A conversation's new turn and a flow's move to a node archive the steps
before them: ``RunStore.load`` carries the current turn's or node visit's
steps, while ``get_steps`` (the whole journal, from the events) still lists
every step with its global index, and a resume in the middle of a later
node replays that node's steps without executing them again.
"""

from __future__ import annotations

from typing import Any

from conftest import StoreFactory
from pydantic import BaseModel

from kuralle_es import (
    ModelRequest,
    Runtime,
    SignalDelivery,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
)
from kuralle_es._runtime.context import RunContext
from kuralle_es.testing import ScriptedModel

SESSION = "bounded"


class _Count(BaseModel):
    n: int


async def test_a_conversations_new_turn_leaves_the_earlier_turns_steps_out_of_its_load(
    open_store: StoreFactory,
) -> None:
    def answer(request: ModelRequest) -> str:
        return f"{len(request.messages)} messages"

    runtime = Runtime([define_agent("chat", "answers", ScriptedModel(answer))], store=open_store())
    run_id = (await runtime.run(SESSION, input="turn 1").result()).run_id
    for turn in range(2, 7):
        result = await runtime.run(SESSION, run_id=run_id, input=f"turn {turn}").result()
        assert result.status == "finished"
        assert result.output == f"{2 * turn - 1} messages"

    loaded = open_store().load(run_id)
    assert loaded is not None
    # Each turn journals one model step: the load holds the sixth turn's only.
    assert [s["index"] for s in loaded.steps] == [5]
    assert loaded.step_base == 5 and loaded.to_state().step_count == 6
    assert len(loaded.to_state().messages) == 12  # the history itself is kept
    steps = await Runtime([], store=open_store()).get_steps(run_id, SESSION)
    assert [(s.index, s.kind) for s in steps] == [(i, "model") for i in range(6)]
    assert len({s.key for s in steps}) == 6


async def test_a_flow_resumed_in_a_later_node_replays_that_node_only(
    open_store: StoreFactory,
) -> None:
    executed: list[int] = []

    def count(args: _Count) -> dict[str, int]:
        executed.append(args.n)
        return {"n": args.n}

    async def visit(state: dict[str, Any], ctx: RunContext) -> Any:
        visits = int(state.get("visits", 0))
        for i in range(3):
            await ctx.tool("count", {"n": 10 * visits + i})
        if visits < 2:
            return goto("v", {"visits": visits + 1})
        decision = await ctx.approve("finish?")
        return end("approved" if decision.approved else "declined")

    flow = define_flow("visits", "three visits of three steps", "v", [action("v", visit)])
    agent = define_agent("worker", "", None, [define_tool("count", "", _Count, count)], [flow])
    paused = await Runtime([agent], store=open_store()).run(SESSION, flow_name="visits").result()
    assert paused.status == "paused"
    assert executed == [0, 1, 2, 10, 11, 12, 20, 21, 22]

    loaded = open_store().load(paused.run_id)
    assert loaded is not None
    # The third visit's three tool steps, from global index 6 on (the approval is
    # journaled when it is delivered).
    assert loaded.step_base == 6
    assert [(s["index"], s["kind"]) for s in loaded.steps] == [(i, "tool") for i in (6, 7, 8)]

    delivery = SignalDelivery(
        signal_id="sig-1", name="__approval", payload={"approved": True, "by": "ops"}
    )
    done = await (
        Runtime([agent], store=open_store())
        .run(SESSION, run_id=paused.run_id, signal_delivery=delivery)
        .result()
    )
    assert (done.status, done.output) == ("finished", "approved")
    assert executed == [0, 1, 2, 10, 11, 12, 20, 21, 22], "a replayed step ran again"
    steps = await Runtime([agent], store=open_store()).get_steps(paused.run_id, SESSION)
    assert [s.index for s in steps] == list(range(10))
    assert steps[-1].kind == "approval"
    assert [s.result for s in steps if s.kind == "tool"] == [
        {"n": n} for n in (0, 1, 2, 10, 11, 12, 20, 21, 22)
    ]
    assert all(s.status == "finished" for s in steps)
