"""The ``demo`` command (internal): the durable refund flow on SQLite, offline, resumed
and retried from new processes, then its journal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .._journal.store import RunStore
from .._runtime.runtime import Runtime
from ..examples import refund
from ..shapes import TurnResult
from ..views.timeline import format_timeline, read_deliveries
from .common import CliError, SubParsers, add_command


def add_demo(sub: SubParsers) -> None:
    demo = add_command(
        sub, "demo", "the durable refund flow on SQLite, offline", _demo, store=False, app=False
    )
    demo.add_argument(
        "--dir",
        default=os.environ.get("KURALLE_DEMO_DIR", ".demo"),
        help="where the demo's SQLite file and ledger go (env KURALLE_DEMO_DIR; default .demo)",
    )
    demo.add_argument("--model", help="'openai:gpt-4o-mini' for a real model (OPENAI_API_KEY)")


def _run_process(command: list[str]) -> None:
    done = subprocess.run(
        command, check=True, env=os.environ.copy(), capture_output=True, text=True
    )
    result = TurnResult.model_validate_json(done.stdout)
    print(f"   that process's turn: status={result.status} output={result.output!r}")


async def _turn(runtime: Runtime, handle_args: dict[str, Any]) -> TurnResult:
    handle = runtime.run(**handle_args)
    async for part in handle:
        if part.type == "text":
            print(f"   assistant: {part.text}")
        elif part.type in ("tool-call", "tool-result"):
            detail = part.args if part.type == "tool-call" else part.result
            print(f"   {part.type}: {part.tool_name} {json.dumps(detail)}")
        elif part.type == "paused" and part.waiting_for is not None:
            print(f"   paused: waiting for {part.waiting_for.kind} ({part.waiting_for.title})")
    return await handle.result()


async def _demo(args: argparse.Namespace) -> int:
    """The durable refund flow on SQLite, offline, resumed by a second process."""
    named = getattr(args, "store", None) or getattr(args, "sqlite", None)
    if named:
        # The demo makes its own SQLite file; saying nothing would leave a user
        # looking for the demo's run in the store they named.
        raise CliError(
            f"demo makes its own SQLite file under --dir ({args.dir}/refund.db) and takes no "
            f"--store or --sqlite (got {named!r}); drop it, and point `kuralle-es runs list` "
            f"at sqlite:///{args.dir}/refund.db afterwards"
        )
    workdir = Path(args.dir)
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    db = workdir / "refund.db"
    ledger = workdir / "ledger.jsonl"
    for path in (db, ledger):
        path.unlink(missing_ok=True)
    os.environ[refund.LEDGER_ENV] = str(ledger)
    if args.model:
        os.environ[refund.MODEL_ENV] = args.model

    print(f"== process {os.getpid()}: a customer asks for a refund (SQLite: {db})")
    with RunStore.sqlite(str(db)) as store:
        runtime = Runtime([refund.build_agent()], store=store)
        print("   user: Hi, I'd like a refund for my order.")
        first = await _turn(
            runtime,
            {
                "session_id": "demo-session",
                "input": "Hi, I'd like a refund for my order.",
                "kind": "flow",
                "flow_name": "refund",
            },
        )
        print("   user: It was $42.50.")
        second = await _turn(
            runtime,
            {"session_id": "demo-session", "run_id": first.run_id, "input": "It was $42.50."},
        )
        print(f"   the turn ended cleanly: status={second.status}")

    print("== a NEW process resumes the run by id and delivers the supervisor's approval")
    command = [
        sys.executable, "-m", "kuralle_es.cli", "--sqlite", str(db), "approve",
        second.run_id, "--by", "supervisor", "--signal-id", "approval-1",
    ]  # fmt: skip
    await asyncio.to_thread(_run_process, command)
    print("== the approval webhook is retried from a third process: a no-op")
    await asyncio.to_thread(_run_process, command)

    refunds = [e for e in refund.ledger_entries() if e["tool"] == "processRefund"]
    print(f"== processRefund executed {len(refunds)} time(s) (the payment's own ledger)")

    print(f"== the run's journal (kuralle-es --sqlite {db} runs show {second.run_id})")
    with RunStore.sqlite(str(db)) as store:
        run = store.load_history(second.run_id)
        assert run is not None
        state = run.to_state(store.lease(run.run_id))
        print(format_timeline(state, run.step_records(), read_deliveries(store, state.run_id)))
        for message in state.messages:
            print(f"   {message.role}: {message.content}")
    return 0 if len(refunds) == 1 and state.status == "finished" else 1
