"""``kuralle-es`` as an operator uses it: the real command, in its own process,
against a real SQLite file and a real PostgreSQL database.

``runs list`` answers from the views (filters, JSON, a table on a terminal and
tab-separated text in a pipe), ``runs show`` prints the timeline (times,
durations, attempts, who delivered what, where the run waits) or the
``RunState`` with its steps; read-only commands never import the app; a store
that cannot be reached is one line within seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import stripped
from views_kit import SESSION, agent, expected_summary, populate

from kuralle_es import RunState, RunStore, RunSummary, Runtime, StepRecord
from kuralle_es.cli import build_parser
from kuralle_es.examples import refund

SCRIPT = Path(sys.executable).parent / "kuralle-es"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "kuralle_es.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not stripped(k, ("PERSISTENCE_", "SQLITE_", "POSTGRES_", "KURALLE_"))
        and k not in ("OPENAI_API_KEY", refund.LEDGER_ENV)
    }
    env[refund.MODEL_ENV] = "scripted"
    return {**env, **extra}


def kuralle(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args],
        capture_output=True,
        text=True,
        env=_env(**env),
        cwd=cwd,
        timeout=120,
    )


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


async def _states(store: RunStore, run_ids: dict[str, str]) -> dict[str, RunState]:
    runtime = Runtime([agent()], store=store)
    states = {}
    for case, run_id in run_ids.items():
        session = "conversation-session" if case == "conversation" else SESSION
        state = await runtime.get_run(run_id, session)
        assert state is not None
        states[run_id] = state
    return states


async def _populate(store: RunStore) -> dict[str, str]:
    runtime = Runtime([agent()], store=store)
    return (await populate(runtime, Runtime([agent(2)], store=store))).by_case


# ------------------------------------------------------------------ demo
def test_the_demo_refuses_a_store_it_would_not_use_and_writes_nothing(tmp_path: Path) -> None:
    demo_dir = tmp_path / "demo"
    for named in (["--store", "postgresql://postgres@127.0.0.1:5432/x"], ["--sqlite", "x.db"]):
        done = kuralle("demo", *named, KURALLE_DEMO_DIR=str(demo_dir), cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert "takes no --store or --sqlite" in done.stderr
        assert f"sqlite:///{demo_dir}/refund.db" in done.stderr
        assert not demo_dir.exists() and not (tmp_path / "x.db").exists()


def test_runs_list_json_after_the_demo_shows_the_demo_run_finished(tmp_path: Path) -> None:
    demo_dir = tmp_path / "demo"
    _ok(kuralle("demo", KURALLE_DEMO_DIR=str(demo_dir)))
    db = demo_dir / "refund.db"

    listed = json.loads(_ok(kuralle("--store", f"sqlite:///{db}", "runs", "list", "--json")))
    assert len(listed) == 1
    summary = RunSummary.model_validate(listed[0])
    assert summary.status == "finished" and summary.session_id == "demo-session"
    with RunStore.sqlite(str(db)) as store:
        run = store.load(summary.run_id)
        assert run is not None
        assert listed[0] == expected_summary(run.to_state())

    shown = _ok(kuralle("--sqlite", str(db), "runs", "show", summary.run_id))
    assert f"run {summary.run_id}" in shown
    assert "signal   __approval       by supervisor" in shown  # the actor of the delivery
    assert "signal_id=approval-1" in shown
    assert " ms  x1  -> " in shown  # each step's duration and attempts
    # Each line starts with the date and time (UTC), to the millisecond.
    assert re.search(r"^  \d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3}  #0 ", shown, re.MULTILINE)


# -------------------------------------------------------- sqlite and pg
def _open(url: str) -> RunStore:
    if url.startswith("sqlite:"):
        return RunStore.sqlite(url.removeprefix("sqlite:///"))
    return RunStore.postgres(url)


async def test_runs_list_filters_answer_what_the_runs_say(store_url: str) -> None:
    with _open(store_url) as store:
        runs = await _populate(store)
        states = await _states(store, runs)

    listed = json.loads(_ok(kuralle("--store", store_url, "runs", "list", "--json")))
    assert {s["run_id"]: s for s in listed} == {
        run_id: expected_summary(state) for run_id, state in states.items()
    }
    paused = json.loads(
        _ok(kuralle("runs", "list", "--status", "paused", "--json", KURALLE_STORE=store_url))
    )
    assert {s["run_id"] for s in paused} == {
        run_id for run_id, state in states.items() if state.status == "paused"
    }
    by_flow = json.loads(
        _ok(kuralle("runs", "list", "--flow", "approve", "--json", "--store", store_url))
    )
    assert [s["run_id"] for s in by_flow] == [runs["approve"]]
    by_session = json.loads(
        _ok(
            kuralle(
                "--store", store_url, "runs", "list", "--session", "conversation-session", "--json"
            )
        )
    )
    assert [s["run_id"] for s in by_session] == [runs["conversation"]]
    assert (
        len(
            json.loads(_ok(kuralle("--store", store_url, "runs", "list", "--limit", "2", "--json")))
        )
        == 2
    )

    piped = _ok(kuralle("--store", store_url, "runs", "list", "--status", "paused"))
    header, *lines = piped.splitlines()
    assert header.split("\t")[:2] == ["RUN_ID", "STATUS"]
    assert {line.split("\t")[0] for line in lines} == {s["run_id"] for s in paused}
    assert all(line.split("\t")[1] == "paused" for line in lines)


async def test_runs_show_prints_the_timeline_or_the_state_with_its_steps(store_url: str) -> None:
    with _open(store_url) as store:
        runtime = Runtime([agent()], store=store)
        runs = await _populate(store)
        approve = await runtime.get_run(runs["approve"], SESSION)
        steps = await runtime.get_steps(runs["approve"], SESSION)
    assert approve is not None

    shown = json.loads(
        _ok(kuralle("--store", store_url, "runs", "show", runs["approve"], "--json"))
    )
    steps_json = shown.pop("steps")
    assert RunState.model_validate(shown) == approve
    assert [StepRecord.model_validate(s) for s in steps_json] == steps

    text = _ok(kuralle("--store", store_url, "runs", "show", runs["approve"]))
    assert f"run {runs['approve']}" in text
    assert "waiting for __approval (approval)" in text
    assert "deadline: 2001-01-01 00:00:00.000 UTC" in text
    assert "flow approve at node ask" in text


def test_a_missing_run_is_one_line_and_exit_1(store_url: str) -> None:
    with _open(store_url):
        pass  # creates the database's tables
    done = kuralle("--store", store_url, "runs", "show", "00000000-0000-0000-0000-000000000000")
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        == "kuralle-es: RunNotFoundError: no run 00000000-0000-0000-0000-000000000000 in this store"
    )


async def test_a_delivery_from_the_command_line_resumes_the_run_with_the_named_actor(
    store_url: str, tmp_path: Path
) -> None:
    """``--app`` is imported from the current folder; the actor shows in ``runs show``."""
    (tmp_path / "views_app.py").write_text(
        "from views_kit import agent\nAGENTS = [agent()]\n", encoding="utf-8"
    )
    with _open(store_url) as store:
        runs = await _populate(store)
    tests_dir = str(Path(__file__).parent)
    done = kuralle(
        "--store", store_url, "--app", "views_app:AGENTS", "signal", runs["signal"], "shipment",
        "--payload", '{"tracking": "T1"}', "--actor", "dock-7",
        cwd=tmp_path, PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]),
    )  # fmt: skip
    assert json.loads(_ok(done))["status"] == "finished"
    text = _ok(kuralle("--store", store_url, "runs", "show", runs["signal"]))
    assert "signal   shipment         by dock-7" in text
    assert '{"tracking": "T1"}' in text


# ---------------------------------------------------------- read-only
async def test_read_only_commands_never_import_the_app(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    with RunStore.sqlite(str(db)) as store:
        runs = await _populate(store)
    bad = {"KURALLE_APP": "no_such_module_anywhere:agents"}
    _ok(kuralle("--sqlite", str(db), "runs", "list", **bad))
    _ok(kuralle("--sqlite", str(db), "runs", "show", runs["quick"], **bad))
    _ok(kuralle("--sqlite", str(db), "--app", "no_such_module:x", "runs", "list", "--json"))
    refused = kuralle("--sqlite", str(db), "approve", runs["approve"], "--by", "ann", **bad)
    assert refused.returncode == 2
    assert refused.stderr.startswith("kuralle-es: cannot load --app no_such_module_anywhere:agents")
    assert "Traceback" not in refused.stderr


def test_a_read_only_command_on_a_missing_sqlite_file_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "nope.db"
    done = kuralle("--store", f"sqlite:///{missing}", "runs", "list")
    assert done.returncode == 2
    assert done.stderr.strip() == f"kuralle-es: no SQLite database at {missing}"
    assert not missing.exists()


# -------------------------------------------------------- unreachable
@pytest.mark.parametrize(
    ("how", "host", "port"),
    [
        ("--store", "127.0.0.1", "1"),
        ("KURALLE_STORE", "127.0.0.1", "1"),
        ("env", "10.255.255.1", "5432"),
    ],
)
def test_an_unreachable_store_fails_within_seconds_with_one_line(
    how: str, host: str, port: str
) -> None:
    url = f"postgresql://postgres@{host}:{port}/kuralle_missing"
    if how == "--store":
        args, env = ["--store", url], {}
    elif how == "KURALLE_STORE":
        args, env = [], {"KURALLE_STORE": url}
    else:
        args, env = (
            [],
            {
                "PERSISTENCE_MODULE": "eventsourcing.postgres",
                "POSTGRES_HOST": host,
                "POSTGRES_PORT": port,
                "POSTGRES_DBNAME": "kuralle_missing",
                "POSTGRES_USER": "postgres",
            },
        )
    started = time.monotonic()
    done = kuralle(*args, "runs", "list", **env)
    elapsed = time.monotonic() - started
    assert done.returncode == 2
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(
        f"kuralle-es: cannot reach PostgreSQL at {host}:{port}, database 'kuralle_missing': "
    )
    assert elapsed < 5.0, f"took {elapsed:.1f} s"


def test_a_wrong_database_names_the_server_reason(postgres_admin_dsn: str) -> None:
    from conftest import dsn_for

    url = dsn_for(postgres_admin_dsn, "kuralle_no_such_database")
    done = kuralle("--store", url, "runs", "list")
    assert done.returncode == 2
    assert 'database "kuralle_no_such_database" does not exist' in done.stderr
    assert len(done.stderr.splitlines()) == 1


# ------------------------------------------------------------- layout
def test_runs_list_on_a_terminal_is_an_aligned_table(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    with RunStore.sqlite(str(db)) as store:
        runs = asyncio.run(_populate(store))
    primary, secondary = pty.openpty()
    with subprocess.Popen(
        [*COMMAND, "--sqlite", str(db), "runs", "list"],
        stdout=secondary,
        stderr=subprocess.PIPE,
        env=_env(),
    ) as proc:
        os.close(secondary)
        chunks = []
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=60) == 0
    os.close(primary)
    lines = b"".join(chunks).decode().replace("\r\n", "\n").splitlines()
    assert lines[0].startswith("RUN_ID") and "\t" not in lines[0]
    assert set(lines[1]) <= {"-", " "}
    assert lines[-1] == f"{len(runs)} run(s)"
    status_column = lines[0].index("STATUS")
    assert all(line[status_column - 2 : status_column] == "  " for line in lines[2:-1])


def test_version_and_help_on_every_option() -> None:
    assert _ok(kuralle("--version")).startswith("kuralle-es ")

    def undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
        missing = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    missing += undocumented(child, f"{path} {name}")
            elif not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
        return missing

    assert undocumented(build_parser(), "kuralle-es") == []
    assert "--store URL" in _ok(kuralle("runs", "list", "--help"))
