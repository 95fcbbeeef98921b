"""One clock for leases: the store's, never a worker's.

A take or renewal carries a TTL; the store compares the lease record with its
own time and sets the expiry to its own time plus the TTL (PostgreSQL: the
server's ``clock_timestamp()``). The regression test of issue 36 runs worker
A in one process, inside a sync tool longer than its lease, and worker B in
another started under ``faketime -f +60s`` (Debian's libfaketime, which also
fakes the clock of B's PostgreSQL client library): B's views think A's lease
expired a minute ago, B tries to recover the run, the take meets the live
lease in SQL, and the tool runs once.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import psycopg
import pytest
from conftest import stripped

from kuralle_es import LeaseHeldError, RunStore
from kuralle_es._journal.leases import LeaseOp
from kuralle_es._journal.run import Run

PROCS = Path(__file__).resolve().parent / "procs"
sys.path.insert(0, str(PROCS))
from lease_app import ledger_lines  # noqa: E402

#: worker A's lease, its tool's length, and worker B's clock, ahead of the server's.
LEASE_TTL = 2.0
HOLD_SECONDS = 9.0
SKEW = "+60s"


def _in_ci() -> bool:
    return os.environ.get("CI") == "true" or os.environ.get("KURALLE_REQUIRE_POSTGRES") == "1"


def _faketime() -> str:
    """The ``faketime`` command (skip, or fail in CI, without one)."""
    found = shutil.which("faketime")
    if found is None:
        message = (
            "NO FAKETIME: the clock-skew lease test runs a worker under Debian's faketime "
            "(libfaketime), which is not installed. `make faketime` installs it as root "
            "(`apt-get install faketime`)."
        )
        if _in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return found


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not stripped(k, ("KT_", "KURALLE_"))}
    env.update(extra)
    return env


def a_run() -> Run:
    return Run(uuid4(), "s-clock", "flow", "agent", "f", "d")


# ------------------------------------------------------ the store's clock
@pytest.mark.parametrize(
    "backend", ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_lease_expires_at_the_stores_time_plus_its_ttl_and_is_shown_as_the_record_holds_it(
    open_store: Any,
) -> None:
    store = open_store()
    run = a_run()
    before = datetime.now(UTC)
    store.create_run(run, LeaseOp.take(run.id, "worker-a", "ta", timedelta(seconds=30)))
    after = datetime.now(UTC)
    record = store.lease(run.run_id)
    assert record is not None and record.live and record.holder == "worker-a"
    # The store's clock is this machine's here (one host): the expiry is its now + TTL.
    slack = timedelta(seconds=1)
    assert before + timedelta(seconds=30) - slack <= record.expires_at
    assert record.expires_at <= after + timedelta(seconds=30) + slack

    with pytest.raises(LeaseHeldError) as held:
        await store.save_run_async(run, LeaseOp.take(run.id, "worker-b", "tb", timedelta(1)))
    # What the refusal shows is what the record holds, to the microsecond.
    assert (held.value.holder, held.value.expires_at) == ("worker-a", record.expires_at)
    state = run.to_state(await store.lease_async(run.run_id))
    assert state.lease_expires_at == record.expires_at


async def test_on_postgresql_a_take_compares_with_the_servers_clock_not_the_clients(
    pg_dsn: str,
) -> None:
    """A lease whose record expires a second from now by the server's clock is
    live for every client, whatever its own clock says, and the record's expiry
    is the server's time plus the TTL, read back with the server's clock."""
    with RunStore.postgres(pg_dsn) as store:
        run = a_run()
        store.create_run(run, LeaseOp.take(run.id, "worker-a", "ta", timedelta(seconds=1)))
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT expires_at - clock_timestamp(), expires_at > clock_timestamp() "
                "FROM runstore_leases WHERE run_id = %s",
                (run.id,),
            ).fetchone()
        assert row is not None
        left, live = row
        assert live and timedelta(0) < left <= timedelta(seconds=1)
        record = store.lease(run.run_id)
        assert record is not None and record.live
        with pytest.raises(LeaseHeldError):
            store.save_run(run, LeaseOp.take(run.id, "worker-b", "tb", timedelta(seconds=30)))
        await asyncio.sleep(1.2)  # past it by the server's clock: free to take
        lapsed = store.lease(run.run_id)
        assert lapsed is not None and not lapsed.live
        store.save_run(run, LeaseOp.take(run.id, "worker-b", "tb", timedelta(seconds=30)))
        taken = store.lease(run.run_id)
        assert taken is not None and taken.holder == "worker-b" and taken.live


# -------------------------------------------- a worker whose clock runs ahead
def _recover_under_skew(faketime: str, dsn: str) -> subprocess.CompletedProcess[str]:
    command = [
        faketime, "-f", SKEW, sys.executable, "-m", "kuralle_es.cli", "recover",
        "--store", dsn, "--app", "lease_app:build_agents", "--holder", "worker-b",
        "--lease-ttl", str(LEASE_TTL),
    ]  # fmt: skip
    return subprocess.run(
        command, cwd=PROCS, env=_env(), capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.postgres
@pytest.mark.timeout(240)
def test_a_worker_whose_clock_runs_a_minute_ahead_never_takes_a_live_lease(
    pg_dsn: str, tmp_path: Path
) -> None:
    faketime = _faketime()
    skewed = subprocess.run(
        [faketime, "-f", SKEW, sys.executable, "-c", "import time; print(time.time())"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert float(skewed.stdout) - time.time() > 50, "faketime did not move the clock"

    ledger = tmp_path / "ledger"
    worker_a = subprocess.Popen(
        [sys.executable, str(PROCS / "lease_app.py"), "start", pg_dsn, "s-skew", "hold-sync",
         str(LEASE_TTL)],
        env=_env(KT_LEDGER=str(ledger), KT_HOLD=str(HOLD_SECONDS)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "start" not in ledger_lines(ledger):
            assert worker_a.poll() is None, worker_a.communicate()
            assert time.monotonic() < deadline, "worker A never entered its tool"
            time.sleep(0.05)
        entered = time.monotonic()
        skips = []
        # Worker B tries while A's tool runs (it runs HOLD_SECONDS, four and a half
        # leases): by B's clock A's lease lapsed a minute ago, so its views list the
        # run as an orphan and it tries to take it.
        while "end" not in ledger_lines(ledger):
            attempt = _recover_under_skew(faketime, pg_dsn)
            if "end" in ledger_lines(ledger):
                break  # this attempt may have started after A's tool was done
            assert "0 run(s) recovered" in attempt.stderr, attempt.stderr
            skips.append(attempt)
        out, err = worker_a.communicate(timeout=60)
    finally:
        if worker_a.poll() is None:
            worker_a.kill()
            worker_a.communicate()
    assert worker_a.returncode == 0, err
    assert time.monotonic() - entered > LEASE_TTL * 2
    assert skips, "worker B never tried while A's tool ran (a loaded machine?)"
    # Each try found the run (its views, by B's clock, call it an orphan) and met
    # the live lease in the take itself: skipped, with the lease holder's refusal.
    for attempt in skips:
        assert attempt.returncode == 1, attempt.stderr
        assert "LeaseHeldError" in attempt.stdout + attempt.stderr, attempt.stdout
    run_id, status = out.split()
    assert status == "finished"
    assert ledger_lines(ledger) == ["start", "end"], "the tool ran more than once"
    with RunStore.postgres(pg_dsn) as store:
        run = store.load(run_id)
        assert run is not None and run.status == "finished"
        names = [type(e).TOPIC.rsplit(".", 1)[-1] for e in store.events.get(run.id)]
        assert "Recovered" not in names
        (step,) = run.step_records()
        assert (step.name, step.status, step.attempts) == ("hold_sync", "finished", 1)
