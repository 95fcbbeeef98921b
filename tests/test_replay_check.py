"""``replay_check``: the runs today's code could not resume, found without executing.

Runs of a flow pause at an approval after two tool calls. Checked against the
same code, nothing is found; against code that calls the tools in another
order, each paused run is a ``nondeterminism`` finding; against a changed flow
definition, a ``drift`` finding. Finished runs are never re-run. The check
executes no tool, asks no model, and writes nothing to the store.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from conftest import StoreFactory
from pydantic import BaseModel

from kuralle_es import (
    Agent,
    Flow,
    RunContext,
    RunStore,
    Runtime,
    SignalDelivery,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es.testing import ExactlyOnceLedger, replay_check


class Item(BaseModel):
    sku: str
    quantity: int = 1  # a default the tool's own model fills in


def make_flow(order: tuple[str, str], *, extra_node: bool = False) -> Flow:
    async def order_node(state: dict[str, Any], ctx: RunContext) -> Any:
        first, second = order
        await ctx.tool(first, {"sku": "A"})
        await ctx.now()
        await ctx.tool(second, {"sku": "B"})
        decision = await ctx.approve("Ship it?")
        return end("shipped" if decision.approved else "held")

    nodes = [action("order", order_node)]
    if extra_node:
        nodes.append(action("audit", order_node))
    return define_flow("order", "", "order", nodes)


def make_agent(ledger: ExactlyOnceLedger, flow: Flow) -> Agent:
    def reserve(args: Item, call: ToolCall) -> dict[str, Any]:
        ledger.record(call, args.sku)
        return {"reserved": args.sku}

    def pick(args: Item, call: ToolCall) -> dict[str, Any]:
        ledger.record(call, args.sku)
        return {"picked": args.sku}

    tools = [define_tool("reserve", "", Item, reserve), define_tool("pick", "", Item, pick)]
    return define_agent("warehouse", "", None, tools, [flow])


def stored(store: RunStore) -> tuple[Any, ...]:
    notifications = store.recorder.select_notifications(start=None, limit=100_000)
    return tuple((n.id, n.originator_id, n.originator_version, n.state) for n in notifications)


async def start_runs(store: RunStore, ledger: ExactlyOnceLedger) -> list[str]:
    """Two runs paused at the approval, one finished."""
    runtime = Runtime([make_agent(ledger, make_flow(("reserve", "pick")))], store=store)
    run_ids = []
    for session in ("s1", "s2", "s3"):
        result = await runtime.run(session, kind="flow", flow_name="order").result()
        assert result.status == "paused"
        run_ids.append(result.run_id)
    approval = SignalDelivery(signal_id="ok", name="__approval", payload={"approved": True})
    done = await runtime.run("s3", run_id=run_ids[2], signal_delivery=approval).result()
    assert done.status == "finished"
    return run_ids[:2]


async def test_unchanged_code_finds_nothing(open_store: StoreFactory) -> None:
    store = open_store()
    ledger = ExactlyOnceLedger()
    await start_runs(store, ledger)
    flow = make_flow(("reserve", "pick"))
    before, executed = stored(store), len(ledger.entries)
    assert await replay_check(store, flow) == []
    assert await replay_check(store, flow, agents=[make_agent(ledger, flow)]) == []
    assert stored(store) == before and len(ledger.entries) == executed


async def test_a_reordered_tool_call_is_found_in_every_live_run(open_store: StoreFactory) -> None:
    store = open_store()
    ledger = ExactlyOnceLedger()
    paused = await start_runs(store, ledger)
    reordered = make_flow(("pick", "reserve"))
    assert reordered.digest == make_flow(("reserve", "pick")).digest  # code, not definition
    before, executed = stored(store), len(ledger.entries)
    for agents in ([], [make_agent(ledger, reordered)]):
        findings = await replay_check(store, reordered, agents=agents)
        assert sorted(f.run_id for f in findings) == sorted(paused)
        assert {f.kind for f in findings} == {"nondeterminism"}
        assert all("callsite 0" in f.message and "'reserve'" in f.message for f in findings)
    assert stored(store) == before and len(ledger.entries) == executed
    for run_id in paused:  # the real runs are untouched and still resumable as they were
        state = store.load(run_id)
        assert state is not None and state.status == "paused"
        assert store.recorder.select_events(UUID(run_id))


async def test_a_changed_flow_definition_is_a_drift_finding(open_store: StoreFactory) -> None:
    store = open_store()
    ledger = ExactlyOnceLedger()
    paused = await start_runs(store, ledger)
    changed = make_flow(("reserve", "pick"), extra_node=True)
    findings = await replay_check(store, changed)
    assert sorted(f.run_id for f in findings) == sorted(paused)
    assert {f.kind for f in findings} == {"drift"}
    assert all("resolve_drift" in f.message for f in findings)
