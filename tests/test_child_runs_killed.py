"""A worker SIGKILLed inside a child run's tool, and another process finishes the family.

A process starts a ``household`` run (``tests/procs/family_app.py``) on
PostgreSQL; its ``ctx.child`` starts an ``errand`` child run inside the
parent's turn, and the child's ``charge`` tool writes the ledger (keyed by
``call.idempotency_key``) and stands still before its result is journaled.
The test SIGKILLs the process there: both runs are left ``running`` with
the dead worker's lease. A ``kuralle-es worker`` process recovers them: the
parent's in-doubt start step executes again and finds the one child (its id
derives from the step's key), the child's charge executes again with its
key, the child's end resumes the parent. One child, one charge.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import stripped

from kuralle_es import RunStore

PROCS = Path(__file__).resolve().parent / "procs"
sys.path.insert(0, str(PROCS))
from charge_app import read_ledger  # noqa: E402


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not stripped(k, ("KT_", "KURALLE_"))}
    env.update(extra)
    return env


def _killed_inside_the_childs_tool(dsn: str, tmp: Path) -> str:
    marker = tmp / "standing"
    doomed = subprocess.Popen(
        [sys.executable, str(PROCS / "family_app.py"), "start", dsn, "family"],
        env=_env(KT_LEDGER=dsn, KT_KILL_AT="in-tool", KT_MARKER=str(marker)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert doomed.poll() is None, doomed.communicate()
            assert time.monotonic() < deadline, "the doomed worker never reached the child's tool"
            time.sleep(0.05)
    finally:
        doomed.send_signal(signal.SIGKILL)
        out, _ = doomed.communicate(timeout=30)
    assert doomed.returncode == -signal.SIGKILL
    (parent_id,) = out.split()
    return parent_id


def _worker(dsn: str) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "kuralle_es.cli", "worker", "--store", dsn,
        "--app", "family_app:build_agents", "--interval", "0.2", "--lease-ttl", "1",
        "--holder", "rescuer",
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        cwd=PROCS,
        env=_env(KT_LEDGER=dsn),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.postgres
@pytest.mark.timeout(180)
def test_a_worker_killed_inside_a_childs_tool_is_recovered_with_one_child_and_one_charge(
    pg_dsn: str, tmp_path: Path
) -> None:
    assert read_ledger(pg_dsn) == ([], [])  # its tables, before the processes race to
    parent_id = _killed_inside_the_childs_tool(pg_dsn, tmp_path)
    with RunStore.from_url(pg_dsn) as store:
        parent = store.load(parent_id)
        assert parent is not None and parent.status == "running"
        (child_id,) = parent.children
        child = store.load(child_id)
        assert child is not None and child.status == "running"

        worker = _worker(pg_dsn)
        try:
            deadline = time.monotonic() + 90
            while True:
                parent = store.load(parent_id)
                assert parent is not None
                if parent.status == "finished":
                    break
                assert worker.poll() is None, worker.communicate()
                assert time.monotonic() < deadline, (parent.status, parent.waiting_for)
                time.sleep(0.1)
        finally:
            worker.send_signal(signal.SIGTERM)
            _, log = worker.communicate(timeout=60)
        assert worker.returncode in (0, -signal.SIGTERM), log

        assert parent.outcome == "the errand says: charged 500"
        assert parent.children == [child_id]
        child = store.load(child_id)
        assert child is not None and (child.status, child.output) == ("finished", "charged 500")
        assert sorted(store.session_run_ids("family")) == sorted([parent_id, child_id])
        (start, wait) = parent.step_records()
        assert (start.kind, start.attempts, wait.name) == ("child", 2, "__child")
        (charged,) = child.step_records()
        assert (charged.name, charged.attempts, charged.status) == ("charge", 2, "finished")
    charges, attempts = read_ledger(pg_dsn)
    assert [(run_id, cents) for _, run_id, cents in charges] == [(child_id, 500)]
    assert [key for key, _ in attempts] == [charges[0][0]] * 2  # the same key, twice
