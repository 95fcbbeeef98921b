"""``DurableAgent.run`` takes what ``Agent.run`` takes (docs/pydantic-ai.md): ``deps``
(never journaled: each process gives its own), ``message_history`` (journaled with the
turn), ``usage_limits`` (the run's budget) and ``idempotency_key``, and returns the
agent's typed output whichever process drove the turn. Each process is a fresh
``Runtime`` over a new store object on the same database.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, RunContext, ToolOutput
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import UsageLimits
from test_pydantic_ai import crashing

from kuralle_es import BudgetExceededError, InvalidArgumentError, Runtime, recover_orphaned_runs
from kuralle_es.integrations.pydantic_ai import definition, durable, typed_output
from kuralle_es.testing import Crash, CrashPlan

SESSION = "customer-9"
HISTORY: list[ModelMessage] = [
    ModelRequest(parts=[UserPromptPart("I am Ann, I buy in bulk")]),
    ModelResponse(parts=[TextPart("Hello Ann")]),
]


class Quote(BaseModel):
    cents: int
    who: str


@dataclass
class Rates:
    """The deps: a price list, which each process has its own copy of."""

    cents_per_unit: int
    process: str


class Quoter:
    """Prices an order (the price tool needs approval) and answers with a ``Quote``."""

    def __init__(self, *, approval: bool = True) -> None:
        self.requests: list[list[ModelMessage]] = []
        self.priced_by: list[str] = []
        self.agent = Agent(
            FunctionModel(self.answer), name="quoter", deps_type=Rates, output_type=Quote
        )
        self.agent.tool(requires_approval=approval)(self.price)

    def answer(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests.append(messages)
        last = messages[-1].parts[-1]
        if isinstance(last, ToolReturnPart) and last.tool_name == "price":
            said = [p.content for m in messages for p in m.parts if isinstance(p, UserPromptPart)]
            who = "Ann" if "I am Ann, I buy in bulk" in said else "nobody"
            final = {"cents": last.content, "who": who}
            return ModelResponse(parts=[ToolCallPart(info.output_tools[0].name, final)])
        return ModelResponse(parts=[ToolCallPart("price", {"qty": 3}, tool_call_id="p1")])

    def price(self, ctx: RunContext[Rates], qty: int) -> int:
        """Price a quantity with the rates of the process that runs it."""
        self.priced_by.append(ctx.deps.process)
        return ctx.deps.cents_per_unit * qty


async def test_deps_are_each_processs_own_and_the_history_is_journaled_with_the_turn(
    open_store: Any,
) -> None:
    quoter = Quoter()
    first = durable(quoter.agent, Runtime([], store=open_store(), holder="p1"))
    paused = await first.run(
        "price 3 please", session_id=SESSION, deps=Rates(100, "p1"), message_history=HISTORY
    )
    assert paused.status == "paused" and paused.output is None
    # Another process approves: the price runs with that process's deps, and the
    # model's next request still has the history the first call gave (journaled).
    second = Runtime([], store=open_store(), holder="p2")
    durable(quoter.agent, second, deps=Rates(120, "p2"))
    done = await second.approve(paused.run_id, SESSION, by="ann")
    assert done.status == "finished" and quoter.priced_by == ["p2"]
    said = [p.content for p in quoter.requests[-1][0].parts if isinstance(p, UserPromptPart)]
    assert said == ["I am Ann, I buy in bulk"]
    assert typed_output(quoter.agent, done.output) == Quote(cents=360, who="Ann")
    steps = await second.get_steps(paused.run_id, SESSION)
    kinds = [(s.kind, s.name) for s in steps]
    assert kinds[0] == ("value", "message_history") and kinds[1][0] == "model"
    assert steps[0].result[0]["parts"][0]["content"] == "I am Ann, I buy in bulk"


async def test_the_deps_of_an_apps_definition_drive_the_turns_of_the_command_line_and_worker(
    open_store: Any,
) -> None:
    """An app lists ``definition(agent, deps=...)`` (what ``kuralle-es approve`` and
    the worker load); a later ``durable`` without deps keeps them."""
    quoter = Quoter()
    first = durable(quoter.agent, Runtime([], store=open_store(), holder="p1"))
    paused = await first.run("price 3 please", session_id=SESSION, deps=Rates(100, "p1"))
    app = Runtime([definition(quoter.agent, deps=Rates(110, "app"))], store=open_store())
    durable(quoter.agent, app)

    done = await app.approve(paused.run_id, SESSION, by="ann")

    assert done.status == "finished" and quoter.priced_by == ["app"]
    assert typed_output(quoter.agent, done.output) == Quote(cents=330, who="nobody")


async def test_a_retried_call_in_another_process_gets_the_typed_output_from_the_journal(
    open_store: Any,
) -> None:
    quoter = Quoter(approval=False)
    first = durable(quoter.agent, Runtime([], store=open_store(), holder="p1"))
    done = await first.run(
        "price 3", session_id=SESSION, deps=Rates(100, "p1"), idempotency_key="order-1"
    )
    assert (done.status, done.output) == ("finished", Quote(cents=300, who="nobody"))
    asked = len(quoter.requests)
    again = await durable(quoter.agent, Runtime([], store=open_store(), holder="p2")).run(
        "price 3", session_id=SESSION, run_id=done.run_id, idempotency_key="order-1"
    )
    assert (again.status, again.run_id, again.output) == ("finished", done.run_id, done.output)
    assert len(quoter.requests) == asked and quoter.priced_by == ["p1"]


async def test_a_keyed_call_cut_off_by_a_crash_and_recovered_elsewhere_answers_its_retry(
    open_store: Any,
) -> None:
    """The worker dies after the price was recorded; a sweeper on another worker
    finishes the turn; the caller's retry (same key, the run id it learned)
    gets the typed output, and nothing runs again."""
    quoter = Quoter(approval=False)
    dying, reopen = crashing(open_store)
    dying.plan = CrashPlan("after_finalize", nth=2)  # the price is recorded
    first = durable(quoter.agent, Runtime([], store=dying, lease_ttl=0.2, holder="dead"))
    with pytest.raises(Crash):
        await first.run("price 3", session_id=SESSION, deps=Rates(100, "p1"),
                        idempotency_key="order-2")  # fmt: skip
    dying.plan = None
    await asyncio.sleep(0.3)
    sweeper = Runtime([], store=reopen(), holder="sweeper")
    durable(quoter.agent, sweeper, deps=Rates(100, "sweeper"))
    [run_id] = await recover_orphaned_runs(sweeper)
    asked, priced = len(quoter.requests), list(quoter.priced_by)
    again = await durable(quoter.agent, Runtime([], store=reopen(), holder="p3")).run(
        "price 3", session_id=SESSION, run_id=run_id, idempotency_key="order-2"
    )
    assert (again.status, again.output) == ("finished", Quote(cents=300, who="nobody"))
    assert (len(quoter.requests), quoter.priced_by) == (asked, priced) and priced == ["p1"]


async def test_usage_limits_are_the_runs_budget(open_store: Any) -> None:
    def chatty(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if isinstance(messages[-1].parts[-1], ToolReturnPart):
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart("look", {})])

    agent = Agent(FunctionModel(chatty), name="looker")

    @agent.tool_plain
    def look() -> str:
        """Look around."""
        return "nothing"

    runtime = Runtime([], store=open_store())
    looker = durable(agent, runtime)
    with pytest.raises(BudgetExceededError):
        await looker.run("look", session_id=SESSION, usage_limits=UsageLimits(request_limit=1))
    [run] = await runtime.views.list_runs(session_id=SESSION)
    assert run.status == "error"
    assert (await runtime.views.usage(run_id=run.run_id)).model_calls == 1
    # Resumed with one more request allowed (on top of the one it spent): it ends.
    enough = await looker.run(
        "look", session_id=SESSION, run_id=run.run_id, usage_limits=UsageLimits(request_limit=1)
    )
    assert (enough.status, enough.output) == ("finished", "done")
    with pytest.raises(InvalidArgumentError, match="tool_calls_limit"):
        await looker.run("look", session_id=SESSION, usage_limits=UsageLimits(tool_calls_limit=3))


def test_the_typed_output_is_rebuilt_from_the_journals_text() -> None:
    quoting = Agent("test", name="q", output_type=Quote)
    assert typed_output(quoting, '{"cents": 5, "who": "x"}') == Quote(cents=5, who="x")
    assert typed_output(Agent("test", name="t"), "plain text") == "plain text"
    several = Agent("test", name="s", output_type=[ToolOutput(Quote), int])
    assert typed_output(several, "42") == 42
    assert typed_output(several, "not json") == "not json"
