"""What the usage views sum is what the journal says, whatever happened to the run.

A Hypothesis property over random conversations, on memory, SQLite and
PostgreSQL: each user turn makes a few model calls (some asking for a tool,
each reporting some usage or none), a model call may fail (the turn ends in
error and the run is addressed again: that call's step runs its next
attempt), and the first turn may die at any journal boundary (a
``CrashingStore``; the run is then addressed again from a fresh store, as
a restarted worker would). Afterwards ``views.usage(run_id=...)`` must equal
the sums over the run's journal (model calls: every attempt of every model
step; tokens: what the finished steps' responses reported; tool calls: every
attempt of every tool step), and every call the model really answered must
be counted (``model_calls`` is at least the calls made; a crash between a
call's intent and the call adds an attempt that never reached the model).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kuralle_es import (
    ModelRequest,
    ModelResponse,
    RunStore,
    Runtime,
    RunViews,
    ToolCallRequest,
    define_agent,
    define_tool,
)
from kuralle_es._journal.spending import ModelUsage, normalise_usage, total
from kuralle_es.shapes import Usage
from kuralle_es.testing import Crash, CrashingStore, CrashPlan, ScriptedModel, crash_plans

HOLDER = "usage-property-worker"
SESSIONS = itertools.count()
#: Examples per backend: PostgreSQL's saves cost the most.
EXAMPLES = {"memory": 150, "sqlite": 60, "postgres": 30}


class Item(BaseModel):
    sku: str


#: One model call of a turn: the usage it reports (None: none) and whether it
#: asks for the tool (else it is the turn's answer), and how often it fails first.
Call = tuple[dict[str, int] | None, bool, int]

usages = st.none() | st.builds(
    lambda i, o, with_total: (
        {"input_tokens": i, "output_tokens": o} | ({"total_tokens": i + o} if with_total else {})
    ),
    st.integers(0, 500),
    st.integers(0, 500),
    st.booleans(),
)
calls = st.tuples(usages, st.booleans(), st.integers(0, 2))
turns = st.lists(st.lists(calls, min_size=0, max_size=3), min_size=1, max_size=3)


class ProgramModel(ScriptedModel):
    """Answers each turn from its program: its calls in order (the position read
    from the conversation, so a re-asked call gets the same answer), failing the
    first attempts a call is told to fail, then the turn's final text."""

    def __init__(self, program: list[list[Call]]) -> None:
        super().__init__(self.answer, id="m-prop")
        self.program = program
        self.failed: Counter[tuple[int, int]] = Counter()
        self.answered = 0

    def answer(self, request: ModelRequest) -> ModelResponse:
        users = [i for i, m in enumerate(request.messages) if m.role == "user"]
        turn = len(users) - 1
        since = request.messages[users[-1] :]
        position = sum(1 for m in since if m.role == "assistant")
        plan = self.program[turn]
        usage, wants_tool, fails = plan[position] if position < len(plan) else (None, False, 0)
        if self.failed[(turn, position)] < fails:
            self.failed[(turn, position)] += 1
            raise ConnectionError("the model's server dropped the connection")
        self.answered += 1
        if wants_tool and position < len(plan):
            call = ToolCallRequest(id=f"c{turn}-{position}", name="stock", args={"sku": "a"})
            return ModelResponse(tool_calls=[call], usage=usage)
        return ModelResponse(content=f"turn {turn} done", usage=usage)


def journal_usage(steps: list[Any]) -> Usage:
    """What the journal says its model and tool steps spent."""
    by_model: dict[str, ModelUsage] = {}
    tool_calls = 0
    for step in steps:
        if step.kind == "tool":
            tool_calls += step.attempts
        if step.kind != "model":
            continue
        result = step.result if isinstance(step.result, dict) else {}
        reported = normalise_usage(result.get("usage")) or {}
        seen = by_model.get(step.name) or ModelUsage(model=step.name)
        by_model[step.name] = ModelUsage(
            model=step.name,
            calls=seen.calls + step.attempts,
            input_tokens=seen.input_tokens + (reported.get("input_tokens") or 0),
            output_tokens=seen.output_tokens + (reported.get("output_tokens") or 0),
            total_tokens=seen.total_tokens + (reported.get("total_tokens") or 0),
        )
    return total(list(by_model.values()), tool_calls, None)


async def converse(
    program: list[list[Call]],
    plan: CrashPlan | None,
    open_crashing: Callable[[], CrashingStore],
    open_store: Callable[[], RunStore],
    opened: list[RunStore],
) -> None:
    model = ProgramModel(program)
    tool = define_tool("stock", "stock of an item", Item, lambda args: {"stock": 3})
    agent = define_agent("clerk", "answer briefly", model, [tool])
    session = f"s-usage-{next(SESSIONS)}"
    crashing = open_crashing()
    opened.append(crashing)
    crashing.plan = plan
    store: RunStore = crashing
    run_id = None
    for turn in range(len(program)):
        handle = Runtime([agent], store=store, holder=HOLDER).run(session, input=f"turn {turn}")
        for _ in range(12):  # a turn that crashed or errored is addressed again
            try:
                result = await handle.result()
            except Crash:
                crashing.plan = None
                store = open_store()
                opened.append(store)
            except ConnectionError:
                pass
            else:
                assert result.status == "finished", result
                run_id = result.run_id
                break
            run_id = await handle.run_id
            handle = Runtime([agent], store=store, holder=HOLDER).run(session, run_id=run_id)
        else:
            pytest.fail(f"turn {turn} of run {run_id} did not finish")
    assert run_id is not None
    runtime = Runtime([agent], store=store, holder=HOLDER)
    steps = await runtime.get_steps(run_id, session)
    expected = journal_usage(steps)
    views = RunViews(store)
    found = await views.usage(run_id=run_id)
    assert found == expected
    assert found.model_calls >= model.answered + sum(model.failed.values())
    assert await views.usage(session_id=session) == expected
    assert await views.usage(agent_id="clerk", session_id=session) == expected


def _settings(backend: str) -> Any:
    return settings(
        max_examples=EXAMPLES[backend],
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def check_property(backend: str, target: str | None) -> None:
    crashing_memory = CrashingStore.memory()

    def open_crashing() -> CrashingStore:
        if backend == "memory":
            return crashing_memory
        assert target is not None
        if backend == "sqlite":
            return CrashingStore.sqlite(target)
        return CrashingStore.postgres(target)

    def open_store() -> RunStore:
        if backend == "memory":
            return crashing_memory
        assert target is not None
        return RunStore.sqlite(target) if backend == "sqlite" else RunStore.postgres(target)

    @_settings(backend)
    @given(program=turns, plan=st.none() | crash_plans(max_nth=4))
    def check(program: list[list[Call]], plan: CrashPlan | None) -> None:
        opened: list[RunStore] = []
        try:
            asyncio.run(converse(program, plan, open_crashing, open_store, opened))
        finally:
            if backend != "memory":
                for store in opened:
                    with contextlib.suppress(Exception):
                        store.close()

    check()


def test_usage_sums_equal_the_journal_after_failures_and_crashes_memory() -> None:
    check_property("memory", None)


def test_usage_sums_equal_the_journal_after_failures_and_crashes_sqlite(tmp_path: Path) -> None:
    check_property("sqlite", str(tmp_path / "runs.db"))


@pytest.mark.postgres
def test_usage_sums_equal_the_journal_after_failures_and_crashes_postgres(pg_dsn: str) -> None:
    check_property("postgres", pg_dsn)
