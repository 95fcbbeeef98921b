"""The ``kuralle-es`` command operates runs from a shell, each call its own process:
``runs show`` prints the journal, ``approve``/``deny``/``signal`` resume a run by id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kuralle_es import RunStore, Runtime
from kuralle_es.examples import refund


def cli(db: Path, ledger: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, refund.LEDGER_ENV: str(ledger), refund.MODEL_ENV: "scripted"}
    return subprocess.run(
        [sys.executable, "-m", "kuralle_es.cli", "--sqlite", str(db), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


async def paused_for_approval(db: Path, ledger: Path, monkeypatch: Any) -> str:
    monkeypatch.setenv(refund.LEDGER_ENV, str(ledger))
    monkeypatch.setenv(refund.MODEL_ENV, "scripted")
    with RunStore.sqlite(str(db)) as store:
        runtime = Runtime([refund.build_agent()], store=store)
        result = await runtime.run(
            "cli-session", input="refund $10 please", kind="flow", flow_name="refund"
        ).result()
    assert result.waiting_for is not None and result.waiting_for.name == "__approval"
    return result.run_id


async def test_deny_from_the_command_line_declines_and_refunds_nothing(
    tmp_path: Path, monkeypatch: Any
) -> None:
    db, ledger = tmp_path / "runs.db", tmp_path / "ledger.jsonl"
    run_id = await paused_for_approval(db, ledger, monkeypatch)

    denied = cli(db, ledger, "deny", run_id, "--by", "lead", "--reason", "duplicate")
    assert denied.returncode == 0, denied.stderr
    result = json.loads(denied.stdout)
    assert result["status"] == "finished"
    assert "declined" in result["output"]
    assert not ledger.exists()

    shown = cli(db, ledger, "runs", "show", run_id)
    assert shown.returncode == 0, shown.stderr
    assert f"run {run_id}" in shown.stdout
    assert "approval __approval" in shown.stdout
    assert '"reason": "duplicate"' in shown.stdout
    assert "outcome: declined" in shown.stdout


async def test_approve_from_the_command_line_refunds_once_and_a_retry_is_a_no_op(
    tmp_path: Path, monkeypatch: Any
) -> None:
    db, ledger = tmp_path / "runs.db", tmp_path / "ledger.jsonl"
    run_id = await paused_for_approval(db, ledger, monkeypatch)

    for _ in range(2):
        approved = cli(db, ledger, "approve", run_id, "--by", "lead", "--signal-id", "hook-7")
        assert approved.returncode == 0, approved.stderr
        assert json.loads(approved.stdout)["status"] == "finished"
    lines = ledger.read_text().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["amount_cents"] == 1000


async def test_a_signal_the_run_does_not_wait_for_is_refused_and_changes_nothing(
    tmp_path: Path, monkeypatch: Any
) -> None:
    db, ledger = tmp_path / "runs.db", tmp_path / "ledger.jsonl"
    run_id = await paused_for_approval(db, ledger, monkeypatch)
    with RunStore.sqlite(str(db)) as store:
        before = store.load(run_id)
        assert before is not None
        version = before.version

    refused = cli(db, ledger, "signal", run_id, "shipment", "--payload", '{"ok": true}')
    assert refused.returncode == 1
    assert refused.stderr.startswith("kuralle-es: SignalMismatchError:")
    assert "Traceback" not in refused.stderr
    assert "__approval" in refused.stderr
    bad_json = cli(db, ledger, "signal", run_id, "__approval", "--payload", "{nope")
    assert bad_json.returncode == 2
    assert "not JSON" in bad_json.stderr
    missing = cli(db, ledger, "runs", "show", "00000000-0000-0000-0000-000000000000")
    assert missing.returncode == 1

    with RunStore.sqlite(str(db)) as store:
        after = store.load(run_id)
        assert after is not None
        assert after.version == version
