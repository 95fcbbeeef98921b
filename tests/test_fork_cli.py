"""``kuralle-es runs fork`` in its own process against a real SQLite file.

The refund example's finished run is forked at its approval step by the
command (which loads the app, the refund demo by default, and reads the
run's session from the store); the fork waits for a new approval, is denied
from another process, ends declined, and ``runs show`` says where it came
from. Refusals are one line and write nothing.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from test_cli_operator import _ok, kuralle

from kuralle_es import RunStore, Runtime, SignalDelivery, TurnResult
from kuralle_es.examples import refund

SESSION = "s-fork-cli"


async def _approved_refund(db: Path) -> str:
    with RunStore.sqlite(str(db)) as store:
        runtime = Runtime([refund.build_agent(refund.demo_model())], store=store)
        start = await runtime.run(
            SESSION, input="Refund $12 please", kind="flow", flow_name="refund"
        ).result()
        approval = SignalDelivery(
            signal_id="ok-1", name="__approval", payload={"approved": True, "by": "supervisor"}
        )
        done = await runtime.run(SESSION, run_id=start.run_id, signal_delivery=approval).result()
        assert done.status == "finished"
        return start.run_id


def log_head(db: Path) -> int:
    with RunStore.sqlite(str(db)) as store:
        return store.recorder.max_notification_id() or 0


def test_runs_fork_forks_a_finished_refund_at_its_approval_and_the_fork_can_be_denied(
    tmp_path: Path,
) -> None:
    db = tmp_path / "runs.db"
    original = asyncio.run(_approved_refund(db))
    shown_before = _ok(kuralle("--sqlite", str(db), "runs", "show", original, "--json"))

    forked = TurnResult.model_validate_json(
        _ok(kuralle("--sqlite", str(db), "runs", "fork", original, "--at", "1"))
    )

    assert forked.run_id != original
    assert forked.status == "paused"
    assert forked.waiting_for is not None and forked.waiting_for.kind == "approval"
    shown = json.loads(_ok(kuralle("--sqlite", str(db), "runs", "show", forked.run_id, "--json")))
    assert shown["forked_from"] == {"run_id": original, "at_step": 1}
    assert shown["session_id"] == SESSION
    timeline = _ok(kuralle("--sqlite", str(db), "runs", "show", forked.run_id))
    assert f"forked from run {original} at step 1" in timeline

    denied = TurnResult.model_validate_json(
        _ok(kuralle("--sqlite", str(db), "deny", forked.run_id, "--by", "cli", "--reason", "no"))
    )
    assert denied.status == "finished"
    assert _ok(kuralle("--sqlite", str(db), "runs", "show", original, "--json")) == shown_before

    fork_into = ("runs", "fork", original, "--at", "0", "--into-session", "elsewhere")
    into = TurnResult.model_validate_json(_ok(kuralle("--sqlite", str(db), *fork_into)))
    shown = json.loads(_ok(kuralle("--sqlite", str(db), "runs", "show", into.run_id, "--json")))
    assert shown["session_id"] == "elsewhere"


def test_runs_fork_refusals_are_one_line_and_write_nothing(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    original = asyncio.run(_approved_refund(db))
    head = log_head(db)

    out_of_range = kuralle("--sqlite", str(db), "runs", "fork", original, "--at", "99")
    unknown = kuralle(
        "--sqlite", str(db), "runs", "fork", "00000000-0000-4000-8000-000000000000", "--at", "0"
    )

    assert out_of_range.returncode == 1
    assert out_of_range.stderr.count("\n") == 1
    assert "InvalidArgumentError" in out_of_range.stderr and "at_step" in out_of_range.stderr
    assert unknown.returncode == 1
    assert unknown.stderr.count("\n") == 1
    assert log_head(db) == head
