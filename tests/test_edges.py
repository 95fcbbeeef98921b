"""The promise at the edges (docs/guarantees.md, "At the edges").

One named regression test per way exactly-once broke where real applications
meet the library, each reproduced on an earlier release and each on memory,
SQLite and PostgreSQL where a backend applies: inbound keys after a crash,
args a tool mutates, tools that exit, values the journal cannot hold,
approvals racing cancels, deadlines on typed waits, and numbers that are not
numbers. (The lease clock and the heartbeat have their own tests:
``test_lease_clock.py``; the servers' doors ``test_http_doors.py``.)
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from kuralle_es import (
    DeadlineExpiredError,
    InvalidArgumentError,
    ModelResponseError,
    RetryPolicy,
    RunContext,
    Runtime,
    StaleWriteError,
    ToolCall,
    ToolExecutionError,
    UnrecordableValueError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    sweep_deadlines,
)

SESSION = "s-edges"


class Amount(BaseModel):
    amount: float


class Ledger:
    """What the tools really did (thread-safe: sync tools run on threads)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.keys: Counter[str] = Counter()
        self._lock = threading.Lock()

    def note(self, what: str, value: Any, key: str) -> None:
        with self._lock:
            self.calls.append((what, value))
            self.keys[key] += 1


def flow_agent(*tools: Any, nodes: list[Any], name: str = "edge") -> Any:
    return define_agent(
        "edges",
        "",
        None,
        list(tools),
        [define_flow(name, "", nodes[0].id, nodes)],
    )


# ------------------------------------------------------- tools that exit
@pytest.mark.parametrize("raised", [SystemExit(2), KeyboardInterrupt(), GeneratorExit()])
@pytest.mark.parametrize("style", ["sync", "async", "async-timeout"])
async def test_a_tool_raising_systemexit_or_keyboardinterrupt_fails_its_step_and_the_worker_goes_on(
    open_store: Any, raised: BaseException, style: str
) -> None:
    ledger = Ledger()

    def exits(args: Amount, call: ToolCall) -> Any:
        ledger.note("exits", args.amount, call.idempotency_key)
        raise raised

    async def exits_async(args: Amount, call: ToolCall) -> Any:
        return exits(args, call)

    tool = define_tool(
        "exits",
        "",
        Amount,
        exits if style == "sync" else exits_async,
        timeout=5.0 if style == "async-timeout" else None,
    )

    async def go(state: dict[str, Any], ctx: RunContext) -> Any:
        try:
            await ctx.tool("exits", {"amount": 1})
        except ToolExecutionError as e:
            return end(f"failed with {e.error_type}")
        return end("ran")

    runtime = Runtime([flow_agent(tool, nodes=[action("go", go)])], store=open_store())
    done = await runtime.run(SESSION, kind="flow", flow_name="edge").result()
    assert done.status == "finished"
    assert done.output == f"failed with {type(raised).__name__}"
    (step,) = await runtime.get_steps(done.run_id, SESSION)
    assert step.status == "error"
    assert step.error is not None and step.error.type == type(raised).__name__
    # Replayed, it stays frozen: the tool is not executed again.
    again = await runtime.run(SESSION, run_id=done.run_id).result()
    assert again.status == "finished"
    assert len(ledger.calls) == 1


def test_an_async_tool_attempt_closed_from_outside_closes_quietly() -> None:
    """Only a ``GeneratorExit`` the tool raises fails its attempt: the attempt's
    coroutine closed from outside (a pending task collected at a loop's end)
    closes the tool's coroutine and ends without raising anything else."""
    from kuralle_es._definitions.tools import _contained

    closed: list[bool] = []

    class Pending:
        def __await__(self) -> Any:
            try:
                yield None
            except GeneratorExit:
                closed.append(True)
                raise

    async def tool() -> None:
        await Pending()

    attempt = _contained(tool())
    attempt.send(None)  # now suspended in the tool
    attempt.close()  # raises nothing: the close went through
    assert closed == [True]


async def test_a_tool_raising_systemexit_is_retried_under_its_policy_like_any_failure(
    open_store: Any,
) -> None:
    ledger = Ledger()

    def flaky(args: Amount, call: ToolCall) -> Any:
        ledger.note("flaky", args.amount, call.idempotency_key)
        if len(ledger.calls) == 1:
            raise SystemExit("bad flag")
        return {"ok": True}

    tool = define_tool(
        "flaky", "", Amount, flaky, retry=RetryPolicy(max_attempts=2, initial_interval=0.01)
    )

    async def go(state: dict[str, Any], ctx: RunContext) -> Any:
        return end(str(await ctx.tool("flaky", {"amount": 1})))

    runtime = Runtime([flow_agent(tool, nodes=[action("go", go)])], store=open_store())
    done = await runtime.run(SESSION, kind="flow", flow_name="edge").result()
    assert (done.status, done.output) == ("finished", "{'ok': True}")
    (step,) = await runtime.get_steps(done.run_id, SESSION)
    assert step.attempts == 2
    assert len(set(ledger.keys)) == 1


# ------------------------------------------------- numbers that are not numbers
NOT_SECONDS = [math.nan, math.inf, -math.inf, "5", True, False, -1, 0, 10**30]


@pytest.mark.parametrize("value", NOT_SECONDS)
def test_lease_ttl_refuses_what_is_not_a_positive_number_of_seconds(value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="lease_ttl"):
        Runtime([], lease_ttl=value)


@pytest.mark.parametrize("value", NOT_SECONDS)
def test_a_tool_timeout_refuses_what_is_not_a_positive_number_of_seconds(value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="timeout"):
        define_tool("t", "", Amount, lambda args: None, timeout=value)


@pytest.mark.parametrize("value", NOT_SECONDS)
@pytest.mark.parametrize("field", ["initial_interval", "max_interval"])
def test_retry_intervals_refuse_what_is_not_a_positive_number_of_seconds(
    value: Any, field: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        RetryPolicy(**{field: value})


@pytest.mark.parametrize("value", [*NOT_SECONDS, datetime(2030, 1, 1), timedelta(seconds=-1)])
@pytest.mark.parametrize("wait", ["approve", "signal", "sleep"])
async def test_deadlines_and_sleeps_refuse_nan_infinities_strings_and_the_far_future_in_the_node(
    open_store: Any, value: Any, wait: str
) -> None:
    if wait == "sleep" and isinstance(value, datetime):
        pytest.skip("a sleep takes a length of time, not a moment")
    refused: list[str] = []

    async def go(state: dict[str, Any], ctx: RunContext) -> Any:
        try:
            if wait == "approve":
                await ctx.approve("ok?", deadline=value)
            elif wait == "signal":
                await ctx.signal("shipped", deadline=value)
            else:
                await ctx.sleep(value)
        except InvalidArgumentError as e:
            refused.append(str(e))
            return end("refused")
        return end("accepted")

    runtime = Runtime([flow_agent(nodes=[action("go", go)])], store=open_store())
    done = await runtime.run(SESSION, kind="flow", flow_name="edge").result()
    assert (done.status, done.output) == ("finished", "refused")
    assert refused and ("deadline" in refused[0] or "sleep" in refused[0])


async def test_an_empty_signal_id_and_an_approval_by_nobody_are_refused_and_write_nothing(
    open_store: Any,
) -> None:
    async def go(state: dict[str, Any], ctx: RunContext) -> Any:
        decision = await ctx.approve("ok?")
        return end("approved" if decision.approved else "denied")

    runtime = Runtime([flow_agent(nodes=[action("go", go)])], store=open_store())
    paused = await runtime.run(SESSION, kind="flow", flow_name="edge").result()
    before = await runtime.get_run(paused.run_id, SESSION)
    with pytest.raises(InvalidArgumentError, match="signal_id"):
        await runtime.approve(paused.run_id, SESSION, by="ann", signal_id="")
    with pytest.raises(InvalidArgumentError, match="by"):
        await runtime.approve(paused.run_id, SESSION, by=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="signal_id"):
        await runtime.signal(paused.run_id, SESSION, "x", {}, signal_id="")
    after = await runtime.get_run(paused.run_id, SESSION)
    assert before is not None and after is not None
    assert (after.version, after.status) == (before.version, "paused")


def test_timezone_naive_and_far_future_moments_are_refused_with_a_clear_line() -> None:
    from kuralle_es._durations import deadline_at

    now = datetime.now(UTC)
    with pytest.raises(InvalidArgumentError, match="timezone-aware"):
        deadline_at(datetime(2030, 1, 1), now)
    with pytest.raises(InvalidArgumentError, match="9999"):
        deadline_at(timedelta(days=3_000_000), now)
    assert deadline_at(timedelta(hours=1), now) == now + timedelta(hours=1)


# --------------------------------------------- args are the journal's, not the caller's
async def test_an_approved_tool_converting_its_args_in_place_runs_the_approved_args_each_attempt(
    open_store: Any,
) -> None:
    """The ported refund agent: the approver saw 42.5; the payment API got 4250 and then
    425000 under the same key, and the run finished "refunded 425000"."""
    ledger = Ledger()

    def refund(args: Amount, call: ToolCall) -> dict[str, Any]:
        args.amount = round(args.amount * 100)  # to cents, in place
        ledger.note("refund", args.amount, call.idempotency_key)
        if len(ledger.calls) == 1:
            raise ConnectionError("payment API timed out")
        return {"refunded": args.amount}

    tool = define_tool(
        "refund",
        "",
        Amount,
        refund,
        needs_approval=True,
        retry=RetryPolicy(max_attempts=3, initial_interval=0.01),
    )

    async def go(state: dict[str, Any], ctx: RunContext) -> Any:
        done = await ctx.tool("refund", {"amount": 42.5})
        return end(f"refunded {done['refunded']}")

    runtime = Runtime([flow_agent(tool, nodes=[action("go", go)])], store=open_store())
    paused = await runtime.run(SESSION, kind="flow", flow_name="edge").result()
    assert paused.waiting_for is not None and paused.waiting_for.operation is not None
    assert paused.waiting_for.operation.args == {"amount": 42.5}
    done = await runtime.approve(paused.run_id, SESSION, by="ann")
    assert (done.status, done.output) == ("finished", "refunded 4250")
    assert ledger.calls == [("refund", 4250), ("refund", 4250)]
    assert len(ledger.keys) == 1


async def test_a_node_that_changes_its_value_after_calling_ctx_tool_does_not_change_the_call(
    open_store: Any,
) -> None:
    seen: list[Any] = []

    class Basket(BaseModel):
        items: list[str]
        extra: dict[str, Any] = {}

    def order(args: Basket) -> dict[str, Any]:
        seen.append((list(args.items), dict(args.extra)))
        return {"ordered": len(args.items)}

    tool = define_tool("order", "", Basket, order)

    async def go(state: dict[str, Any], ctx: RunContext) -> Any:
        value = {"items": ["tea"], "extra": {"note": "first"}}
        model = Basket(items=["cake"])
        first = ctx.tool("order", value)
        second = ctx.tool("order", model)
        value["items"].append("coffee")
        value["extra"]["note"] = "changed"
        model.items.append("pie")
        await first
        await second
        return end("ok")

    runtime = Runtime([flow_agent(tool, nodes=[action("go", go)])], store=open_store())
    done = await runtime.run(SESSION, kind="flow", flow_name="edge").result()
    assert done.status == "finished"
    assert seen == [(["tea"], {"note": "first"}), (["cake"], {})]
    steps = await runtime.get_steps(done.run_id, SESSION)
    assert [s.status for s in steps] == ["finished", "finished"]


# ------------------------------------------------ values the journal cannot hold
def nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "returned",
    ["ok \ud800", nested(3000), nested(101), {"when": object()}, {"x": math.nan}],
    ids=["lone-surrogate", "3000-deep", "101-deep", "an-object", "nan"],
)
async def test_a_tool_result_the_journal_cannot_hold_fails_the_step_once_and_is_never_rerun(
    open_store: Any, returned: Any
) -> None:
    ledger = Ledger()

    def tool_fn(args: Amount, call: ToolCall) -> Any:
        ledger.note("odd", args.amount, call.idempotency_key)
        return returned

    tool = define_tool("odd", "", Amount, tool_fn)
    errors: list[ToolExecutionError] = []

    async def go(state: dict[str, Any], ctx: RunContext) -> Any:
        try:
            await ctx.tool("odd", {"amount": 1})
        except ToolExecutionError as e:
            errors.append(e)
            return end("refused")
        return end("stored")

    runtime = Runtime([flow_agent(tool, nodes=[action("go", go)])], store=open_store())
    done = await runtime.run(SESSION, kind="flow", flow_name="edge").result()
    assert (done.status, done.output) == ("finished", "refused")
    assert "cannot be journaled" in errors[0].message and "$" in errors[0].message
    (step,) = await runtime.get_steps(done.run_id, SESSION)
    assert step.status == "error"
    fork = await runtime.fork(done.run_id, SESSION, at_step=1)  # replays the frozen error
    assert fork.status == "finished"
    assert len(ledger.calls) == 1


async def test_a_tool_error_whose_message_holds_a_lone_surrogate_is_journaled(
    open_store: Any,
) -> None:
    def tool_fn(args: Amount) -> Any:
        raise ValueError("bad \udcff input")

    async def go(state: dict[str, Any], ctx: RunContext) -> Any:
        try:
            await ctx.tool("bad", {"amount": 1})
        except ToolExecutionError as e:
            return end(f"failed: {e.message}")
        return end("ok")

    tool = define_tool("bad", "", Amount, tool_fn)
    runtime = Runtime([flow_agent(tool, nodes=[action("go", go)])], store=open_store())
    done = await runtime.run(SESSION, kind="flow", flow_name="edge").result()
    assert done.status == "finished"
    assert done.output == "failed: bad \\udcff input"


@pytest.mark.parametrize(
    "ending",
    ["surrogate-output", "object-output", "object-in-state", "surrogate-title"],
)
async def test_a_node_value_the_journal_cannot_hold_ends_the_run_error_never_left_running(
    open_store: Any, ending: str
) -> None:
    async def go(state: dict[str, Any], ctx: RunContext) -> Any:
        if ending == "surrogate-output":
            return end("bye \ud83d")  # a model reply cut mid-emoji
        if ending == "object-output":
            return end(object())  # type: ignore[arg-type]
        if ending == "surrogate-title":
            await ctx.approve("ok \ud800?")
        state["when"] = object()
        return end("done")

    runtime = Runtime([flow_agent(nodes=[action("go", go)])], store=open_store())
    handle = runtime.run(SESSION, kind="flow", flow_name="edge")
    with pytest.raises(UnrecordableValueError, match="cannot be journaled"):
        await handle.result()
    run_id = await handle.run_id
    state = await runtime.get_run(run_id, SESSION)
    assert state is not None
    assert state.status == "error"
    assert state.lease_holder is None
    assert state.error is not None and state.error.type == "UnrecordableValueError"


async def test_a_model_reply_cut_mid_emoji_ends_the_conversation_turn_in_error(
    open_store: Any,
) -> None:
    from kuralle_es.testing import ScriptedModel

    agent = define_agent("chat", "", ScriptedModel(["half an emoji \ud83d"]), [])
    runtime = Runtime([agent], store=open_store())
    handle = runtime.run("s-chat", input="hello")
    with pytest.raises(ModelResponseError, match=r"\$\.content"):
        await handle.result()
    state = await runtime.get_run(await handle.run_id, "s-chat")
    assert state is not None and state.status == "error" and state.lease_holder is None


# ------------------------------------------------------------ cancels in flight
@pytest.mark.parametrize("attempt", range(12))
async def test_an_approval_racing_a_cancel_never_leaves_an_executed_charge_unrecorded(
    open_store: Any, attempt: int
) -> None:
    """14 of 60 tries: the charge ran, the run ended ``aborted`` with the step
    ``running``, and the approver was told "nothing of this write was stored"."""
    ledger = Ledger()

    async def charge(args: Amount, call: ToolCall) -> dict[str, Any]:
        ledger.note("charge", args.amount, call.idempotency_key)
        await asyncio.sleep(0.002 * (attempt % 4))
        return {"charged": args.amount}

    tool = define_tool("charge", "", Amount, charge, needs_approval=True)

    async def go(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("charge", {"amount": 42.5})
        return end("charged")

    agent = flow_agent(tool, nodes=[action("go", go)])
    approver = Runtime([agent], store=open_store(), holder="approver")
    operator = Runtime([agent], store=open_store(), holder="operator")
    paused = await approver.run(SESSION, kind="flow", flow_name="edge").result()

    async def cancel_soon() -> Any:
        await asyncio.sleep(0.001 * (attempt % 6))
        return await operator.cancel(paused.run_id, SESSION, "changed my mind")

    approved, cancelled = await asyncio.gather(
        approver.approve(paused.run_id, SESSION, by="ann"),
        cancel_soon(),
        return_exceptions=True,
    )
    if isinstance(cancelled, InvalidArgumentError):  # the run finished first
        assert "nothing to cancel" in str(cancelled)
    else:
        assert not isinstance(cancelled, BaseException), cancelled
    steps = await operator.get_steps(paused.run_id, SESSION)
    charges = [s for s in steps if s.name == "charge"]
    if ledger.calls:
        assert len(ledger.calls) == 1
        assert [s.status for s in charges] == ["finished"]
        if isinstance(approved, StaleWriteError):
            assert approved.recorded, approved
            assert "nothing of this write was stored" not in str(approved)
    else:
        assert all(s.status != "running" for s in charges)
    final = await operator.get_run(paused.run_id, SESSION)
    assert final is not None and final.status in ("aborted", "finished")
    assert final.lease_holder is None


# ------------------------------------------------------ a deadline on a typed wait
class Shipped(BaseModel):
    tracking: str


@pytest.mark.parametrize("typed", [True, False])
async def test_a_typed_signal_whose_deadline_passes_raises_deadline_expired_in_the_node(
    open_store: Any, typed: bool
) -> None:
    """The deadline path handed ``ctx.signal(schema=M)`` a plain dict, so typed node
    code (``shipped.tracking``) raised."""
    seen: list[Any] = []

    async def wait(state: dict[str, Any], ctx: RunContext) -> Any:
        try:
            shipped = await ctx.signal("shipped", deadline=0.2, schema=Shipped if typed else None)
        except DeadlineExpiredError as expired:
            seen.append(expired)
            return end("timed out")
        seen.append(shipped)
        return end("no tracking" if isinstance(shipped, dict) else shipped.tracking)

    store = open_store()
    runtime = Runtime([flow_agent(nodes=[action("wait", wait)])], store=store)
    paused = await runtime.run(SESSION, kind="flow", flow_name="edge").result()
    assert paused.waiting_for is not None and paused.waiting_for.deadline is not None
    await asyncio.sleep(0.3)
    assert await sweep_deadlines(runtime) == [paused.run_id]
    done = await runtime.get_run(paused.run_id, SESSION)
    assert done is not None and done.status == "finished"
    if typed:
        assert done.outcome == "timed out"
        (expired,) = seen
        assert expired.name == "shipped"
        assert expired.deadline == paused.waiting_for.deadline
        # Replayed (a fork past the deny), the node meets the same error.
        fork = await runtime.fork(paused.run_id, SESSION, at_step=1)
        assert (fork.status, fork.output) == ("finished", "timed out")
        assert seen[-1].deadline == paused.waiting_for.deadline
    else:
        assert done.outcome == "no tracking"
        deny = {"approved": False, "denied": True, "by": "deadline", "reason": "deadline-expired"}
        assert seen == [deny]


@pytest.mark.parametrize("flag", ["--lease-ttl", "--interval"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "soon"])
def test_the_worker_refuses_a_flag_that_is_not_a_number_of_seconds_at_once(
    flag: str, value: str, tmp_path: Any
) -> None:
    """``kuralle-es worker --lease-ttl nan`` started and logged a skip every pass."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "kuralle_es.cli", "worker", "--store",
         f"sqlite:///{tmp_path / 'runs.db'}", flag, value],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert flag in done.stderr and "seconds" in done.stderr
    assert "worker started" not in done.stderr
