"""The operator verbs of ``kuralle-es`` through real processes, on SQLite and PostgreSQL.

``say`` starts and continues a conversation (a tool call in it), ``input`` answers a
``collect`` wait, ``runs resume`` re-drives a run whose model step was in doubt after
an outage (its approved charge runs once), ``resolve-drift`` restarts a drifted run, and
``worker --resume-in-doubt --inline-sleep-limit 0`` resumes another such run on its own
and sleeps durably; a command killed inside a turn with ``--lease-ttl 1`` is recovered
a second later, not thirty. The runs are made and read in this process, through the
library, on the same database; the commands run from ``tests/procs`` with
``--app operator_app:build_agents``. Independent commands run at once, to keep it quick.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import stripped
from procs.operator_app import DOWN_ENV, LEDGER_ENV, SLEEP_ENV, VARIANT_ENV, build_agents, ledger

from kuralle_es import RunStore, Runtime, TurnResult, recover_orphaned_runs
from kuralle_es._journal import catalogue as stored

PROCS = Path(__file__).resolve().parent / "procs"
SCRIPT = Path(sys.executable).parent / "kuralle-es"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "kuralle_es.cli"]
APP = "operator_app:build_agents"


@pytest.fixture
def ops(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Runtime, dict[str, str]]]:
    """A runtime of the operator app on the store, and the environment the commands get
    (the same ledger and outage flag as this process)."""
    env = {LEDGER_ENV: str(tmp_path / "ledger.jsonl"), DOWN_ENV: str(tmp_path / "down")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    with RunStore.from_url(store_url) as store:
        yield Runtime(build_agents(), store=store), {"KURALLE_STORE": store_url, **env}


def spawn(env: dict[str, str], *args: str, app: str = APP) -> subprocess.Popen[str]:
    """``kuralle-es ARGS --app APP`` started from ``tests/procs`` (not waited for)."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not stripped(k, ("PERSISTENCE_", "SQLITE_", "POSTGRES_", "KURALLE_", "OPS_"))
    }
    return subprocess.Popen(
        [*COMMAND, *args, "--app", app],
        cwd=PROCS,
        env={**clean, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str], code: int = 0) -> tuple[str, str]:
    """The command's stdout and stderr, once it exited with ``code``."""
    out, err = process.communicate(timeout=120)
    assert process.returncode == code, f"exit {process.returncode}\n{out}\n{err}"
    return out, err


def done(process: subprocess.Popen[str], code: int = 0) -> str:
    """What the command printed: stdout when it succeeded, stderr when it refused."""
    out, err = finish(process, code)
    return out if code == 0 else err


def _down(env: dict[str, str], down: bool) -> None:
    flag = Path(env[DOWN_ENV])
    flag.touch() if down else flag.unlink(missing_ok=True)


async def _in_doubt_after_approval(runtime: Runtime, env: dict[str, str], session: str) -> str:
    """A ``pay`` run approved while the model is down: charged, then ``error`` with its
    model step in doubt (what issue 40 met after a model outage)."""
    started = await runtime.run(session, kind="flow", flow_name="pay").result()
    _down(env, True)
    try:
        with pytest.raises(ConnectionError):
            await runtime.approve(started.run_id, session, by="ann")
    finally:
        _down(env, False)
    state = await runtime.get_run(started.run_id, session)
    assert state is not None and state.status == "error"
    assert (await runtime.get_steps(started.run_id, session))[-1].status == "running"
    return started.run_id


async def _state(runtime: Runtime, run_id: str, session: str) -> Any:
    state = await runtime.get_run(run_id, session)
    assert state is not None
    return state


async def test_say_input_resume_and_resolve_drift_from_the_command_line(
    ops: tuple[Runtime, dict[str, str]],
) -> None:
    runtime, env = ops
    resumed = await _in_doubt_after_approval(runtime, env, "s-resume")
    intake = await runtime.run("s-intake", kind="flow", flow_name="intake").result()
    assert intake.waiting_for is not None and intake.waiting_for.kind == "input"
    drifted = (await runtime.run("s-drift", kind="flow", flow_name="drifty").result()).run_id
    asks_approval = (await runtime.run("s-ask", kind="flow", flow_name="pay").result()).run_id

    running = {
        "say": spawn(env, "say", "s-chat", "where is order 7"),
        "input": spawn(env, "input", intake.run_id, "It was 12.50", "--json"),
        "resume": spawn(env, "runs", "resume", resumed, "--json"),
        "drift": spawn({**env, VARIANT_ENV: "2"}, "resolve-drift", drifted, "restart"),
        "wrong wait": spawn(env, "input", asks_approval, "hello"),
        "search": spawn(env, "runs", "list", "--run-id", intake.run_id[:8], "--since",
                        "2000-01-01T00:00:00", "--limit", "1", "--json"),
    }  # fmt: skip

    assert done(running["say"]) == "Order 7 is shipped.\n"
    chat = await _state(runtime, (await runtime.views.list_runs(session_id="s-chat"))[0].run_id,
                        "s-chat")  # fmt: skip
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "assistant"]
    assert chat.messages[1].tool_calls[0]["function"]["name"] == "lookup"

    answered = TurnResult.model_validate_json(done(running["input"]))
    assert (answered.status, answered.output) == ("finished", "amount 12.5")

    result = TurnResult.model_validate_json(done(running["resume"]))
    assert (result.status, result.output) == ("finished", "Paid.")
    assert [e["cents"] for e in ledger(Path(env[LEDGER_ENV]))] == [500]  # charged once
    steps = await runtime.get_steps(resumed, "s-resume")
    assert [(s.kind, s.status, s.attempts) for s in steps][1:3] == [
        ("tool", "finished", 1), ("model", "finished", 2),
    ]  # fmt: skip

    assert done(running["drift"]).strip() == f"run {drifted} is paused, waiting for signal go"
    out, err = finish(running["search"])
    [found] = json.loads(out)
    assert found["run_id"] == intake.run_id and found["flow"] == "intake"
    assert err.startswith("more may follow: --after ")
    refused = done(running["wrong wait"], 1)
    assert refused.startswith("kuralle-es: SignalMismatchError: run") and "not for input" in refused

    # The conversation goes on in the same run; a frozen error stays frozen on resume.
    again = done(spawn(env, "say", "s-chat", "thanks"))
    assert again == "You said: thanks\n"
    assert len((await _state(runtime, chat.run_id, "s-chat")).messages) == 6


async def test_the_worker_resumes_runs_in_doubt_only_when_asked_and_sleeps_durably(
    ops: tuple[Runtime, dict[str, str]],
) -> None:
    runtime, env = ops
    run_id = await _in_doubt_after_approval(runtime, env, "s-worker")
    worker = spawn(
        env, "worker", "--interval", "0.2", "--resume-in-doubt", "--resume-in-doubt-after", "0",
        "--inline-sleep-limit", "0", "--lease-ttl", "3",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while (await _state(runtime, run_id, "s-worker")).status != "finished":
            assert time.monotonic() < deadline and worker.poll() is None, worker.stderr
            await asyncio.sleep(0.2)
    finally:
        worker.send_signal(signal.SIGTERM)
    _, err = finish(worker)
    assert "inline_sleep_limit=0.0 resume_in_doubt=after 0s" in err
    assert f"run resumed run={run_id}" in err, err
    assert [e["cents"] for e in ledger(Path(env[LEDGER_ENV]))] == [500]
    # --inline-sleep-limit 0: the sleep paused the run on a timer, which the worker woke.
    events = await asyncio.to_thread(runtime.store.run_events, run_id)
    kinds = [e.waiting_for.get("kind") for e in events if isinstance(e, stored.Paused)]
    assert kinds == ["approval", "timer"]


async def test_a_command_killed_inside_a_turn_is_recovered_after_its_lease_ttl(
    ops: tuple[Runtime, dict[str, str]],
) -> None:
    runtime, env = ops
    sleeper = spawn(
        {**env, SLEEP_ENV: "30"}, "runs", "start", "--flow", "sleepy", "--session", "s-kill",
        "--lease-ttl", "1", "--inline-sleep-limit", "60",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (found := await runtime.views.list_runs(session_id="s-kill")) or not (
        await runtime.get_steps(found[0].run_id, "s-kill")
    ):
        assert time.monotonic() < deadline and sleeper.poll() is None
        await asyncio.sleep(0.1)
    run_id = found[0].run_id
    lease = await runtime.store.lease_async(run_id)
    assert lease is not None and lease.live
    sleeper.send_signal(signal.SIGKILL)
    sleeper.wait(timeout=30)
    killed_at = time.monotonic()
    while not await recover_orphaned_runs(runtime):
        assert time.monotonic() - killed_at < 10, "not recovered within 10 s"
        await asyncio.sleep(0.1)
    assert time.monotonic() - killed_at < 5  # its 1 s lease, not the default 30 s
    # The recovery re-entered the sleep: past this runtime's 1 s inline limit, it pauses.
    state = await _state(runtime, run_id, "s-kill")
    assert state.status == "paused" and state.waiting_for.kind == "timer"
