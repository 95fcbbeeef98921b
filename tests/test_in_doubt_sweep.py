"""Runs in ``error`` with a step in doubt are resumed by a sweep only when asked, on
memory, SQLite and PostgreSQL.

A ``pay`` run approved during a model outage is charged, then ends in ``error``
with its model step in doubt. ``resume_in_doubt_runs`` leaves it alone until it
has been idle ``idle_for`` seconds, then resumes it: the charge replays (it ran
once), the model step runs again, the run finishes. A run whose error is frozen
(its node raised) is never picked; the sweeper's job resumes runs in doubt only
when given ``resume_in_doubt``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import StoreFactory
from procs.operator_app import DOWN_ENV, LEDGER_ENV, build_agents, ledger
from views_kit import agent, start

from kuralle_es import (
    InvalidArgumentError,
    Runtime,
    create_sweep_job_runner,
    resume_in_doubt_runs,
)


@pytest.fixture
def outage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    monkeypatch.setenv(DOWN_ENV, str(tmp_path / "down"))
    return tmp_path / "down"


def _model_down(flag: Path, down: bool) -> None:
    if down:
        flag.touch()
    else:
        flag.unlink()


async def _approved_during_outage(runtime: Runtime, flag: Path, session: str) -> str:
    started = await runtime.run(session, kind="flow", flow_name="pay").result()
    _model_down(flag, True)
    with pytest.raises(ConnectionError):
        await runtime.approve(started.run_id, session, by="ann")
    _model_down(flag, False)
    return started.run_id


async def test_a_run_in_doubt_is_resumed_once_idle_and_its_charge_replays(
    open_store: StoreFactory, outage: Path
) -> None:
    store = open_store()
    runtime = Runtime([*build_agents(), agent()], store=store, inline_sleep_limit=5)
    run_id = await _approved_during_outage(runtime, outage, "s-doubt")
    frozen = await start(runtime, "crash")  # its node raised: error, nothing in doubt

    assert await resume_in_doubt_runs(runtime, idle_for=60) == []
    assert await resume_in_doubt_runs(runtime, idle_for=0) == [run_id]
    state = await runtime.get_run(run_id, "s-doubt")
    assert state is not None and (state.status, state.outcome) == ("finished", "paid")
    assert [e["cents"] for e in ledger(outage.parent / "ledger.jsonl")] == [500]
    crashed = await runtime.views.list_runs(run_id=frozen)
    assert crashed[0].status == "error"
    assert await resume_in_doubt_runs(runtime, idle_for=0) == []


async def test_the_sweep_job_resumes_runs_in_doubt_only_when_given_the_option(
    open_store: StoreFactory, outage: Path
) -> None:
    runtime = Runtime(build_agents(), store=open_store(), inline_sleep_limit=5)
    run_id = await _approved_during_outage(runtime, outage, "s-job")
    assert (await create_sweep_job_runner(runtime)()).resumed == []
    report = await create_sweep_job_runner(runtime, resume_in_doubt=0)()
    assert report.resumed == [run_id] and report.driven == [run_id]
    with pytest.raises(InvalidArgumentError):
        create_sweep_job_runner(runtime, resume_in_doubt=float("nan"))
