"""The refund example (``kuralle_es.examples.refund``) and ``kuralle-es demo``.

In process on every backend, then resumed from a FRESH OS process at every
pause (SQLite and PostgreSQL): collect the amount, ask a supervisor, refund
exactly once (counted in the ``REFUND_LEDGER`` file the tool appends to), reply.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from procs.child import Child

from kuralle_es import RunStore, Runtime, SignalDelivery, TurnResult
from kuralle_es.examples import refund

SESSION = "s-refund"
#: What a child turn runs without: it uses the offline scripted model.
OFFLINE: dict[str, str | None] = {"OPENAI_API_KEY": None, refund.MODEL_ENV: None}
APPROVED_REPLY = "Good news: your refund was approved and is on its way."
DECLINED_REPLY = "Sorry, your refund was declined."


def ledger(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def ledger_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(refund.LEDGER_ENV, str(path))
    monkeypatch.delenv(refund.MODEL_ENV, raising=False)
    return path


def fresh_runtime(open_store: Any) -> Runtime:
    """What a new process would build: a new agent, a new store over the same DB."""
    return Runtime([refund.build_agent()], store=open_store())


async def turn_in_fresh_runtime(open_store: Any, **kwargs: Any) -> TurnResult:
    return await fresh_runtime(open_store).run(SESSION, **kwargs).result()


def decision(signal_id: str, approved: bool) -> SignalDelivery:
    payload: dict[str, Any] = {"approved": approved, "by": "supervisor"}
    if not approved:
        payload["reason"] = "not eligible"
    return SignalDelivery(signal_id=signal_id, name="__approval", payload=payload)


# -------------------------------------------------------------- in process
async def test_refund_flow_runs_to_one_refund_with_a_fresh_runtime_at_every_pause(
    open_store: Any, ledger_path: Path
) -> None:
    start = await turn_in_fresh_runtime(
        open_store, input="Hi, I'd like a refund for my order.", kind="flow", flow_name="refund"
    )
    assert start.status == "paused"
    assert start.waiting_for is not None
    assert start.waiting_for.kind == "input"
    assert start.output == "How much should be refunded, in dollars?"

    amount = await turn_in_fresh_runtime(open_store, run_id=start.run_id, input="It was $42.50.")
    assert amount.status == "paused"
    assert amount.waiting_for is not None
    assert amount.waiting_for.kind == "approval"
    assert amount.waiting_for.title == "Refund $42.50?"
    assert ledger(ledger_path) == []

    runtime = fresh_runtime(open_store)
    done = await runtime.run(
        SESSION, run_id=start.run_id, signal_delivery=decision("ok-1", True)
    ).result()
    assert done.status == "finished"
    assert done.output == APPROVED_REPLY
    entries = ledger(ledger_path)
    assert len(entries) == 1
    assert entries[0]["amount_cents"] == 4250
    assert re.fullmatch(r"[0-9a-f]{64}", entries[0]["key"])

    retried = await turn_in_fresh_runtime(
        open_store, run_id=start.run_id, signal_delivery=decision("ok-1", True)
    )
    assert retried.status == "finished"
    assert len(ledger(ledger_path)) == 1

    state = await runtime.get_run(start.run_id, SESSION)
    assert state is not None
    assert state.outcome == "approved"
    assert state.state["amount"] == 42.5
    assert state.state["approved_by"] == "supervisor"
    assert state.state["receipt"]["amount_cents"] == 4250
    tools = [s for s in await runtime.get_steps(start.run_id, SESSION) if s.kind == "tool"]
    assert [(s.name, s.status, s.key) for s in tools] == [
        ("processRefund", "finished", entries[0]["key"])
    ]


async def test_a_declined_refund_replies_declined_and_refunds_nothing(
    open_store: Any, ledger_path: Path
) -> None:
    start = await turn_in_fresh_runtime(
        open_store, input="Refund $19.99 please", kind="flow", flow_name="refund"
    )
    assert start.status == "paused"
    assert start.waiting_for is not None
    assert start.waiting_for.kind == "approval"  # the amount came with the first message

    done = await turn_in_fresh_runtime(
        open_store, run_id=start.run_id, signal_delivery=decision("no-1", False)
    )
    assert done.status == "finished"
    assert done.output == DECLINED_REPLY
    assert ledger(ledger_path) == []
    runtime = fresh_runtime(open_store)
    state = await runtime.get_run(start.run_id, SESSION)
    assert state is not None
    assert state.outcome == "declined"
    assert state.state["declined_by"] == "supervisor"
    assert state.state["reason"] == "not eligible"
    steps = await runtime.get_steps(start.run_id, SESSION)
    assert not [s for s in steps if s.kind == "tool"]


# ------------------------------------------------------ fresh OS processes
def turn_in_child(db: tuple[str, str], ledger_path: Path, *args: str) -> dict[str, Any]:
    backend, target = db
    with Child("refund", backend, target, ledger_path, SESSION, *args, env=OFFLINE) as child:
        code, result = child.wait(timeout=120)
    assert code == 0, f"child failed: {child.stdout}\n{child.stderr}"
    assert result is not None
    assert result["pid"] != os.getpid()
    TurnResult.model_validate({k: v for k, v in result.items() if k != "pid"})
    return result


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def shared_db(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    if request.param == "sqlite":
        return "sqlite", str(tmp_path / "refund.db")
    return "postgres", str(request.getfixturevalue("pg_dsn"))


def _open(db: tuple[str, str]) -> RunStore:
    backend, target = db
    return RunStore.sqlite(target) if backend == "sqlite" else RunStore.postgres(target)


def test_refund_resumed_by_a_new_process_at_every_pause_refunds_exactly_once(
    shared_db: tuple[str, str], ledger_path: Path
) -> None:
    start = turn_in_child(
        shared_db, ledger_path, "start", "refund", "Hi, I'd like a refund for my order."
    )
    assert start["status"] == "paused"
    assert start["waiting_for"]["kind"] == "input"
    run_id = start["run_id"]

    amount = turn_in_child(shared_db, ledger_path, "input", run_id, "It was $42.50.")
    assert amount["status"] == "paused"
    assert amount["waiting_for"]["kind"] == "approval"
    assert amount["pid"] != start["pid"]
    assert ledger(ledger_path) == []

    done = turn_in_child(shared_db, ledger_path, "decide", run_id, "sig-1", "approved", "sup")
    assert done["status"] == "finished"
    assert done["output"] == APPROVED_REPLY
    assert len({start["pid"], amount["pid"], done["pid"]}) == 3

    retry = turn_in_child(shared_db, ledger_path, "decide", run_id, "sig-1", "approved", "sup")
    assert retry["status"] == "finished"
    entries = [e for e in ledger(ledger_path) if e["tool"] == "processRefund"]
    assert len(entries) == 1
    assert entries[0]["amount_cents"] == 4250

    store = _open(shared_db)
    try:
        run = store.load_history(run_id)  # every step, the earlier nodes' too
        assert run is not None
        state = run.to_state()
        assert state.status == "finished"
        assert state.outcome == "approved"
        tools = [s for s in run.step_records() if s.kind == "tool"]
        assert [s.key for s in tools] == [entries[0]["key"]]
    finally:
        store.close()


def test_a_refund_declined_from_a_new_process_replies_declined_and_refunds_nothing(
    shared_db: tuple[str, str], ledger_path: Path
) -> None:
    start = turn_in_child(shared_db, ledger_path, "start", "refund", "I need a refund")
    run_id = start["run_id"]
    amount = turn_in_child(shared_db, ledger_path, "input", run_id, "$12")
    assert amount["waiting_for"]["kind"] == "approval"

    done = turn_in_child(shared_db, ledger_path, "decide", run_id, "sig-no", "declined", "sup")
    assert done["status"] == "finished"
    assert done["output"] == DECLINED_REPLY
    assert ledger(ledger_path) == []
    store = _open(shared_db)
    try:
        run = store.load(run_id)
        assert run is not None
        assert run.to_state().outcome == "declined"
    finally:
        store.close()


# -------------------------------------------------------------------- CLI
def test_kuralle_es_demo_runs_offline_and_refunds_once(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "kuralle-es"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "kuralle_es.cli"]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OPENAI_API_KEY", refund.MODEL_ENV, refund.LEDGER_ENV)
        and not k.startswith(("PERSISTENCE_", "SQLITE_", "POSTGRES_"))
    }
    demo_dir = tmp_path / "demo"
    done = subprocess.run(
        [*command, "demo", "--dir", str(demo_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "processRefund executed 1 time(s)" in done.stdout
    assert (demo_dir / "refund.db").exists()
    lines = (demo_dir / "ledger.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["amount_cents"] == 4250
