"""Leases, orphan recovery and deadline sweeps, over memory, SQLite and PostgreSQL.

An orphan is made the way a dying worker makes one: its ``charge`` tool
raises the testing kit's ``Crash`` (a ``BaseException``, like ``SIGKILL``:
nothing catches or journals it), so the run stays ``running`` with the
step's intent journaled and the dead worker's lease on it. Sweepers are
separate ``Runtime`` + ``RunStore`` instances with their own holders, as
separate worker processes would be; ``tests/test_kill_recovery.py`` does
the same with real processes and ``SIGKILL``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pytest
from events_kit import everything
from pydantic import BaseModel

from kuralle_es import (
    LeaseHeldError,
    RunStore,
    Runtime,
    SignalDelivery,
    SignalMismatchError,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    recover_orphaned_runs,
    sweep_deadlines,
)
from kuralle_es.events import RunResumed
from kuralle_es.testing import Crash

SESSION = "s-recovery"
PAY_FLOW = "pay"


class Amount(BaseModel):
    cents: int


class Ledger:
    """The payment system: executions per idempotency key, and the charges it keeps."""

    def __init__(self) -> None:
        self.executions: Counter[str] = Counter()
        self.charges: dict[str, int] = {}

    def charge(self, args: Amount, call: ToolCall) -> dict[str, Any]:
        self.executions[call.idempotency_key] += 1
        self.charges.setdefault(call.idempotency_key, args.cents)
        return {"charged": args.cents}


def pay_agent(ledger: Ledger, *, dies: bool = False, slow: float = 0.0) -> Any:
    """The ``pay`` flow: one ``charge`` call, then ``end("paid")``.

    ``dies``: the worker dies inside the tool, after the charge happened.
    ``slow``: the tool takes that long (to watch the lease meanwhile).
    """

    async def charge(args: Amount, call: ToolCall) -> dict[str, Any]:
        result = ledger.charge(args, call)
        if slow:
            await asyncio.sleep(slow)
        if dies:
            raise Crash("the worker dies inside the charge tool")
        return result

    async def pay(state: dict[str, Any], ctx: Any) -> Any:
        state["receipt"] = await ctx.tool("charge", {"cents": 500})
        return end("paid")

    tool = define_tool("charge", "charge a card", Amount, charge)
    flow = define_flow(PAY_FLOW, "charge once", "pay", [action("pay", pay)])
    return define_agent("payer", "pays", None, [tool], [flow])


async def orphan(
    store: RunStore, ledger: Ledger, *, lease_ttl: float, session: str = SESSION
) -> str:
    """A run whose worker died inside ``charge``: running, intent journaled, lease left."""
    dying = Runtime([pay_agent(ledger, dies=True)], store=store, lease_ttl=lease_ttl, holder="dead")
    handle = dying.run(session, kind="flow", flow_name=PAY_FLOW)
    with pytest.raises(Crash):
        await handle.result()
    return await handle.run_id


def event_names(store: RunStore, run_id: str) -> list[str]:
    return [type(e).TOPIC.rsplit(".", 1)[-1] for e in store.events.get(UUID(run_id))]


# ------------------------------------------------------------------ leases
async def test_a_turn_takes_the_lease_renews_it_while_a_slow_tool_runs_and_clears_it(
    open_store: Any,
) -> None:
    """The lease is a record apart from the journal: taken at the opening save,
    renewed by the heartbeat while the tool runs (0.8 s against a 0.3 s lease),
    each renewal pushing the expiry on, and dropped at the close; none of it is
    an event of the run."""
    ledger = Ledger()
    store = open_store()
    runtime = Runtime([pay_agent(ledger, slow=0.8)], store=store, lease_ttl=0.3, holder="w1")
    handle = runtime.run(SESSION, kind="flow", flow_name=PAY_FLOW)
    run_id = await handle.run_id
    seen = await runtime.get_run(run_id, SESSION)
    assert seen is not None and seen.lease_holder == "w1"
    assert seen.lease_expires_at is not None and seen.lease_expires_at > datetime.now(UTC)
    expiries = []
    result = asyncio.ensure_future(handle.result())
    while not result.done():
        lease = await store.lease_async(run_id)
        if lease is not None and (not expiries or expiries[-1] != lease.expires_at):
            assert lease.holder == "w1"
            expiries.append(lease.expires_at)
        await asyncio.sleep(0.02)
    assert (await result).status == "finished"
    assert len(expiries) >= 3
    assert expiries == sorted(expiries)
    names = event_names(store, run_id)
    assert "LeaseTaken" not in names and "LeaseReleased" not in names
    assert await store.lease_async(run_id) is None
    after = await runtime.get_run(run_id, SESSION)
    assert after is not None and after.lease_holder is None and after.lease_expires_at is None


async def test_a_live_lease_is_refused_at_once_and_skipped_by_recovery(
    open_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger()
    run_id = await orphan(open_store(), ledger, lease_ttl=60.0)
    sweeper = Runtime([pay_agent(ledger)], store=open_store(), holder="sweeper")

    # Not an orphan yet: its lease runs for another minute.
    assert await recover_orphaned_runs(sweeper) == []
    with pytest.raises(LeaseHeldError) as held:
        await sweeper.run(SESSION, run_id=run_id).result()
    assert held.value.holder == "dead"

    # A view that thinks the lease expired (a clock ahead) still meets the live
    # lease in the run itself: logged and skipped, nothing written.
    version = (await sweeper.get_run(run_id, SESSION)).version  # type: ignore[union-attr]
    with caplog.at_level(logging.INFO, logger="kuralle_es"):
        later = datetime.now(UTC) + timedelta(hours=1)
        assert await recover_orphaned_runs(sweeper, now=later) == []
    assert any(
        "recovery skipped" in r.getMessage() and "LeaseHeldError" in r.getMessage()
        for r in caplog.records
    )
    state = await sweeper.get_run(run_id, SESSION)
    assert state is not None and state.version == version and state.status == "running"
    assert sum(ledger.executions.values()) == 1


async def test_an_expired_lease_is_recovered_by_the_sweep_and_the_charge_is_kept_once(
    open_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = Ledger()
    store = open_store()
    run_id = await orphan(store, ledger, lease_ttl=0.2)
    await asyncio.sleep(0.3)
    sweeper = Runtime([pay_agent(ledger)], store=open_store(), holder="sweeper")

    with caplog.at_level(logging.INFO, logger="kuralle_es"):
        assert await recover_orphaned_runs(sweeper) == [run_id]
    assert any(
        r.getMessage().startswith(f"run recovered run={run_id} status=finished")
        for r in caplog.records
    )
    state = await sweeper.get_run(run_id, SESSION)
    assert state is not None and state.status == "finished" and state.outcome == "paid"
    assert state.lease_holder is None
    steps = await sweeper.get_steps(run_id, SESSION)
    assert [(s.name, s.status, s.attempts) for s in steps] == [("charge", "finished", 2)]
    # The tool ran again with the same key: the payment system kept one charge.
    assert list(ledger.executions.values()) == [2]
    assert ledger.charges == {steps[0].key: 500}
    # Nothing is left to recover, and the recovery is a public event.
    assert await recover_orphaned_runs(sweeper) == []
    assert "Recovered" in event_names(store, run_id)
    resumed = [e for e in await everything(store) if isinstance(e, RunResumed)]
    assert [(e.run_id, e.reason) for e in resumed] == [(run_id, "recovery")]


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_workers_racing_over_the_same_orphans_recover_each_exactly_once(
    open_store: Any, workers: int
) -> None:
    ledger = Ledger()
    store = open_store()
    orphans = [await orphan(store, ledger, lease_ttl=0.2, session=f"s{i}") for i in range(6)]
    await asyncio.sleep(0.3)
    sweepers = [
        Runtime([pay_agent(ledger)], store=open_store(), holder=f"worker-{n}")
        for n in range(workers)
    ]

    passes = await asyncio.gather(*(recover_orphaned_runs(s) for s in sweepers))

    recovered = [run_id for driven in passes for run_id in driven]
    assert sorted(recovered) == sorted(orphans), passes  # each once, by exactly one worker
    # Every charge executed twice (the dead worker's and one recovery), never three times.
    assert sorted(ledger.executions.values()) == [2] * len(orphans)
    for i, run_id in enumerate(orphans):
        state = await sweepers[0].get_run(run_id, f"s{i}")
        assert state is not None and state.status == "finished" and state.lease_holder is None
        assert event_names(store, run_id).count("Recovered") == 1
    # A second round finds nothing.
    again = await asyncio.gather(*(recover_orphaned_runs(s) for s in sweepers))
    assert again == [[] for _ in sweepers]


# --------------------------------------------------------------- deadlines
SHORT = 0.3
#: Flow name -> (what it waits for, its deadline in seconds or None).
WAITS: dict[str, tuple[str, float | None]] = {
    "approval-short": ("approval", SHORT),
    "approval-long": ("approval", 3600.0),
    "signal-short": ("signal", SHORT),
    "signal-none": ("signal", None),
}


def waiting_agent() -> Any:
    """One flow per entry of ``WAITS``: it waits, then ends saying what it got."""

    def node(kind: str, seconds: float | None) -> Any:
        deadline = None if seconds is None else timedelta(seconds=seconds)

        async def run(state: dict[str, Any], ctx: Any) -> Any:
            if kind == "approval":
                decision = await ctx.approve("Refund?", deadline=deadline)
                return end(f"approved={decision.approved} by={decision.by} {decision.reason}")
            payload = await ctx.signal("go", deadline=deadline)
            return end(f"signal {payload['reason']}")

        return run

    flows = [
        define_flow(name, f"waits for {kind}", "wait", [action("wait", node(kind, seconds))])
        for name, (kind, seconds) in WAITS.items()
    ]
    return define_agent("waiter", "waits", None, [], flows)


async def start_waiting(runtime: Runtime) -> dict[str, str]:
    """One paused run per flow of ``WAITS`` (each in its own session); flow -> run id."""
    runs = {}
    for flow in WAITS:
        result = await runtime.run(f"s-{flow}", kind="flow", flow_name=flow).result()
        assert result.status == "paused"
        runs[flow] = result.run_id
    return runs


async def test_a_deadline_sweep_denies_only_the_approvals_and_signals_past_their_deadline(
    open_store: Any,
) -> None:
    runtime = Runtime([waiting_agent()], store=open_store(), holder="w")
    runs = await start_waiting(runtime)
    await asyncio.sleep(SHORT + 0.1)
    # Too late for anyone else: only the sweeper's deny gets through.
    with pytest.raises(SignalMismatchError, match="expired before delivery"):
        late = SignalDelivery(signal_id="ann-1", name="__approval", payload={"approved": True})
        await runtime.run(
            "s-approval-short", run_id=runs["approval-short"], signal_delivery=late
        ).result()

    swept = await sweep_deadlines(runtime)

    assert sorted(swept) == sorted([runs["approval-short"], runs["signal-short"]])
    outcomes = {}
    for flow, run_id in runs.items():
        state = await runtime.get_run(run_id, f"s-{flow}")
        assert state is not None
        outcomes[flow] = (state.status, state.outcome)
    assert outcomes == {
        "approval-short": ("finished", "approved=False by=deadline deadline-expired"),
        "approval-long": ("paused", None),
        "signal-short": ("finished", "signal deadline-expired"),
        "signal-none": ("paused", None),
    }
    assert await sweep_deadlines(runtime) == []


async def test_two_sweepers_deliver_one_deadline_deny_per_run(open_store: Any) -> None:
    first = Runtime([waiting_agent()], store=open_store(), holder="sweeper-1")
    second = Runtime([waiting_agent()], store=open_store(), holder="sweeper-2")
    runs = await start_waiting(first)
    await asyncio.sleep(SHORT + 0.1)

    swept = await asyncio.gather(sweep_deadlines(first), sweep_deadlines(second))

    assert sorted(swept[0] + swept[1]) == sorted([runs["approval-short"], runs["signal-short"]])
    store = open_store()
    for flow in ("approval-short", "signal-short"):
        run = store.load(runs[flow])
        assert run is not None
        assert list(run.signal_ids) == [f"deadline:{run_request_id(store, runs[flow])}"]
        assert event_names(store, runs[flow]).count("SignalAccepted") == 1


def run_request_id(store: RunStore, run_id: str) -> str:
    """The request id of the run's first wait."""
    for event in store.events.get(UUID(run_id)):
        if type(event).TOPIC.rsplit(".", 1)[-1] == "Paused":
            return str(event.waiting_for["request_id"])
    msg = f"run {run_id} never paused"
    raise AssertionError(msg)


async def test_a_deadline_deny_is_a_duplicate_when_delivered_again(open_store: Any) -> None:
    runtime = Runtime([waiting_agent()], store=open_store(), holder="w")
    runs = await start_waiting(runtime)
    await asyncio.sleep(SHORT + 0.1)
    assert runs["signal-short"] in await sweep_deadlines(runtime)
    store = open_store()
    request_id = run_request_id(store, runs["signal-short"])
    version = store.load(runs["signal-short"]).version  # type: ignore[union-attr]
    again = SignalDelivery(signal_id=f"deadline:{request_id}", name="go", payload={"x": 1})
    result = await runtime.run(
        "s-signal-short", run_id=runs["signal-short"], signal_delivery=again
    ).result()
    assert result.status == "finished"
    assert store.load(runs["signal-short"]).version == version  # type: ignore[union-attr]
