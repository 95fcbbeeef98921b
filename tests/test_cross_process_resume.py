"""A run paused in one OS process is resumed in another (PostgreSQL).

Every turn here runs in a child process of its own (``tests/procs/child.py``);
this process only reads the database and the tool's ledger file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import flows
from procs.child import run_child

from kuralle_es import RunStore, Runtime

pytestmark = pytest.mark.postgres

SESSION = "session-cross"


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


def child(pg_dsn: str, ledger: Path, *args: str) -> dict[str, Any]:
    code, report = run_child("flows", "postgres", pg_dsn, ledger, SESSION, *args)
    assert report is not None, f"child reported nothing (exit {code})"
    if code != 0:
        raise AssertionError(f"child turn failed: {report}")
    return report


async def test_a_run_paused_in_one_process_resumes_in_another_by_run_id(
    runtime: Runtime, pg_dsn: str, ledger: Path
) -> None:
    paused = child(pg_dsn, ledger, "start", flows.APPROVE_FLOW)
    assert paused["status"] == "paused"
    run_id = paused["run_id"]
    waiting = paused["waiting_for"]
    assert waiting["name"] == "__approval"
    assert waiting["operation"]["tool_name"] == "transfer"
    assert waiting["operation"]["args"] == {"amount": 100, "to": "acct-1"}
    assert flows.read_ledger(ledger) == []

    state = await runtime.get_run(run_id, SESSION)
    assert state is not None and state.status == "paused"
    assert state.waiting_for is not None
    assert state.waiting_for.request_id == waiting["request_id"]
    assert state.lease_holder is None

    payload = json.dumps({"approved": True, "by": "alice", "request": waiting["request_id"]})
    resumed = child(pg_dsn, ledger, "deliver", run_id, "ok-1", "__approval", payload)

    assert resumed["status"] == "finished"
    assert resumed["run_id"] == run_id
    assert resumed["pid"] != paused["pid"] != os.getpid()
    done = [e for e in flows.read_ledger(ledger) if e["phase"] == "done"]
    assert len(done) == 1
    assert done[0]["pid"] == resumed["pid"]
    assert done[0]["args"] == {"amount": 100, "to": "acct-1"}
    state = await runtime.get_run(run_id, SESSION)
    assert state is not None
    assert state.status == "finished"
    assert state.outcome == "paid"
    assert state.waiting_for is None
    steps = await runtime.get_steps(run_id, SESSION)
    assert [(s.kind, s.status) for s in steps] == [("approval", "finished"), ("tool", "finished")]
    assert steps[1].key == done[0]["key"]

    # The same delivery again, from a third process: a no-op.
    again = child(pg_dsn, ledger, "deliver", run_id, "ok-1", "__approval", payload)
    assert again["status"] == "finished"
    assert len([e for e in flows.read_ledger(ledger) if e["phase"] == "done"]) == 1


async def test_a_delivery_from_another_process_without_run_id_finds_the_waiting_run(
    runtime: Runtime, pg_dsn: str, ledger: Path
) -> None:
    paused = child(pg_dsn, ledger, "start", flows.APPROVE_FLOW)
    assert paused["status"] == "paused"

    resumed = child(pg_dsn, ledger, "deliver", "-", "ok-1", "__approval", '{"approved": true}')

    assert resumed["run_id"] == paused["run_id"]
    assert resumed["status"] == "finished"
    assert len([e for e in flows.read_ledger(ledger) if e["phase"] == "done"]) == 1


async def test_a_typed_signal_is_validated_by_a_process_that_did_not_pause_the_run(
    runtime: Runtime, pg_dsn: str, ledger: Path
) -> None:
    paused = child(pg_dsn, ledger, "start", flows.TYPED_SIGNAL_FLOW)
    assert paused["status"] == "paused"
    run_id = paused["run_id"]
    before = await runtime.get_run(run_id, SESSION)
    assert before is not None

    code, refused = run_child(
        "flows",
        "postgres",
        pg_dsn,
        ledger,
        SESSION,
        "deliver",
        run_id,
        "bad",
        "address",
        '{"street": "Main St"}',
    )

    assert code == 2
    assert refused is not None and refused["error"]["type"] == "InvalidSignalError"
    after = await runtime.get_run(run_id, SESSION)
    assert after is not None
    assert (after.status, after.version, after.step_count) == (
        before.status,
        before.version,
        before.step_count,
    )

    resumed = child(
        pg_dsn, ledger, "deliver", run_id, "good", "address", '{"street": "Main St", "zip": "1"}'
    )
    assert resumed["status"] == "finished"
    state = await runtime.get_run(run_id, SESSION)
    assert state is not None
    assert state.state == {"is_address": True, "address": {"street": "Main St", "zip": "1"}}
