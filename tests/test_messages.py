"""Messages (``runtime.send`` / ``ctx.receive``), on memory, SQLite and PostgreSQL.

A message goes into a run's mailbox whatever the run is doing; a receive
takes the oldest unread one of its name and journals which, so a replay
takes the same; a run paused in a receive is driven on within the send. A
send racing the turn that drives the run is taken into that turn's next
save: the turn is not stopped and its step is not left in doubt.
docs/messages.md.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest
from pydantic import BaseModel

from kuralle_es import (
    DeadlineExpiredError,
    InvalidArgumentError,
    InvalidSignalError,
    RunNotFoundError,
    RunStore,
    Runtime,
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
from kuralle_es._journal.catalogue import MailDelivered, Paused
from kuralle_es._journal.leases import LeaseOp
from kuralle_es._journal.run import Run
from kuralle_es.testing import Crash

SESSION = "s-mail"


class Item(BaseModel):
    sku: str


class Nothing(BaseModel):
    pass


class Shop:
    """Flows that receive messages; ``ships`` counts executions of ``ship`` by key."""

    def __init__(self, *, ship_dies: bool = False, ship_takes: float = 0.0) -> None:
        self.ships: Counter[str] = Counter()
        self.ship_dies = ship_dies
        self.ship_takes = ship_takes

    async def ship(self, args: Nothing, call: ToolCall) -> str:
        self.ships[call.idempotency_key] += 1
        if self.ship_takes:
            await asyncio.sleep(self.ship_takes)
        if self.ship_dies:
            raise Crash("the worker dies inside ship, after shipping")
        return "shipped"

    def agent(self) -> Any:
        async def two(state: dict[str, Any], ctx: Any) -> Any:
            first = await ctx.receive("item")
            second = await ctx.receive("item")
            await ctx.tool("ship", {})
            return end(f"{first}+{second}")

        async def after_ok(state: dict[str, Any], ctx: Any) -> Any:
            await ctx.approve("go on?")
            return end(str(await ctx.receive("item")))

        async def ship_then_receive(state: dict[str, Any], ctx: Any) -> Any:
            await ctx.tool("ship", {})
            return end(str(await ctx.receive("item")))

        async def typed(state: dict[str, Any], ctx: Any) -> Any:
            item = await ctx.receive("item", schema=Item)
            return end(item.sku)

        async def timer(state: dict[str, Any], ctx: Any) -> Any:
            try:
                stop = await ctx.receive("stop", deadline=timedelta(seconds=0.3))
            except DeadlineExpiredError:
                return end("the timer ran out")
            return end(f"stopped: {stop}")

        flows = [
            define_flow(name, "", name, [action(name, node)])
            for name, node in (
                ("two", two), ("after_ok", after_ok), ("ship_then_receive", ship_then_receive),
                ("typed", typed), ("timer", timer),
            )
        ]  # fmt: skip
        return define_agent("shop", "", None, [define_tool("ship", "", Nothing, self.ship)], flows)


def runtime(shop: Shop, store: RunStore, **kwargs: Any) -> Runtime:
    return Runtime([shop.agent()], store=store, **kwargs)


async def start(rt: Runtime, flow: str) -> str:
    result = await rt.run(SESSION, kind="flow", flow_name=flow).result()
    return result.run_id


def versions(store: RunStore, run_id: str) -> int:
    return len(store.run_events(run_id))


def received(steps: list[Any]) -> list[tuple[str, Any]]:
    return [(s.result["message_id"], s.result["payload"]) for s in steps if s.kind == "receive"]


async def test_a_message_sent_before_the_run_reaches_its_receive_is_received(
    open_store: Any,
) -> None:
    rt = runtime(Shop(), open_store())
    run_id = await start(rt, "after_ok")
    early = await rt.send(run_id, SESSION, "item", "A-1", message_id="m1")
    assert early.status == "paused" and early.waiting_for is not None
    assert early.waiting_for.name == "__approval"  # the run as it stands: still on its approval
    done = await rt.approve(run_id, SESSION, by="ann")
    assert (done.status, done.output) == ("finished", "A-1")
    assert received(await rt.get_steps(run_id, SESSION)) == [("m1", "A-1")]


async def test_a_message_to_a_run_waiting_in_receive_resumes_it_within_send(
    open_store: Any,
) -> None:
    store = open_store()
    rt = runtime(Shop(), store)
    run_id = await start(rt, "two")
    state = await rt.get_run(run_id, SESSION)
    assert state is not None and state.waiting_for is not None
    assert (state.status, state.waiting_for.kind, state.waiting_for.name) == (
        "paused", "message", "item",
    )  # fmt: skip
    first = await rt.send(run_id, SESSION, "item", "A-1", message_id="m1")
    assert first.status == "paused" and first.waiting_for is not None
    assert first.waiting_for.callsite == 1  # driven on to the second receive
    done = await rt.send(run_id, SESSION, "item", "B-2", message_id="m2")
    assert (done.status, done.output) == ("finished", "A-1+B-2")
    steps = await rt.get_steps(run_id, SESSION)
    assert received(steps) == [("m1", "A-1"), ("m2", "B-2")]
    assert [s.kind for s in steps] == ["receive", "receive", "tool"]


async def test_a_repeated_message_id_is_a_no_op(open_store: Any) -> None:
    store = open_store()
    rt = runtime(Shop(), store)
    run_id = await start(rt, "after_ok")
    await rt.send(run_id, SESSION, "item", "A-1", message_id="m1")
    stored = versions(store, run_id)
    again = await rt.send(run_id, SESSION, "item", "other", message_id="m1")
    assert again.status == "paused" and versions(store, run_id) == stored
    done = await rt.approve(run_id, SESSION, by="ann")
    assert done.output == "A-1"
    after = versions(store, run_id)
    late = await rt.send(run_id, SESSION, "item", "A-1", message_id="m1")  # a retry after use
    assert late.status == "finished" and versions(store, run_id) == after


async def test_a_send_to_an_ended_run_is_refused_and_writes_nothing(open_store: Any) -> None:
    store = open_store()
    rt = runtime(Shop(), store)
    finished = await start(rt, "two")
    await rt.send(finished, SESSION, "item", 1, message_id="m1")
    await rt.send(finished, SESSION, "item", 2, message_id="m2")
    cancelled = await start(rt, "two")
    await rt.cancel(cancelled, SESSION, "changed my mind")
    for run_id, status in ((finished, "finished"), (cancelled, "aborted")):
        stored = versions(store, run_id)
        with pytest.raises(SignalMismatchError, match=f"is {status}"):
            await rt.send(run_id, SESSION, "item", 3, message_id="m3")
        assert versions(store, run_id) == stored
    with pytest.raises(RunNotFoundError):
        await rt.send(finished, "another-session", "item", 3, message_id="m4")
    with pytest.raises(RunNotFoundError):
        await rt.send(str(UUID(int=7)), SESSION, "item", 3, message_id="m4")
    with pytest.raises(InvalidArgumentError):
        await rt.send(finished, SESSION, "__approval", 3, message_id="m5")
    with pytest.raises(InvalidArgumentError):
        await rt.send(finished, SESSION, "item", 3, message_id="")


async def test_two_receives_take_two_messages_in_order_and_a_replay_takes_the_same_ones(
    open_store: Any,
) -> None:
    """The worker dies inside ``ship``, after both receives were journaled; a third
    message arrives while the run is an orphan. The recovery replays the receives
    (the same two messages, in order) and leaves the third unread."""
    dying = Shop(ship_dies=True)
    rt = runtime(dying, open_store(), lease_ttl=0.3, holder="dead")
    run_id = await start(rt, "two")
    await rt.send(run_id, SESSION, "item", "A-1", message_id="m1")
    with pytest.raises(Crash):
        await rt.send(run_id, SESSION, "item", "B-2", message_id="m2")
    late = await rt.send(run_id, SESSION, "item", "C-3", message_id="m3")
    assert late.status == "running"  # the orphan as it stands: the message waits in its mailbox
    await asyncio.sleep(0.4)
    shop = Shop()
    sweeper = runtime(shop, open_store(), holder="sweeper")
    assert await recover_orphaned_runs(sweeper) == [run_id]
    state = await sweeper.get_run(run_id, SESSION)
    assert state is not None and (state.status, state.outcome) == ("finished", "A-1+B-2")
    steps = await sweeper.get_steps(run_id, SESSION)
    assert received(steps) == [("m1", "A-1"), ("m2", "B-2")]
    [ship] = [s for s in steps if s.kind == "tool"]
    assert (dying.ships[ship.key], shop.ships[ship.key], ship.attempts) == (1, 1, 2)
    run = sweeper.store.load(run_id)
    assert run is not None and [m["message_id"] for m in run.mailbox] == ["m3"]


async def test_a_receive_past_its_deadline_raises_deadline_expired_via_sweep_deadlines(
    open_store: Any,
) -> None:
    rt = runtime(Shop(), open_store())
    run_id = await start(rt, "timer")
    state = await rt.get_run(run_id, SESSION)
    assert state is not None and state.waiting_for is not None
    assert (state.waiting_for.kind, state.waiting_for.deadline is not None) == ("message", True)
    with pytest.raises(SignalMismatchError, match=r"runtime\.send"):
        await rt.signal(run_id, SESSION, "stop", "now")  # signals keep their strict match
    await asyncio.sleep(0.4)
    assert await sweep_deadlines(rt) == [run_id]
    state = await rt.get_run(run_id, SESSION)
    assert state is not None and (state.status, state.outcome) == ("finished", "the timer ran out")
    [step] = await rt.get_steps(run_id, SESSION)
    assert (step.kind, step.name, set(step.result)) == ("receive", "stop", {"deadline_expired"})
    assert await sweep_deadlines(rt) == []


async def test_a_message_before_the_deadline_cuts_the_timer_short(open_store: Any) -> None:
    rt = runtime(Shop(), open_store())
    run_id = await start(rt, "timer")
    done = await rt.send(run_id, SESSION, "stop", "by hand", message_id="stop-1")
    assert (done.status, done.output) == ("finished", "stopped: by hand")


async def test_a_receive_with_a_schema_refuses_a_payload_that_does_not_fit(
    open_store: Any,
) -> None:
    store = open_store()
    rt = runtime(Shop(), store)
    run_id = await start(rt, "typed")
    stored = versions(store, run_id)
    with pytest.raises(InvalidSignalError, match="Item"):
        await rt.send(run_id, SESSION, "item", {"nope": 1}, message_id="bad")
    assert versions(store, run_id) == stored
    done = await rt.send(run_id, SESSION, "item", {"sku": "A-1"}, message_id="good")
    assert (done.status, done.output) == ("finished", "A-1")


async def test_a_send_while_a_turn_drives_the_run_is_taken_into_that_turn(
    open_store: Any,
) -> None:
    """The send lands while ``ship`` executes: the turn's next save clashes with it,
    takes the message in and is made after it; the turn goes on to its receive,
    which finds the message, and the tool ran once, its step never in doubt."""
    shop = Shop(ship_takes=0.4)
    store = open_store()
    rt = runtime(shop, store)
    sender = runtime(Shop(), open_store(), holder="sender")
    handle = rt.run(SESSION, kind="flow", flow_name="ship_then_receive")
    run_id = await handle.run_id
    await asyncio.sleep(0.15)
    sent = await sender.send(run_id, SESSION, "item", "A-1", message_id="m1")
    assert sent.status == "running"
    done = await handle.result()
    assert (done.status, done.output) == ("finished", "A-1")
    steps = await rt.get_steps(run_id, SESSION)
    assert [(s.kind, s.attempts) for s in steps] == [("tool", 1), ("receive", 1)]
    assert list(shop.ships.values()) == [1]
    names = [type(e).__name__ for e in store.run_events(run_id)]
    assert names.index("MailReceived") < names.index("StepSucceeded")


class SendsAsItPauses(RunStore):
    """A store whose save of a pause in a receive first lets another process's send
    land, so the pause loses that race: the message arrives after the receive looked."""

    sender: tuple[Runtime, str] | None = None
    #: Die (the testing kit's Crash) right after the save that woke the run.
    dies_after_the_wake = False

    async def save_run_async(self, run: Run, lease: LeaseOp | None = None) -> None:
        pausing = any(
            isinstance(e, Paused) and e.waiting_for["kind"] == "message" for e in run.pending_events
        )
        woken = any(isinstance(e, MailDelivered) for e in run.pending_events)
        if pausing and self.sender is not None:
            other, message_id = self.sender
            self.sender = None
            late = await other.send(run.run_id, SESSION, "item", "late", message_id=message_id)
            assert late.status == "running"
        await super().save_run_async(run, lease)
        if woken and self.dies_after_the_wake:
            self.dies_after_the_wake = False
            raise Crash("the worker dies right after its close was woken by a message")


def racing_stores(
    backend: str, tmp_path: Any, request: pytest.FixtureRequest
) -> tuple[SendsAsItPauses, RunStore]:
    """A store whose pause in a receive loses the race to a send, and the sender's store."""
    if backend == "memory":
        store = SendsAsItPauses.memory()
        return store, store
    if backend == "sqlite":
        path = str(tmp_path / "race.db")
        return SendsAsItPauses.sqlite(path), RunStore.sqlite(path)
    dsn = request.getfixturevalue("pg_dsn")
    return SendsAsItPauses.postgres(dsn), RunStore.postgres(dsn)


async def test_a_message_that_lands_as_the_turn_pauses_in_receive_wakes_the_run_at_once(
    backend: str, tmp_path: Any, request: pytest.FixtureRequest
) -> None:
    """The pause's save clashes with the message: it takes it in, and wakes the run
    in that same save (the receive's step journaled), then drives it on."""
    store, other_store = racing_stores(backend, tmp_path, request)
    try:
        rt = runtime(Shop(), store)
        store.sender = (runtime(Shop(), other_store, holder="sender"), "m1")
        result = await rt.run(SESSION, kind="flow", flow_name="after_ok").result()
        assert result.status == "paused"
        done = await rt.approve(result.run_id, SESSION, by="ann")
        assert (done.status, done.output) == ("finished", "late")
        events = [type(e).__name__ for e in store.run_events(result.run_id)]
        assert events.count("MailDelivered") == 1 and events.count("Paused") == 2
        steps = await rt.get_steps(result.run_id, SESSION)
        assert received(steps) == [("m1", "late")]
    finally:
        store.close()
        if other_store is not store:
            other_store.close()


async def test_a_worker_dying_right_after_that_wake_leaves_an_orphan_that_recovery_ends(
    backend: str, tmp_path: Any, request: pytest.FixtureRequest
) -> None:
    """The woken close kept the lease: the run is running, not paused on a wait
    whose message already came, so a recovery drives it on once the lease lapses."""
    store, other_store = racing_stores(backend, tmp_path, request)
    try:
        rt = runtime(Shop(), store, lease_ttl=0.3, holder="dead")
        store.sender = (runtime(Shop(), other_store, holder="sender"), "m1")
        store.dies_after_the_wake = True
        result = await rt.run(SESSION, kind="flow", flow_name="after_ok").result()
        with pytest.raises(Crash):
            await rt.approve(result.run_id, SESSION, by="ann")
        state = await rt.get_run(result.run_id, SESSION)
        assert state is not None and (state.status, state.lease_holder) == ("running", "dead")
        await asyncio.sleep(0.4)
        sweeper = runtime(Shop(), other_store, holder="sweeper")
        assert await recover_orphaned_runs(sweeper) == [result.run_id]
        state = await sweeper.get_run(result.run_id, SESSION)
        assert state is not None and (state.status, state.outcome) == ("finished", "late")
    finally:
        store.close()
        if other_store is not store:
            other_store.close()


async def test_a_fork_takes_the_messages_the_original_had_where_it_stands(
    open_store: Any,
) -> None:
    """Forked at its second receive, the fork replays the first (the same message)
    and its second receive takes, from the mailbox copied up to there, the one
    the original took."""
    shop = Shop()
    rt = runtime(shop, open_store())
    run_id = await start(rt, "two")
    await rt.send(run_id, SESSION, "item", "A-1", message_id="m1")
    await rt.send(run_id, SESSION, "item", "B-2", message_id="m2")
    fork = await rt.fork(run_id, SESSION, 1)
    assert (fork.status, fork.output) == ("finished", "A-1+B-2")
    assert received(await rt.get_steps(fork.run_id, SESSION)) == [("m1", "A-1"), ("m2", "B-2")]
    assert sum(shop.ships.values()) == 2  # the original's ship, and the fork's own key's
