"""The OpenAI adapter end to end: the real ``openai`` client against a local
OpenAI-compatible HTTP server (``tests/openai_server.py``).

Nothing of kuralle_es is mocked: the requests the client puts on the wire are
read back from the server, and the server's request count is the proof that
a resumed run does not ask the model again for a turn it has journaled.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from openai import AsyncOpenAI, InternalServerError
from openai_server import (
    Raw,
    ScriptedOpenAIServer,
    json_completion,
    serve,
    text_completion,
    tool_call_completion,
)
from pydantic import BaseModel

from kuralle_es import (
    ModelResponseError,
    OpenAIModel,
    Runtime,
    SignalDelivery,
    StepRecord,
    collect,
    define_agent,
    define_flow,
    define_tool,
    end,
    openai_model,
)

MODEL_ID = "gpt-test"
INSTRUCTIONS = "You are the order desk. Use tools."

EXECUTED: list[tuple[str, dict[str, Any]]] = []


class OrderRef(BaseModel):
    order_id: str


class RefundArgs(BaseModel):
    order_id: str
    amount_cents: int


def lookup(args: OrderRef) -> dict[str, Any]:
    EXECUTED.append(("lookup", args.model_dump()))
    return {"order_id": args.order_id, "status": "shipped"}


def refund(args: RefundArgs) -> dict[str, Any]:
    EXECUTED.append(("refund", args.model_dump()))
    return {"refunded": args.amount_cents}


LOOKUP = define_tool("lookup", "Look an order up", OrderRef, lookup)
REFUND = define_tool("refund", "Refund an order", RefundArgs, refund, needs_approval=True)


class Amount(BaseModel):
    amount: float | None = None
    currency: str | None = None


AMOUNT_FLOW = define_flow(
    "amount_intake",
    "collect an amount",
    "amount",
    [
        collect(
            "amount",
            Amount,
            ["amount"],
            ask=lambda missing: f"Please tell me the {', '.join(missing)}.",
            on_complete=lambda data: end("collected"),
        )
    ],
)


@pytest.fixture(autouse=True)
def _reset() -> None:
    EXECUTED.clear()


@pytest.fixture
def server() -> Iterator[ScriptedOpenAIServer]:
    with serve() as scripted:
        yield scripted


@pytest.fixture
async def clients() -> AsyncIterator[list[AsyncOpenAI]]:
    """Every client a test makes, closed at the end."""
    made: list[AsyncOpenAI] = []
    yield made
    for client in made:
        await client.close()


def model_over(
    server: ScriptedOpenAIServer, clients: list[AsyncOpenAI], max_retries: int = 0
) -> OpenAIModel:
    client = AsyncOpenAI(base_url=server.base_url, api_key="test-key", max_retries=max_retries)
    clients.append(client)
    return openai_model(MODEL_ID, client=client)


def agent_with(model: Any) -> Any:
    return define_agent("desk", INSTRUCTIONS, model, [LOOKUP, REFUND], [AMOUNT_FLOW])


def model_steps(steps: list[StepRecord]) -> list[StepRecord]:
    return [s for s in steps if s.kind == "model"]


USAGE_1 = {"prompt_tokens": 31, "completion_tokens": 9, "total_tokens": 40}
USAGE_2 = {"prompt_tokens": 52, "completion_tokens": 6, "total_tokens": 58}


# --------------------------------------------------------------- tool calls
async def test_model_tool_call_runs_the_tool_once_and_the_final_text_is_the_output(
    server: ScriptedOpenAIServer,
) -> None:
    server.queue(
        tool_call_completion([("call_1", "lookup", '{"order_id": "A1"}')], usage=USAGE_1),
        text_completion("Order A1 has shipped.", usage=USAGE_2),
    )
    # The documented form: base_url + api_key, the adapter makes its own client.
    model = openai_model(MODEL_ID, base_url=server.base_url, api_key="test-key")
    runtime = Runtime([agent_with(model)])
    try:
        result = await runtime.run("s-openai", input="Where is order A1?").result()
    finally:
        await model.client().close()

    assert result.status == "finished"
    assert result.output == "Order A1 has shipped."
    assert EXECUTED == [("lookup", {"order_id": "A1"})]
    assert len(server.requests) == 2
    assert server.headers[0]["authorization"] == "Bearer test-key"

    first, second = server.requests
    assert first["model"] == MODEL_ID
    assert first["messages"][0] == {"role": "system", "content": INSTRUCTIONS}
    assert first["messages"][-1] == {"role": "user", "content": "Where is order A1?"}
    tools = {t["function"]["name"]: t for t in first["tools"]}
    assert set(tools) == {"lookup", "refund"}
    assert tools["lookup"]["type"] == "function"
    assert tools["lookup"]["function"]["description"] == "Look an order up"
    assert tools["lookup"]["function"]["parameters"] == OrderRef.model_json_schema()
    assert "response_format" not in first

    assistant, tool_msg = second["messages"][-2:]
    assert assistant["role"] == "assistant"
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1"]
    assert assistant["tool_calls"][0]["function"]["name"] == "lookup"
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"order_id": "A1"}
    assert tool_msg["role"] == "tool"
    assert tool_msg["tool_call_id"] == "call_1"
    assert json.loads(tool_msg["content"]) == {"order_id": "A1", "status": "shipped"}


async def test_token_usage_and_tool_calls_are_journaled_in_the_model_steps(
    server: ScriptedOpenAIServer, clients: list[AsyncOpenAI]
) -> None:
    server.queue(
        tool_call_completion([("call_1", "lookup", '{"order_id": "B2"}')], usage=USAGE_1),
        text_completion("B2 shipped.", usage=USAGE_2),
    )
    runtime = Runtime([agent_with(model_over(server, clients))])
    result = await runtime.run("s-usage", input="B2?").result()

    steps = await runtime.get_steps(result.run_id, "s-usage")
    turns = model_steps(steps)
    assert [s.name for s in turns] == [MODEL_ID, MODEL_ID]
    assert all(s.status == "finished" for s in turns)
    # The adapter maps OpenAI's prompt/completion tokens to input/output tokens.
    for step, usage in zip(turns, (USAGE_1, USAGE_2), strict=True):
        assert step.result["usage"] == {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
        }
    assert turns[0].result["tool_calls"] == [
        {"id": "call_1", "name": "lookup", "args": {"order_id": "B2"}}
    ]
    assert turns[1].result["content"] == "B2 shipped."


async def test_resumed_run_from_a_fresh_store_never_asks_the_model_again_for_journaled_turns(
    server: ScriptedOpenAIServer, clients: list[AsyncOpenAI], open_store: Any
) -> None:
    server.queue(
        tool_call_completion(
            [("call_r", "refund", '{"order_id": "C3", "amount_cents": 1250}')], usage=USAGE_1
        )
    )
    first = Runtime([agent_with(model_over(server, clients))], store=open_store())
    paused = await first.run("s-approve", input="Refund C3 please").result()
    assert paused.status == "paused"
    assert paused.waiting_for is not None
    assert paused.waiting_for.kind == "approval"
    assert paused.waiting_for.operation is not None
    assert paused.waiting_for.operation.tool_name == "refund"
    assert paused.waiting_for.operation.args == {"order_id": "C3", "amount_cents": 1250}
    assert EXECUTED == []
    assert len(server.requests) == 1

    # A new runtime over a new store (a new process, in effect) delivers the approval.
    server.queue(text_completion("Refunded $12.50 on C3.", usage=USAGE_2))
    second = Runtime([agent_with(model_over(server, clients))], store=open_store())
    approval = SignalDelivery(
        signal_id="approve-1", name="__approval", payload={"approved": True, "by": "sam"}
    )
    done = await second.run("s-approve", run_id=paused.run_id, signal_delivery=approval).result()

    assert done.status == "finished"
    assert done.output == "Refunded $12.50 on C3."
    assert EXECUTED == [("refund", {"order_id": "C3", "amount_cents": 1250})]
    # One new model call: the first turn came back from the journal.
    assert len(server.requests) == 2
    tool_msg = server.requests[1]["messages"][-1]
    assert tool_msg["tool_call_id"] == "call_r"
    assert json.loads(tool_msg["content"]) == {"refunded": 1250}

    # A retried webhook is a no-op: no model call, no second refund.
    again = await second.run("s-approve", run_id=paused.run_id, signal_delivery=approval).result()
    assert again.status == "finished"
    assert len(server.requests) == 2
    assert len(EXECUTED) == 1
    steps = await second.get_steps(paused.run_id, "s-approve")
    assert len(model_steps(steps)) == 2
    assert [s.name for s in steps if s.kind == "tool"] == ["refund"]


async def test_a_server_numbering_tool_calls_per_response_still_runs_the_tool_every_user_turn(
    server: ScriptedOpenAIServer, clients: list[AsyncOpenAI]
) -> None:
    """Some OpenAI-compatible servers name tool calls "call_0", "call_1", ...
    in every response, so one id recurs across a conversation's turns."""
    for order in ("A1", "B2"):
        server.queue(
            tool_call_completion([("call_0", "lookup", json.dumps({"order_id": order}))]),
            text_completion(f"{order} shipped."),
        )
    runtime = Runtime([agent_with(model_over(server, clients))])
    first = await runtime.run("s-ids", input="Where is A1?").result()
    second = await runtime.run("s-ids", input="And B2?").result()

    assert (first.output, second.output) == ("A1 shipped.", "B2 shipped.")
    assert EXECUTED == [("lookup", {"order_id": "A1"}), ("lookup", {"order_id": "B2"})]
    last = server.requests[-1]["messages"]
    assert last[-1]["role"] == "tool"
    assert json.loads(last[-1]["content"]) == {"order_id": "B2", "status": "shipped"}


# ------------------------------------------------------------- malformed
async def test_completion_without_choices_fails_the_turn_and_leaves_its_model_step_to_retry(
    server: ScriptedOpenAIServer, clients: list[AsyncOpenAI]
) -> None:
    server.queue({"id": "x", "object": "chat.completion", "created": 0, "model": MODEL_ID})
    runtime = Runtime([agent_with(model_over(server, clients))])
    handle = runtime.run("s-nochoice", input="hello")
    with pytest.raises(ModelResponseError) as caught:
        await handle.result()
    assert caught.value.model == MODEL_ID
    assert "no choices" in str(caught.value)

    run_id = await handle.run_id
    state = await runtime.get_run(run_id, "s-nochoice")
    assert state is not None
    assert state.status == "error"
    assert state.error is not None
    assert state.error.type == "ModelResponseError"
    # The intent was journaled before the call; no response was, so nothing is frozen.
    (intent,) = model_steps(await runtime.get_steps(run_id, "s-nochoice"))
    assert (intent.status, intent.attempts) == ("running", 1)

    # Re-addressing the run asks the model again: the step's second attempt.
    server.queue(text_completion("Hello!"))
    result = await runtime.run("s-nochoice", run_id=run_id).result()
    assert result.status == "finished"
    assert result.output == "Hello!"
    assert len(server.requests) == 2
    turns = model_steps(await runtime.get_steps(run_id, "s-nochoice"))
    assert [(s.status, s.attempts) for s in turns] == [("finished", 2)]


async def test_tool_arguments_that_are_not_json_give_the_model_an_error_and_execute_nothing(
    server: ScriptedOpenAIServer, clients: list[AsyncOpenAI]
) -> None:
    server.queue(
        tool_call_completion([("call_bad", "lookup", '{"order_id": "A1"')]),  # truncated
        text_completion("Sorry, let me try that differently."),
    )
    runtime = Runtime([agent_with(model_over(server, clients))])
    result = await runtime.run("s-badjson", input="Where is A1?").result()

    assert result.status == "finished"
    assert result.output == "Sorry, let me try that differently."
    assert EXECUTED == []
    tool_msg = server.requests[1]["messages"][-1]
    assert tool_msg["role"] == "tool"
    assert tool_msg["tool_call_id"] == "call_bad"
    error = json.loads(tool_msg["content"])["error"]
    assert "lookup" in error
    assert "not valid JSON" in error
    steps = await runtime.get_steps(result.run_id, "s-badjson")
    assert [s.kind for s in steps] == ["model", "model"]


async def test_http_500_fails_the_turn_and_journals_only_the_calls_intent(
    server: ScriptedOpenAIServer, clients: list[AsyncOpenAI]
) -> None:
    server.queue(Raw(500, b'{"error": {"message": "upstream exploded"}}'))
    runtime = Runtime([agent_with(model_over(server, clients, max_retries=0))])
    handle = runtime.run("s-500", input="hi")
    with pytest.raises(InternalServerError):
        await handle.result()
    run_id = await handle.run_id
    assert len(server.requests) == 1
    state = await runtime.get_run(run_id, "s-500")
    assert state is not None
    assert state.status == "error"
    steps = await runtime.get_steps(run_id, "s-500")
    assert [(s.kind, s.status, s.attempts) for s in steps] == [("model", "running", 1)]


async def test_client_retry_of_a_5xx_is_one_journaled_model_turn(
    server: ScriptedOpenAIServer, clients: list[AsyncOpenAI]
) -> None:
    server.queue(
        Raw(503, b'{"error": {"message": "busy"}}', {"retry-after-ms": "10"}),
        text_completion("Back again."),
    )
    runtime = Runtime([agent_with(model_over(server, clients, max_retries=1))])
    result = await runtime.run("s-retry", input="hi").result()
    assert result.output == "Back again."
    assert len(server.requests) == 2
    assert server.requests[0] == server.requests[1]
    turns = model_steps(await runtime.get_steps(result.run_id, "s-retry"))
    assert len(turns) == 1
    assert turns[0].result["content"] == "Back again."


# ------------------------------------------------------------ extraction
async def test_collect_extracts_with_a_json_schema_response_format_and_parses_json_content(
    server: ScriptedOpenAIServer, clients: list[AsyncOpenAI]
) -> None:
    server.queue(json_completion({"amount": None}), json_completion({"amount": 42.5}))
    runtime = Runtime([agent_with(model_over(server, clients))])
    paused = await runtime.run(
        "s-extract", input="I want a refund", kind="flow", flow_name="amount_intake"
    ).result()
    assert paused.status == "paused"
    assert paused.waiting_for is not None
    assert paused.waiting_for.kind == "input"
    assert paused.output == "Please tell me the amount."

    done = await runtime.run("s-extract", run_id=paused.run_id, input="It was 42.50").result()
    assert done.status == "finished"
    state = await runtime.get_run(paused.run_id, "s-extract")
    assert state is not None
    assert state.outcome == "collected"
    assert state.state["amount"] == 42.5

    assert len(server.requests) == 2
    for request in server.requests:
        assert request["response_format"]["type"] == "json_schema"
        assert request["response_format"]["json_schema"]["schema"] == Amount.model_json_schema()
        assert "tools" not in request
    users = [m["content"] for m in server.requests[1]["messages"] if m["role"] == "user"]
    assert users == ["I want a refund", "It was 42.50"]
    turns = model_steps(await runtime.get_steps(paused.run_id, "s-extract"))
    assert [t.result["data"] for t in turns] == [{"amount": None}, {"amount": 42.5}]


async def test_extraction_content_that_is_not_json_is_a_model_response_error(
    server: ScriptedOpenAIServer, clients: list[AsyncOpenAI]
) -> None:
    server.queue(text_completion("the amount is forty two"))
    runtime = Runtime([agent_with(model_over(server, clients))])
    handle = runtime.run("s-notjson", input="refund 42", kind="flow", flow_name="amount_intake")
    with pytest.raises(ModelResponseError, match="not JSON"):
        await handle.result()
    run_id = await handle.run_id
    # Only the call's intent is journaled: nothing frozen, the next pass asks again.
    turns = model_steps(await runtime.get_steps(run_id, "s-notjson"))
    assert [(t.status, t.attempts) for t in turns] == [("running", 1)]
