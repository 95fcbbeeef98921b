"""A user's ``mypy --strict`` passes against kuralle_es, installed editable and regular.

Each case makes a throwaway virtual environment, installs this checkout into
it (``pip install -e`` or ``pip install``) without dependencies, lends it the
test environment's packages (pydantic, eventsourcing, mypy, ...) through a
``.pth`` line, and type-checks a small user project that uses the public API
from a folder outside the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

USER_APP = """
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from kuralle_es import (
    ApprovalDecision, RunContext, RunState, RunStore, Runtime, SignalDelivery, StepRecord,
    ToolCall, TurnResult, action, define_agent, define_flow, define_tool, end, goto,
)
from kuralle_es.testing import ScriptedModel


class Refund(BaseModel):
    amount_cents: int


def charge(args: Refund, call: ToolCall) -> dict[str, int]:
    return {"refunded": args.amount_cents, "key_length": len(call.idempotency_key)}


def refund_policy(name: str, args: Refund, call: ToolCall | None) -> Literal["allow", "ask"]:
    return "ask" if args.amount_cents > 1000 else "allow"


async def ask(state: dict[str, Any], ctx: RunContext) -> Any:
    decision: ApprovalDecision = await ctx.approve("Refund?")
    if not decision.approved:
        return end("declined")
    result: Any = await ctx.tool("charge", {"amount_cents": 100})
    return goto("done", {"result": result})


async def done(state: dict[str, Any], ctx: RunContext) -> Any:
    return end("approved")


flow = define_flow("refund", "", "ask", [action("ask", ask), action("done", done)])
agent = define_agent(
    "support",
    "",
    ScriptedModel(["ok"]),
    [
        define_tool("charge", "", Refund, charge, policy=refund_policy),
        define_tool("echo", "", Refund, lambda args: {"cents": args.amount_cents}),
    ],
    [flow],
)


async def main() -> TurnResult:
    with RunStore.memory() as store:
        runtime = Runtime([agent], store=store)
        paused: TurnResult = await runtime.run("s", kind="flow", flow_name="refund").result()
        delivery = SignalDelivery(signal_id="1", name="__approval", payload={"approved": True})
        state: RunState | None = await runtime.get_run(paused.run_id, "s")
        steps: list[StepRecord] = await runtime.get_steps(paused.run_id, "s")
        assert state is not None and not steps
        return await runtime.run("s", run_id=paused.run_id, signal_delivery=delivery).result()
"""


TYPO_APP = """
from pydantic import BaseModel

from kuralle_es import define_tool


class Refund(BaseModel):
    amount_cents: int


tool = define_tool("refund", "", Refund, lambda args: {"cents": args.amount_cent})
"""


def _site_packages(env_dir: Path) -> Path:
    scheme = {"base": str(env_dir), "platbase": str(env_dir)}
    return Path(sysconfig.get_path("purelib", vars=scheme))


def _user_env(tmp_path: Path, *, editable: bool) -> Path:
    """A fresh venv holding this checkout (editable or not) and, by .pth, our deps."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    purelib = _site_packages(env_dir)
    ours = sysconfig.get_path("purelib")  # the test environment's packages
    (purelib / "zz_lent_packages.pth").write_text(ours + "\n", encoding="utf-8")
    python = env_dir / "bin" / "python"
    target = ["-e", str(ROOT)] if editable else [str(ROOT)]
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-build-isolation", *target],
        check=True, capture_output=True, text=True, timeout=300,
        cwd=tmp_path,
    )  # fmt: skip
    return python


@pytest.mark.parametrize("editable", [True, False], ids=["editable", "regular"])
def test_a_users_mypy_strict_passes_against_the_installed_package(
    tmp_path: Path, editable: bool
) -> None:
    python = _user_env(tmp_path, editable=editable)
    project = tmp_path / "project"
    project.mkdir()
    (project / "app.py").write_text(USER_APP, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    where = subprocess.run(
        [str(python), "-c", "import kuralle_es; print(kuralle_es.__file__)"],
        cwd=project, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    installed = Path(where.stdout.strip())
    # Editable: the checkout itself; regular: a copy in the user's environment.
    assert (installed.parent == ROOT / "kuralle_es") is editable
    checked = subprocess.run(
        [str(python), "-m", "mypy", "--strict", "--no-incremental",
         "--python-executable", str(python), "app.py"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    if editable:
        # The tool's args are typed as its input model: a typo is the user's mypy error.
        (project / "typo.py").write_text(TYPO_APP, encoding="utf-8")
        typo = subprocess.run(
            [str(python), "-m", "mypy", "--strict", "--no-incremental",
             "--python-executable", str(python), "typo.py"],
            cwd=project, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert typo.returncode == 1, typo.stdout
        assert '"Refund" has no attribute "amount_cent"' in typo.stdout, typo.stdout
