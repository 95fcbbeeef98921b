"""Typed input and child runs from the real ``kuralle-es`` command (its own process).

``runs start --input JSON`` starts a typed flow (a refused input names its
fields and starts nothing); ``runs show`` shows a child's parent and a
parent's children (and ``--json`` the ``RunState`` with both); a parent's
wait for its child is read-only (``approve`` of it is refused, pointing at
the child); approving the child finishes the parent within that command;
``cancel`` of the parent reaches its children without the app.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import stripped

from kuralle_es import RunStore

SCRIPT = Path(sys.executable).parent / "kuralle-es"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "kuralle_es.cli"]

APP = """
from pydantic import BaseModel

from kuralle_es import action, define_agent, define_flow, end


class Order(BaseModel):
    sku: str
    qty: int = 1


async def order(state, ctx):
    await ctx.approve(f"Ship {ctx.input.qty} {ctx.input.sku}?")
    return end(f"{ctx.input.qty}x{ctx.input.sku}")


async def household(state, ctx):
    return end(f"ordered {await ctx.child('order', {'sku': 'tea', 'qty': 2})}")


AGENTS = [define_agent("shop", "", None, [], [
    define_flow("order", "", "go", [action("go", order)], input=Order),
    define_flow("household", "", "go", [action("go", household)]),
])]
"""


def _env(folder: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not stripped(k, ("PERSISTENCE_", "SQLITE_", "POSTGRES_", "KURALLE_"))
    }
    return {**env, "KURALLE_STORE": f"sqlite:///{folder / 'runs.db'}"}


def kuralle(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], capture_output=True, text=True, env=_env(folder), cwd=folder,
        timeout=120,
    )  # fmt: skip


def ok(folder: Path, *args: str) -> str:
    done = kuralle(folder, *args)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def started(folder: Path, flow: str, *extra: str) -> dict[str, Any]:
    shown = ok(folder, "--app", "family:AGENTS", "runs", "start", "--flow", flow,
               "--session", "s", "--json", *extra)  # fmt: skip
    result: dict[str, Any] = json.loads(shown)
    return result


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "family.py").write_text(APP, encoding="utf-8")
    return tmp_path


def test_runs_start_takes_a_json_input_and_refuses_a_bad_one_naming_its_fields(
    folder: Path,
) -> None:
    refused = kuralle(folder, "--app", "family:AGENTS", "runs", "start", "--flow", "order",
                      "--session", "s", "--input", '{"qty": "many"}')  # fmt: skip
    assert refused.returncode == 1
    assert "InvalidArgumentError" in refused.stderr and "['qty', 'sku']" in refused.stderr
    with RunStore.sqlite(str(folder / "runs.db")) as store:
        assert store.session_run_ids("s") == []  # nothing written

    paused = started(folder, "order", "--input", '{"sku": "tea", "qty": 3}')
    assert paused["status"] == "paused"
    assert paused["waiting_for"]["title"] == "Ship 3 tea?"


def test_runs_show_links_parent_and_child_and_the_childs_approval_finishes_the_parent(
    folder: Path,
) -> None:
    parent = started(folder, "household")
    child_id = parent["waiting_for"]["child_run_id"]
    shown = ok(folder, "runs", "show", parent["run_id"])
    assert f"children: {child_id}" in shown
    assert f"until child run {child_id} ends" in shown
    assert f"child of run {parent['run_id']} (started by its step 0)" in ok(
        folder, "runs", "show", child_id
    )

    refused = kuralle(folder, "--app", "family:AGENTS", "approve", parent["run_id"], "--by", "a")
    assert refused.returncode == 1 and f"runs show {child_id}" in refused.stderr
    ok(folder, "--app", "family:AGENTS", "approve", child_id, "--by", "ann")
    state = json.loads(ok(folder, "runs", "show", parent["run_id"], "--json"))
    assert (state["status"], state["outcome"]) == ("finished", "ordered 2xtea")
    assert state["children"] == [child_id] and state["parent"] is None
    assert [s["kind"] for s in state["steps"]] == ["child", "child"]


def test_cancel_of_a_parent_from_the_command_line_cancels_its_child(folder: Path) -> None:
    parent = started(folder, "household")
    child_id = parent["waiting_for"]["child_run_id"]
    ok(folder, "cancel", parent["run_id"], "--reason", "not today")
    child = json.loads(ok(folder, "runs", "show", child_id, "--json"))
    assert child["status"] == "aborted"
    assert child["outcome"].startswith("cancelled: not today (its parent run")
