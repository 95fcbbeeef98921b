"""Callsites, reads that are never replayed, and errors that keep what they know.

- ``replay=False`` reads run again on every pass but keep one step per key.
- ``ctx.reserve_callsites(n)`` and ``ctx.tool(..., callsite=/index=)`` pin
  effects to ordinals chosen up front, whatever order they are called in.
- A frozen tool failure carries its journaled error data on the first pass
  and, identical, on replay.
- Bad arguments to public calls are ``InvalidArgumentError`` (a ``ValueError``).
"""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest
from pydantic import BaseModel

from kuralle_es import (
    InvalidArgumentError,
    KuralleError,
    RunStore,
    Runtime,
    SignalDelivery,
    StaleWriteError,
    ToolExecutionError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    idempotency_key,
)

SESSION = "s-journal"


class Echo(BaseModel):
    x: str


class NoArgs(BaseModel):
    pass


def runtime_of(node: Any, tools: list[Any], store: RunStore) -> Runtime:
    flow = define_flow("f", "d", "n", [action("n", node)])
    return Runtime([define_agent("a", "i", None, tools, [flow])], store=store)


async def go(runtime: Runtime, run_id: str, signal_id: str = "go-1") -> Any:
    delivery = SignalDelivery(signal_id=signal_id, name="go", payload={})
    return await runtime.run(SESSION, run_id=run_id, signal_delivery=delivery).result()


# ------------------------------------------------------------- replay=False
async def test_a_read_that_is_never_replayed_runs_each_pass_on_one_step_per_key(
    open_store: Any,
) -> None:
    calls: list[int] = []

    def read(args: NoArgs) -> dict[str, int]:
        calls.append(len(calls) + 1)
        return {"pass": len(calls)}

    seen: list[Any] = []

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        seen.append(await ctx.tool("read"))
        await ctx.signal("go")
        return end("done")

    tool = define_tool("read", "a live read", NoArgs, read, replay=False)
    runtime = runtime_of(node, [tool], open_store())
    paused = await runtime.run(SESSION, kind="flow", flow_name="f").result()
    assert paused.status == "paused"
    done = await go(runtime, paused.run_id)
    assert done.status == "finished"

    assert seen == [{"pass": 1}, {"pass": 2}]  # re-run on the second pass, not replayed
    steps = await runtime.get_steps(paused.run_id, SESSION)
    reads = [s for s in steps if s.name == "read"]
    assert len(reads) == 1
    assert reads[0].attempts == 2
    assert reads[0].status == "finished"
    assert reads[0].result == {"pass": 2}
    assert len({s.key for s in steps}) == len(steps)


# ------------------------------------------------------------- callsites
async def test_reserved_callsites_pin_tools_to_their_ordinals_whatever_the_call_order(
    open_store: Any,
) -> None:
    executed: list[str] = []

    async def echo(args: Echo) -> str:
        executed.append(args.x)
        await asyncio.sleep(0)
        return args.x

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        first, second = ctx.reserve_callsites(2)
        later = ctx.tool("echo", {"x": "second"}, callsite=second)
        sooner = ctx.tool("echo", {"x": "first"}, index=first)
        results = await asyncio.gather(later, sooner)
        await ctx.now()  # takes the next ordinal after the reserved ones
        await ctx.signal("go")
        return end(",".join(results))

    runtime = runtime_of(node, [define_tool("echo", "echo", Echo, echo)], open_store())
    paused = await runtime.run(SESSION, kind="flow", flow_name="f").result()
    state = await runtime.get_run(paused.run_id, SESSION)
    assert state is not None
    done = await go(runtime, paused.run_id)
    assert done.status == "finished"
    assert executed == ["second", "first"]  # replayed on the second pass, not executed

    steps = await runtime.get_steps(paused.run_id, SESSION)
    by_callsite = {s.callsite: s for s in steps}
    assert by_callsite[0].result == "first"
    assert by_callsite[1].result == "second"
    assert by_callsite[2].kind == "now"
    assert by_callsite[3].kind == "signal"
    logical = f"{paused.run_id}#0#f@{state.flow_digest}"
    for callsite, x in ((0, "first"), (1, "second")):
        payload = {"name": "echo", "args": {"x": x}}
        assert by_callsite[callsite].key == idempotency_key(logical, callsite, payload)


async def test_bad_callsite_arguments_are_invalid_argument_errors_and_take_no_callsite() -> None:
    outcomes: list[str] = []

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        for bad in (
            lambda: ctx.reserve_callsites(-1),
            lambda: ctx.tool("echo", {"x": "a"}, callsite=1, index=2),
        ):
            try:
                bad()
            except InvalidArgumentError as e:
                assert isinstance(e, ValueError)
                outcomes.append(type(e).__name__)
        assert ctx.reserve_callsites(1) == [0]  # nothing was taken by the refusals
        return end("ok")

    echo = define_tool("echo", "echo", Echo, lambda a: a.x)
    runtime = runtime_of(node, [echo], RunStore.memory())
    result = await runtime.run(SESSION, kind="flow", flow_name="f").result()
    assert result.status == "finished"
    assert outcomes == ["InvalidArgumentError", "InvalidArgumentError"]


# ------------------------------------------------------------- error data
class CardDeclinedError(Exception):
    def __init__(self, code: str, retry_after: int) -> None:
        self.code = code
        self.retry_after = retry_after
        super().__init__(f"card declined: {code}")


async def test_a_frozen_tool_failure_keeps_its_error_data_identical_on_replay(
    open_store: Any,
) -> None:
    charges: list[int] = []

    def charge(args: NoArgs) -> None:
        charges.append(1)
        raise CardDeclinedError("insufficient_funds", 30)

    seen: list[tuple[str, str, str, dict[str, Any]]] = []

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        try:
            await ctx.tool("charge")
        except ToolExecutionError as e:
            seen.append((e.tool_name, e.error_type, e.message, e.data))
        await ctx.signal("go")
        return end("done")

    runtime = runtime_of(node, [define_tool("charge", "charge", NoArgs, charge)], open_store())
    paused = await runtime.run(SESSION, kind="flow", flow_name="f").result()
    done = await go(runtime, paused.run_id)
    assert done.status == "finished"
    assert charges == [1]  # frozen: never executed again
    expected = (
        "charge",
        "CardDeclinedError",
        "card declined: insufficient_funds",
        {"code": "insufficient_funds", "retry_after": 30},
    )
    assert seen == [expected, expected]
    steps = await runtime.get_steps(paused.run_id, SESSION)
    assert steps[0].error is not None
    assert steps[0].error.data == expected[3]


# ------------------------------------------------------------- public arguments
async def test_bad_arguments_to_public_calls_are_invalid_argument_errors() -> None:
    for ttl in (0, -1.0):
        with pytest.raises(InvalidArgumentError, match="lease_ttl"):
            Runtime([], store=RunStore.memory(), lease_ttl=ttl)
    agent = define_agent("a", "i", None, [], [])
    with pytest.raises(InvalidArgumentError, match="two agents"):
        Runtime([agent, agent], store=RunStore.memory())
    runtime = Runtime([agent], store=RunStore.memory())
    with pytest.raises(InvalidArgumentError, match="kind must be"):
        await runtime.run(SESSION, input="hi", kind="batch").result()
    with pytest.raises(InvalidArgumentError, match="needs flow_name"):
        await runtime.run(SESSION, input="hi", kind="flow").result()
    with pytest.raises(InvalidArgumentError, match="unknown agent"):
        runtime.agent("nobody")
    with pytest.raises(InvalidArgumentError, match="no agents"):
        await Runtime([], store=RunStore.memory()).run(SESSION, input="hi").result()

    async def bad_signal(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.signal("__reserved")
        return end("never")

    flow_runtime = runtime_of(bad_signal, [], RunStore.memory())
    with pytest.raises(InvalidArgumentError, match="signal name") as caught:
        await flow_runtime.run(SESSION, kind="flow", flow_name="f").result()
    assert isinstance(caught.value, KuralleError)


# ------------------------------------------------------------- failed saves
async def test_a_save_that_fails_for_another_reason_is_not_reported_as_another_writer(
    tmp_path: Any,
) -> None:
    db = tmp_path / "runs.db"
    env = {
        "PERSISTENCE_MODULE": "eventsourcing.sqlite",
        "SQLITE_DBNAME": str(db),
        "SQLITE_LOCK_TIMEOUT": "1",
    }
    store = RunStore(env=env)
    locker = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    calls: list[int] = []

    def lock_the_database(args: NoArgs) -> str:
        calls.append(1)
        if len(calls) == 1:
            locker.execute("BEGIN EXCLUSIVE")  # the result's save cannot get in
        return "done"

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        return end(await ctx.tool("lock"))

    tool = define_tool("lock", "holds the database", NoArgs, lock_the_database)
    runtime = runtime_of(node, [tool], store)
    handle = runtime.run(SESSION, kind="flow", flow_name="f")
    run_id = await handle.run_id
    try:
        with pytest.raises(Exception) as caught:
            await handle.result()
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert not isinstance(caught.value, StaleWriteError)
    assert "another writer" not in str(caught.value)
    assert "locked" in str(caught.value), repr(caught.value)

    # Nothing after the failed save was stored: the tool's step is still in
    # doubt, and re-addressing the run executes it again with the same key.
    steps = await runtime.get_steps(run_id, SESSION)
    assert [(s.name, s.status) for s in steps] == [("lock", "running")]
    again = await runtime.run(SESSION, run_id=run_id).result()
    assert again.status == "finished"
    assert calls == [1, 1]
    steps = await runtime.get_steps(run_id, SESSION)
    assert [(s.name, s.status, s.attempts) for s in steps] == [("lock", "finished", 2)]
    store.close()
