"""A webhook that starts a flow and is retried starts it once (docs/contract.md: turns, inbound
``idempotency_key``): the run's id is derived from the session, the flow and
the key, so a retry — sequential or racing — finds the run the first one made.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

from kuralle_es import (
    LeaseHeldError,
    Runtime,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)

SESSION = "webhooks"


class Order(BaseModel):
    order_id: str


def runtime_for(
    store: Any,
    executions: list[str],
    gate: asyncio.Event | None = None,
    started: asyncio.Event | None = None,
) -> Runtime:
    async def ship(args: Order, call: ToolCall) -> dict[str, str]:
        executions.append(call.idempotency_key)
        if started is not None:
            started.set()
        if gate is not None:
            await gate.wait()
        return {"shipped": args.order_id}

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("ship", {"order_id": "A-1"})
        return end("shipped")

    agent = define_agent(
        "ops",
        "ship orders",
        None,
        [define_tool("ship", "ship an order", Order, ship)],
        [define_flow("ship", "ship an order", "go", [action("go", node)])],
    )
    return Runtime([agent], store=store)


async def test_a_retried_start_with_the_same_key_returns_the_first_run(open_store: Any) -> None:
    executions: list[str] = []
    first = (
        await runtime_for(open_store(), executions)
        .run(
            SESSION, input="order A-1 paid", kind="flow", flow_name="ship", idempotency_key="evt-1"
        )
        .result()
    )
    again = (
        await runtime_for(open_store(), executions)
        .run(
            SESSION, input="order A-1 paid", kind="flow", flow_name="ship", idempotency_key="evt-1"
        )
        .result()
    )
    assert again == first
    assert first.status == "finished"
    assert len(executions) == 1

    other = (
        await runtime_for(open_store(), executions)
        .run(
            SESSION, input="order A-1 paid", kind="flow", flow_name="ship", idempotency_key="evt-2"
        )
        .result()
    )
    assert other.run_id != first.run_id
    unkeyed = [
        await runtime_for(open_store(), executions)
        .run(SESSION, kind="flow", flow_name="ship")
        .result()
        for _ in range(2)
    ]
    assert len({first.run_id, other.run_id, *(r.run_id for r in unkeyed)}) == 4
    assert len(executions) == 4


async def test_a_retry_while_the_first_start_is_still_running_is_told_the_lease_is_held(
    open_store: Any,
) -> None:
    """Another holder still drives the run the key started: the retry starts nothing
    and is refused with ``LeaseHeldError`` (retry later), as any call to a run held
    elsewhere is (docs/guarantees.md, "At the edges")."""
    executions: list[str] = []
    gate, started = asyncio.Event(), asyncio.Event()
    runtime = runtime_for(open_store(), executions, gate, started)
    first = runtime.run(SESSION, kind="flow", flow_name="ship", idempotency_key="evt-9")
    run_id = await first.run_id
    await started.wait()

    with pytest.raises(LeaseHeldError) as held:
        await (
            runtime_for(open_store(), executions)
            .run(SESSION, kind="flow", flow_name="ship", idempotency_key="evt-9")
            .result()
        )
    assert held.value.run_id == run_id
    gate.set()
    done = await first.result()
    assert done.status == "finished"
    assert len(executions) == 1


async def test_two_identical_starts_racing_make_one_run(open_store: Any) -> None:
    executions: list[str] = []
    a = runtime_for(open_store(), executions)
    b = runtime_for(open_store(), executions)
    results = await asyncio.gather(
        a.run(SESSION, kind="flow", flow_name="ship", idempotency_key="evt-race").result(),
        b.run(SESSION, kind="flow", flow_name="ship", idempotency_key="evt-race").result(),
        return_exceptions=True,
    )
    assert not any(isinstance(r, BaseException) for r in results), results
    run_ids = {r.run_id for r in results if not isinstance(r, BaseException)}
    assert len(run_ids) == 1, results
    assert len(executions) == 1
    final = await a.get_run(run_ids.pop(), SESSION)
    assert final is not None and final.status == "finished"
