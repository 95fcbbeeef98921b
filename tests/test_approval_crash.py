"""An approval survives a real SIGKILL between the decision and the execution (PostgreSQL).

The run is paused in this process on ``transfer``'s approval with the args
``{"amount": 100, "to": "acct-1"}``. A child process then resumes it with the
decision and is SIGKILLed before the tool completes; a fresh child resumes
it again. Children run with ``KT_AMOUNT=999``: the node now computes other
args, and only the frozen ones may ever execute. The tool appends to a ledger
file: an ``attempt`` line as ``execute`` starts, a ``done`` line as it completes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import flows
from procs.child import KILLED, run_child, wait_lease_expired

from kuralle_es import RunStore, Runtime, StepRecord, TurnResult, idempotency_key

pytestmark = pytest.mark.postgres

SESSION = "session-crash"
APPROVAL = "__approval"
FROZEN = {"amount": flows.DEFAULT_AMOUNT, "to": "acct-1"}
NOW_COMPUTED = {"KT_AMOUNT": "999"}


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    return tmp_path / "ledger.jsonl"


@pytest.fixture
def runtime(pg_dsn: str, ledger: Path) -> Iterator[Runtime]:
    store = RunStore.postgres(pg_dsn)
    try:
        yield Runtime([flows.make_agent(ledger)], store=store)
    finally:
        store.close()


async def pause_on_approval(runtime: Runtime) -> tuple[str, TurnResult]:
    handle = runtime.run(SESSION, input="go", kind="flow", flow_name=flows.APPROVE_FLOW)
    result = await handle.result()
    assert result.status == "paused"
    assert result.waiting_for is not None and result.waiting_for.operation is not None
    assert result.waiting_for.operation.args == FROZEN
    return await handle.run_id, result


def deliver_in_child(
    pg_dsn: str, ledger: Path, run_id: str, signal_id: str, payload: str, **env: str
) -> tuple[int, dict[str, Any] | None]:
    return run_child(
        "flows",
        "postgres",
        pg_dsn,
        ledger,
        SESSION,
        "deliver",
        run_id,
        signal_id,
        APPROVAL,
        payload,
        env={**NOW_COMPUTED, **env},
    )


def resume_in_child(pg_dsn: str, ledger: Path, run_id: str) -> tuple[int, dict[str, Any] | None]:
    return run_child(
        "flows", "postgres", pg_dsn, ledger, SESSION, "resume", run_id, env=NOW_COMPUTED
    )


def transfer_steps(steps: list[StepRecord]) -> list[StepRecord]:
    return [s for s in steps if s.kind == "tool" and s.name == "transfer"]


def expected_key(run_id: str) -> str:
    flow = next(f for f in flows.FLOWS if f.name == flows.APPROVE_FLOW)
    logical = f"{run_id}#0#{flow.name}@{flow.digest}"
    return idempotency_key(logical, 0, {"name": "transfer", "args": FROZEN})


async def test_a_crash_right_after_the_approval_is_saved_executes_once_with_frozen_args(
    runtime: Runtime, pg_dsn: str, ledger: Path
) -> None:
    run_id, _ = await pause_on_approval(runtime)

    code, _ = deliver_in_child(
        pg_dsn, ledger, run_id, "ok-1", '{"approved": true, "by": "alice"}', KT_DIE_AT="node"
    )

    assert code == KILLED
    state = await runtime.get_run(run_id, SESSION)
    assert state is not None
    assert state.status == "running", "the decision must be saved before the node re-runs"
    assert state.waiting_for is None
    steps = await runtime.get_steps(run_id, SESSION)
    approvals = [s for s in steps if s.kind == "approval"]
    assert len(approvals) == 1 and approvals[0].status == "finished"
    assert approvals[0].result == {"approved": True, "by": "alice"}
    assert transfer_steps(steps) == [], "the child died before the tool's intent"
    assert flows.read_ledger(ledger) == []

    await wait_lease_expired(runtime, run_id, SESSION)
    code, report = resume_in_child(pg_dsn, ledger, run_id)

    assert code == 0, report
    assert report is not None and report["status"] == "finished"
    done = [e for e in flows.read_ledger(ledger) if e["phase"] == "done"]
    assert len(done) == 1, "the approved tool must execute exactly once"
    assert done[0]["args"] == FROZEN, "it executed with args the approver never saw"
    assert done[0]["pid"] == report["pid"]
    (step,) = transfer_steps(await runtime.get_steps(run_id, SESSION))
    assert step.status == "finished"
    assert step.key == done[0]["key"] == expected_key(run_id)
    state = await runtime.get_run(run_id, SESSION)
    assert state is not None and state.status == "finished"
    assert state.state["receipt"] == {"transferred": True, **FROZEN}

    # One more resume, in yet another process: nothing executes again.
    code, report = resume_in_child(pg_dsn, ledger, run_id)
    assert code == 0 and report is not None and report["status"] == "finished"
    assert len([e for e in flows.read_ledger(ledger) if e["phase"] == "done"]) == 1


async def test_a_crash_inside_the_approved_tool_reexecutes_it_once_with_the_same_key(
    runtime: Runtime, pg_dsn: str, ledger: Path
) -> None:
    run_id, _ = await pause_on_approval(runtime)

    code, _ = deliver_in_child(
        pg_dsn, ledger, run_id, "ok-1", '{"approved": true}', KT_DIE_AT="tool"
    )

    assert code == KILLED
    (step,) = transfer_steps(await runtime.get_steps(run_id, SESSION))
    assert step.status == "running", "the intent is journaled, the result never was"
    assert [e["phase"] for e in flows.read_ledger(ledger)] == ["attempt"]

    await wait_lease_expired(runtime, run_id, SESSION)
    code, report = resume_in_child(pg_dsn, ledger, run_id)

    assert code == 0, report
    assert report is not None and report["status"] == "finished"
    entries = flows.read_ledger(ledger)
    assert [e["phase"] for e in entries] == ["attempt", "attempt", "done"]
    assert all(e["args"] == FROZEN for e in entries)
    (step,) = transfer_steps(await runtime.get_steps(run_id, SESSION))
    assert step.status == "finished"
    assert {e["key"] for e in entries} == {step.key} == {expected_key(run_id)}


async def test_a_denied_approval_never_executes_even_across_a_crash_and_another_process(
    runtime: Runtime, pg_dsn: str, ledger: Path
) -> None:
    run_id, _ = await pause_on_approval(runtime)

    code, _ = deliver_in_child(
        pg_dsn,
        ledger,
        run_id,
        "no-1",
        '{"approved": false, "by": "bob", "reason": "fraud"}',
        KT_DIE_AT="node",
    )

    assert code == KILLED
    await wait_lease_expired(runtime, run_id, SESSION)
    code, report = resume_in_child(pg_dsn, ledger, run_id)

    assert code == 0, report
    assert report is not None and report["status"] == "finished"
    state = await runtime.get_run(run_id, SESSION)
    assert state is not None
    assert state.outcome == "denied"
    assert state.state["denied"] == {"tool_name": "transfer", "denied_by": "bob", "reason": "fraud"}
    assert flows.read_ledger(ledger) == [], "a denied tool executed"
    assert transfer_steps(await runtime.get_steps(run_id, SESSION)) == []
    # A retry of the denial and a re-resume change nothing.
    code, report = deliver_in_child(
        pg_dsn, ledger, run_id, "no-1", '{"approved": false, "by": "bob", "reason": "fraud"}'
    )
    assert code == 0 and report is not None and report["status"] == "finished"
    assert flows.read_ledger(ledger) == []
