"""Replay properties of the runtime, checked with Hypothesis on ``RunStore.memory()``.

A random "program" (tool calls with random JSON args, ``now``, ``uuid`` and
``gather`` batches), spread over one or two action nodes of a flow, fails at a
random point on its first pass; re-entry with ``runtime.run(session_id,
run_id=...)`` then completes it. Whatever the failure, these must hold:

- each tool call executes exactly once per idempotency key (an external
  ledger keyed by ``call.idempotency_key`` counts executions), except a call
  in doubt at the crash (cut off mid-execution, or executed with its result
  not saved yet: a result rides the turn's next save, docs/guarantees.md),
  which re-executes once with the *same* key;
- every value the first pass saw and the journal saved is the value the
  second pass sees, and both equal the journal's recorded results;
- the journal never holds two finished steps with one key; its callsites are
  exactly ``0..n-1``; its keys are the documented hashes (docs/concepts.md), computed independently.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID, uuid4

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kuralle_es import (
    RunStore,
    Runtime,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
)
from kuralle_es.testing import Crash

SESSION = "session-props"
TOOL_NAMES = ("alpha", "beta")


class Payload(BaseModel):
    payload: Any = None


class NodeFailure(RuntimeError):
    """An ordinary node error on the first pass."""


# ------------------------------------------------------------------ strategies
keys = st.text(max_size=6).filter(lambda k: not (k.startswith("_") and k.endswith("_")))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=6,
)
tool_effect = st.tuples(st.just("tool"), st.sampled_from(TOOL_NAMES), json_values)
effects = st.one_of(
    tool_effect,
    st.tuples(st.just("now")),
    st.tuples(st.just("uuid")),
    st.tuples(
        st.just("gather"),
        st.lists(st.tuples(st.sampled_from(TOOL_NAMES), json_values), min_size=1, max_size=4),
    ),
)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    program = draw(st.lists(effects, min_size=0, max_size=8))
    split = draw(st.integers(0, len(program)))
    fail_at = draw(st.integers(0, len(program)))
    mode = draw(st.sampled_from(["error", "crash", "crash_in_tool"]))
    return Scenario(program=program, split=split, fail_at=fail_at, mode=mode)


@dataclass
class Scenario:
    program: list[tuple[Any, ...]]
    split: int  # effects [0, split) run in node "a", the rest in node "b"
    fail_at: int  # the first pass fails just before effect ``fail_at`` (or at the end)
    mode: str  # "error" (node raises), "crash" (turn dies), "crash_in_tool"

    @property
    def cuts_a_tool(self) -> bool:
        """The failure lands inside a single tool's execution (after its effect)."""
        return (
            self.mode == "crash_in_tool"
            and self.fail_at < len(self.program)
            and self.program[self.fail_at][0] == "tool"
        )


# ---------------------------------------------------------------------- ledger
@dataclass
class Ledger:
    """An external system that deduplicates by idempotency key."""

    applied: dict[str, dict[str, Any]] = field(default_factory=dict)
    attempts: Counter[str] = field(default_factory=Counter)
    calls: list[ToolCall] = field(default_factory=list)
    crash_next: bool = False

    def execute(self, name: str, args: Payload, call: ToolCall) -> dict[str, Any]:
        self.attempts[call.idempotency_key] += 1
        self.calls.append(call)
        if call.idempotency_key not in self.applied:
            self.applied[call.idempotency_key] = {
                "tool": name,
                "echo": args.payload,
                "nonce": uuid4().hex,  # a re-execution would show a new nonce
            }
        if self.crash_next:
            self.crash_next = False
            raise Crash(f"died inside {name} after its effect")
        return self.applied[call.idempotency_key]


# --------------------------------------------------------------------- the run
def spec_key(logical_run_id: str, callsite: int, payload: Any) -> str:
    text = json.dumps(
        {"run": logical_run_id, "callsite": callsite, "payload": payload},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def expected_payloads(program: list[tuple[Any, ...]]) -> list[Any]:
    """The key payload of each effect, in callsite order (a gather is flattened)."""
    out: list[Any] = []
    for effect in program:
        if effect[0] == "tool":
            out.append({"name": effect[1], "args": {"payload": effect[2]}})
        elif effect[0] == "gather":
            out.extend({"name": n, "args": {"payload": p}} for n, p in effect[1])
        else:
            out.append(effect[0])
    return out


def callsites_of(program: list[tuple[Any, ...]]) -> list[list[int]]:
    """The callsites each effect of ``program`` takes (a gather takes one per call)."""
    out: list[list[int]] = []
    next_site = 0
    for effect in program:
        width = len(effect[1]) if effect[0] == "gather" else 1
        out.append(list(range(next_site, next_site + width)))
        next_site += width
    return out


Observed = list[dict[int, list[Any]]]  # per turn: effect index -> the values it returned


def build(scenario: Scenario, ledger: Ledger, observed: Observed) -> Runtime:
    """A flow whose nodes "a" and "b" run the program; ``observed[-1]`` is the current turn."""

    def make_tool(name: str) -> Any:
        def execute(args: Payload, call: ToolCall) -> dict[str, Any]:
            return ledger.execute(name, args, call)

        return define_tool(name, f"the {name} tool", Payload, execute)

    async def perform(ctx: Any, effect: tuple[Any, ...]) -> list[Any]:
        kind = effect[0]
        if kind == "tool":
            return [await ctx.tool(effect[1], {"payload": effect[2]})]
        if kind == "now":
            return [(await ctx.now()).isoformat()]
        if kind == "uuid":
            return [await ctx.uuid()]
        calls = [ctx.tool(name, {"payload": p}) for name, p in effect[1]]
        return list(await asyncio.gather(*calls))

    async def run_effects(ctx: Any, first: int, last: int, is_last_node: bool) -> None:
        first_pass = len(observed) == 1
        for i in range(first, last):
            if first_pass and i == scenario.fail_at:
                if scenario.cuts_a_tool:
                    ledger.crash_next = True
                elif scenario.mode == "error":
                    raise NodeFailure(f"first pass fails before effect {i}")
                else:
                    raise Crash(f"first pass dies before effect {i}")
            observed[-1][i] = await perform(ctx, scenario.program[i])
        if first_pass and is_last_node and scenario.fail_at == len(scenario.program):
            if scenario.mode == "error":
                raise NodeFailure("first pass fails after the last effect")
            raise Crash("first pass dies after the last effect")

    async def node_a(state: dict[str, Any], ctx: Any) -> Any:
        await run_effects(ctx, 0, scenario.split, is_last_node=False)
        return goto("b")

    async def node_b(state: dict[str, Any], ctx: Any) -> Any:
        await run_effects(ctx, scenario.split, len(scenario.program), is_last_node=True)
        return end("done")

    flow = define_flow("prog", "a random program", "a", [action("a", node_a), action("b", node_b)])
    agent = define_agent("agent", "test", None, [make_tool(n) for n in TOOL_NAMES], [flow])
    return Runtime([agent], store=RunStore.memory(), holder="worker-1")


def with_store(runtime: Runtime) -> Runtime:
    """A fresh runtime (a restarted worker, same holder) over the same store."""
    agent = next(iter(runtime.agents.values()))
    return Runtime([agent], store=runtime.store, holder="worker-1")


async def play(scenario: Scenario) -> None:
    ledger = Ledger()
    observed: Observed = []
    rt = build(scenario, ledger, observed)

    # ---- first pass: fails at the chosen point
    observed.append({})
    handle = rt.run(SESSION, input="go", kind="flow", flow_name="prog")
    errored = scenario.mode == "error" and not scenario.cuts_a_tool
    expected_failure: type[BaseException] = NodeFailure if errored else Crash
    with pytest.raises(expected_failure):
        await handle.result()
    run_id = await handle.run_id
    assert sorted(observed[0]) == list(range(scenario.fail_at))
    state = await rt.get_run(run_id, SESSION)
    assert state is not None
    assert state.status == ("error" if expected_failure is NodeFailure else "running")
    # What the crash left saved: a step's result rides the turn's next save, so
    # the last results before a crash may be in doubt (re-run under their keys).
    saved = [s for s in await rt.get_steps(run_id, SESSION) if s.status == "finished"]
    saved_sites = {s.callsite for s in saved}
    saved_keys = {s.key for s in saved}
    if errored:  # an error closes the turn with a save: nothing is in doubt
        reached = callsites_of(scenario.program)[: scenario.fail_at]
        assert len(saved) == sum(len(sites) for sites in reached)

    # ---- re-entry completes (a crashed turn is re-entered by a restarted worker)
    again = rt if errored else with_store(rt)
    observed.append({})
    result = await again.run(SESSION, run_id=run_id).result()
    assert result.status == "finished", result
    assert result.output == "done"
    first, second = observed
    # Re-entry resumes at the active node: it sees at least every effect the
    # first pass did not reach, and whatever both saw is identical.
    assert set(range(scenario.fail_at, len(scenario.program))) <= set(second)
    sites = callsites_of(scenario.program)
    for i in set(first) & set(second):
        if set(sites[i]) <= saved_sites:
            assert first[i] == second[i], i
    merged = {**first, **second}
    final = [v for i in sorted(merged) for v in merged[i]]

    # ---- journal shape
    payloads = expected_payloads(scenario.program)
    steps = await again.get_steps(run_id, SESSION)
    n = len(payloads)
    assert sorted(s.callsite for s in steps) == list(range(n))
    assert [s.index for s in steps] == list(range(len(steps)))
    assert len(steps) == n  # nothing journaled twice
    assert all(s.status == "finished" for s in steps)
    finished_keys = [s.key for s in steps if s.status == "finished"]
    assert len(finished_keys) == len(set(finished_keys))
    flow = again.flow("prog")[1]
    logical = f"{run_id}#0#prog@{flow.digest}"
    by_site = sorted(steps, key=lambda s: s.callsite)
    assert [s.key for s in by_site] == [spec_key(logical, i, p) for i, p in enumerate(payloads)]

    # ---- results: every value any pass saw is the journal's recorded result
    assert sorted(merged) == list(range(len(scenario.program)))
    assert final == [s.result for s in by_site]

    # ---- the external ledger: once per key, and keys are the journal's keys
    tool_keys = {s.key for s in steps if s.kind == "tool"}
    assert set(ledger.applied) == tool_keys
    assert len(ledger.applied) == sum(1 for p in payloads if isinstance(p, dict))
    for key, count in ledger.attempts.items():
        assert count == 1 or (count == 2 and key not in saved_keys), (key, count)
    if scenario.cuts_a_tool:
        # The cut-off call re-executed once, under exactly the key it had.
        assert sorted(ledger.attempts.values()).count(2) >= 1
    for call in ledger.calls:
        step = next(s for s in steps if s.key == call.idempotency_key)
        assert call.callsite == step.callsite
        assert call.run_id == run_id
        assert call.session_id == SESSION

    # ---- a third entry of the finished run executes nothing
    attempts = dict(ledger.attempts)
    observed.append({})
    result = await again.run(SESSION, run_id=run_id).result()
    assert result.status == "finished"
    assert dict(ledger.attempts) == attempts
    assert observed[-1] == {}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(scenarios())
def test_failed_first_pass_then_reentry_executes_each_key_once_and_replays_recorded_values(
    scenario: Scenario,
) -> None:
    asyncio.run(play(scenario))


@settings(max_examples=20, deadline=None)
@given(
    st.lists(tool_effect, min_size=1, max_size=6),
    st.integers(min_value=0, max_value=10),
)
def test_every_reentry_of_an_errored_run_replays_and_never_re_executes(
    program: list[tuple[Any, ...]], failures: int
) -> None:
    """A node that keeps failing after all its effects: every re-entry replays
    the same recorded results and the ledger never moves."""

    async def scenario() -> None:
        ledger = Ledger()
        observed: list[list[Any]] = []
        remaining = {"n": failures}

        async def node(state: dict[str, Any], ctx: Any) -> Any:
            values = [await ctx.tool(e[1], {"payload": e[2]}) for e in program]
            observed.append(values)
            if remaining["n"] > 0:
                remaining["n"] -= 1
                raise NodeFailure("still failing")
            return end("done")

        def make_tool(name: str) -> Any:
            return define_tool(name, "d", Payload, lambda a, c: ledger.execute(name, a, c))

        flow = define_flow("loop", "d", "n", [action("n", node)])
        agent = define_agent("agent", "t", None, [make_tool(n) for n in TOOL_NAMES], [flow])
        rt = Runtime([agent], store=RunStore.memory())
        handle = rt.run(SESSION, kind="flow", flow_name="loop")
        run_id: str | None = None
        for attempt in range(failures + 1):
            if attempt:
                assert run_id is not None
                handle = rt.run(SESSION, run_id=run_id)
            if attempt < failures:
                with pytest.raises(NodeFailure):
                    await handle.result()
            else:
                assert (await handle.result()).status == "finished"
            run_id = await handle.run_id
        assert run_id is not None
        UUID(run_id)
        assert len(observed) == failures + 1
        assert all(values == observed[0] for values in observed)
        assert all(count == 1 for count in ledger.attempts.values())
        assert len(ledger.applied) == len(program)
        steps = await rt.get_steps(run_id, SESSION)
        assert [s.callsite for s in steps] == list(range(len(program)))
        assert [s.result for s in steps] == observed[0]

    asyncio.run(scenario())
