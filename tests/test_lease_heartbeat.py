"""A tool that runs longer than the lease is never executed twice at once.

While an effect executes, the turn renews its lease with a heartbeat save
about every ``lease_ttl / 3``; another worker (another holder, its own store
connection) that tries to take the run over meanwhile is refused with
``LeaseHeldError``. A turn whose heartbeat loses to another writer stops with
``StaleWriteError`` and executes nothing further.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from conftest import stripped
from pydantic import BaseModel

from kuralle_es import (
    LeaseHeldError,
    RunStore,
    Runtime,
    StaleWriteError,
    ToolExecutionError,
    TurnClosedError,
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
        except StaleWriteError:
            # Read before the first worker's last save, sent after it released the
            # lease: refused whole, nothing written (the ledger below says so).
            pass
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


# ------------------------------------------- whatever the effect does to the loop
#: The lease of the tests below, and how long their tools block (five leases).
SHORT_LEASE = 0.3
BLOCK_SECONDS = 1.5
PROCS = Path(__file__).resolve().parent / "procs"
sys.path.insert(0, str(PROCS))
from lease_app import build_agents, ledger_lines, rival  # noqa: E402


def _url(open_store: Any) -> str:
    """The store URL of the factory's database, for a process of its own."""
    if open_store.backend == "sqlite":
        return f"sqlite:///{open_store.target}"
    return str(open_store.target)


class Rival:
    """A second worker that tries to take the run while worker A drives it: in a
    process of its own over SQLite and PostgreSQL, on a thread with its own event
    loop and store over memory (a memory store lives in one process)."""

    def __init__(self, open_store: Any, session: str) -> None:
        self.tally: dict[str, Any] | None = None
        self._process: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        if open_store.backend == "memory":
            store = open_store()
            work = rival(store, session, SHORT_LEASE, 60)
            self._thread = threading.Thread(target=self._in_thread, args=(work,))
            self._thread.start()
            return
        self._process = subprocess.Popen(
            [sys.executable, str(PROCS / "lease_app.py"), "rival", _url(open_store), session,
             str(SHORT_LEASE), "60"],
            env={k: v for k, v in os.environ.items() if not stripped(k, "KURALLE_")},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self._process.stdout is not None
        assert self._process.stdout.readline().strip() == "ready", self._process.communicate()

    def _in_thread(self, work: Any) -> None:
        self.tally = asyncio.run(work)

    def result(self) -> dict[str, Any]:
        if self._thread is not None:
            self._thread.join(timeout=60)
            assert self.tally is not None
            return self.tally
        assert self._process is not None
        out, err = self._process.communicate(timeout=90)
        assert self._process.returncode == 0, err
        tally: dict[str, Any] = json.loads(out.splitlines()[-1])
        return tally


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flow", ["hold-async", "hold-sync"])
@pytest.mark.parametrize(
    "backend", ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_tool_that_blocks_the_event_loop_longer_than_the_lease_is_never_taken_over(
    open_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flow: str
) -> None:
    """``hold-async`` calls ``time.sleep`` inside an ``async def``: the turn's loop
    stands still for five leases. The heartbeat renews from its own thread, so
    the second worker meets a live lease on every try and the tool runs once."""
    ledger = tmp_path / "ledger"
    monkeypatch.setenv("KT_LEDGER", str(ledger))
    monkeypatch.setenv("KT_HOLD", str(BLOCK_SECONDS))
    session = f"s-block-{flow}"
    second = Rival(open_store, session)
    first = Runtime(build_agents(), store=open_store(), lease_ttl=SHORT_LEASE, holder="worker-a")

    result = await first.run(session, kind="flow", flow_name=flow).result()

    tally = second.result()
    assert result.status == "finished"
    assert ledger_lines(ledger) == ["start", "end"], "the tool ran more than once"
    assert tally["recovered"] == []
    assert set(tally["refused"]) == {"worker-a"} and tally["refused"]["worker-a"] >= 3, tally
    # Its last try met the run done (or, racing worker A's closing save, lost to it).
    assert set(tally["other"]) <= {"returned finished", "StaleWriteError"}, tally
    steps = await first.get_steps(result.run_id, session)
    assert [(s.status, s.attempts) for s in steps] == [("finished", 1)]
    stored = open_store().events.get(UUID(result.run_id))
    assert "Recovered" not in [type(e).__name__ for e in stored], "the run was taken over"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "backend", ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_context_called_from_another_thread_or_loop_is_refused_and_the_heartbeat_goes_on(
    open_store: Any,
) -> None:
    """While a slow tool (five leases) executes, node code hands its ``ctx`` to a
    thread, which calls it plainly and from event loops of its own: every call
    is ``TurnClosedError`` and executes nothing, and the lease stays live the
    whole time (a second runtime over the store, on its own thread, is refused
    on every try)."""
    ledger = Ledger()
    charged: list[str] = []
    session = "s-ctx-thread"

    def charge(args: NoArgs) -> dict[str, Any]:
        charged.append("charge")
        return {"charged": True}

    async def slow(args: NoArgs) -> dict[str, Any]:
        ledger.started += 1
        ledger.first_started.set()
        await asyncio.sleep(BLOCK_SECONDS)
        return {"slept": BLOCK_SECONDS}

    def misuse(ctx: Any, made_on_the_loop: Any) -> list[BaseException | None]:
        async def on_a_loop_of_its_own() -> Any:
            return await ctx.tool("charge")

        tries: list[Callable[[], Any]] = [
            lambda: ctx.tool("charge"),
            lambda: ctx.now(),
            lambda: ctx.emit({"from": "a thread"}),
            lambda: ctx.reserve_callsites(1),
            lambda: asyncio.run(made_on_the_loop),
            lambda: asyncio.run(on_a_loop_of_its_own()),
        ]
        outcomes: list[BaseException | None] = []
        for attempt in tries:
            try:
                attempt()
            except BaseException as error:
                outcomes.append(error)
            else:
                outcomes.append(None)
        return outcomes

    seen: list[BaseException | None] = []

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        running = asyncio.ensure_future(ctx.tool("slow"))
        await asyncio.wait_for(ledger.first_started.wait(), 10)
        seen.extend(await asyncio.to_thread(misuse, ctx, ctx.tool("charge")))
        await running
        await ctx.tool("next_step")
        return end("done")

    tools = [
        define_tool("slow", "sleeps five leases", NoArgs, slow),
        define_tool("charge", "must never run", NoArgs, charge),
        define_tool("next_step", "runs after the slow tool", NoArgs, ledger.next_step),
    ]
    flow = define_flow("misused", "ctx handed to a thread", "n", [action("n", node)])
    agent = define_agent("a", "i", None, tools, [flow])
    first = Runtime([agent], store=open_store(), lease_ttl=SHORT_LEASE, holder="worker-a")
    tally: list[dict[str, Any]] = []
    other_store = open_store()
    watcher = threading.Thread(
        target=lambda: tally.append(asyncio.run(rival(other_store, session, SHORT_LEASE, 60)))
    )
    watcher.start()

    result = await first.run(session, kind="flow", flow_name="misused").result()
    watcher.join(timeout=60)

    assert result.status == "finished"
    assert len(seen) == 6
    for outcome in seen:
        assert isinstance(outcome, TurnClosedError), seen
        assert outcome.elsewhere
        assert "another thread or event loop" in str(outcome)
        assert "nothing was executed" in str(outcome)
    assert charged == []
    (watched,) = tally
    assert watched["recovered"] == []
    assert set(watched["refused"]) == {"worker-a"} and watched["refused"]["worker-a"] >= 3
    steps = await first.get_steps(result.run_id, session)
    assert [(s.name, s.status, s.attempts) for s in steps] == [
        ("slow", "finished", 1),
        ("next_step", "finished", 1),
    ]


@pytest.mark.parametrize(
    "backend", ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_tool_past_its_timeout_is_no_longer_kept_alive_by_the_heartbeat(
    open_store: Any,
) -> None:
    """The heartbeat keeps the lease while an attempt runs, up to the tool's
    ``timeout``: an async tool that blocks the loop past it lets its lease
    lapse (by the store's clock) before it returns."""
    blocking = threading.Event()
    lapsed: list[bool] = []
    store = open_store()
    watching_store = open_store()

    async def stuck(args: NoArgs) -> dict[str, Any]:
        blocking.set()
        time.sleep(BLOCK_SECONDS)  # noqa: ASYNC251 - blocks the loop past the timeout
        blocking.clear()
        return {"done": True}

    def watch(run_id: str) -> None:
        assert blocking.wait(10)
        while blocking.is_set():
            lease = watching_store.lease(run_id)
            if lease is not None and not lease.live:
                lapsed.append(True)
                return
            time.sleep(0.02)

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        with contextlib.suppress(ToolExecutionError):  # timed out, or not: either is fine
            await ctx.tool("stuck")
        return end("done")

    tool = define_tool("stuck", "blocks the loop", NoArgs, stuck, timeout=0.3)
    flow = define_flow("stuck", "a tool past its timeout", "n", [action("n", node)])
    runtime = Runtime(
        [define_agent("a", "i", None, [tool], [flow])],
        store=store, lease_ttl=SHORT_LEASE, holder="worker-a",
    )  # fmt: skip
    handle = runtime.run("s-timeout", kind="flow", flow_name="stuck")
    run_id = await handle.run_id
    watcher = threading.Thread(target=watch, args=(run_id,))
    watcher.start()
    await handle.result()
    watcher.join(timeout=30)
    assert lapsed == [True], "the lease was kept alive past the tool's timeout"


async def test_short_steps_start_no_heartbeat_thread_beyond_the_one_of_the_process() -> None:
    """Steps shorter than the heartbeat's interval share the process's one
    heartbeat thread (started once), and no step starts another."""

    def quick(args: NoArgs) -> dict[str, Any]:
        return {"ok": True}

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        for _ in range(20):
            await ctx.tool("quick")
        return end("done")

    tool = define_tool("quick", "returns at once", NoArgs, quick)
    flow = define_flow("quick", "twenty short steps", "n", [action("n", node)])
    runtime = Runtime([define_agent("a", "i", None, [tool], [flow])], store=RunStore.memory())
    results = await asyncio.gather(
        *(runtime.run(f"s-quick-{i}", kind="flow", flow_name="quick").result() for i in range(5))
    )
    assert {r.status for r in results} == {"finished"}
    beating = [t for t in threading.enumerate() if t.name == "kuralle-lease-heartbeat"]
    assert len(beating) == 1


def test_the_heartbeat_thread_sleeps_through_short_steps_and_beats_for_one_that_finished() -> None:
    """Short effects do not wake the process's heartbeat thread: while the lease is
    held it sleeps until the next beat is due, whether or not an effect is
    executing when it looks; then it beats once for the effects that finished
    meanwhile, and not again while none executes or finishes."""
    from kuralle_es._runtime.heartbeat import _PULSE, Heartbeat

    beats: list[float] = []

    def renew() -> bool:
        beats.append(time.monotonic())
        return True

    heartbeat = Heartbeat(renew, lambda: None, interval=0.3)
    heartbeat.renewed(time.monotonic())
    try:
        for _ in range(500):  # 500 short steps, each in and out at once
            heartbeat.leave(heartbeat.enter())
        assert heartbeat.renewed_at is not None
        due = heartbeat.renewed_at + heartbeat.interval
        deadline = time.monotonic() + 2.0  # the thread, told once, looks and sleeps
        while _PULSE.wakes_at > due and time.monotonic() < deadline:
            time.sleep(0.001)
        assert _PULSE.wakes_at <= due
        asleep_until = _PULSE.wakes_at
        for _ in range(500):
            heartbeat.leave(heartbeat.enter())
        assert _PULSE.wakes_at == asleep_until  # not woken by those steps
        time.sleep(0.6)  # the beat falls due: the steps finished since the last one
        assert len(beats) == 1
        time.sleep(0.7)  # nothing executed or finished since: no beat, however long
        assert len(beats) == 1
    finally:
        heartbeat.stop()


# ------------------------------------------------- a save slower than the lease
@pytest.mark.postgres
async def test_an_effect_never_starts_under_a_lease_that_lapsed_while_its_intent_was_saved(
    pg_dsn: str,
) -> None:
    """A save can outlast the lease: the store tries it again across a failover
    (CI caught a step executed twice that way: its intent committed on the new
    primary after the lease had lapsed, the tool ran, a sweeper took the run
    over and ran it again). Here the events table is locked for two and a
    half leases while the step's intent waits to be saved, and the lease
    record a little longer (so that a heartbeat's renewal cannot beat the
    tool to it): the tool must not start until the turn holds a live lease
    again, so it finds its lease live when it starts."""
    import psycopg

    lease_ttl = 1.0
    locked = threading.Event()
    started_live: list[bool] = []
    store, watching = RunStore.postgres(pg_dsn), RunStore.postgres(pg_dsn)

    def lock(run_id: str, table: str, seconds: float, ready: threading.Event) -> None:
        with psycopg.connect(pg_dsn) as conn:
            if table == "runstore_events":
                conn.execute("LOCK TABLE runstore_events IN EXCLUSIVE MODE")
            else:
                conn.execute(
                    "SELECT 1 FROM runstore_leases WHERE run_id = %s FOR UPDATE", (UUID(run_id),)
                )
            ready.set()
            time.sleep(seconds)

    def check(args: NoArgs, call: Any) -> dict[str, Any]:
        lease = watching.lease(call.run_id)
        started_live.append(lease is not None and lease.live)
        return {"ok": True}

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        if not locked.is_set():  # once
            table, row = threading.Event(), threading.Event()
            for name, seconds, ready in (
                ("runstore_events", 2.5 * lease_ttl, table),
                ("runstore_leases", 2.8 * lease_ttl, row),
            ):
                threading.Thread(target=lock, args=(ctx.run_id, name, seconds, ready)).start()
            assert table.wait(10) and row.wait(10)
            locked.set()
        await ctx.tool("check")
        return end("done")

    tool = define_tool("check", "reads its run's lease", NoArgs, check)
    flow = define_flow("slow-save", "a save slower than the lease", "n", [action("n", node)])
    runtime = Runtime(
        [define_agent("a", "i", None, [tool], [flow])],
        store=store, lease_ttl=lease_ttl, holder="worker-a",
    )  # fmt: skip
    try:
        result = await runtime.run("s-slow-save", kind="flow", flow_name="slow-save").result()
    finally:
        store.close()
        watching.close()
    assert result.status == "finished"
    assert started_live == [True], "the tool started under a lease that had lapsed"
