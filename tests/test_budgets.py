"""Budgets: nothing is spent past a budget without a human's yes (docs/usage.md).

On memory, SQLite and PostgreSQL: a model call journals its intent first
(a call cut off is re-run as its step's next attempt, and counted); a run
whose usage reached its budget does not call the model again: ``"ask"``
pauses it on ``__budget`` until a human approves (with ``raise_to``) or
denies (the run finishes, outcome ``"budget exceeded"``); ``"fail"`` ends it
with ``BudgetExceededError``. A run's own budget survives into another process.
"""

from __future__ import annotations

from typing import Any

import pytest

from kuralle_es import (
    Budget,
    BudgetExceededError,
    InvalidSignalError,
    ModelRequest,
    ModelResponse,
    Runtime,
    define_agent,
)
from kuralle_es.testing import ScriptedModel

SESSION = "s-budget"
TOKENS = {"input_tokens": 40, "output_tokens": 20, "total_tokens": 60}


class CountingModel(ScriptedModel):
    """Answers every turn with 60 tokens; ``fail_next`` makes calls fail first."""

    def __init__(self) -> None:
        super().__init__(self.answer, id="counting")
        self.fail_next = 0

    def answer(self, request: ModelRequest) -> ModelResponse:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("the model's server dropped the connection")
        return ModelResponse(content=f"answer {len(self.requests)}", usage=TOKENS)


def runtime_for(store: Any, model: CountingModel, budget: Budget | None = None) -> Runtime:
    agent = define_agent("assistant", "answer briefly", model, [], budget=budget)
    return Runtime([agent], store=store)


async def say(runtime: Runtime, text: str = "hi", **options: Any) -> Any:
    return await runtime.run(SESSION, input=text, **options).result()


async def model_steps(runtime: Runtime, run_id: str) -> list[Any]:
    return [s for s in await runtime.get_steps(run_id, SESSION) if s.kind == "model"]


async def test_a_model_call_cut_off_is_its_steps_next_attempt_and_is_counted(
    open_store: Any,
) -> None:
    model = CountingModel()
    runtime = runtime_for(open_store(), model)
    model.fail_next = 1
    handle = runtime.run(SESSION, input="hi")
    run_id = await handle.run_id
    with pytest.raises(ConnectionError):
        await handle.result()
    (step,) = await model_steps(runtime, run_id)
    assert step.status == "running" and step.attempts == 1  # the intent came first

    done = await runtime.run(SESSION, run_id=run_id).result()
    assert done.status == "finished"
    (step,) = await model_steps(runtime, done.run_id)
    assert step.status == "finished" and step.attempts == 2
    assert step.result["usage"] == TOKENS
    assert len(model.requests) == 2


async def test_ask_pauses_before_the_call_past_the_budget_and_calls_nothing_while_paused(
    open_store: Any,
) -> None:
    model = CountingModel()
    runtime = runtime_for(open_store(), model, Budget(max_total_tokens=100))
    assert (await say(runtime)).status == "finished"  # 0 spent: the call starts
    assert (await say(runtime)).status == "finished"  # 60 < 100: it starts too
    paused = await say(runtime)  # 120 >= 100: no third call

    assert paused.status == "paused"
    wait = paused.waiting_for
    assert wait is not None and (wait.name, wait.kind) == ("__budget", "approval")
    assert wait.operation is not None and wait.operation.tool_name == "__budget"
    assert wait.operation.args["budget"] == {"max_total_tokens": 100}
    assert wait.operation.args["usage"]["total_tokens"] == 120
    assert wait.operation.args["usage"]["model_calls"] == 2
    assert len(model.requests) == 2

    # A plain re-address while paused calls nothing either.
    assert (await runtime.run(SESSION, run_id=paused.run_id).result()).status == "paused"
    assert len(model.requests) == 2

    done = await runtime.approve(
        paused.run_id, SESSION, by="finance", raise_to={"max_total_tokens": 1000}
    )
    assert done.status == "finished" and len(model.requests) == 3
    # Under the raised budget the next turns go on without asking.
    assert (await say(runtime)).status == "finished"
    assert len(model.requests) == 4


async def test_an_approval_without_raise_to_lets_one_call_through(open_store: Any) -> None:
    model = CountingModel()
    runtime = runtime_for(open_store(), model, Budget(max_model_calls=1))
    await say(runtime)
    paused = await say(runtime)
    assert paused.status == "paused"
    assert (await runtime.approve(paused.run_id, SESSION, by="b")).status == "finished"
    assert len(model.requests) == 2
    again = await say(runtime)  # still past the budget: asks again
    assert again.status == "paused" and len(model.requests) == 2


async def test_a_denied_budget_ends_the_run_with_budget_exceeded(open_store: Any) -> None:
    model = CountingModel()
    runtime = runtime_for(open_store(), model, Budget(max_model_calls=1))
    await say(runtime)
    paused = await say(runtime)
    denied = await runtime.deny(paused.run_id, SESSION, by="finance", reason="too much")
    assert denied.status == "finished"
    state = await runtime.get_run(paused.run_id, SESSION)
    assert state is not None and state.outcome == "budget exceeded"
    assert len(model.requests) == 1


async def test_fail_ends_the_run_with_budget_exceeded_error(open_store: Any) -> None:
    model = CountingModel()
    runtime = runtime_for(open_store(), model, Budget(max_model_calls=1, on_exceed="fail"))
    await say(runtime)
    handle = runtime.run(SESSION, input="again")
    run_id = await handle.run_id
    with pytest.raises(BudgetExceededError) as refused:
        await handle.result()
    assert refused.value.reached == ["max_model_calls"]
    assert "Budget" in str(refused.value)
    state = await runtime.get_run(run_id, SESSION)
    assert state is not None and state.status == "error"
    assert state.error is not None and state.error.type == "BudgetExceededError"
    assert len(model.requests) == 1


async def test_a_runs_own_budget_replaces_the_agents_and_survives_another_process(
    open_store: Any,
) -> None:
    model = CountingModel()
    first = runtime_for(open_store(), model)  # the agent has no budget
    await say(first, budget=Budget(max_model_calls=1))
    paused = await say(first)
    assert paused.status == "paused"

    other = runtime_for(open_store(), CountingModel())
    done = await other.approve(paused.run_id, SESSION, by="b", raise_to={"max_model_calls": 5})
    assert done.status == "finished"


async def test_a_raise_to_that_is_not_a_budget_is_refused_and_writes_nothing(
    open_store: Any,
) -> None:
    runtime = runtime_for(open_store(), CountingModel(), Budget(max_model_calls=0))
    paused = await say(runtime)
    before = await runtime.get_run(paused.run_id, SESSION)
    for bad in ({"max_tokens": 5}, {"max_model_calls": -1}, {"on_exceed": "fail"}, []):
        with pytest.raises(InvalidSignalError, match="raise_to"):
            await runtime.signal(
                paused.run_id, SESSION, "__budget", {"approved": True, "raise_to": bad}
            )
    after = await runtime.get_run(paused.run_id, SESSION)
    assert before is not None and after is not None and after.version == before.version
