"""Flow drift: checked before any wait is matched; ``restart`` drives the new flow.

A flow run paused on an approval, on a signal or on input, whose flow has
since changed, refuses every kind of resume (a delivery, input, a plain call)
with ``FlowDriftError`` and writes nothing. ``resolve_drift(..., "abandon")``
aborts it for good; ``resolve_drift(..., "restart")`` re-pins the flow and
drives it from its start node within the call, so the next delivery or input
reaches the new flow's wait.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

import pytest
from pydantic import BaseModel

from kuralle_es import (
    FlowDriftError,
    InvalidArgumentError,
    ModelRequest,
    ModelResponse,
    RunStore,
    Runtime,
    SignalDelivery,
    SignalMismatchError,
    action,
    collect,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
)
from kuralle_es.testing import ScriptedModel

SESSION = "s-drift"
WAITS = ["approval", "signal", "input"]


class Mark(BaseModel):
    version: int


class Name(BaseModel):
    name: str


def extract(request: ModelRequest) -> ModelResponse:
    """Finds ``name=X`` in the last user message, or nothing."""
    users = [m.content or "" for m in request.messages if m.role == "user"]
    last = users[-1] if users else ""
    data = {"name": last.split("=", 1)[1]} if last.startswith("name=") else {}
    return ModelResponse(data=data)


def build(wait: str, version: int, ledger: list[int], store: RunStore) -> Runtime:
    """A flow that marks its version with a tool, then waits (``wait``), then ends.

    Version 2 has one more node, so its digest differs from version 1's.
    """
    mark = define_tool("mark", "records the flow version", Mark, lambda a: ledger.append(a.version))

    async def start(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("mark", {"version": version})
        if wait == "approval":
            decision = await ctx.approve("go on?")
            return end(f"v{version}: approved={decision.approved}")
        if wait == "signal":
            payload = await ctx.signal("go")
            return end(f"v{version}: signal {payload['n']}")
        return goto("ask")

    nodes = [
        action("start", start),
        collect(
            "ask",
            Name,
            ["name"],
            lambda missing: "your name?",
            lambda data: end(f"v{version}: name {data['name']}"),
        ),
    ]
    if version == 2:

        async def unused(state: dict[str, Any], ctx: Any) -> Any:
            return end("never")

        nodes.append(action("v2-only", unused))
    flow = define_flow("drifty", "d", "start", nodes)
    agent = define_agent("a", "i", ScriptedModel(extract), [mark], [flow])
    return Runtime([agent], store=store)


def resolving_delivery(wait: str, signal_id: str) -> SignalDelivery:
    if wait == "approval":
        return SignalDelivery(
            signal_id=signal_id, name="__approval", payload={"approved": True, "by": "ann"}
        )
    if wait == "signal":
        return SignalDelivery(signal_id=signal_id, name="go", payload={"n": 7})
    return SignalDelivery(signal_id=signal_id, name="__input", payload={"name": "x"})


def stored_events(store: RunStore, run_id: str) -> list[tuple[int, str]]:
    events = store.events.get(UUID(run_id))
    return [(e.originator_version, type(e).TOPIC.rsplit(".", 1)[-1]) for e in events]


async def paused_under_v1(wait: str, store: RunStore, ledger: list[int]) -> str:
    v1 = build(wait, 1, ledger, store)
    paused = await v1.run(SESSION, input="hello", kind="flow", flow_name="drifty").result()
    assert paused.status == "paused"
    assert paused.waiting_for is not None and paused.waiting_for.kind == wait
    assert ledger == [1]
    return paused.run_id


async def refuse_every_resume(v2: Runtime, store: RunStore, wait: str, run_id: str) -> None:
    """Each kind of resume answers FlowDriftError and leaves the journal as it was."""
    before = stored_events(store, run_id)
    state_before = await v2.get_run(run_id, SESSION)
    attempts = [
        v2.run(SESSION, run_id=run_id, signal_delivery=resolving_delivery(wait, "d-1")),
        v2.run(SESSION, signal_delivery=resolving_delivery(wait, "d-2")),  # found by session
        v2.run(SESSION, run_id=run_id, input="name=Bo"),
        v2.run(SESSION, run_id=run_id),
    ]
    for handle in attempts:
        with pytest.raises(FlowDriftError) as caught:
            await handle.result()
        assert caught.value.run_id == run_id
        assert caught.value.recovery == ("restart", "abandon")
        assert stored_events(store, run_id) == before
    assert await v2.get_run(run_id, SESSION) == state_before


@pytest.mark.parametrize("wait", WAITS)
async def test_a_drifted_run_refuses_every_resume_then_restart_drives_the_new_flow(
    open_store: Any, wait: str
) -> None:
    ledger: list[int] = []
    run_id = await paused_under_v1(wait, open_store(), ledger)
    old_keys = {s.key for s in await build(wait, 1, [], open_store()).get_steps(run_id, SESSION)}

    store = open_store()
    v2 = build(wait, 2, ledger, store)
    await refuse_every_resume(v2, store, wait, run_id)
    assert ledger == [1]

    restarted = await v2.resolve_drift(run_id, SESSION, "restart")
    # Driven within the call, from the start node, to the new flow's own wait.
    assert restarted.status == "paused"
    assert restarted.flow_digest == v2.flow("drifty")[1].digest
    assert restarted.waiting_for is not None and restarted.waiting_for.kind == wait
    assert restarted.lease_holder is None
    assert ledger == [1, 2]  # the new flow's tool ran once; the old one's never again
    new_steps = [s for s in await v2.get_steps(run_id, SESSION) if s.key not in old_keys]
    assert [s.name for s in new_steps if s.kind == "tool"] == ["mark"]
    assert all(s.attempts == 1 for s in new_steps)

    if wait == "input":
        done = await v2.run(SESSION, run_id=run_id, input="name=Bo").result()
        assert done.status == "finished"
        final = await v2.get_run(run_id, SESSION)
        assert final is not None and final.outcome == "v2: name Bo"
    else:
        delivery = resolving_delivery(wait, "after-restart")
        done = await v2.run(SESSION, run_id=run_id, signal_delivery=delivery).result()
        assert done.status == "finished"
        final = await v2.get_run(run_id, SESSION)
        expected = "v2: approved=True" if wait == "approval" else "v2: signal 7"
        assert final is not None and final.outcome == expected
    assert ledger == [1, 2]


@pytest.mark.parametrize("wait", WAITS)
async def test_abandon_aborts_a_drifted_run_and_later_calls_say_so(
    open_store: Any, wait: str
) -> None:
    ledger: list[int] = []
    run_id = await paused_under_v1(wait, open_store(), ledger)
    store = open_store()
    v2 = build(wait, 2, ledger, store)

    abandoned = await v2.resolve_drift(run_id, SESSION, "abandon")
    assert abandoned.status == "aborted"
    assert abandoned.outcome == "abandoned: flow drift"
    assert abandoned.waiting_for is None
    after_abandon = stored_events(store, run_id)

    with pytest.raises(SignalMismatchError, match=r"aborted \(abandoned: flow drift\)"):
        await v2.run(
            SESSION, run_id=run_id, signal_delivery=resolving_delivery(wait, "late")
        ).result()
    for handle in (v2.run(SESSION, run_id=run_id, input="name=Bo"), v2.run(SESSION, run_id=run_id)):
        result = await handle.result()
        assert result.status == "aborted"
    with pytest.raises(InvalidArgumentError, match="no flow drift"):
        await v2.resolve_drift(run_id, SESSION, "restart")
    assert stored_events(store, run_id) == after_abandon
    assert ledger == [1]


async def test_resolve_drift_of_a_run_without_drift_or_with_a_bad_recovery_writes_nothing(
    open_store: Any,
) -> None:
    ledger: list[int] = []
    store = open_store()
    run_id = await paused_under_v1("signal", store, ledger)
    same = build("signal", 1, ledger, store)
    before = stored_events(store, run_id)
    with pytest.raises(InvalidArgumentError, match="no flow drift"):
        await same.resolve_drift(run_id, SESSION, "restart")
    with pytest.raises(InvalidArgumentError) as caught:
        await same.resolve_drift(run_id, SESSION, "rewind")
    assert isinstance(caught.value, ValueError)
    assert stored_events(store, run_id) == before
    assert ledger == [1]
