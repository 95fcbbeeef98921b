"""Hostile input at every door: refused with a KuralleError, or handled; nothing lost.

Hypothesis generates what callers, webhooks and models send on a bad day —
huge and deeply nested values, lone surrogates, NUL, NaN and Infinity,
non-string keys, empty ids, values JSON cannot hold — and throws it at each
door: session ids, user input, signal payloads, tool arguments and model
responses. Each is either refused with a ``KuralleError`` whose message says
what to do, leaving the run's stored events byte-for-byte as they were and
the store's log without a new entry, or accepted and read back exactly.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kuralle_es import (
    InvalidArgumentError,
    InvalidSignalError,
    InvalidToolArgsError,
    KuralleError,
    ModelResponse,
    ModelResponseError,
    PayloadTooLargeError,
    RunContext,
    RunStore,
    Runtime,
    SignalDelivery,
    ToolCallRequest,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es.testing import ScriptedModel

# ------------------------------------------------------------------ hostility
lone_surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
hostile_text = st.one_of(
    st.text(max_size=8),
    st.text(st.characters(codec=None), max_size=8),  # any code point, surrogates too
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=3), lone_surrogates, st.text(max_size=3)),
    st.sampled_from(["", " ", "\x00", "a\x00b", "\n", "\u202e", "x" * 300]),
)
hostile_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # NaN and Infinity included
    hostile_text,
    st.binary(max_size=4),
    st.builds(set, st.lists(st.integers(), max_size=2)),
)
hostile_keys = st.one_of(hostile_text, st.integers(), st.booleans(), st.none(), st.floats())
hostile_json = st.recursive(
    hostile_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner),
        st.dictionaries(hostile_keys, inner, max_size=3),
    ),
    max_leaves=8,
)


def nested(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = {"down": value}
    return value


extremes = st.sampled_from(
    [nested(101), nested(500), "x" * 1_100_000, ["y" * 1000] * 1100, {"k": float("inf")}]
)


def is_plain_json(value: Any, depth: int = 0) -> bool:
    """What the journal holds exactly: the test's own statement of "plain JSON"."""
    if depth > 100:
        return False
    if value is None or isinstance(value, bool | int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, list | tuple):
        return all(is_plain_json(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain_json(k) for k in value) and all(
            is_plain_json(v, depth + 1) for v in value.values()
        )
    return False


def good_id(value: Any) -> bool:
    return (
        isinstance(value, str)
        and bool(value.strip())
        and len(value) <= 256
        and is_plain_json(value)
        and not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in value)
    )


SESSIONS = itertools.count()


# -------------------------------------------------------------------- the app
class Note(BaseModel):
    text: str
    extra: Any = None


async def listen(state: dict[str, Any], ctx: RunContext) -> Any:
    payload = await ctx.signal("note")
    return end(json.dumps(payload, sort_keys=True))


async def call_tool(state: dict[str, Any], ctx: RunContext) -> Any:
    note = await ctx.signal("args")
    result = await ctx.tool("keep", note)
    return end(json.dumps(result, sort_keys=True))


def make_runtime(store: RunStore, model: ScriptedModel | None = None) -> Runtime:
    keep = define_tool("keep", "keeps a note", Note, lambda args: args.model_dump(mode="json"))
    flows = [
        define_flow("listen", "", "go", [action("go", listen)]),
        define_flow("tool", "", "go", [action("go", call_tool)]),
    ]
    agents = [define_agent("agent", "", model or ScriptedModel(["ok"] * 1000), [keep], flows)]
    return Runtime(agents, store=store)


def fingerprint(store: RunStore, run_id: str | None) -> tuple[Any, ...]:
    """The run's stored events, byte for byte, and the end of the store's log."""
    stored = store.recorder.select_events(UUID(run_id)) if run_id else []
    events = [(e.originator_version, e.topic, e.state) for e in stored]
    return tuple(events), store.recorder.max_notification_id()


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "memory":
        with RunStore.memory() as memory:
            yield memory
    else:
        path = Path(tmp_path_factory.mktemp("doors")) / "runs.db"
        with RunStore.sqlite(str(path)) as sqlite:
            yield sqlite


SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def assert_says_what_to_do(error: KuralleError) -> None:
    text = str(error)
    assert ";" in text or "pass" in text or "send" in text, text


# ---------------------------------------------------------------------- doors
@SETTINGS
@given(session_id=st.one_of(hostile_text, st.integers(), st.none()))
async def test_a_session_id_is_refused_unless_it_is_a_printable_string(
    store: RunStore, session_id: Any
) -> None:
    runtime = make_runtime(store)
    before = fingerprint(store, None)
    handle = runtime.run(session_id, kind="flow", flow_name="listen")
    if good_id(session_id):
        assert (await handle.result()).status == "paused"
        return
    with pytest.raises(InvalidArgumentError) as refused:
        await handle.result()
    assert "session_id" in str(refused.value)
    assert_says_what_to_do(refused.value)
    assert fingerprint(store, None) == before


@SETTINGS
@given(text=st.one_of(hostile_text, st.just("z" * 1_000_001)))
async def test_user_input_is_refused_unless_it_is_valid_text_within_the_bound(
    store: RunStore, text: str
) -> None:
    runtime = make_runtime(store)
    before = fingerprint(store, None)
    handle = runtime.run("s", input=text, kind="flow", flow_name="listen")
    if is_plain_json(text) and len(text.encode("utf-8")) <= 1_000_000:
        assert (await handle.result()).status == "paused"
        return
    with pytest.raises((InvalidArgumentError, PayloadTooLargeError)) as refused:
        await handle.result()
    assert "input" in str(refused.value)
    assert fingerprint(store, None) == before


@SETTINGS
@given(payload=st.one_of(hostile_json, extremes))
async def test_a_signal_payload_is_refused_or_journaled_exactly(
    store: RunStore, payload: Any
) -> None:
    runtime = make_runtime(store)
    paused = await runtime.run("s", kind="flow", flow_name="listen").result()
    before = fingerprint(store, paused.run_id)
    delivery = SignalDelivery(signal_id="d1", name="note", payload=payload)
    handle = runtime.run("s", run_id=paused.run_id, signal_delivery=delivery)
    size = len(json.dumps(payload, allow_nan=True, default=str).encode("utf-8", "replace"))
    if is_plain_json(payload) and size <= 1_000_000:
        done = await handle.result()
        assert done.status == "finished"
        assert done.output == json.dumps(payload, sort_keys=True)
        return
    with pytest.raises(InvalidSignalError) as refused:
        await handle.result()
    assert_says_what_to_do(refused.value)
    assert fingerprint(store, paused.run_id) == before
    state = await runtime.get_run(paused.run_id, "s")
    assert state is not None and state.status == "paused"


@SETTINGS
@given(text=hostile_text, extra=hostile_json)
async def test_tool_arguments_are_refused_before_anything_is_journaled(
    store: RunStore, text: str, extra: Any
) -> None:
    runtime = make_runtime(store)
    paused = await runtime.run("s", kind="flow", flow_name="tool").result()
    # The node hands the delivered note to the tool: a payload the door let in
    # can still carry arguments the tool's journal cannot hold.
    payload = {"text": text, "extra": extra}
    if not is_plain_json(payload):
        return  # refused at the signal door (test above)
    delivery = SignalDelivery(signal_id="d1", name="args", payload=payload)
    done = await runtime.run("s", run_id=paused.run_id, signal_delivery=delivery).result()
    assert done.status == "finished"
    assert json.loads(str(done.output)) == json.loads(json.dumps(payload))  # tuples: lists
    steps = await runtime.get_steps(paused.run_id, "s")
    assert [s.kind for s in steps] == ["signal", "tool"]


async def test_tool_arguments_with_a_lone_surrogate_are_refused_when_called(
    store: RunStore,
) -> None:
    agent_tool = define_tool("keep", "", Note, lambda args: {})
    with pytest.raises(InvalidToolArgsError, match="lone surrogate"):
        agent_tool.validate({"text": "a\ud800"})
    with pytest.raises(InvalidToolArgsError, match="NaN or Infinity"):
        agent_tool.validate({"text": "a", "extra": [float("nan")]})


@SETTINGS
@given(content=hostile_text, args=hostile_json)
async def test_a_model_response_is_refused_before_it_is_journaled_or_used(
    store: RunStore, content: str, args: Any
) -> None:
    """A response JSON cannot hold is refused: none of it is journaled or used. The
    call's intent was journaled before the call (a model step is an effect like a
    tool's), so the step stays ``running`` with no result, and the next pass asks
    the model again as that step's next attempt."""
    call = ToolCallRequest(id="c1", name="keep", args={"text": "t", "extra": args})
    response = ModelResponse(content=content, tool_calls=[call])
    model = ScriptedModel([response] * 2 + ["done"] * 10)
    agent = define_agent("chat", "", model, [define_tool("keep", "", Note, lambda a: {})])
    runtime = Runtime([agent], store=store)
    session = f"s-model-{next(SESSIONS)}"
    handle = runtime.run(session, input="hello")
    try:
        result = await handle.result()
    except ModelResponseError as refused:
        assert "response" in str(refused)
        assert not is_plain_json({"content": content, "args": args})
        run_id = await handle.run_id
        steps = await runtime.get_steps(run_id, session)
        assert [(s.kind, s.status, s.result, s.error) for s in steps] == [
            ("model", "running", None, None)
        ]  # the intent only: nothing of the response journaled
        return
    # Handled: what pydantic turned into plain JSON (bytes into text) is what the
    # journal holds and what the run went on with.
    assert result.status == "finished"
    steps = await runtime.get_steps(result.run_id, session)
    assert steps[0].kind == "model" and steps[0].result["content"] == content
