"""``kuralle-es consume approvals``: the approval notifier from the command line.

Real processes on SQLite and PostgreSQL: ``--once`` catches up and exits;
without it the notifier follows new runs until SIGTERM, then exits cleanly,
and a restart writes nothing twice.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from events_kit import refund_run

from kuralle_es import Runtime
from kuralle_es.examples import approval_notifier, refund

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def consume_command(backend: str, target: str, *extra: str) -> list[str]:
    where = ["--sqlite", target] if backend == "sqlite" else ["--store", target]
    return [sys.executable, "-m", "kuralle_es.cli", "consume", "approvals", *where, *extra]


def outbox(store: Any) -> list[tuple[int, str, str | None]]:
    with store.recorder.datastore.transaction(commit=False) as curs:
        table = approval_notifier.OUTBOX_TABLE
        curs.execute(f"SELECT position, run_id, title FROM {table} ORDER BY position")
        return [(int(r["position"]), r["run_id"], r["title"]) for r in curs.fetchall()]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_consume_approvals_once_then_following_until_sigterm(
    open_store: Any, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(refund.LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    monkeypatch.delenv(refund.MODEL_ENV, raising=False)
    store = open_store()
    runtime = Runtime([refund.build_agent()], store=store)
    first = await refund_run(runtime, "a", approve=True)
    second = await refund_run(runtime, "b", approve=None)

    once = await asyncio.to_thread(
        subprocess.run,
        consume_command(backend, open_store.target, "--once"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert once.returncode == 0, once.stderr
    assert json.loads(once.stdout)["consumer"] == "approvals"
    assert [(run, title) for _, run, title in outbox(store)] == [
        (first, "Refund $42.50?"), (second, "Refund $42.50?"),
    ]  # fmt: skip

    follower = await asyncio.to_thread(
        subprocess.Popen,
        consume_command(backend, open_store.target),
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert follower.stderr is not None
    ready = await asyncio.to_thread(follower.stderr.readline)
    assert "following" in ready, ready
    third = await refund_run(runtime, "c", approve=None)
    for _ in range(200):  # the follower picks the new pause up within a poll or a NOTIFY
        if len(outbox(store)) == 3:
            break
        await asyncio.sleep(0.05)
    follower.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(follower.wait, 30) == 0
    rows = outbox(store)
    assert [run for _, run, _ in rows] == [first, second, third]

    again = await asyncio.to_thread(
        subprocess.run,
        consume_command(backend, open_store.target, "--once"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["applied"] == 0
    assert outbox(store) == rows
