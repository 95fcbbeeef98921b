"""``Runtime(clock=...)`` and ``TestClock``: timers and deadlines tested without waiting.

Everything the runtime dates comes from its clock (``ctx.now()``'s first
recording, wake times, deadlines, what the sweeps count as due or expired),
so a test moves a ``TestClock`` and the sweeps act at once: a one-hour sleep
is woken and a 24-hour approval denied in milliseconds. Leases stay on the
store's clock: a runtime whose clock is days ahead never takes a run another
worker holds. A sweep's ``now=`` is the same as a clock that reads it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from kuralle_es import (
    InvalidArgumentError,
    RetryPolicy,
    RunStore,
    Runtime,
    SignalMismatchError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    fire_timers,
    recover_orphaned_runs,
    sweep_deadlines,
)
from kuralle_es.testing import Crash, TestClock

SESSION = "s-clock"
START = datetime(2031, 3, 4, 9, 0, tzinfo=UTC)
#: A test that moves a TestClock takes no real time worth the name.
FAST = 5.0


class NoArgs(BaseModel):
    pass


def napper(counts: dict[str, int]) -> Any:
    async def nap(state: dict[str, Any], ctx: Any) -> Any:
        counts["before"] += 1
        began = await ctx.now()
        await ctx.sleep(timedelta(hours=1))
        counts["after"] += 1
        return end(f"slept from {began.isoformat()}")

    return define_agent(
        "napper", "", None, [], [define_flow("nap", "", "nap", [action("nap", nap)])]
    )


def asker() -> Any:
    async def ask(state: dict[str, Any], ctx: Any) -> Any:
        decision = await ctx.approve("Refund 42.00?", deadline=timedelta(hours=24))
        return end("approved" if decision.approved else f"denied by {decision.by}")

    return define_agent(
        "asker", "", None, [], [define_flow("ask", "", "ask", [action("ask", ask)])]
    )


async def test_a_one_hour_sleep_is_woken_by_advancing_the_clock_with_no_real_wait(
    open_store: Any,
) -> None:
    counts = {"before": 0, "after": 0}
    clock = TestClock(START)
    runtime = Runtime([napper(counts)], store=open_store(), clock=clock)
    began = time.monotonic()

    paused = await runtime.run(SESSION, kind="flow", flow_name="nap").result()
    assert paused.status == "paused" and paused.waiting_for is not None
    assert paused.waiting_for.deadline == START + timedelta(hours=1)
    assert await fire_timers(runtime) == []  # not due by the clock yet
    clock.advance(minutes=59)
    assert await fire_timers(runtime) == []
    clock.advance(hours=2)
    assert await fire_timers(runtime) == [paused.run_id]

    state = await runtime.get_run(paused.run_id, SESSION)
    assert state is not None and state.status == "finished"
    assert state.outcome == f"slept from {START.isoformat()}"  # ctx.now() read the clock
    assert counts == {"before": 2, "after": 1}
    steps = await runtime.get_steps(paused.run_id, SESSION)
    timer = next(s for s in steps if s.kind == "timer")
    assert timer.result == {"wake_at": (START + timedelta(hours=1)).isoformat()}
    assert time.monotonic() - began < FAST


async def test_a_24_hour_approval_deadline_is_denied_by_advancing_the_clock(
    open_store: Any,
) -> None:
    clock = TestClock(START)
    runtime = Runtime([asker()], store=open_store(), clock=clock)
    began = time.monotonic()

    paused = await runtime.run(SESSION, kind="flow", flow_name="ask").result()
    assert paused.waiting_for is not None
    assert paused.waiting_for.deadline == START + timedelta(hours=24)
    clock.advance(hours=23)
    assert await sweep_deadlines(runtime) == []
    clock.advance(hours=2)
    # A human's answer after the deadline, by this clock, is refused...
    with pytest.raises(SignalMismatchError, match="expired before delivery"):
        await runtime.approve(paused.run_id, SESSION, by="ann")
    # ...and the sweep denies the wait at once.
    assert await sweep_deadlines(runtime) == [paused.run_id]

    state = await runtime.get_run(paused.run_id, SESSION)
    assert state is not None and (state.status, state.outcome) == ("finished", "denied by deadline")
    assert time.monotonic() - began < FAST


async def test_a_sweeps_now_is_a_clock_set_to_it(open_store: Any) -> None:
    """The sweeps' ``now=`` wakes a future timer, as a clock reading it would (the
    runtime's own clock, here this machine's, is an hour short of it)."""
    counts = {"before": 0, "after": 0}
    runtime = Runtime([napper(counts)], store=open_store())
    paused = await runtime.run(SESSION, kind="flow", flow_name="nap").result()
    assert await fire_timers(runtime) == []

    later = datetime.now(UTC) + timedelta(hours=2)
    assert await fire_timers(runtime, now=later) == [paused.run_id]
    state = await runtime.get_run(paused.run_id, SESSION)
    assert state is not None and state.status == "finished"
    assert counts["after"] == 1


async def test_a_clock_days_ahead_never_takes_a_lease_another_worker_holds(
    open_store: Any,
) -> None:
    """Worker A is inside a tool longer than its lease TTL (its heartbeat keeps the
    lease); worker B's clock is a week ahead, so its views call A's run an orphan,
    but the take is decided by the store's clock: B drives nothing, the tool runs once."""
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow(args: Any) -> dict[str, bool]:
        calls.append("slow")
        entered.set()
        release.wait(10)
        return {"ok": True}

    async def work(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("slow", {})
        return end("done")

    agent = define_agent(
        "worker",
        "",
        None,
        [define_tool("slow", "", NoArgs, slow)],
        [define_flow("work", "", "work", [action("work", work)])],
    )
    a = Runtime([agent], store=open_store(), holder="a", lease_ttl=0.6)
    ahead = TestClock()
    ahead.advance(days=7)
    b = Runtime([agent], store=open_store(), holder="b", lease_ttl=0.6, clock=ahead)

    handle = a.run(SESSION, kind="flow", flow_name="work")
    assert await asyncio.to_thread(entered.wait, 10)
    await asyncio.sleep(0.9)  # past A's first TTL: only its heartbeat keeps it
    try:
        assert await recover_orphaned_runs(b) == []
    finally:
        release.set()
    result = await handle.result()
    assert result.status == "finished" and calls == ["slow"]


def test_test_clock_moves_only_when_told() -> None:
    clock = TestClock(START)
    assert clock.now() == START
    assert clock.advance(3600) == START + timedelta(hours=1)
    assert clock.advance(timedelta(minutes=30)) == START + timedelta(hours=1, minutes=30)
    assert clock.advance(hours=2, minutes=30) == START + timedelta(hours=4)
    assert clock.advance(60, seconds=30) == START + timedelta(hours=4, seconds=90)
    assert clock.set(START) == START and clock.now() == START
    naive = datetime(2031, 1, 1, 12, 0)
    assert clock.set(naive) == naive.replace(tzinfo=UTC)
    assert abs(TestClock().now() - datetime.now(UTC)) < timedelta(seconds=5)
    for bad_call in (
        lambda: clock.advance(-1),
        lambda: clock.advance(hours=-1),
        lambda: clock.advance(float("nan")),
        lambda: clock.advance(True),
        lambda: clock.advance("60"),  # type: ignore[arg-type]
        lambda: clock.advance(fortnights=1),
        lambda: clock.advance(),
        lambda: clock.set("tomorrow"),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidArgumentError):
            bad_call()
    assert clock.now() == naive.replace(tzinfo=UTC)


def test_a_runtime_refuses_a_clock_without_now() -> None:
    with pytest.raises(InvalidArgumentError, match="now"):
        Runtime([], clock=object())  # type: ignore[arg-type]


async def test_a_clock_of_ones_own_with_now_dates_the_run() -> None:
    """Any object with ``now()`` is a clock; a naive reading is taken as UTC."""

    class Naive:
        def now(self) -> datetime:
            return datetime(2030, 5, 6, 7, 8)

    counts = {"before": 0, "after": 0}
    runtime = Runtime([napper(counts)], store=RunStore.memory(), clock=Naive())
    paused = await runtime.run(SESSION, kind="flow", flow_name="nap").result()
    assert paused.waiting_for is not None
    assert paused.waiting_for.deadline == datetime(2030, 5, 6, 8, 8, tzinfo=UTC)


async def test_a_retrys_next_attempt_is_dated_by_the_clock(open_store: Any) -> None:
    """A failed attempt journals when the next is due by the runtime's clock; the
    backoff itself is waited out in real time (it is 0.05 s here)."""
    attempts: list[int] = []

    def flaky(args: NoArgs) -> dict[str, int]:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("the bank hung up")
        return {"attempt": len(attempts)}

    async def work(state: dict[str, Any], ctx: Any) -> Any:
        return end(str(await ctx.tool("flaky", {})))

    retry = RetryPolicy(max_attempts=3, initial_interval=0.05)
    agent = define_agent(
        "retrier",
        "",
        None,
        [define_tool("flaky", "", NoArgs, flaky, retry=retry)],
        [define_flow("work", "", "work", [action("work", work)])],
    )
    store = open_store()
    result = (
        await Runtime([agent], store=store, clock=TestClock(START))
        .run(SESSION, kind="flow", flow_name="work")
        .result()
    )
    assert result.output == "{'attempt': 2}"
    (failed,) = [e for e in store.run_events(result.run_id) if type(e).__name__ == "AttemptFailed"]
    assert failed.retry_at == START + timedelta(seconds=0.05)


async def test_a_clock_standing_still_does_not_hide_an_orphan(open_store: Any) -> None:
    """A worker dies mid-tool; its lease runs out in real time while the test clock
    stands still: the recovery still finds the run (an orphan is a lease's matter),
    and the tool runs again under its key."""
    calls: list[str] = []

    def dies_once(args: NoArgs, call: Any) -> dict[str, bool]:
        calls.append(call.idempotency_key)
        if len(calls) == 1:
            raise Crash("the worker died inside the tool")
        return {"ok": True}

    async def work(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("dies_once", {})
        return end("done")

    agent = define_agent(
        "mortal",
        "",
        None,
        [define_tool("dies_once", "", NoArgs, dies_once)],
        [define_flow("work", "", "work", [action("work", work)])],
    )
    clock = TestClock()
    dead = Runtime([agent], store=open_store(), holder="dead", lease_ttl=0.3, clock=clock)
    handle = dead.run(SESSION, kind="flow", flow_name="work")
    run_id = await handle.run_id
    with pytest.raises(Crash):
        await handle.result()
    await asyncio.sleep(0.5)  # past the lease, by the store's clock; the test clock stands

    sweeper = Runtime([agent], store=open_store(), holder="sweeper", clock=clock)
    assert await recover_orphaned_runs(sweeper) == [run_id]
    state = await sweeper.get_run(run_id, SESSION)
    assert state is not None and state.status == "finished"
    assert len(calls) == 2 and calls[0] == calls[1]
