"""A tool that runs longer than the lease is never executed twice at once.

While an effect executes, the turn renews its lease with a heartbeat save
about every ``lease_ttl / 3``; another worker (another holder, its own store
connection) that tries to take the run over meanwhile is refused with
``LeaseHeldError``. A turn whose heartbeat loses to another writer stops with
``StaleWriteError`` and executes nothing further.
"""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import UUID

import pytest
from pydantic import BaseModel

from kuralle_es import (
    LeaseHeldError,
    Runtime,
    StaleWriteError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)

SESSION = "s-heartbeat"
TOOL_SECONDS = 0.6
LEASE_TTL = 0.2


class NoArgs(BaseModel):
    pass


class Ledger:
    """Counts executions of the slow tool and the most that ran at once."""

    def __init__(self) -> None:
        self.started = 0
        self.running = 0
        self.peak = 0
        self.after = 0
        self.first_started = asyncio.Event()

    async def slow(self, args: NoArgs) -> dict[str, Any]:
        self.started += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.first_started.set()
        try:
            await asyncio.sleep(TOOL_SECONDS)
        finally:
            self.running -= 1
        return {"slept": TOOL_SECONDS}

    def next_step(self, args: NoArgs) -> dict[str, Any]:
        self.after += 1
        return {"ok": True}


def runtime_for(ledger: Ledger, store: Any, holder: str) -> Runtime:
    tools = [
        define_tool("slow", "sleeps longer than the lease", NoArgs, ledger.slow),
        define_tool("next_step", "runs after the slow tool", NoArgs, ledger.next_step),
    ]

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("slow")
        await ctx.tool("next_step")
        return end("done")

    flow = define_flow("slow-flow", "one slow tool", "n", [action("n", node)])
    agent = define_agent("a", "i", None, tools, [flow])
    return Runtime([agent], store=store, lease_ttl=LEASE_TTL, holder=holder)


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_tool_longer_than_the_lease_is_never_taken_over_by_a_second_worker(
    open_store: Any,
) -> None:
    ledger = Ledger()
    first = runtime_for(ledger, open_store(), holder="worker-a")
    second = runtime_for(ledger, open_store(), holder="worker-b")

    handle = first.run(SESSION, kind="flow", flow_name="slow-flow")
    run_id = await handle.run_id
    await asyncio.wait_for(ledger.first_started.wait(), timeout=10)

    finished = asyncio.ensure_future(handle.result())
    refusals: list[LeaseHeldError] = []
    while not finished.done():
        try:
            await second.run(SESSION, run_id=run_id).result()
        except LeaseHeldError as e:
            refusals.append(e)
        await asyncio.sleep(0.04)

    result = await finished
    assert result.status == "finished"
    assert ledger.started == 1
    assert ledger.peak == 1
    assert ledger.after == 1
    # The slow tool outlived the lease three times over, and every takeover
    # attempt while it ran met a live lease held by the first worker.
    assert len(refusals) >= 5
    assert {e.holder for e in refusals} == {"worker-a"}
    steps = await second.get_steps(run_id, SESSION)
    assert [(s.name, s.status, s.attempts) for s in steps] == [
        ("slow", "finished", 1),
        ("next_step", "finished", 1),
    ]
    state = await second.get_run(run_id, SESSION)
    assert state is not None and state.lease_holder is None


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_a_turn_whose_heartbeat_loses_to_another_writer_stops_and_executes_nothing_more(
    open_store: Any,
) -> None:
    ledger = Ledger()
    store = open_store()
    runtime = runtime_for(ledger, store, holder="worker-a")
    handle = runtime.run(SESSION, kind="flow", flow_name="slow-flow")
    run_id = await handle.run_id
    await asyncio.wait_for(ledger.first_started.wait(), timeout=10)

    # Another writer appends to the run while the slow tool executes.
    other_store = open_store()
    run = await asyncio.to_thread(other_store.load, run_id)
    assert run is not None
    run.abort("taken over by an operator")
    await asyncio.to_thread(other_store.save_run, run)

    with pytest.raises(StaleWriteError) as caught:
        await handle.result()
    assert caught.value.clash
    assert "another writer" in str(caught.value)
    assert ledger.started == 1
    assert ledger.after == 0  # nothing after the lost heartbeat executed
    stored = list(store.events.get(UUID(run_id)))
    # The slow tool had run: its outcome is recorded after the abort, then nothing.
    assert [type(e).__name__ for e in stored[-2:]] == ["Aborted", "StepSucceeded"]
