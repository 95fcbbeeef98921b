"""The kill test: a worker process SIGKILLed mid-run, and ``kuralle-es worker`` finishes it.

A process runs the ``charge`` flow of ``tests/procs/charge_app.py`` (its
tool writes a ledger table keyed by ``call.idempotency_key``) with a 1 s
lease and stands still at a chosen point: before the tool's intent, inside
the tool (the charge is written, its result is not journaled), or after the
result is journaled. The test SIGKILLs it there and starts ``kuralle-es
worker`` processes (``--interval 0.2``); the run completes, recovered by
exactly one of them, and the ledger holds exactly one charge. SIGTERM then
stops each worker cleanly (exit 0).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import stripped

from kuralle_es import RunStore, Runtime

PROCS = Path(__file__).resolve().parent / "procs"
sys.path.insert(0, str(PROCS))
from charge_app import KILL_POINTS, build_agents, read_ledger  # noqa: E402

INTERVAL = "0.2"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not stripped(k, ("KT_", "KURALLE_"))}
    env.update(extra)
    return env


def kill_while_standing(url: str, ledger: str, point: str, tmp: Path, runs: int = 1) -> list[str]:
    """Start ``runs`` runs in a doomed process, SIGKILL it once all stand at ``point``."""
    marker = tmp / "standing"
    assert read_ledger(ledger) == ([], [])  # creates its tables, before processes race to
    doomed = subprocess.Popen(
        [sys.executable, str(PROCS / "charge_app.py"), "start", url, "kill", str(runs)],
        env=_env(KT_LEDGER=ledger, KT_KILL_AT=point, KT_MARKER=str(marker)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert doomed.poll() is None, doomed.communicate()
            assert time.monotonic() < deadline, "the doomed worker never reached its kill point"
            time.sleep(0.05)
    finally:
        doomed.send_signal(signal.SIGKILL)
        out, _ = doomed.communicate(timeout=30)
    assert doomed.returncode == -signal.SIGKILL
    return out.split()


def start_worker(url: str, ledger: str, name: str) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "kuralle_es.cli", "worker", "--store", url,
        "--app", "charge_app:build_agents", "--interval", INTERVAL, "--lease-ttl", "1",
        "--holder", name,
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        cwd=PROCS,  # --app is importable from the current folder
        env=_env(KT_LEDGER=ledger),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_finished(store: RunStore, run_ids: list[str], workers: list[Any]) -> None:
    deadline = time.monotonic() + 90
    while True:
        states = [store.load(run_id) for run_id in run_ids]
        if all(s is not None and s.status == "finished" for s in states):
            return
        for worker in workers:
            assert worker.poll() is None, worker.communicate()
        assert time.monotonic() < deadline, [s and (s.status, s.lease_holder) for s in states]
        time.sleep(0.1)


def stop(workers: list[subprocess.Popen[str]]) -> list[str]:
    """SIGTERM every worker; each must exit 0. Returns their stderr (their log)."""
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    logs = []
    for worker in workers:
        _, err = worker.communicate(timeout=60)
        if worker.returncode == -signal.SIGTERM:
            # On a loaded machine a worker can still be importing Python modules
            # when the runs are done: killed before `main` ran, it never started.
            assert "worker started" not in err, err
            continue
        assert worker.returncode == 0, err
        assert "worker stopped" in err  # also "... before it started (nothing held)"
        logs.append(err)
    return logs


def check_recovered_once(url: str, ledger: str, run_ids: list[str], point: str) -> None:
    with RunStore.from_url(url) as store:
        for run_id in run_ids:
            run = store.load(run_id)
            assert run is not None
            assert (run.status, run.outcome, store.lease(run_id)) == ("finished", "charged", None)
            names = [type(e).TOPIC.rsplit(".", 1)[-1] for e in store.events.get(run.id)]
            assert names.count("Recovered") == 1
            (step,) = run.step_records()
            # Inside the tool: executed again with its key; else executed once.
            assert (step.name, step.attempts) == ("charge", 2 if point == "in-tool" else 1)
    charges, attempts = read_ledger(ledger)
    assert sorted(run_id for _, run_id, _ in charges) == sorted(run_ids)
    per_run = 2 if point == "in-tool" else 1
    assert len(attempts) == per_run * len(run_ids)
    assert {key for key, _ in attempts} == {key for key, _, _ in charges}


def targets(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, str]:
    """(store URL, ledger) of the backend; the SQLite ledger is a file of its own."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'runs.db'}", str(tmp_path / "ledger.db")
    dsn = str(request.getfixturevalue("pg_dsn"))
    if backend == "pgbouncer":  # the store through PgBouncer; the ledger, the payment
        return request.getfixturevalue("pgbouncer").url(dsn), dsn  # system's, direct
    return dsn, dsn


@pytest.mark.timeout(240)
@pytest.mark.parametrize("point", KILL_POINTS)
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_a_worker_killed_mid_run_is_recovered_by_another_and_charges_once(
    backend: str, point: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    killed_and_recovered(backend, point, tmp_path, request)


@pytest.mark.timeout(240)
@pytest.mark.postgres
@pytest.mark.pgbouncer
def test_a_worker_killed_in_a_tool_behind_pgbouncer_is_recovered_and_charges_once(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    killed_and_recovered("pgbouncer", "in-tool", tmp_path, request)


def killed_and_recovered(
    backend: str, point: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A worker killed at ``point`` on ``backend``; another recovers its run once."""
    url, ledger = targets(backend, tmp_path, request)
    (run_id,) = kill_while_standing(url, ledger, point, tmp_path)
    with RunStore.from_url(url) as store:
        left = store.load(run_id)
        assert left is not None and left.status == "running"
        lease = store.lease(run_id)
        assert lease is not None and lease.holder.startswith("doomed-")

        worker = start_worker(url, ledger, "rescuer")
        try:
            wait_finished(store, [run_id], [worker])
        finally:
            (log,) = stop([worker])
    assert f"run recovered run={run_id} status=finished holder=rescuer" in log
    assert "turn opened" not in log  # one line per run, not each turn's lines
    check_recovered_once(url, ledger, [run_id], point)


@pytest.mark.timeout(300)
@pytest.mark.postgres
@pytest.mark.parametrize("workers", [2, 4])
def test_worker_processes_racing_over_one_postgres_recover_each_orphan_once(
    workers: int, tmp_path: Path, pg_dsn: str
) -> None:
    run_ids = kill_while_standing(pg_dsn, pg_dsn, "in-tool", tmp_path, runs=4)
    assert len(run_ids) == 4
    with RunStore.from_url(pg_dsn) as store:
        started = [start_worker(pg_dsn, pg_dsn, f"rescuer-{n}") for n in range(workers)]
        try:
            wait_finished(store, run_ids, started)
        finally:
            logs = stop(started)
    lines = [line for log in logs for line in log.splitlines() if "run recovered" in line]
    recovered = sorted(line.split("run=")[1].split()[0] for line in lines)
    assert recovered == sorted(run_ids)  # each by exactly one worker process
    check_recovered_once(pg_dsn, pg_dsn, run_ids, "in-tool")


def cli(url: str, ledger: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "kuralle_es.cli", *args, "--store", url,
        "--app", "charge_app:build_agents", "--lease-ttl", "1",
    ]  # fmt: skip
    return subprocess.run(
        command, cwd=PROCS, env=_env(KT_LEDGER=ledger), capture_output=True, text=True, timeout=60
    )


@pytest.mark.timeout(120)
async def test_kuralle_es_recover_and_sweep_run_one_pass_and_print_what_they_drove(
    tmp_path: Path,
) -> None:
    url, ledger = f"sqlite:///{tmp_path / 'runs.db'}", str(tmp_path / "ledger.db")
    (orphan,) = kill_while_standing(url, ledger, "in-tool", tmp_path)
    with RunStore.from_url(url) as store:
        runtime = Runtime(build_agents(), store=store)
        held = await runtime.run("s-hold", kind="flow", flow_name="hold").result()
        napping = await runtime.run("s-nap", kind="flow", flow_name="nap").result()
    assert held.status == napping.status == "paused"
    await asyncio.sleep(1.6)  # past the lease (1 s), the deadline (0.5 s) and the sleep (1.5 s)

    swept = cli(url, ledger, "sweep")
    assert swept.returncode == 0, swept.stderr
    assert sorted(swept.stdout.split("\n")) == sorted(
        ["", f"swept {held.run_id}", f"woken {napping.run_id}"]
    )
    recovered = cli(url, ledger, "recover")
    assert recovered.returncode == 0, recovered.stderr
    assert recovered.stdout == f"recovered {orphan}\n"
    assert "1 run(s) recovered" in recovered.stderr
    again = cli(url, ledger, "recover")
    assert (again.returncode, again.stdout) == (0, "")
    with RunStore.from_url(url) as store:
        outcomes = {r: store.load(r).outcome for r in (orphan, held.run_id, napping.run_id)}  # type: ignore[union-attr]
    assert outcomes == {orphan: "charged", held.run_id: "approved=False", napping.run_id: "rested"}
