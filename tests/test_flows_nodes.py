"""Flow nodes and transitions (docs/contract.md: flows, turns): collect, reply, every transition
form, the flow digest, drift and its resolution, unknown flows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from kuralle_es import (
    Flow,
    FlowDriftError,
    FlowNotFoundError,
    ModelRequest,
    ModelResponse,
    RunStore,
    Runtime,
    StreamPart,
    TurnHandle,
    TurnResult,
    action,
    collect,
    define_agent,
    define_flow,
    end,
    goto,
    handoff,
    reply,
)
from kuralle_es.testing import ScriptedModel

TESTS_DIR = Path(__file__).resolve().parent
SESSION = "s-flows"
COMPLETED: list[dict[str, Any]] = []
VISITED: list[str] = []
RETURNS: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _reset() -> None:
    COMPLETED.clear()
    VISITED.clear()
    RETURNS.clear()


class Details(BaseModel):
    name: str | None = None
    email: str | None = None
    age: int | None = None


class DetailsWithPhone(Details):
    phone: str | None = None


def extracting(request: ModelRequest) -> ModelResponse | str:
    """The model: extracts ``field=value`` pairs the user wrote; replies with its instructions."""
    if request.purpose == "extract":
        said = " ".join(m.content or "" for m in request.messages if m.role == "user")
        return ModelResponse(data=dict(re.findall(r"(\w+)=(\S+)", said)))
    return f"[{request.instructions}]"


def ask(missing: list[str]) -> str:
    return f"Please give: {', '.join(missing)}"


def completed(data: dict[str, Any]) -> Any:
    COMPLETED.append(dict(data))
    return goto("greet")


def intake_flow(
    *,
    greeting: str = "Greet the customer warmly.",
    schema: type[BaseModel] = Details,
    required: tuple[str, ...] = ("name", "email"),
    extra_node: bool = False,
) -> Flow:
    """The flow the digest and drift tests vary one part of at a time."""
    nodes: list[Any] = [
        collect("details", schema, list(required), ask=ask, on_complete=completed),
        reply("greet", greeting, end("greeted")),
    ]
    if extra_node:
        nodes.append(reply("survey", "Ask for feedback.", end("surveyed")))
    return define_flow("intake", "collect details, then greet", "details", nodes)


def runtime_with(flow: Flow, store: RunStore | None = None, model: Any = None) -> Runtime:
    agent = define_agent("main", "Be helpful.", model or ScriptedModel(extracting), [], [flow])
    billing = define_agent("billing", "Billing desk.", ScriptedModel(["billing here"]))
    return Runtime([agent, billing], store=store or RunStore.memory())


async def drain(handle: TurnHandle) -> tuple[list[StreamPart], TurnResult]:
    parts = [part async for part in handle]
    return parts, await handle.result()


# ----------------------------------------------------------------- collect
async def test_collect_asks_for_missing_fields_parks_for_input_and_completes_on_the_next_input(
    open_store: Any,
) -> None:
    model = ScriptedModel(extracting)
    runtime = runtime_with(intake_flow(), open_store(), model)
    parts, paused = await drain(
        runtime.run(SESSION, input="hi, name=Ann", kind="flow", flow_name="intake")
    )

    assert paused.status == "paused"
    assert paused.output == "Please give: email"
    assert paused.waiting_for is not None
    assert paused.waiting_for.kind == "input"
    assert paused.waiting_for.name == "__input"
    assert [(p.type, p.text) for p in parts if p.type == "text"] == [("text", "Please give: email")]
    assert parts[-1].type == "paused"
    state = await runtime.get_run(paused.run_id, SESSION)
    assert state is not None
    assert state.status == "paused"
    assert state.active_node == "details"
    assert state.state == {"name": "Ann"}
    assert state.messages[-1].role == "assistant"
    assert state.messages[-1].content == "Please give: email"
    assert COMPLETED == []
    assert model.requests[0].purpose == "extract"
    assert model.requests[0].schema == Details.model_json_schema()

    done = await runtime.run(SESSION, run_id=paused.run_id, input="email=ann@x.io").result()

    assert done.status == "finished"
    assert done.output == "[Greet the customer warmly.]"
    assert COMPLETED == [{"name": "Ann", "email": "ann@x.io"}]
    final = await runtime.get_run(paused.run_id, SESSION)
    assert final is not None
    assert final.outcome == "greeted"
    assert final.state["name"] == "Ann"
    assert final.state["email"] == "ann@x.io"
    extracts = [r for r in model.requests if r.purpose == "extract"]
    assert len(extracts) == 2
    assert [m.content for m in extracts[1].messages if m.role == "user"] == [
        "hi, name=Ann",
        "email=ann@x.io",
    ]


async def test_collect_with_everything_given_completes_without_pausing() -> None:
    runtime = runtime_with(intake_flow())
    result = await runtime.run(
        SESSION, input="name=Bo email=bo@x.io", kind="flow", flow_name="intake"
    ).result()
    assert result.status == "finished"
    assert COMPLETED == [{"name": "Bo", "email": "bo@x.io"}]


async def test_collect_asks_again_for_a_value_that_does_not_fit_its_field() -> None:
    runtime = runtime_with(intake_flow(required=("name", "age")))
    paused = await runtime.run(
        SESSION, input="name=Cy age=old", kind="flow", flow_name="intake"
    ).result()
    assert paused.status == "paused"
    assert paused.output == "Please give: age"

    done = await runtime.run(SESSION, run_id=paused.run_id, input="age=41").result()
    assert done.status == "finished"
    assert COMPLETED == [{"name": "Cy", "age": 41}]


async def test_a_finished_flow_run_given_input_returns_its_state_and_runs_nothing() -> None:
    runtime = runtime_with(intake_flow())
    done = await runtime.run(
        SESSION, input="name=Di email=d@x.io", kind="flow", flow_name="intake"
    ).result()
    assert done.status == "finished"
    before = await runtime.get_run(done.run_id, SESSION)
    again = await runtime.run(SESSION, run_id=done.run_id, input="name=Other").result()
    assert again.status == "finished"
    after = await runtime.get_run(done.run_id, SESSION)
    assert before is not None
    assert after is not None
    assert after.version == before.version
    assert len(COMPLETED) == 1


# ------------------------------------------------------------------- reply
def _reply_flow(next_value: Any) -> Flow:
    after = action("after", _visit_and_end)
    resolved = after if next_value == "NODE" else next_value
    return define_flow(
        "replies",
        "one reply",
        "say",
        [reply("say", "Say hello to the customer.", resolved), after],
    )


async def _visit_and_end(state: dict[str, Any], ctx: Any) -> Any:
    VISITED.append("after")
    return end(f"after:{state.get('tone')}")


@pytest.mark.parametrize(
    ("next_value", "outcome", "visited"),
    [
        (end("said"), "said", []),
        ({"end": "said"}, "said", []),
        (lambda state: end(f"tone={state.get('tone')}"), "tone=None", []),
        (lambda: end("said-0"), "said-0", []),
        (goto("after", {"tone": "warm"}), "after:warm", ["after"]),
        (lambda state: goto("after", {"tone": "cool"}), "after:cool", ["after"]),
        ("NODE", "after:None", ["after"]),
    ],
    ids=["end", "end-dict", "callable-state", "callable-0", "goto-data", "callable-goto", "node"],
)
async def test_reply_makes_one_model_turn_with_its_instructions_and_follows_next(
    next_value: Any, outcome: str, visited: list[str]
) -> None:
    model = ScriptedModel(extracting)
    runtime = runtime_with(_reply_flow(next_value), model=model)
    parts, result = await drain(runtime.run(SESSION, input="hi", kind="flow", flow_name="replies"))

    assert result.status == "finished"
    assert len(model.requests) == 1
    (request,) = model.requests
    assert request.purpose == "reply"
    assert request.instructions == "Say hello to the customer."
    assert request.tools == []
    assert [p.text for p in parts if p.type == "text"] == ["[Say hello to the customer.]"]
    state = await runtime.get_run(result.run_id, SESSION)
    assert state is not None
    assert state.outcome == outcome
    assert visited == VISITED
    assert state.messages[-1].role == "assistant"
    assert state.messages[-1].content == "[Say hello to the customer.]"
    steps = await runtime.get_steps(result.run_id, SESSION)
    assert [(s.kind, s.name) for s in steps] == [("model", "scripted")]


# -------------------------------------------------------------- transitions
async def _first(state: dict[str, Any], ctx: Any) -> Any:
    VISITED.append("first")
    return RETURNS["value"]


async def _second(state: dict[str, Any], ctx: Any) -> Any:
    VISITED.append("second")
    return end(f"second saw x={state.get('x')}")


SECOND = action("second", _second)
TRANSITIONS = define_flow("moves", "transition forms", "first", [action("first", _first), SECOND])


@pytest.mark.parametrize(
    ("returned", "expect"),
    [
        (SECOND, {"visited": ["first", "second"], "outcome": "second saw x=None"}),
        (goto("second"), {"visited": ["first", "second"], "outcome": "second saw x=None"}),
        (
            goto("second", {"x": 7}),
            {"visited": ["first", "second"], "outcome": "second saw x=7", "x": 7},
        ),
        (
            {"goto": "second", "data": {"x": 8}},
            {"visited": ["first", "second"], "outcome": "second saw x=8", "x": 8},
        ),
        (end("all-done"), {"visited": ["first"], "outcome": "all-done"}),
        ({"end": "all-done"}, {"visited": ["first"], "outcome": "all-done"}),
        (
            handoff("billing", "needs billing"),
            {"visited": ["first"], "outcome": "needs billing", "agent": "billing"},
        ),
        (
            {"kind": "handoff", "to": "billing", "reason": "needs billing"},
            {"visited": ["first"], "outcome": "needs billing", "agent": "billing"},
        ),
    ],
    ids=[
        "node",
        "goto",
        "goto-data",
        "goto-dict",
        "end",
        "end-dict",
        "handoff",
        "handoff-dict",
    ],
)
async def test_every_transition_form_moves_the_flow_as_specified(
    returned: Any, expect: dict[str, Any]
) -> None:
    RETURNS["value"] = returned
    runtime = runtime_with(TRANSITIONS)
    result = await runtime.run(SESSION, input="go", kind="flow", flow_name="moves").result()

    assert result.status == "finished"
    state = await runtime.get_run(result.run_id, SESSION)
    assert state is not None
    assert state.status == "finished"
    assert expect["visited"] == VISITED
    assert state.outcome == expect["outcome"]
    assert state.active_flow is None
    assert state.active_node is None
    assert state.active_agent == expect.get("agent", "main")
    if "x" in expect:
        assert state.state["x"] == expect["x"]


async def test_goto_an_unknown_node_fails_the_turn_with_a_clear_error() -> None:
    RETURNS["value"] = goto("nowhere")
    runtime = runtime_with(TRANSITIONS)
    handle = runtime.run(SESSION, input="go", kind="flow", flow_name="moves")
    with pytest.raises(ValueError, match="unknown node 'nowhere'"):
        await handle.result()


# ------------------------------------------------------------------- digest
def _digest_in_a_new_process(hash_seed: str) -> str:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import test_flows_nodes as t; print(t.intake_flow().digest)"
    )
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", code, str(TESTS_DIR)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout.strip()


def test_flow_digest_is_the_same_in_two_fresh_processes() -> None:
    here = intake_flow().digest
    assert re.fullmatch(r"[0-9a-f]{64}", here)
    assert _digest_in_a_new_process("1") == here
    assert _digest_in_a_new_process("2") == here


def test_flow_digest_changes_when_a_node_an_instruction_or_a_schema_changes() -> None:
    base = intake_flow().digest
    assert intake_flow().digest == base  # a rebuild of the same definition
    variants = {
        "instruction": intake_flow(greeting="Greet the customer briefly.").digest,
        "schema": intake_flow(schema=DetailsWithPhone).digest,
        "required": intake_flow(required=("name",)).digest,
        "node": intake_flow(extra_node=True).digest,
    }
    for what, digest in variants.items():
        assert digest != base, f"changing the {what} left the digest unchanged"
    assert len(set(variants.values())) == len(variants)


# -------------------------------------------------------------------- drift
async def test_resuming_after_the_flow_changed_raises_flow_drift_and_writes_nothing(
    open_store: Any,
) -> None:
    old, new = intake_flow(), intake_flow(greeting="Greet the customer briefly.")
    v1 = runtime_with(old, open_store())
    paused = await v1.run(SESSION, input="hello", kind="flow", flow_name="intake").result()
    assert paused.status == "paused"
    before = await v1.get_run(paused.run_id, SESSION)
    assert before is not None
    assert before.flow_digest == old.digest

    model = ScriptedModel(extracting)
    v2 = runtime_with(new, open_store(), model)
    handle = v2.run(SESSION, run_id=paused.run_id, input="name=Ann email=a@x.io")
    with pytest.raises(FlowDriftError) as caught:
        await handle.result()
    error = caught.value
    assert error.run_id == paused.run_id
    assert error.pinned == old.digest
    assert error.current == new.digest
    assert error.recovery == ("restart", "abandon")
    with pytest.raises(FlowDriftError):
        await handle.run_id
    assert model.requests == []

    after = await v2.get_run(paused.run_id, SESSION)
    assert after is not None
    assert after.version == before.version
    assert after.step_count == before.step_count
    assert after.messages == before.messages
    assert after.status == "paused"
    assert COMPLETED == []


async def test_resolve_drift_restart_repins_and_drives_the_new_flow_from_its_start_with_fresh_keys(
    open_store: Any,
) -> None:
    old, new = intake_flow(), intake_flow(greeting="Greet the customer briefly.")
    v1 = runtime_with(old, open_store())
    paused = await v1.run(SESSION, input="name=Ann", kind="flow", flow_name="intake").result()
    assert paused.status == "paused"
    old_keys = {s.key for s in await v1.get_steps(paused.run_id, SESSION)}

    model = ScriptedModel(extracting)
    v2 = runtime_with(new, open_store(), model)
    repinned = await v2.resolve_drift(paused.run_id, SESSION, "restart")
    assert repinned.flow_digest == new.digest
    assert repinned.active_flow == "intake"
    assert repinned.active_node == "details"
    # Driven within the call: the start node asks again, under the new definition.
    assert repinned.status == "paused"
    assert repinned.waiting_for is not None and repinned.waiting_for.kind == "input"
    assert repinned.state == {"name": "Ann"}
    assert repinned.lease_holder is None

    again = await v2.run(SESSION, run_id=paused.run_id).result()
    assert again.status == "paused"  # a plain call on a paused run executes nothing
    done = await v2.run(SESSION, run_id=paused.run_id, input="email=ann@x.io").result()

    assert done.status == "finished"
    assert done.output == "[Greet the customer briefly.]"
    assert COMPLETED == [{"name": "Ann", "email": "ann@x.io"}]
    new_steps = [s for s in await v2.get_steps(paused.run_id, SESSION) if s.key not in old_keys]
    assert [s.kind for s in new_steps] == ["model", "model", "model"]
    assert len(model.requests) == 3  # nothing of the old pass was replayed
    final = await v2.get_run(paused.run_id, SESSION)
    assert final is not None
    assert final.outcome == "greeted"


async def test_resolve_drift_abandon_aborts_the_run_and_it_executes_nothing_after(
    open_store: Any,
) -> None:
    v1 = runtime_with(intake_flow(), open_store())
    paused = await v1.run(SESSION, input="hello", kind="flow", flow_name="intake").result()

    model = ScriptedModel(extracting)
    v2 = runtime_with(intake_flow(extra_node=True), open_store(), model)
    aborted = await v2.resolve_drift(paused.run_id, SESSION, "abandon")
    assert aborted.status == "aborted"
    assert aborted.waiting_for is None

    again = await v2.run(SESSION, run_id=paused.run_id, input="name=A email=b@c.d").result()
    assert again.status == "aborted"
    assert model.requests == []
    state = await v2.get_run(paused.run_id, SESSION)
    assert state is not None
    assert state.version == aborted.version


# ------------------------------------------------------------ unknown flow
async def test_unknown_flow_name_is_a_clear_error_and_creates_nothing() -> None:
    store = RunStore.memory()
    runtime = runtime_with(intake_flow(), store)
    handle = runtime.run(SESSION, input="hi", kind="flow", flow_name="no-such-flow")
    with pytest.raises(FlowNotFoundError) as caught:
        await handle.result()
    assert caught.value.flow_name == "no-such-flow"
    assert "intake" in str(caught.value)
    with pytest.raises(FlowNotFoundError):
        await handle.run_id
    assert store.session_run_ids(SESSION) == []
