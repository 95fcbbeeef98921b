"""The protected ``eventsourcing`` hooks the store leans on exist, on the whole
version range ``pyproject.toml`` states.

``kuralle_es._journal.eventsourcing_hooks`` is the one module that uses the
library's protected hooks, and ``HOOKS`` names each with the parameters it
uses. These tests check them on the installed release (the newest the range
admits, as ``make test`` installs it) and on the lowest release of the range,
whose wheel is downloaded from the package index and imported in a child
process beside this checkout, where a flow with an approval also runs end to
end on memory and SQLite, with its views.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from kuralle_es._journal.eventsourcing_hooks import HOOKS

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".venv" / "kuralle-hook-wheels"


def stated_range() -> tuple[str, str]:
    """The lowest and the excluded highest ``eventsourcing`` of ``pyproject.toml``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
    [spec] = [d for d in project["project"]["dependencies"] if d.startswith("eventsourcing")]
    lowest = re.search(r">=\s*([\d.]+)", spec)
    below = re.search(r"<\s*([\d.]+)", spec)
    assert lowest and below, f"pyproject.toml states no range for eventsourcing: {spec!r}"
    return lowest.group(1), below.group(1)


def as_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def missing_hooks() -> list[str]:
    """The hooks of ``HOOKS`` the imported ``eventsourcing`` lacks or shapes otherwise."""
    problems = []
    for owner, name, params in HOOKS:
        module, cls = owner.split(":")
        method = getattr(getattr(importlib.import_module(module), cls), name, None)
        if method is None:
            problems.append(f"{owner}.{name} is gone")
            continue
        found = tuple(inspect.signature(method).parameters)[: len(params)]
        if found != params:
            problems.append(f"{owner}.{name} takes {found}, not {params}")
    return problems


def test_the_installed_eventsourcing_is_in_the_range_pyproject_states() -> None:
    lowest, below = stated_range()
    installed = as_tuple(version("eventsourcing"))
    assert as_tuple(lowest) <= installed < as_tuple(below)


def test_every_hook_exists_as_used_on_the_installed_eventsourcing() -> None:
    assert missing_hooks() == []


CHILD = """
import asyncio, sys, tempfile, os
import eventsourcing
sys.path.insert(0, {tests!r})
import test_eventsourcing_hooks as checks
assert eventsourcing.__file__.startswith({wheel!r}), eventsourcing.__file__
problems = checks.missing_hooks()
assert problems == [], problems

from pydantic import BaseModel
from kuralle_es import RunStore, Runtime, action, define_agent, define_flow, define_tool, end

class Amount(BaseModel):
    cents: int

charged = []

async def pay(state, ctx):
    await ctx.approve("Charge?")
    await ctx.tool("charge", {{"cents": 500}})
    return end("paid")

agent = define_agent("a", "", None,
    [define_tool("charge", "", Amount, lambda args: charged.append(args.cents) or {{"ok": True}})],
    [define_flow("pay", "", "n", [action("n", pay)])])

async def main(store):
    runtime = Runtime([agent], store=store)
    paused = await runtime.run("s", kind="flow", flow_name="pay").result()
    assert paused.status == "paused", paused
    done = await runtime.approve(paused.run_id, "s", by="ops")
    assert done.status == "finished", done
    [summary] = await runtime.views.list_runs()
    assert summary.status == "finished"

asyncio.run(main(RunStore.memory()))
with tempfile.TemporaryDirectory() as folder:
    with RunStore.sqlite(os.path.join(folder, "runs.db")) as store:
        asyncio.run(main(store))
assert charged == [500, 500], charged
print("ok", eventsourcing.__file__)
"""


def lowest_wheel(lowest: str) -> Path:
    """The unpacked wheel of ``eventsourcing==lowest`` (downloaded once per checkout)."""
    target = WHEELS / lowest
    if (target / "eventsourcing" / "__init__.py").exists():
        return target
    WHEELS.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "-d", str(WHEELS), f"eventsourcing=={lowest}"],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    [wheel] = WHEELS.glob(f"eventsourcing-{lowest}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def test_every_hook_exists_and_a_flow_runs_on_the_lowest_eventsourcing_stated() -> None:
    lowest, _ = stated_range()
    if as_tuple(version("eventsourcing")) == as_tuple(lowest):
        pytest.skip(f"the installed eventsourcing is the lowest stated ({lowest})")
    wheel = lowest_wheel(lowest)
    code = CHILD.format(tests=str(ROOT / "tests"), wheel=str(wheel))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(wheel), str(ROOT)])}
    env.pop("PERSISTENCE_MODULE", None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok"), done.stdout
