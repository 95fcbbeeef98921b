"""Bad input gets a clear error that names the culprit, and nothing is journaled as finished.

Everything runs on ``RunStore.memory()`` through the public API.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from pydantic import BaseModel

import kuralle_es
from kuralle_es import (
    InvalidToolArgsError,
    RunStore,
    Runtime,
    ToolCall,
    ToolExecutionError,
    ToolResultTypeError,
    UnknownToolError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
)

Node = Callable[[dict[str, Any], Any], Awaitable[Any]]


class Amount(BaseModel):
    amount: int
    currency: str = "EUR"


class Free(BaseModel):
    value: Any = None


class Calls:
    """How often each tool's ``execute`` really ran."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}

    def hit(self, name: str) -> None:
        self.count[name] = self.count.get(name, 0) + 1


class Opaque:
    def __repr__(self) -> str:
        return "<Opaque>"


def make_tools(calls: Calls) -> list[kuralle_es.Tool]:
    def charge(args: Amount, call: ToolCall) -> dict[str, Any]:
        calls.hit("charge")
        return {"charged": args.amount}

    def gives_set(args: Free) -> Any:
        calls.hit("gives_set")
        return {"tags": {"a", "b"}}

    def gives_object(args: Free) -> Any:
        calls.hit("gives_object")
        return Opaque()

    def gives_big(args: Free) -> Any:
        calls.hit("gives_big")
        return {"blob": "x" * 500}

    return [
        define_tool("charge", "charge a card", Amount, charge),
        define_tool("gives_set", "returns a set", Free, gives_set),
        define_tool("gives_object", "returns an object", Free, gives_object),
        define_tool("gives_big", "returns a large value", Free, gives_big),
    ]


def runtime_for(nodes: list[Any], calls: Calls, start: str | None = None) -> Runtime:
    flow = define_flow("f", "test flow", start or nodes[0].id, nodes)
    agent = define_agent("agent", "test", None, make_tools(calls), [flow])
    return Runtime([agent], store=RunStore.memory())


async def start(rt: Runtime) -> tuple[str, kuralle_es.TurnResult | BaseException]:
    handle = rt.run("s1", input="hi", kind="flow", flow_name="f")
    try:
        outcome: kuralle_es.TurnResult | BaseException = await handle.result()
    except Exception as e:
        outcome = e
    return await handle.run_id, outcome


# ------------------------------------------------------- (a) non-JSON tool results
@pytest.mark.parametrize("tool_name", ["gives_set", "gives_object"])
async def test_non_json_tool_result_is_a_type_error_naming_the_tool_and_never_finished(
    tool_name: str,
) -> None:
    calls = Calls()
    seen: list[BaseException] = []
    passes: list[int] = []

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        passes.append(1)
        try:
            await ctx.tool(tool_name, {"value": 1})
        except TypeError as e:
            seen.append(e)
        if len(passes) == 1:
            # End the first turn in error so that a resume must replay the step.
            raise RuntimeError("first pass stops here")
        return end("done")

    rt = runtime_for([action("n", node)], calls)
    run_id, first = await start(rt)
    assert isinstance(first, RuntimeError)

    assert len(seen) == 1
    error = seen[0]
    assert isinstance(error, ToolResultTypeError)
    assert isinstance(error, ToolExecutionError)
    assert isinstance(error, TypeError)
    assert error.tool_name == tool_name
    assert tool_name in str(error)
    assert "JSON" in str(error)

    steps = await rt.get_steps(run_id, "s1")
    assert len(steps) == 1
    assert steps[0].name == tool_name
    assert steps[0].status == "error"
    assert steps[0].result is None
    assert steps[0].error is not None
    assert calls.count == {tool_name: 1}

    # Re-entry replays the frozen error: same error, no re-execution.
    result = await rt.run("s1", run_id=run_id).result()
    assert result.status == "finished"
    assert len(seen) == 2
    again = seen[1]
    assert type(again) is type(error)
    assert isinstance(again, ToolResultTypeError)
    assert str(again) == str(error)
    assert again.tool_name == tool_name
    assert calls.count == {tool_name: 1}
    steps = await rt.get_steps(run_id, "s1")
    assert [s.status for s in steps] == ["error"]


async def test_non_json_tool_result_uncaught_fails_the_run_with_type_error() -> None:
    calls = Calls()

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("gives_set", {})
        return end("done")

    rt = runtime_for([action("n", node)], calls)
    run_id, outcome = await start(rt)
    assert isinstance(outcome, TypeError)
    assert "gives_set" in str(outcome)
    state = await rt.get_run(run_id, "s1")
    assert state is not None
    assert state.status == "error"
    assert state.error is not None
    assert state.error.type == "ToolResultTypeError"
    assert "gives_set" in state.error.message
    steps = await rt.get_steps(run_id, "s1")
    assert all(s.status != "finished" for s in steps)


# ------------------------------------------------------------- (b) unknown tools
async def test_unknown_tool_is_refused_naming_it_and_nothing_is_journaled() -> None:
    calls = Calls()
    seen: list[BaseException] = []

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        try:
            await ctx.tool("refund_everything", {"amount": 1})
        except UnknownToolError as e:
            seen.append(e)
        return end("done")

    rt = runtime_for([action("n", node)], calls)
    run_id, outcome = await start(rt)
    assert isinstance(outcome, kuralle_es.TurnResult)
    assert outcome.status == "finished"
    assert len(seen) == 1
    assert isinstance(seen[0], UnknownToolError)
    assert seen[0].tool_name == "refund_everything"
    assert "refund_everything" in str(seen[0])
    state = await rt.get_run(run_id, "s1")
    assert state is not None
    assert state.step_count == 0
    assert await rt.get_steps(run_id, "s1") == []
    assert calls.count == {}


async def test_unknown_tool_does_not_consume_a_callsite() -> None:
    calls = Calls()

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        with pytest.raises(UnknownToolError):
            ctx.tool("nope", {})
        await ctx.tool("charge", {"amount": 1})
        return end("done")

    rt = runtime_for([action("n", node)], calls)
    run_id, outcome = await start(rt)
    assert isinstance(outcome, kuralle_es.TurnResult)
    steps = await rt.get_steps(run_id, "s1")
    assert [(s.name, s.callsite, s.status) for s in steps] == [("charge", 0, "finished")]


# ------------------------------------------------------------- (c) invalid args
@pytest.mark.parametrize(
    ("args", "field"),
    [({"amount": "lots"}, "amount"), ({}, "amount"), ({"amount": 1, "currency": 3}, "currency")],
    ids=["wrong-type", "missing", "second-field"],
)
async def test_invalid_args_are_refused_naming_tool_and_field_without_executing(
    args: dict[str, Any], field: str
) -> None:
    calls = Calls()
    seen: list[BaseException] = []

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        try:
            await ctx.tool("charge", args)
        except InvalidToolArgsError as e:
            seen.append(e)
        return end("done")

    rt = runtime_for([action("n", node)], calls)
    run_id, outcome = await start(rt)
    assert isinstance(outcome, kuralle_es.TurnResult)
    assert len(seen) == 1
    error = seen[0]
    assert isinstance(error, InvalidToolArgsError)
    assert isinstance(error, ValueError)
    assert error.tool_name == "charge"
    assert "charge" in str(error)
    assert field in str(error)
    assert calls.count == {}
    state = await rt.get_run(run_id, "s1")
    assert state is not None
    assert state.step_count == 0


async def test_invalid_args_uncaught_fail_the_run_with_the_error_recorded() -> None:
    calls = Calls()

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("charge", {"amount": "lots"})
        return end("done")

    rt = runtime_for([action("n", node)], calls)
    run_id, outcome = await start(rt)
    assert isinstance(outcome, InvalidToolArgsError)
    state = await rt.get_run(run_id, "s1")
    assert state is not None
    assert state.status == "error"
    assert state.error is not None
    assert state.error.type == "InvalidToolArgsError"
    assert state.step_count == 0
    assert calls.count == {}


# --------------------------------------------------------------- (d) size bound
async def test_result_over_the_size_bound_is_an_error_naming_the_tool_never_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KURALLE_MAX_PAYLOAD_BYTES", "64")
    calls = Calls()
    seen: list[BaseException] = []

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        try:
            await ctx.tool("gives_big", {})
        except ToolExecutionError as e:
            seen.append(e)
        # A small result still fits under the same bound.
        await ctx.tool("charge", {"amount": 1})
        return end("done")

    rt = runtime_for([action("n", node)], calls)
    run_id, outcome = await start(rt)
    assert isinstance(outcome, kuralle_es.TurnResult)
    assert outcome.status == "finished"
    assert len(seen) == 1
    error = seen[0]
    assert isinstance(error, ToolExecutionError)
    assert error.tool_name == "gives_big"
    assert "gives_big" in str(error)
    assert "64" in str(error)
    steps = await rt.get_steps(run_id, "s1")
    assert [(s.name, s.status) for s in steps] == [("gives_big", "error"), ("charge", "finished")]
    assert steps[0].result is None
    assert calls.count == {"gives_big": 1, "charge": 1}


async def test_result_within_a_raised_size_bound_is_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KURALLE_MAX_PAYLOAD_BYTES", "10000")
    calls = Calls()

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("gives_big", {})
        return end("done")

    rt = runtime_for([action("n", node)], calls)
    run_id, outcome = await start(rt)
    assert isinstance(outcome, kuralle_es.TurnResult)
    steps = await rt.get_steps(run_id, "s1")
    assert [(s.status, s.result) for s in steps] == [("finished", {"blob": "x" * 500})]


# -------------------------------------------------------- (e) bad definitions
def test_define_tool_refuses_an_input_that_is_not_a_pydantic_model() -> None:
    class NotAModel:
        amount: int

    with pytest.raises(TypeError, match="refund"):
        define_tool("refund", "d", NotAModel, lambda a: a)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="refund"):
        define_tool("refund", "d", dict, lambda a: a)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="refund"):
        define_tool("refund", "d", Amount(amount=1), lambda a: a)  # type: ignore[arg-type]


def test_define_tool_refuses_a_bad_on_in_doubt() -> None:
    with pytest.raises(ValueError, match="on_in_doubt") as info:
        define_tool("refund", "d", Amount, lambda a: a, on_in_doubt="maybe")  # type: ignore[arg-type]
    assert "refund" in str(info.value)
    assert "maybe" in str(info.value)


def test_define_tool_refuses_a_non_callable_execute_and_reserved_names() -> None:
    with pytest.raises(TypeError, match="refund"):
        define_tool("refund", "d", Amount, "not callable")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        define_tool("", "d", Amount, lambda a: a)
    with pytest.raises(ValueError):
        define_tool("__approval", "d", Amount, lambda a: a)


async def _noop(state: dict[str, Any], ctx: Any) -> Any:
    return end("done")


def test_define_flow_refuses_duplicate_node_ids() -> None:
    with pytest.raises(ValueError, match=r"twice|share|duplicate") as info:
        define_flow("f", "d", "a", [action("a", _noop), action("a", _noop)])
    assert "'a'" in str(info.value)


def test_define_flow_refuses_an_unknown_start() -> None:
    with pytest.raises(ValueError) as info:
        define_flow("f", "d", "nowhere", [action("a", _noop)])
    assert "nowhere" in str(info.value)


@pytest.mark.parametrize(
    "returned",
    [42, None, object(), {"neither": "goto nor end"}],
    ids=["int", "none", "object", "unknown-dict"],
)
async def test_node_returning_garbage_fails_the_run_with_a_clear_error(returned: Any) -> None:
    calls = Calls()

    async def garbage(state: dict[str, Any], ctx: Any) -> Any:
        return returned

    rt = runtime_for([action("garbage", garbage)], calls)
    handle = rt.run("s1", kind="flow", flow_name="f")
    with pytest.raises((TypeError, ValueError)) as info:
        await handle.result()
    assert "garbage" in str(info.value)  # names the node
    state = await rt.get_run(await handle.run_id, "s1")
    assert state is not None
    assert state.status == "error"
    assert state.error is not None
    assert state.error.type == type(info.value).__name__
    assert "garbage" in state.error.message


@pytest.mark.parametrize("form", ["goto", "dict", "str"])
async def test_goto_an_unknown_node_fails_the_run_naming_it(form: str) -> None:
    calls = Calls()

    async def lost(state: dict[str, Any], ctx: Any) -> Any:
        if form == "goto":
            return goto("atlantis")
        if form == "dict":
            return {"goto": "atlantis"}
        return "atlantis"

    rt = runtime_for([action("lost", lost)], calls)
    handle = rt.run("s1", kind="flow", flow_name="f")
    with pytest.raises(ValueError, match="atlantis"):
        await handle.result()
    state = await rt.get_run(await handle.run_id, "s1")
    assert state is not None
    assert state.status == "error"
    assert state.error is not None
    assert state.error.type == "ValueError"
    assert "atlantis" in state.error.message
    assert state.outcome is None


async def test_goto_data_that_is_not_json_fails_the_run_clearly_and_the_run_stays_loadable() -> (
    None
):
    """A state bag the journal cannot hold is bad input like any other: a clear
    TypeError, run status "error", and the run's stream still loads."""
    calls = Calls()

    async def first(state: dict[str, Any], ctx: Any) -> Any:
        return goto("second", {"when": {1, 2}})

    async def second(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("charge", {"amount": 1})
        return end("done")

    rt = runtime_for([action("first", first), action("second", second)], calls)
    run_id, outcome = await start(rt)
    assert isinstance(outcome, TypeError)
    state = await rt.get_run(run_id, "s1")
    assert state is not None
    assert state.status == "error"
    assert state.error is not None
    assert "first" in str(outcome) or "second" in str(outcome)  # names the node


# ---------------------------------------------------- uncaught errors in nodes
async def test_uncaught_node_error_propagates_and_marks_the_run_error() -> None:
    calls = Calls()

    async def boom(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("charge", {"amount": 3})
        raise KeyError("no such customer")

    rt = runtime_for([action("boom", boom)], calls)
    handle = rt.run("s1", kind="flow", flow_name="f")
    with pytest.raises(KeyError, match="no such customer"):
        await handle.result()
    run_id = await handle.run_id
    state = await rt.get_run(run_id, "s1")
    assert state is not None
    assert state.status == "error"
    assert state.error is not None
    assert state.error.type == "KeyError"
    assert "no such customer" in state.error.message
    assert state.lease_holder is None
    # The effect that did happen stays journaled as finished, exactly once.
    steps = await rt.get_steps(run_id, "s1")
    assert [(s.name, s.status) for s in steps] == [("charge", "finished")]
    assert calls.count == {"charge": 1}


async def test_uncaught_node_error_is_raised_by_the_stream_after_an_error_part() -> None:
    calls = Calls()

    async def boom(state: dict[str, Any], ctx: Any) -> Any:
        raise RuntimeError("kaput")

    rt = runtime_for([action("boom", boom)], calls)
    handle = rt.run("s1", kind="flow", flow_name="f")
    parts: list[Any] = []
    with pytest.raises(RuntimeError, match="kaput"):
        async for part in handle:
            parts.append(part)
    errors = [p for p in parts if p.type == "error"]
    assert len(errors) == 1
    assert errors[0].error is not None
    assert errors[0].error.type == "RuntimeError"
    assert not [p for p in parts if p.type == "finished"]


async def test_tool_that_raises_is_a_tool_execution_error_frozen_in_the_journal() -> None:
    attempts: list[int] = []

    def flaky(args: Amount) -> Any:
        attempts.append(args.amount)
        raise ConnectionError("card network down")

    tool = define_tool("flaky", "d", Amount, flaky)
    seen: list[ToolExecutionError] = []
    passes: list[int] = []

    async def node(state: dict[str, Any], ctx: Any) -> Any:
        passes.append(1)
        try:
            await ctx.tool("flaky", {"amount": 9})
        except ToolExecutionError as e:
            seen.append(e)
        if len(passes) == 1:
            raise RuntimeError("first pass stops here")
        return end("done")

    flow = define_flow("f", "d", "n", [action("n", node)])
    rt = Runtime([define_agent("a", "i", None, [tool], [flow])], store=RunStore.memory())
    run_id, outcome = await start(rt)
    assert isinstance(outcome, RuntimeError)
    result = await rt.run("s1", run_id=run_id).result()
    assert result.status == "finished"
    assert attempts == [9]
    assert len(seen) == 2
    assert all(e.tool_name == "flaky" and e.error_type == "ConnectionError" for e in seen)
    assert str(seen[0]) == str(seen[1])
    steps = await rt.get_steps(run_id, "s1")
    assert [s.status for s in steps] == ["error"]
    assert steps[0].error is not None
    assert steps[0].error.type == "ConnectionError"
