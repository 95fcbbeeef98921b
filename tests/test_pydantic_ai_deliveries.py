"""A Pydantic AI agent's run paused on an approval is decided from another
process (docs/pydantic-ai.md): ``kuralle-es approve`` and ``deny``, and the HTTP
API's ``approve``, on SQLite and PostgreSQL. The refund runs once, in the
deciding process, with the args the approver saw; denied, it never runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from http_kit import start_server
from procs import pai_app
from test_cli_operator import _ok, kuralle

from kuralle_es import RunStore, Runtime
from kuralle_es.integrations.pydantic_ai import durable

SESSION = "customer-pai"
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture
def ledger_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "refunds.jsonl"
    monkeypatch.setenv(pai_app.LEDGER_ENV, str(path))
    return path


async def paused(store_url: str) -> str:
    """A shop run paused on the refund's approval, started in this process."""
    store = RunStore.from_url(store_url)
    try:
        shop = durable(pai_app.build_agent(), Runtime(store=store))
        result = await shop.run("Please refund my order A1", session_id=SESSION)
        assert result.status == "paused" and result.waiting_for is not None
        operation = result.waiting_for.operation
        assert operation is not None and operation.tool_name == "refund_order"
        assert operation.args == {"order_id": "A1", "cents": 4250}
        return result.run_id
    finally:
        store.close()


async def state_of(store_url: str, run_id: str) -> Any:
    store = RunStore.from_url(store_url)
    try:
        return await Runtime(pai_app.AGENTS, store=store).get_run(run_id, SESSION)
    finally:
        store.close()


def cli(store_url: str, ledger: Path, *args: str) -> Any:
    return kuralle(
        "--store", store_url, "--app", "procs.pai_app:AGENTS", *args,
        PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
        **{pai_app.LEDGER_ENV: str(ledger)},
    )  # fmt: skip


async def test_the_cli_approves_and_the_refund_runs_once_there(
    store_url: str, ledger_file: Path
) -> None:
    run_id = await paused(store_url)
    assert pai_app.ledger(ledger_file) == []
    out = _ok(cli(store_url, ledger_file, "approve", run_id, "--by", "ann"))
    assert "Done: refunded 4250 cents on A1" in out
    [refund] = pai_app.ledger(ledger_file)
    assert (refund["cents"], refund["pid"] != os.getpid()) == (4250, True)
    state = await state_of(store_url, run_id)
    assert state.status == "finished"


async def test_the_cli_denies_and_the_refund_never_runs(store_url: str, ledger_file: Path) -> None:
    run_id = await paused(store_url)
    _ok(cli(store_url, ledger_file, "deny", run_id, "--by", "ann", "--reason", "no receipt"))
    assert pai_app.ledger(ledger_file) == []
    state = await state_of(store_url, run_id)
    assert state.status == "finished"
    denial = [m for m in state.messages if m.role == "tool" and "denied" in (m.content or "")]
    assert denial, f"the model was not told of the denial: {state.messages}"


async def test_the_http_api_approves_and_the_refund_runs_once_in_the_server(
    store_url: str, ledger_file: Path, tmp_path: Path
) -> None:
    run_id = await paused(store_url)
    server = start_server(
        store_url, tmp_path, app="pai_app:AGENTS", **{pai_app.LEDGER_ENV: str(ledger_file)}
    )
    try:
        answer = server.call("POST", f"/api/runs/{run_id}/approve", {"by": "ann"})
        assert answer.status == 200, answer.body
        assert answer.body["status"] == "finished"
        assert answer.body["output"] == "Done: refunded 4250 cents on A1"
        [refund] = pai_app.ledger(ledger_file)
        assert refund["pid"] == server.process.pid
    finally:
        server.stop()
