"""``kuralle-es check``, ``migrate`` and ``runs list`` for a deploy, as real processes.

Against a SQLite file and a PostgreSQL database holding runs of the ``order``
flow's version 1 (tests/procs/deploy_app.py): two paused on an approval, one
errored, one finished. ``check`` replays every live run against an app
without executing or writing anything and exits 0 when each would resume
(the app has version 1 beside version 2), 1 when one would not (only version
2: drift; version 1's digest with other code: nondeterminism at step 0).
``runs list --flow`` says which version each run is on. ``migrate`` moves a
paused run onto version 2; approved from another process, it finishes with
each effect once. Refusals are one line and write nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from procs import deploy_app
from procs.deploy_app import FLOW
from test_cli_operator import _ok, kuralle

from kuralle_es import RunStore, Runtime, ToolExecutionError, TurnResult
from kuralle_es._runtime.migrate import migration_id

SESSION = "s-deploy-cli"
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture
def ledger_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(deploy_app.LEDGER_ENV, str(path))
    return path


def cli(store_url: str, ledger: Path, *args: str) -> Any:
    """``kuralle-es --store URL ARGS`` with the deploy app importable and its ledger."""
    return kuralle(
        "--store",
        store_url,
        *args,
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        **{deploy_app.LEDGER_ENV: str(ledger)},
    )


def app(attr: str) -> tuple[str, str]:
    return ("--app", f"procs.deploy_app:{attr}")


def stored(store_url: str) -> tuple[int, dict[str, int]]:
    """The log's head and every run's version: unchanged means nothing was written."""
    with RunStore.from_url(store_url) as store:
        head = store.recorder.max_notification_id() or 0
        runs = {
            str(n.originator_id): n.originator_version
            for n in store.recorder.select_notifications(start=None, limit=100_000)
        }
    return head, runs


async def _populate(store_url: str) -> dict[str, str]:
    """Version 1 runs: two paused, one errored (its reserve failed), one finished."""
    with RunStore.from_url(store_url) as store:
        runtime = Runtime(deploy_app.v1(), store=store)
        runs = {}
        for name in ("paused", "other"):
            runs[name] = (await runtime.run(SESSION, kind="flow", flow_name=FLOW).result()).run_id
        done = (await runtime.run(SESSION, kind="flow", flow_name=FLOW).result()).run_id
        await runtime.approve(done, SESSION, by="ann")
        runs["finished"] = done
        saved = os.environ.pop(deploy_app.LEDGER_ENV)
        try:  # no ledger: the tool fails, its error is frozen, the run is errored
            with pytest.raises(ToolExecutionError):
                await runtime.run(SESSION, kind="flow", flow_name=FLOW).result()
        finally:
            os.environ[deploy_app.LEDGER_ENV] = saved
        errored = [
            s.run_id for s in await runtime.views.list_runs(status="error", session_id=SESSION)
        ]
        runs["errored"] = errored[0]
    return runs


def test_check_exits_0_on_a_compatible_app_and_1_on_an_incompatible_one_writing_nothing(
    store_url: str, ledger_file: Path
) -> None:
    runs = asyncio.run(_populate(store_url))
    live = {runs["paused"], runs["other"], runs["errored"]}
    executed = deploy_app.ledger()
    before = stored(store_url)

    compatible = cli(store_url, ledger_file, "check", *app("v1_and_v2"), "--json")
    assert compatible.returncode == 0, compatible.stderr
    checks = json.loads(compatible.stdout)
    assert {c["run_id"] for c in checks} == live
    assert {(c["kind"], c["ok"], c["flow"], c["flow_version"]) for c in checks} == {
        ("ok", True, FLOW, "1")
    }
    assert "3 live run(s): 3 ok, 0 drift, 0 nondeterminism" in compatible.stderr

    drift = cli(store_url, ledger_file, "check", *app("v2"), "--json")
    assert drift.returncode == 1
    assert {(c["run_id"], c["kind"]) for c in json.loads(drift.stdout)} == {
        (run_id, "drift") for run_id in live
    }

    replay = cli(store_url, ledger_file, "check", *app("v1_reordered"))
    assert replay.returncode == 1
    lines = replay.stdout.splitlines()
    assert len(lines) == 3
    by_run = {line.split()[1]: line for line in lines}
    for run_id in (runs["paused"], runs["other"]):
        assert by_run[run_id].startswith("nondeterminism ")
        assert f"{FLOW}@1  step 0  non-deterministic replay at callsite 0" in by_run[run_id]
    # The errored run failed at its first step: as recorded, the clock read is new.
    assert by_run[runs["errored"]].startswith("nondeterminism ")

    text = cli(store_url, ledger_file, "check", *app("v1"))
    assert text.returncode == 0
    assert all(line.startswith("ok ") for line in text.stdout.splitlines())

    assert stored(store_url) == before
    assert deploy_app.ledger() == executed


def test_runs_list_shows_the_version_each_run_is_on(store_url: str, ledger_file: Path) -> None:
    runs = asyncio.run(_populate(store_url))

    async def start_on_v2() -> str:
        with RunStore.from_url(store_url) as store:
            runtime = Runtime(deploy_app.v1_and_v2(), store=store)
            return (await runtime.run(SESSION, kind="flow", flow_name=FLOW).result()).run_id

    newer = asyncio.run(start_on_v2())
    listed = json.loads(_ok(cli(store_url, ledger_file, "runs", "list", "--flow", FLOW, "--json")))
    assert {s["run_id"]: s["flow_version"] for s in listed} == {
        **{run_id: "1" for run_id in runs.values()},
        newer: "2",
    }
    header, *lines = _ok(cli(store_url, ledger_file, "runs", "list", "--flow", FLOW)).splitlines()
    column = header.split("\t").index("VERSION")
    assert {line.split("\t")[0]: line.split("\t")[column] for line in lines} == {
        **{run_id: "1" for run_id in runs.values()},
        newer: "2",
    }


def test_migrate_moves_a_run_onto_v2_and_it_finishes_with_each_effect_once(
    store_url: str, ledger_file: Path
) -> None:
    runs = asyncio.run(_populate(store_url))
    paused = runs["paused"]
    before = stored(store_url)
    refused = [
        cli(store_url, ledger_file, "migrate", paused, "--at", "99", *app("v2")),
        cli(store_url, ledger_file, "migrate", runs["finished"], "--at", "1", *app("v2")),
        cli(store_url, ledger_file, "migrate", "00000000-0000-4000-8000-000000000000",
            "--at", "0", *app("v2")),
    ]  # fmt: skip
    for done in refused:
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "InvalidArgumentError" in refused[0].stderr and "at_step" in refused[0].stderr
    assert stored(store_url) == before

    moved = TurnResult.model_validate_json(
        _ok(cli(store_url, ledger_file, "migrate", paused, "--at", "1", *app("v2")))
    )
    assert moved.run_id == migration_id(paused, 1) and moved.status == "paused"
    shown = json.loads(_ok(cli(store_url, ledger_file, "runs", "show", paused, "--json")))
    assert (shown["status"], shown["outcome"]) == ("aborted", f"migrated: {moved.run_id}")
    assert shown["migrated_to"] == moved.run_id
    assert f"migrated to run {moved.run_id}" in _ok(
        cli(store_url, ledger_file, "runs", "show", paused)
    )
    # A retried migration (a webhook, an impatient operator) is the same move.
    again = TurnResult.model_validate_json(
        _ok(cli(store_url, ledger_file, "migrate", paused, "--at", "1", *app("v2")))
    )
    assert again.run_id == moved.run_id

    approved = TurnResult.model_validate_json(
        _ok(cli(store_url, ledger_file, "approve", moved.run_id, "--by", "ann", *app("v2")))
    )
    assert approved.status == "finished"
    mine = [e for e in deploy_app.ledger() if e["run_id"] in (paused, moved.run_id)]
    assert sorted(e["tool"] for e in mine) == ["notify", "reserve", "ship"]
    assert len({e["key"] for e in mine}) == 3
    # The moved run passes the check against version 2; the other v1 runs drift.
    checks = json.loads(cli(store_url, ledger_file, "check", *app("v2"), "--json").stdout)
    assert moved.run_id not in {c["run_id"] for c in checks}  # finished: not live
    assert {c["run_id"] for c in checks if c["kind"] == "drift"} == {
        runs["other"], runs["errored"],
    }  # fmt: skip


def test_an_unknown_store_is_refused_by_check(tmp_path: Path, ledger_file: Path) -> None:
    missing = tmp_path / "nope.db"
    done = cli(f"sqlite:///{missing}", ledger_file, "check", *app("v1"))
    assert done.returncode == 2
    assert not missing.exists()
