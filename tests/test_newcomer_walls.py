"""The walls a new user hit, each in the real ``kuralle-es`` command (its own process):

a command run without a store refuses instead of opening an empty one; a
command that needs the app and cannot find a run's flow says to pass
``--app``; ``sweep`` reports the runs it skipped and exits 1; ``runs start``
starts a run; ``--payload`` reads ``@FILE`` and stdin; an app that raises at
import is one line; ``runs list`` shows an ended run's flow; help lists only
what a command uses. And ``define_agent`` names the ``Model`` protocol when
given something else.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import stripped

from kuralle_es import RunStore, define_agent
from kuralle_es.cli import NO_STORE, store_label

SCRIPT = Path(sys.executable).parent / "kuralle-es"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "kuralle_es.cli"]

APP = """
from pydantic import BaseModel

from kuralle_es import action, define_agent, define_flow, define_tool, end


class Payout(BaseModel):
    cents: int


def pay(args: Payout) -> dict:
    return {"paid": args.cents}


async def payout(state, ctx):
    decision = await ctx.approve("Pay out $5?")
    if not decision.approved:
        return end("declined")
    await ctx.tool("pay", {"cents": 500})
    return end("paid")


async def nap(state, ctx):
    await ctx.sleep(1.2)  # longer than the inline limit: the run pauses on a timer
    return end("rested")


async def crash(state, ctx):
    await ctx.now()
    raise RuntimeError("a bug in the node")


async def shipment(state, ctx):
    payload = await ctx.signal("shipment")
    return end(f"{len(payload['blob'])} bytes")


FLOWS = [
    define_flow("payout", "", "go", [action("go", payout)]),
    define_flow("nap", "", "go", [action("go", nap)]),
    define_flow("crash", "", "go", [action("go", crash)]),
    define_flow("shipment", "", "go", [action("go", shipment)]),
]
AGENTS = [define_agent("ops", "", None, [define_tool("pay", "", Payout, pay)], FLOWS)]
"""


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not stripped(k, ("PERSISTENCE_", "SQLITE_", "POSTGRES_", "KURALLE_"))
        and k != "OPENAI_API_KEY"
    }
    return {**env, "KURALLE_MODEL": "scripted", **extra}


def kuralle(
    *args: str, cwd: Path, stdin: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args],
        capture_output=True,
        text=True,
        env=_env(**env),
        cwd=cwd,
        input=stdin,
        timeout=120,
    )


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "ops_app.py").write_text(APP, encoding="utf-8")
    return tmp_path


def _store(folder: Path) -> dict[str, str]:
    return {"KURALLE_STORE": f"sqlite:///{folder / 'runs.db'}"}


def _start(folder: Path, flow: str, session: str, *extra: str) -> dict[str, Any]:
    done = kuralle(
        "--app", "ops_app:AGENTS", "runs", "start", "--flow", flow, "--session", session,
        "--json", *extra, cwd=folder, **_store(folder),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


# ------------------------------------------------------------------ the store
@pytest.mark.parametrize(
    "command",
    [
        ["runs", "list"],
        ["runs", "show", "r1"],
        ["runs", "start", "--flow", "payout", "--session", "s"],
        ["approve", "r1", "--by", "ann"],
        ["cancel", "r1", "--reason", "x"],
        ["views", "status"],
        ["consume", "approvals", "--once"],
        ["worker"],
        ["sweep"],
        ["dashboard"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_a_command_given_no_store_refuses_and_says_how_to_name_one(
    command: list[str], tmp_path: Path
) -> None:
    done = kuralle(*command, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == f"kuralle-es: {NO_STORE}"
    assert "--store" in done.stderr and "KURALLE_STORE" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_a_store_named_explicitly_is_used_even_in_memory(tmp_path: Path) -> None:
    listed = kuralle("--store", "memory:", "runs", "list", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []
    # The eventsourcing variables name a store too.
    popo = kuralle("runs", "list", "--json", cwd=tmp_path, PERSISTENCE_MODULE="eventsourcing.popo")
    assert popo.returncode == 0, popo.stderr


def test_the_worker_names_its_store_on_its_start_line(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    worker = subprocess.Popen(
        [*COMMAND, "--store", f"sqlite:///{db}", "worker", "--interval", "0.2"],
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=tmp_path,
    )
    try:
        assert worker.stderr is not None
        line = worker.stderr.readline()
        deadline = time.monotonic() + 60
        while "worker started" not in line and time.monotonic() < deadline:
            line = worker.stderr.readline()
    finally:
        worker.terminate()
        worker.communicate(timeout=60)
    assert "worker started" in line
    assert f"store=sqlite:///{db} ({db})" in line
    assert "app=kuralle_es.examples.refund:build_agent" in line


def test_a_store_label_never_shows_a_password() -> None:
    def label(store: str | None = None, **env: str) -> str:
        return store_label(argparse.Namespace(store=store, sqlite=None), env)

    assert label("postgresql://ann:s3cret@db.internal:5432/runs") == (
        "postgresql://ann@db.internal:5432/runs"
    )
    assert "s3cret" not in label("postgresql://ann@db/runs?password=s3cret&sslmode=require")
    assert "s3cret" not in label(KURALLE_STORE="postgresql://ann:s3cret@db/runs")
    multi = "postgresql://ann:s3cret@h1:5432,h2:5433/runs?target_session_attrs=read-write"
    assert label(multi) == multi.replace("ann:s3cret@", "ann@")
    # A URL that cannot be read is shown redacted, never as given.
    assert label("postgresql://ann:s3cret@db/runs?partitions=abc") == (
        "postgresql://ann:***@db/runs?partitions=abc"
    )
    assert label("memory:").startswith("memory: (this process only")
    assert label(
        PERSISTENCE_MODULE="eventsourcing.postgres", POSTGRES_HOST="db", POSTGRES_USER="ann",
        POSTGRES_DBNAME="runs", POSTGRES_PASSWORD="s3cret",
    ) == "eventsourcing.postgres postgresql://ann@db:5432/runs"  # fmt: skip


# -------------------------------------------------------------------- the app
def test_a_command_without_the_runs_app_says_to_pass_app(app_dir: Path) -> None:
    run = _start(app_dir, "payout", "s-app")
    assert run["status"] == "paused"
    # Forgetting --app: the default (the refund example) lacks the run's flow.
    done = kuralle("approve", run["run_id"], "--by", "ann", cwd=app_dir, **_store(app_dir))
    assert done.returncode == 1
    refusal, hint = done.stderr.strip().splitlines()
    assert refusal.startswith("kuralle-es: FlowNotFoundError: unknown flow 'payout'")
    assert hint.startswith(
        "kuralle-es: the agents came from --app kuralle_es.examples.refund:build_agent "
        "(the default: the refund example); pass --app module:attribute (or set KURALLE_APP)"
    )
    approved = kuralle(
        "approve", run["run_id"], "--by", "ann", cwd=app_dir, KURALLE_APP="ops_app:AGENTS",
        **_store(app_dir),
    )  # fmt: skip
    assert approved.returncode == 0, approved.stderr
    assert json.loads(approved.stdout)["output"] == "paid"


def test_sweep_reports_the_timer_it_could_not_wake_and_exits_1(app_dir: Path) -> None:
    napping = _start(app_dir, "nap", "s-nap")
    assert napping["waiting_for"]["kind"] == "timer"
    time.sleep(1.3)  # the timer is due
    skipped = kuralle("sweep", cwd=app_dir, **_store(app_dir))
    assert skipped.returncode == 1
    assert skipped.stdout.splitlines() == [
        f"skipped {napping['run_id']} (timer wake): FlowNotFoundError: unknown flow 'nap'; "
        "the runtime's agents define ['refund']"
    ]
    assert "pass --app module:attribute" in skipped.stderr
    assert "0 deadline(s) denied, 0 timer(s) fired, 1 run(s) skipped" in skipped.stderr

    # A worker logs the same skip, and says once what to do about it.
    worker = subprocess.Popen(
        [*COMMAND, "worker", "--interval", "0.2"],
        stderr=subprocess.PIPE,
        text=True,
        env=_env(**_store(app_dir)),
        cwd=app_dir,
    )
    try:
        assert worker.stderr is not None
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while not any(" WARNING " in line for line in lines) and time.monotonic() < deadline:
            lines.append(worker.stderr.readline())
    finally:
        worker.terminate()
        _, rest = worker.communicate(timeout=60)
    assert worker.returncode == 0
    [warning] = [line for line in lines + rest.splitlines() if " WARNING " in line]
    assert f"run {napping['run_id']} skipped: FlowNotFoundError: unknown flow 'nap'" in warning
    assert "pass --app module:attribute" in warning
    assert any("wake skipped" in line for line in lines)

    woken = kuralle("--app", "ops_app:AGENTS", "sweep", cwd=app_dir, **_store(app_dir))
    assert woken.returncode == 0, woken.stderr
    assert woken.stdout.splitlines() == [f"woken {napping['run_id']}"]
    recovered = kuralle("--app", "ops_app:AGENTS", "recover", cwd=app_dir, **_store(app_dir))
    assert recovered.returncode == 0
    assert "0 run(s) recovered, 0 skipped" in recovered.stderr


def test_an_app_that_raises_at_import_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken_app.py").write_text("raise RuntimeError('no config file')\n")
    done = kuralle(
        "--app", "broken_app:AGENTS", "runs", "start", "--flow", "x", "--session", "s",
        cwd=tmp_path, **_store(tmp_path),
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "kuralle-es: cannot load --app broken_app:AGENTS: importing broken_app raised "
        "RuntimeError: no config file"
    )
    assert not (tmp_path / "runs.db").exists()  # a bad --app creates no database


# ----------------------------------------------------------------- runs start
def test_runs_start_starts_a_flow_run_and_says_where_it_stands(app_dir: Path) -> None:
    store = _store(app_dir)
    human = kuralle(
        "--app", "ops_app:AGENTS", "runs", "start", "--flow", "payout", "--session", "s1",
        cwd=app_dir, **store,
    )  # fmt: skip
    assert human.returncode == 0, human.stderr
    [line] = human.stdout.splitlines()
    assert line.startswith("run ") and line.endswith(
        " paused, waiting for approval __approval: Pay out $5?"
    )

    first = _start(app_dir, "payout", "s2", "--idempotency-key", "order-9")
    again = _start(app_dir, "payout", "s2", "--idempotency-key", "order-9")
    assert again["run_id"] == first["run_id"]  # a retried start finds the first run

    from_stdin = kuralle(
        "--app", "ops_app:AGENTS", "runs", "start", "--flow", "payout", "--session", "s3",
        "--input", "-", "--json", cwd=app_dir, stdin="pay me please", **store,
    )  # fmt: skip
    assert from_stdin.returncode == 0, from_stdin.stderr
    with RunStore.sqlite(str(app_dir / "runs.db")) as opened:
        run = opened.load(json.loads(from_stdin.stdout)["run_id"])
        assert run is not None
        assert [m.content for m in run.to_state().messages] == ["pay me please"]

    unknown = kuralle(
        "--app", "ops_app:AGENTS", "runs", "start", "--flow", "refund", "--session", "s4",
        cwd=app_dir, **store,
    )  # fmt: skip
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("kuralle-es: FlowNotFoundError: unknown flow 'refund'")
    assert "--app ops_app:AGENTS; pass --app" in unknown.stderr

    crashed = kuralle(
        "--app", "ops_app:AGENTS", "runs", "start", "--flow", "crash", "--session", "s5",
        cwd=app_dir, **store,
    )  # fmt: skip
    assert crashed.returncode == 1
    [said] = crashed.stderr.splitlines()
    assert said.startswith("kuralle-es: run ")
    assert "the turn ended in error: RuntimeError: a bug in the node" in said
    listed = kuralle("runs", "list", "--status", "error", "--json", cwd=app_dir, **store)
    assert [s["session_id"] for s in json.loads(listed.stdout)] == ["s5"]


# -------------------------------------------------------------------- payloads
def test_a_signal_payload_comes_from_a_file_or_stdin(app_dir: Path) -> None:
    store = _store(app_dir)
    waiting = _start(app_dir, "shipment", "s-ship")
    huge = app_dir / "huge.json"
    huge.write_text(json.dumps({"blob": "x" * 1_100_000}), encoding="utf-8")
    too_big = kuralle(
        "--app", "ops_app:AGENTS", "signal", waiting["run_id"], "shipment",
        "--payload", f"@{huge}", cwd=app_dir, **store,
    )  # fmt: skip
    assert too_big.returncode == 1  # read whole, then refused by the payload bound
    assert too_big.stderr.startswith("kuralle-es: InvalidSignalError:")
    assert "1100012 bytes of JSON, over the limit of 1000000" in too_big.stderr
    missing = kuralle(
        "--app", "ops_app:AGENTS", "signal", waiting["run_id"], "shipment",
        "--payload", "@nope.json", cwd=app_dir, **store,
    )  # fmt: skip
    assert missing.returncode == 2 and "cannot read --payload @nope.json" in missing.stderr

    delivered = kuralle(
        "--app", "ops_app:AGENTS", "signal", waiting["run_id"], "shipment", "--payload", "-",
        cwd=app_dir, stdin=json.dumps({"blob": "y" * 1000}), **store,
    )  # fmt: skip
    assert delivered.returncode == 0, delivered.stderr
    assert json.loads(delivered.stdout)["output"] == "1000 bytes"

    # An ended run shows the flow it ended in, not "-".
    listed = kuralle("runs", "list", "--session", "s-ship", cwd=app_dir, **store)
    header, row = listed.stdout.splitlines()
    columns = dict(zip(header.split("\t"), row.split("\t"), strict=True))
    assert (columns["STATUS"], columns["FLOW@NODE"]) == ("finished", "shipment")


# ------------------------------------------------------------------------ help
def test_help_lists_only_what_a_command_uses_in_plain_text(tmp_path: Path) -> None:
    top = kuralle("--help", cwd=tmp_path).stdout
    assert "``" not in top and "docs/cli.md" in top
    demo = kuralle("demo", "--help", cwd=tmp_path).stdout
    assert "--store" not in demo and "--sqlite" not in demo and "--app" not in demo
    for read_only in (["cancel"], ["runs", "list"], ["runs", "show"], ["views", "status"]):
        shown = kuralle(*read_only, "--help", cwd=tmp_path).stdout
        assert "--app" not in shown and "--store URL" in shown, read_only
    assert "--app" in kuralle("approve", "--help", cwd=tmp_path).stdout
    assert "host:pid:random" in kuralle("worker", "--help", cwd=tmp_path).stdout


def test_a_run_that_does_not_exist_names_the_error_class(tmp_path: Path) -> None:
    done = kuralle("runs", "show", "r-none", cwd=tmp_path, KURALLE_STORE="memory:")
    assert done.returncode == 1
    assert done.stderr.strip() == "kuralle-es: RunNotFoundError: no run r-none in this store"


# ----------------------------------------------------------------------- model
def test_an_agent_refuses_a_model_that_is_not_a_model() -> None:
    class Echo:
        id = "echo"

        def answer(self, text: str) -> str:
            return text

    with pytest.raises(TypeError, match=r"async def respond\(self, request: ModelRequest\)"):
        define_agent("echo", "", Echo())


# ------------------------------------------------------------ the docs' walk
def test_the_app_of_the_agents_page_is_started_listed_and_approved_from_the_shell(
    tmp_path: Path,
) -> None:
    """docs/agents.md, "From the command line": its desk.py, the commands it shows."""
    page = (Path(__file__).parent.parent / "docs" / "agents.md").read_text(encoding="utf-8")
    start = page.index("```python\n# desk.py\n") + len("```python\n")
    (tmp_path / "desk.py").write_text(page[start : page.index("```", start)], encoding="utf-8")
    env = {**_store(tmp_path), "KURALLE_APP": "desk:AGENTS"}

    started = kuralle(
        "runs", "start", "--flow", "desk", "--session", "customer-1",
        "--input", "Refund $42.50 please", cwd=tmp_path, **env,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    line = started.stdout.strip()
    assert line.endswith(" paused, waiting for approval __approval: Refund $42.50?")
    run_id = line.split()[1]
    listed = kuralle("runs", "list", "--status", "paused", cwd=tmp_path, **env)
    assert run_id in listed.stdout and "desk@approve" in listed.stdout

    approved = kuralle("approve", run_id, "--by", "ann", cwd=tmp_path, **env)
    assert approved.returncode == 0, approved.stderr
    result = json.loads(approved.stdout)
    assert (result["status"], result["output"]) == ("finished", "Your refund is on its way.")
    shown = kuralle("runs", "show", run_id, cwd=tmp_path, **env)
    assert "tool     refund" in shown.stdout and "outcome: approved" in shown.stdout
