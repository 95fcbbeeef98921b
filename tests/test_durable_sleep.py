"""``ctx.sleep``: a durable timer step; short sleeps inline, long ones pause until woken.

A long sleep pauses the run on a ``timer`` wait that takes no delivery; the
deadline sweep skips it; ``fire_timers`` (through the views) wakes it once
due, once, whoever else sweeps; the node re-executes and the recorded sleep
returns at once.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pytest
from events_kit import everything

from kuralle_es import (
    InvalidArgumentError,
    LeaseHeldError,
    Runtime,
    SignalDelivery,
    SignalMismatchError,
    SweepReport,
    action,
    create_sweep_job_runner,
    define_agent,
    define_flow,
    end,
    fire_timers,
    start_run_sweeper,
    sweep_deadlines,
)
from kuralle_es.events import RunResumed

SESSION = "s-sleep"


class Nap:
    """A flow that counts its node's passes around one ``ctx.sleep``."""

    def __init__(self, duration: float | timedelta) -> None:
        self.duration = duration
        self.before = 0
        self.after = 0

    def agent(self) -> Any:
        async def nap(state: dict[str, Any], ctx: Any) -> Any:
            self.before += 1
            await ctx.sleep(self.duration)
            self.after += 1
            return end("rested")

        flow = define_flow("nap", "sleeps once", "nap", [action("nap", nap)])
        return define_agent("napper", "naps", None, [], [flow])


def wake_at(runtime_steps: list[Any]) -> datetime:
    (step,) = [s for s in runtime_steps if s.kind == "timer"]
    return datetime.fromisoformat(step.result["wake_at"])


async def test_a_short_sleep_waits_inline_and_journals_one_timer_step(open_store: Any) -> None:
    nap = Nap(0.3)
    runtime = Runtime([nap.agent()], store=open_store())
    started = datetime.now(UTC)
    result = await runtime.run(SESSION, kind="flow", flow_name="nap").result()
    assert result.status == "finished"
    assert datetime.now(UTC) - started >= timedelta(seconds=0.3)
    steps = await runtime.get_steps(result.run_id, SESSION)
    assert [(s.kind, s.name, s.status, s.callsite) for s in steps] == [
        ("timer", "sleep", "finished", 0)
    ]
    assert set(steps[0].result) == {"wake_at"}
    assert (nap.before, nap.after) == (1, 1)


async def test_the_heartbeat_keeps_the_lease_through_an_inline_sleep(open_store: Any) -> None:
    nap = Nap(0.95)  # inline: within the default inline_sleep_limit of 1 s
    runtime = Runtime([nap.agent()], store=open_store(), lease_ttl=0.4, holder="sleeper")
    other = Runtime([nap.agent()], store=open_store(), lease_ttl=0.4, holder="other")
    handle = runtime.run(SESSION, kind="flow", flow_name="nap")
    run_id = await handle.run_id
    await asyncio.sleep(0.6)  # the 0.4 s lease taken at the opening would have lapsed
    with pytest.raises(LeaseHeldError):
        await other.run(SESSION, run_id=run_id).result()
    assert (await handle.result()).status == "finished"
    assert nap.after == 1


async def test_a_long_sleep_pauses_on_a_timer_that_refuses_deliveries_and_the_deadline_sweep(
    open_store: Any,
) -> None:
    nap = Nap(timedelta(seconds=30))
    runtime = Runtime([nap.agent()], store=open_store(), inline_sleep_limit=1.0)
    result = await runtime.run(SESSION, kind="flow", flow_name="nap").result()
    assert result.status == "paused"
    wait = result.waiting_for
    assert wait is not None and (wait.name, wait.kind) == ("__timer", "timer")
    steps = await runtime.get_steps(result.run_id, SESSION)
    assert wait.deadline == wake_at(steps)
    for name in ("__timer", "__approval", "go"):
        with pytest.raises(SignalMismatchError, match="durable timer"):
            delivery = SignalDelivery(
                signal_id=f"try-{name}", name=name, payload={"approved": True}
            )
            await runtime.run(SESSION, run_id=result.run_id, signal_delivery=delivery).result()
    with pytest.raises(SignalMismatchError):
        await runtime.run(SESSION, run_id=result.run_id, input="wake up").result()
    # Past its wake time (as a clock an hour ahead sees it), the deadline sweep
    # still leaves a sleeping run alone; only fire_timers wakes it.
    later = datetime.now(UTC) + timedelta(hours=1)
    assert await sweep_deadlines(runtime, now=later) == []
    assert await fire_timers(runtime) == []  # not due by this clock
    state = await runtime.get_run(result.run_id, SESSION)
    assert state is not None and state.status == "paused" and state.step_count == 1
    assert (nap.before, nap.after) == (1, 0)


async def test_a_due_timer_is_fired_once_and_the_replayed_sleep_returns_at_once(
    open_store: Any,
) -> None:
    nap = Nap(1.2)
    store = open_store()
    first = Runtime([nap.agent()], store=store, holder="sweeper-1", inline_sleep_limit=0.5)
    second = Runtime([nap.agent()], store=open_store(), holder="sweeper-2")
    result = await first.run(SESSION, kind="flow", flow_name="nap").result()
    assert result.status == "paused"
    await asyncio.sleep(1.3)

    woken = await asyncio.gather(fire_timers(first), fire_timers(second))

    assert sorted(woken[0] + woken[1]) == [result.run_id]
    state = await first.get_run(result.run_id, SESSION)
    assert state is not None and state.status == "finished" and state.outcome == "rested"
    # The node ran twice (before the pause, after the wake); the sleep did not
    # sleep again, and its step was journaled once.
    assert (nap.before, nap.after) == (2, 1)
    steps = await first.get_steps(result.run_id, SESSION)
    assert [(s.kind, s.status, s.attempts) for s in steps] == [("timer", "finished", 1)]
    names = [type(e).TOPIC.rsplit(".", 1)[-1] for e in store.events.get(UUID(result.run_id))]
    assert names.count("TimerFired") == 1
    resumed = [e for e in await everything(store) if isinstance(e, RunResumed)]
    assert [e.reason for e in resumed] == ["timer"]
    assert await fire_timers(first) == []


async def test_a_two_second_timer_is_woken_by_the_first_sweep_pass_after_it_is_due(
    open_store: Any,
) -> None:
    nap = Nap(2.0)
    runtime = Runtime([nap.agent()], store=open_store())
    result = await runtime.run(SESSION, kind="flow", flow_name="nap").result()
    assert result.status == "paused" and result.waiting_for is not None
    due = result.waiting_for.deadline
    assert due is not None

    passes: list[tuple[datetime, SweepReport]] = []
    job = create_sweep_job_runner(runtime)

    async def timed_pass() -> SweepReport:
        started = datetime.now(UTC)
        report = await job()
        passes.append((started, report))
        return report

    interval = 0.2
    sweeper = start_run_sweeper(timed_pass, interval=interval)
    try:
        for _ in range(100):
            state = await runtime.get_run(result.run_id, SESSION)
            if state is not None and state.status == "finished":
                break
            await asyncio.sleep(0.1)
    finally:
        await sweeper.aclose()

    assert state is not None and state.status == "finished"
    woke = [started for started, report in passes if result.run_id in report.woken]
    assert len(woke) == 1
    # No pass that started after the wake time left the run asleep: the first
    # pass after it was due (at most one sweep interval, plus the pass then
    # in progress, after it) woke it, and no pass before it was due did.
    assert all(started >= woke[0] for started, _ in passes if started >= due)
    assert all(result.run_id not in r.woken for started, r in passes if started < woke[0])
    assert woke[0] >= due - timedelta(seconds=interval)
    assert sweeper.stopped and sweeper.passes == len(passes)


async def test_start_run_sweeper_runs_the_job_on_a_given_scheduler_and_stops_it(
    open_store: Any,
) -> None:
    runtime = Runtime([Nap(0).agent()], store=open_store())

    class EveryTenthSecond:
        """A scheduler of our own: a loop per job, stopped by the function it returns."""

        def __init__(self) -> None:
            self.jobs: list[Any] = []

        def every(self, interval: float, job: Any) -> Any:
            stop = asyncio.Event()

            async def loop() -> None:
                while not stop.is_set():
                    self.jobs.append(await job())
                    await asyncio.sleep(0.1)

            task = asyncio.get_running_loop().create_task(loop())

            async def stopped() -> None:
                stop.set()
                await task

            return stopped

    scheduler = EveryTenthSecond()
    sweeper = start_run_sweeper(scheduler, interval=5.0, runtime=runtime)
    for _ in range(100):
        if len(scheduler.jobs) >= 2:
            break
        await asyncio.sleep(0.05)
    await sweeper.aclose()
    count = len(scheduler.jobs)
    assert count >= 2 and all(isinstance(r, SweepReport) for r in scheduler.jobs)
    await asyncio.sleep(0.25)
    assert len(scheduler.jobs) == count  # stopped for good

    also = start_run_sweeper(None, 0.05, runtime=runtime)
    for _ in range(100):
        if also.passes >= 2:
            break
        await asyncio.sleep(0.05)
    also.stop()
    await also.wait()
    assert also.stopped and also.passes >= 2


@pytest.mark.parametrize("backend", ["memory"])
async def test_bad_sleeps_and_sweeper_arguments_are_refused(open_store: Any) -> None:
    for bad in (-1, float("nan"), "1", True):
        nap = Nap(bad)  # type: ignore[arg-type]
        runtime = Runtime([nap.agent()], store=open_store())
        with pytest.raises(InvalidArgumentError, match="sleep must be a finite number of seconds"):
            await runtime.run(f"bad-{bad!r}", kind="flow", flow_name="nap").result()
    with pytest.raises(InvalidArgumentError, match="inline_sleep_limit"):
        Runtime([], inline_sleep_limit=-1)
    runtime = Runtime([Nap(0).agent()], store=open_store())
    with pytest.raises(InvalidArgumentError, match="interval"):
        start_run_sweeper(runtime, interval=0)
    with pytest.raises(InvalidArgumentError, match="runtime="):
        start_run_sweeper(None, 1.0)
