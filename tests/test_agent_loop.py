"""The agent loop (docs/concepts.md: replay; docs/howto/approvals.md): model ->
tool calls -> results -> model, until a reply; on memory, SQLite and PostgreSQL.

The model is a ``ScriptedModel``; its ``requests`` are what the model was
really asked, so they show both the tool messages it was given back and how
many times it was called (a resume must not call it for a journaled turn).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest
from pydantic import BaseModel

from kuralle_es import (
    ModelResponse,
    Runtime,
    SignalDelivery,
    StepRecord,
    StreamPart,
    ToolCallRequest,
    TurnHandle,
    TurnResult,
    define_agent,
    define_tool,
)
from kuralle_es.testing import ScriptedModel

SESSION = "s-loop"
RAN: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset() -> None:
    RAN.clear()


class AddArgs(BaseModel):
    a: int
    b: int


class RefundArgs(BaseModel):
    amount_cents: int


class Step(BaseModel):
    id: str
    group: str


def add(args: AddArgs) -> int:
    RAN["add"] += 1
    return args.a + args.b


def refund(args: RefundArgs) -> dict[str, int]:
    RAN["refund"] += 1
    return {"refunded": args.amount_cents}


def boom(args: AddArgs) -> int:
    RAN["boom"] += 1
    raise ValueError("boom: out of stock")


ADD = define_tool("add", "Add two numbers", AddArgs, add)
BOOM = define_tool("boom", "Always fails", AddArgs, boom)
REFUND = define_tool("refund", "Refund money", RefundArgs, refund, needs_approval=True)


def call(call_id: str, name: str, **args: Any) -> ToolCallRequest:
    return ToolCallRequest(call_id, name, args)


def tools_asked(*calls: ToolCallRequest, usage: dict[str, Any] | None = None) -> ModelResponse:
    return ModelResponse(tool_calls=list(calls), usage=usage)


def runtime_for(model: ScriptedModel, tools: list[Any], store: Any, **kw: Any) -> Runtime:
    agent = define_agent("helper", "Help with tools.", model, tools)
    return Runtime([agent], store=store, **kw)


async def drain(handle: TurnHandle) -> tuple[list[StreamPart], TurnResult]:
    parts = [part async for part in handle]
    return parts, await handle.result()


def tool_messages(model: ScriptedModel, request_index: int) -> list[Any]:
    return [m for m in model.requests[request_index].messages if m.role == "tool"]


def model_steps(steps: list[StepRecord]) -> list[StepRecord]:
    return [s for s in steps if s.kind == "model"]


# ------------------------------------------------------------------- loop
async def test_model_and_tools_alternate_until_the_model_replies(open_store: Any) -> None:
    model = ScriptedModel(
        [
            tools_asked(call("c1", "add", a=1, b=2)),
            tools_asked(call("c2", "add", a=3, b=4)),
            "The sums are 3 and 7.",
        ]
    )
    runtime = runtime_for(model, [ADD], open_store())
    result = await runtime.run(SESSION, input="add things").result()

    assert result.status == "finished"
    assert result.output == "The sums are 3 and 7."
    assert RAN["add"] == 2
    assert [r.purpose for r in model.requests] == ["agent", "agent", "agent"]
    assert model.requests[0].instructions == "Help with tools."
    assert [t["function"]["name"] for t in model.requests[0].tools] == ["add"]
    assert [(m.tool_call_id, m.content) for m in tool_messages(model, 1)] == [("c1", "3")]
    assert [(m.tool_call_id, m.content) for m in tool_messages(model, 2)] == [
        ("c1", "3"),
        ("c2", "7"),
    ]
    assistant = [m for m in model.requests[2].messages if m.role == "assistant"]
    assert [m.tool_calls[0]["id"] for m in assistant if m.tool_calls] == ["c1", "c2"]


async def test_each_model_turn_is_a_model_step_with_its_response_journaled(
    open_store: Any,
) -> None:
    model = ScriptedModel(
        [
            tools_asked(call("c1", "add", a=2, b=2), usage={"total_tokens": 17}),
            ModelResponse(content="Four.", usage={"total_tokens": 21}),
        ],
        id="scripted-7",
    )
    runtime = runtime_for(model, [ADD], open_store())
    result = await runtime.run(SESSION, input="2+2?").result()

    steps = await runtime.get_steps(result.run_id, SESSION)
    assert [s.kind for s in steps] == ["model", "tool", "model"]
    first, second = model_steps(steps)
    assert (first.name, second.name) == ("scripted-7", "scripted-7")
    assert first.status == second.status == "finished"
    assert first.result["tool_calls"] == [{"id": "c1", "name": "add", "args": {"a": 2, "b": 2}}]
    assert first.result["usage"] == {
        "input_tokens": None,
        "output_tokens": None,
        "total_tokens": 17,
    }
    assert second.result["content"] == "Four."
    assert second.result["usage"] == {
        "input_tokens": None,
        "output_tokens": None,
        "total_tokens": 21,
    }
    assert len({s.key for s in steps}) == 3


# ------------------------------------------------------------ concurrency
@pytest.mark.parametrize("configured", [2, 3, None], ids=["2", "3", "default-8"])
async def test_parallel_safe_calls_overlap_but_never_beyond_max_tool_concurrency(
    open_store: Any, configured: int | None
) -> None:
    bound = configured or 8
    active = 0
    peak = 0
    overlapped = asyncio.Event()

    async def fetch(args: Step) -> str:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        if active >= bound:
            overlapped.set()
        try:
            # The first call cannot finish until `bound` calls run at once.
            await asyncio.wait_for(overlapped.wait(), 10)
            await asyncio.sleep(0.02)  # room for a bound violation to show
        finally:
            active -= 1
        return args.id

    tool = define_tool("fetch", "Fetch", Step, fetch, parallel_safe=True)
    calls = [call(f"c{i}", "fetch", id=f"c{i}", group="p") for i in range(bound + 3)]
    model = ScriptedModel([tools_asked(*calls), "fetched"])
    limit = {} if configured is None else {"max_tool_concurrency": configured}
    runtime = runtime_for(model, [tool], open_store(), **limit)
    result = await runtime.run(SESSION, input="fetch all").result()

    assert result.output == "fetched"
    assert peak == bound
    assert [m.content for m in tool_messages(model, 1)] == [json.dumps(c.id) for c in calls]


async def test_a_call_that_is_not_parallel_safe_runs_alone(open_store: Any) -> None:
    log: list[tuple[str, str]] = []
    started: Counter[str] = Counter()
    together = {"p1": asyncio.Event(), "p2": asyncio.Event()}

    async def step(args: Step) -> str:
        log.append(("start", args.id))
        started[args.group] += 1
        if args.group in together:
            if started[args.group] == 2:
                together[args.group].set()
            await asyncio.wait_for(together[args.group].wait(), 10)
        await asyncio.sleep(0.02)
        log.append(("end", args.id))
        return args.id

    # parallel_safe as a predicate over the args: the "serial" group is not.
    tool = define_tool("step", "A step", Step, step, parallel_safe=lambda a: a.group != "serial")
    calls = [
        call("a", "step", id="a", group="p1"),
        call("b", "step", id="b", group="p1"),
        call("s1", "step", id="s1", group="serial"),
        call("s2", "step", id="s2", group="serial"),
        call("c", "step", id="c", group="p2"),
        call("d", "step", id="d", group="p2"),
    ]
    model = ScriptedModel([tools_asked(*calls), "done"])
    runtime = runtime_for(model, [tool], open_store())
    result = await runtime.run(SESSION, input="go").result()
    assert result.status == "finished"

    def at(event: str, call_id: str) -> int:
        return log.index((event, call_id))

    # a and b overlapped (each started before the other ended) ...
    assert at("start", "b") < at("end", "a")
    assert at("start", "a") < at("end", "b")
    # ... each serial call ran with nothing else in flight ...
    assert max(at("end", "a"), at("end", "b")) < at("start", "s1")
    assert at("start", "s1") + 1 == at("end", "s1")
    assert at("end", "s1") + 1 == at("start", "s2")
    assert at("start", "s2") + 1 == at("end", "s2")
    assert at("end", "s2") < min(at("start", "c"), at("start", "d"))
    # ... and c and d overlapped again.
    assert at("start", "d") < at("end", "c")
    assert at("start", "c") < at("end", "d")


async def test_tool_parts_and_tool_messages_follow_the_models_order_not_completion_order(
    open_store: Any,
) -> None:
    done = {name: asyncio.Event() for name in ("c1", "c2", "c3")}
    completion_order: list[str] = []
    waits_for = {"c1": "c2", "c2": "c3"}  # c3 finishes first, then c2, then c1

    async def fetch(args: Step) -> dict[str, str]:
        if args.id in waits_for:
            await asyncio.wait_for(done[waits_for[args.id]].wait(), 10)
        completion_order.append(args.id)
        done[args.id].set()
        return {"id": args.id}

    tool = define_tool("fetch", "Fetch", Step, fetch, parallel_safe=True)
    model = ScriptedModel(
        [tools_asked(*(call(i, "fetch", id=i, group="p") for i in ("c1", "c2", "c3"))), "ok"]
    )
    runtime = runtime_for(model, [tool], open_store())
    parts, result = await drain(runtime.run(SESSION, input="go"))

    assert result.status == "finished"
    assert completion_order == ["c3", "c2", "c1"]
    assert [p.tool_call_id for p in parts if p.type == "tool-call"] == ["c1", "c2", "c3"]
    results = [p for p in parts if p.type == "tool-result"]
    assert [p.tool_call_id for p in results] == ["c1", "c2", "c3"]
    assert [p.result for p in results] == [{"id": "c1"}, {"id": "c2"}, {"id": "c3"}]
    assert [m.tool_call_id for m in tool_messages(model, 1)] == ["c1", "c2", "c3"]
    assert [json.loads(m.content or "") for m in tool_messages(model, 1)] == [
        {"id": "c1"},
        {"id": "c2"},
        {"id": "c3"},
    ]
    assert parts[-1].type == "finished"


# ---------------------------------------------------------- refused calls
async def test_unknown_tool_gives_the_model_an_error_result_and_executes_nothing(
    open_store: Any,
) -> None:
    model = ScriptedModel(
        [tools_asked(call("c1", "teleport", to="mars"), call("c2", "add", a=1, b=1)), "ok"]
    )
    runtime = runtime_for(model, [ADD], open_store())
    parts, result = await drain(runtime.run(SESSION, input="go"))

    assert result.status == "finished"
    teleport, added = tool_messages(model, 1)
    assert teleport.tool_call_id == "c1"
    error = json.loads(teleport.content or "")["error"]
    assert "unknown tool 'teleport'" in error
    assert "add" in error
    assert (added.tool_call_id, added.content) == ("c2", "2")
    assert dict(RAN) == {"add": 1}
    steps = await runtime.get_steps(result.run_id, SESSION)
    assert [s.name for s in steps if s.kind == "tool"] == ["add"]
    assert not [p for p in parts if p.type == "error"]


async def test_args_failing_the_input_model_give_an_error_result_and_are_not_executed(
    open_store: Any,
) -> None:
    model = ScriptedModel([tools_asked(call("c1", "add", a="seven", b=1)), "ok"])
    runtime = runtime_for(model, [ADD], open_store())
    result = await runtime.run(SESSION, input="go").result()

    assert result.status == "finished"
    (message,) = tool_messages(model, 1)
    error = json.loads(message.content or "")["error"]
    assert "add" in error
    assert "a:" in error
    assert RAN["add"] == 0
    steps = await runtime.get_steps(result.run_id, SESSION)
    assert [s.kind for s in steps] == ["model", "model"]


async def test_a_failing_tool_gives_the_model_an_error_result_with_the_error(
    open_store: Any,
) -> None:
    model = ScriptedModel([tools_asked(call("c1", "boom", a=1, b=1)), "It failed, sorry."])
    runtime = runtime_for(model, [BOOM], open_store())
    result = await runtime.run(SESSION, input="go").result()

    assert result.status == "finished"
    assert result.output == "It failed, sorry."
    (message,) = tool_messages(model, 1)
    assert json.loads(message.content or "") == {"error": "ValueError: boom: out of stock"}
    assert RAN["boom"] == 1
    (step,) = [s for s in await runtime.get_steps(result.run_id, SESSION) if s.kind == "tool"]
    assert step.status == "error"
    assert step.error is not None
    assert step.error.type == "ValueError"
    assert step.error.message == "boom: out of stock"


# ------------------------------------------------------- approval, denial
async def test_a_tool_needing_approval_pauses_and_runs_once_after_approval_from_a_fresh_runtime(
    open_store: Any,
) -> None:
    model = ScriptedModel([tools_asked(call("c1", "refund", amount_cents=900)), "Refunded."])
    first = runtime_for(model, [REFUND], open_store())
    parts, paused = await drain(first.run(SESSION, input="refund me"))

    assert paused.status == "paused"
    assert paused.waiting_for is not None
    assert paused.waiting_for.kind == "approval"
    assert paused.waiting_for.name == "__approval"
    assert paused.waiting_for.operation is not None
    assert paused.waiting_for.operation.tool_name == "refund"
    assert paused.waiting_for.operation.args == {"amount_cents": 900}
    assert [p.type for p in parts] == ["tool-call", "paused"]
    assert RAN["refund"] == 0
    assert len(model.requests) == 1

    second = runtime_for(model, [REFUND], open_store())
    approval = SignalDelivery(
        signal_id="ok-1", name="__approval", payload={"approved": True, "by": "boss"}
    )
    done = await second.run(SESSION, run_id=paused.run_id, signal_delivery=approval).result()

    assert done.status == "finished"
    assert done.output == "Refunded."
    assert RAN["refund"] == 1
    assert len(model.requests) == 2  # the first turn was replayed, not re-asked
    (message,) = tool_messages(model, 1)
    assert json.loads(message.content or "") == {"refunded": 900}
    steps = await second.get_steps(paused.run_id, SESSION)
    assert len(model_steps(steps)) == 2


async def test_a_denied_model_call_reads_as_a_denied_result_and_the_turn_goes_on(
    open_store: Any,
) -> None:
    model = ScriptedModel(
        [tools_asked(call("c1", "refund", amount_cents=50_000)), "I could not refund that."]
    )
    runtime = runtime_for(model, [REFUND], open_store())
    paused = await runtime.run(SESSION, input="refund 500").result()
    assert paused.status == "paused"

    fresh = runtime_for(model, [REFUND], open_store())
    denial = SignalDelivery(
        signal_id="no-1",
        name="__approval",
        payload={"approved": False, "by": "alice", "reason": "over the limit"},
    )
    parts, done = await drain(fresh.run(SESSION, run_id=paused.run_id, signal_delivery=denial))

    assert done.status == "finished"
    assert done.output == "I could not refund that."
    assert RAN["refund"] == 0
    assert not [p for p in parts if p.type == "error"]
    (message,) = tool_messages(model, 1)
    denied = json.loads(message.content or "")
    assert set(denied) == {"__denied", "toolName", "deniedBy", "message"}
    assert denied["__denied"] is True
    assert denied["toolName"] == "refund"
    assert denied["deniedBy"] == "alice"
    assert "declined" in denied["message"]
    assert "not retry" in denied["message"].lower()
    (result_part,) = [p for p in parts if p.type == "tool-result"]
    assert result_part.result == denied
    assert len(model.requests) == 2


async def test_a_policy_deny_denies_without_pausing(open_store: Any) -> None:
    wire = define_tool(
        "wire", "Wire money", RefundArgs, refund, policy=lambda name, args, call: "deny"
    )
    model = ScriptedModel([tools_asked(call("c1", "wire", amount_cents=1)), "Not allowed."])
    runtime = runtime_for(model, [wire], open_store())
    parts, result = await drain(runtime.run(SESSION, input="wire 1 cent"))

    assert result.status == "finished"
    assert result.waiting_for is None
    assert result.output == "Not allowed."
    assert not [p for p in parts if p.type in ("error", "paused")]
    (message,) = tool_messages(model, 1)
    denied = json.loads(message.content or "")
    assert denied["__denied"] is True
    assert denied["deniedBy"] == "policy"
    assert denied["toolName"] == "wire"
    assert RAN["refund"] == 0


async def test_a_policy_ask_pauses_only_its_call_and_the_allowed_one_is_not_rerun_on_resume(
    open_store: Any,
) -> None:
    tool = define_tool(
        "refund",
        "Refund money",
        RefundArgs,
        refund,
        policy=lambda name, args, call: "ask" if args.amount_cents > 1000 else "allow",
    )
    model = ScriptedModel(
        [
            tools_asked(
                call("small", "refund", amount_cents=500),
                call("big", "refund", amount_cents=5000),
            ),
            "Both done.",
        ]
    )
    runtime = runtime_for(model, [tool], open_store())
    paused = await runtime.run(SESSION, input="two refunds").result()
    assert paused.status == "paused"
    assert paused.waiting_for is not None
    assert paused.waiting_for.operation is not None
    assert paused.waiting_for.operation.args == {"amount_cents": 5000}
    assert RAN["refund"] == 1  # the small one ran before the big one asked

    fresh = runtime_for(model, [tool], open_store())
    approval = SignalDelivery(signal_id="a-1", name="__approval", payload={"approved": True})
    done = await fresh.run(SESSION, run_id=paused.run_id, signal_delivery=approval).result()

    assert done.status == "finished"
    assert RAN["refund"] == 2
    assert len(model.requests) == 2
    assert [(m.tool_call_id, json.loads(m.content or "")) for m in tool_messages(model, 1)] == [
        ("small", {"refunded": 500}),
        ("big", {"refunded": 5000}),
    ]


async def test_when_one_call_of_a_parallel_batch_pauses_the_others_settle_and_run_once(
    open_store: Any,
) -> None:
    async def lookup(args: Step) -> str:
        if args.id == "l2":
            await asyncio.sleep(0.1)  # still running when "pay" suspends
        RAN[args.id] += 1
        return args.id

    def pay(args: RefundArgs) -> dict[str, int]:
        RAN["pay"] += 1
        return {"paid": args.amount_cents}

    tools = [
        define_tool("lookup", "Look up", Step, lookup, parallel_safe=True),
        define_tool("pay", "Pay", RefundArgs, pay, parallel_safe=True, needs_approval=True),
    ]
    model = ScriptedModel(
        [
            tools_asked(
                call("l1", "lookup", id="l1", group="p"),
                call("p", "pay", amount_cents=10),
                call("l2", "lookup", id="l2", group="p"),
            ),
            "all done",
        ]
    )
    runtime = runtime_for(model, tools, open_store())
    parts, paused = await drain(runtime.run(SESSION, input="go"))

    assert paused.status == "paused"
    assert dict(RAN) == {"l1": 1, "l2": 1}
    steps = await runtime.get_steps(paused.run_id, SESSION)
    assert sorted((s.name, s.status) for s in steps if s.kind == "tool") == [
        ("lookup", "finished"),
        ("lookup", "finished"),
    ]
    assert [p.tool_call_id for p in parts if p.type == "tool-call"] == ["l1", "p", "l2"]
    assert parts[-1].type == "paused"

    fresh = runtime_for(model, tools, open_store())
    approval = SignalDelivery(signal_id="go", name="__approval", payload={"approved": True})
    done = await fresh.run(SESSION, run_id=paused.run_id, signal_delivery=approval).result()

    assert done.status == "finished"
    assert dict(RAN) == {"l1": 1, "l2": 1, "pay": 1}
    assert len(model.requests) == 2
    assert [(m.tool_call_id, json.loads(m.content or "")) for m in tool_messages(model, 1)] == [
        ("l1", "l1"),
        ("p", {"paid": 10}),
        ("l2", "l2"),
    ]
