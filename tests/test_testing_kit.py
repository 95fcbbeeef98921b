"""The crash kit users import: every boundary, every backend, exactly once.

A user-shaped flow (two tools, a clock read, a uuid) runs through a crash at
each boundary and is resumed on fresh runtimes and stores; the ledger the
tools write to shows one effect per key, the keys of a crash-free run, and
the same result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import StoreFactory
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel

from kuralle_es import (
    Agent,
    RunContext,
    RunStore,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es.testing import (
    BOUNDARIES,
    CrashingStore,
    CrashPlan,
    ExactlyOnceLedger,
    crash_plans,
    drive_through_crash,
)


class Charge(BaseModel):
    cents: int


def make_agent(ledger: ExactlyOnceLedger) -> Agent:
    def charge(args: Charge, call: ToolCall) -> dict[str, Any]:
        ledger.record(call, args.cents)
        return {"charged": args.cents}

    def receipt(args: Charge, call: ToolCall) -> dict[str, Any]:
        ledger.record(call, f"receipt {args.cents}")
        return {"sent": True}

    async def pay(state: dict[str, Any], ctx: RunContext) -> Any:
        first = await ctx.tool("charge", {"cents": 100})
        await ctx.now()
        second = await ctx.tool("charge", {"cents": 250})
        await ctx.uuid()
        await ctx.tool("receipt", {"cents": first["charged"] + second["charged"]})
        return end(f"charged {first['charged'] + second['charged']}")

    tools = [
        define_tool("charge", "charge", Charge, charge),
        define_tool("receipt", "send a receipt", Charge, receipt),
    ]
    return define_agent(
        "payer", "", None, tools, [define_flow("pay", "", "pay", [action("pay", pay)])]
    )


def crashing_factory(open_store: StoreFactory, tmp_path: Path) -> Any:
    """New CrashingStore per call over the backend's database (one for memory)."""
    if open_store.backend == "memory":
        store = CrashingStore.memory()
        open_store.stores.append(store)
        return lambda: store

    def make() -> RunStore:
        assert open_store.target is not None
        store = (
            CrashingStore.sqlite(open_store.target)
            if open_store.backend == "sqlite"
            else CrashingStore.postgres(open_store.target)
        )
        open_store.stores.append(store)
        return store

    return make


async def crash_free_keys() -> tuple[list[str], Any]:
    ledger = ExactlyOnceLedger()
    store = CrashingStore.memory()
    result = await drive_through_crash(
        [make_agent(ledger)], lambda: store, CrashPlan("before_intent", nth=99),
        session_id="s", flow_name="pay",
    )  # fmt: skip
    return [key for key, _, _ in ledger.entries], result.output


@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("boundary", BOUNDARIES)
async def test_a_crash_at_any_boundary_leaves_one_effect_per_key_and_the_same_result(
    open_store: StoreFactory, tmp_path: Path, boundary: Any, nth: int
) -> None:
    expected_keys, expected_output = await crash_free_keys()
    ledger = ExactlyOnceLedger()
    plan = CrashPlan(boundary, nth=nth)
    result = await drive_through_crash(
        [make_agent(ledger)], crashing_factory(open_store, tmp_path), plan,
        session_id="s", flow_name="pay",
    )  # fmt: skip
    assert plan.fired
    assert result.status == "finished" and result.output == expected_output
    # Keys are per run: compare shapes, then exactly-once on this run's keys.
    assert len(ledger.effects()) == len(expected_keys)
    ledger.assert_exactly_once()
    # Only a crash after a tool's effect and before the save that carries its
    # result re-executes it (same key); every other effect ran exactly once.
    for key in ledger.effects():
        expected = 2 if key in plan.in_doubt else 1
        assert ledger.executions(key) == expected, (key, plan)
    if boundary in ("after_intent", "after_finalize"):
        assert plan.in_doubt == []


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=crash_plans())
async def test_any_generated_crash_plan_keeps_exactly_once_on_memory(plan: CrashPlan) -> None:
    ledger = ExactlyOnceLedger()
    store = CrashingStore.memory()
    result = await drive_through_crash(
        [make_agent(ledger)], lambda: store, plan, session_id="s", flow_name="pay"
    )
    assert result.status == "finished" and result.output == "charged 350"
    ledger.assert_exactly_once()
    assert len(ledger.effects()) == 3


def test_the_ledger_names_a_key_that_carried_two_different_effects() -> None:
    ledger = ExactlyOnceLedger()
    call = ToolCall(idempotency_key="k" * 64, run_id="r", session_id="s", tool_name="t", callsite=0)
    ledger.record(call, 1)
    ledger.record(call, 1)
    ledger.assert_exactly_once(expected_keys=["k" * 64])
    ledger.record(call, 2)
    with pytest.raises(AssertionError, match="different effects"):
        ledger.assert_exactly_once()
    with pytest.raises(AssertionError, match="missing"):
        ExactlyOnceLedger().assert_exactly_once(expected_keys=["x"])
