"""A spent budget is decided from another process like any approval
(docs/usage.md): ``kuralle-es approve --raise-to`` and ``deny``, and the HTTP
API's ``approve`` with ``raise_to``, on SQLite and PostgreSQL.

A ``chatty`` run (tests/procs/budget_app.py: two model turns) started with a
budget of one model call pauses on ``__budget`` before its second call. A
decision from a real ``kuralle-es`` process (the CLI, or ``serve`` over
HTTP) resumes it: approved with a raised limit, the second call is made and
the run finishes; denied, no call is made and the run finishes with outcome
``"budget exceeded"``. The decision is journaled with what it raised.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from http_kit import StoreHead, start_server
from procs import budget_app
from test_cli_operator import _ok, kuralle

from kuralle_es import Budget, RunStore, Runtime, TurnResult

SESSION = "s-budget-doors"
TESTS = str(Path(__file__).resolve().parent)


async def paused_on_budget(store_url: str) -> str:
    """A chatty run that made its one allowed model call and waits on ``__budget``."""
    store = RunStore.from_url(store_url)
    try:
        runtime = Runtime(budget_app.build_agents(), store=store)
        result = await runtime.run(
            SESSION, input="go", kind="flow", flow_name=budget_app.FLOW,
            budget=Budget(max_model_calls=1),
        ).result()  # fmt: skip
        assert result.status == "paused" and result.waiting_for is not None
        assert result.waiting_for.name == "__budget"
        operation = result.waiting_for.operation
        assert operation is not None and operation.args["budget"] == {"max_model_calls": 1}
        return result.run_id
    finally:
        store.close()


async def decided(store_url: str, run_id: str) -> tuple[Any, list[Any], Any]:
    """The run's state, its model steps, and its ``__budget`` decision step."""
    store = RunStore.from_url(store_url)
    try:
        runtime = Runtime(budget_app.build_agents(), store=store)
        state = await runtime.get_run(run_id, SESSION)
        steps = await runtime.get_steps(run_id, SESSION)
        [decision] = [s for s in steps if s.name == "__budget"]
        return state, [s for s in steps if s.kind == "model"], decision
    finally:
        store.close()


def cli(store_url: str, *args: str) -> Any:
    return kuralle(
        "--store", store_url, "--app", "procs.budget_app:AGENTS", *args,
        PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
    )  # fmt: skip


async def test_the_cli_approves_a_spent_budget_with_a_raised_limit(store_url: str) -> None:
    run_id = await paused_on_budget(store_url)
    out = _ok(cli(store_url, "approve", run_id, "--by", "ann", "--raise-to",
                  '{"max_model_calls": 3}'))  # fmt: skip
    assert "finished" in out
    state, model_steps, decision = await decided(store_url, run_id)
    assert (state.status, state.outcome) == ("finished", "said")
    assert len(model_steps) == 2
    assert decision.result["raise_to"] == {"max_model_calls": 3}


async def test_the_cli_denies_a_spent_budget_and_no_model_call_is_made(store_url: str) -> None:
    run_id = await paused_on_budget(store_url)
    _ok(cli(store_url, "deny", run_id, "--by", "ann", "--reason", "too dear"))
    state, model_steps, decision = await decided(store_url, run_id)
    assert (state.status, state.outcome) == ("finished", "budget exceeded")
    assert len(model_steps) == 1
    assert decision.result["approved"] is False


async def test_a_raise_to_that_is_not_a_budget_is_one_line_and_writes_nothing(
    store_url: str,
) -> None:
    run_id = await paused_on_budget(store_url)
    head = StoreHead(store_url)
    try:
        before = head.head()
        done = cli(store_url, "approve", run_id, "--by", "ann", "--raise-to", '{"max_pay": 3}')
        assert done.returncode != 0
        assert "raise_to" in done.stderr and "max_total_tokens" in done.stderr
        assert head.head() == before
    finally:
        head.close()


async def test_the_http_api_approves_a_spent_budget_with_a_raised_limit(
    store_url: str, tmp_path: Path
) -> None:
    run_id = await paused_on_budget(store_url)
    server = start_server(store_url, tmp_path, app="budget_app:AGENTS")
    try:
        answer = server.call(
            "POST", f"/api/runs/{run_id}/approve",
            {"by": "ann", "raise_to": {"max_model_calls": 2}},
        )  # fmt: skip
        assert answer.status == 200, answer.body
        result = TurnResult.model_validate(answer.body)
        assert result.status == "finished"  # its output is the last reply, "ok"
    finally:
        server.stop()
    state, model_steps, decision = await decided(store_url, run_id)
    assert state.outcome == "said" and len(model_steps) == 2
    assert decision.result["raise_to"] == {"max_model_calls": 2}
