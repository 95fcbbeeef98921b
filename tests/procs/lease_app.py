"""The app of the lease tests: tools that outlive their lease, and a rival worker.

As ``--app lease_app:build_agents`` (importable from this folder) it is what
a second ``kuralle-es recover`` process drives runs with. Its one tool,
``hold``, stands still for ``KT_HOLD`` seconds (default 3) in the way the
flow names: ``hold-sync`` sleeps on its worker thread, ``hold-async``
sleeps with ``time.sleep`` inside an ``async def``, blocking the event loop
it runs on. Each execution appends ``start <pid>`` and ``end <pid>`` lines
to the file ``KT_LEDGER``, so a second execution, and an overlap, show.

Run as a script:

    lease_app.py start STORE_URL SESSION FLOW LEASE_TTL
        runs FLOW as holder ``worker-a``; prints the run id, then its status
    lease_app.py rival STORE_URL SESSION LEASE_TTL SECONDS
        the second worker (``rival``): see ``rival``; prints its tally as JSON
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    Agent,
    LeaseHeldError,
    Runtime,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    recover_orphaned_runs,
)
from kuralle_es._journal.store import RunStore


class NoArgs(BaseModel):
    pass


def _note(line: str) -> None:
    ledger = os.environ.get("KT_LEDGER")
    if ledger:
        with open(ledger, "a", encoding="utf-8") as f:
            f.write(f"{line} {os.getpid()}\n")


def _hold_seconds() -> float:
    return float(os.environ.get("KT_HOLD", "3"))


def ledger_lines(path: str | Path) -> list[str]:
    """The ledger's lines, without the pids (``start``/``end`` of each execution)."""
    if not Path(path).exists():
        return []
    return [line.split()[0] for line in Path(path).read_text(encoding="utf-8").splitlines()]


def build_agents() -> list[Agent]:
    def hold_sync(args: NoArgs, call: ToolCall) -> dict[str, Any]:
        _note("start")
        time.sleep(_hold_seconds())
        _note("end")
        return {"held": True}

    async def hold_async(args: NoArgs, call: ToolCall) -> dict[str, Any]:
        _note("start")
        time.sleep(_hold_seconds())  # noqa: ASYNC251 - blocks the loop: the misuse under test
        _note("end")
        return {"held": True}

    tools = [
        define_tool("hold_sync", "stands still on its thread", NoArgs, hold_sync),
        define_tool("hold_async", "blocks the event loop", NoArgs, hold_async),
    ]

    def node(tool: str) -> Any:
        async def run(state: dict[str, Any], ctx: Any) -> Any:
            await ctx.tool(tool)
            return end("held")

        return run

    flows = [
        define_flow("hold-sync", "a sync tool longer than the lease", "n",
                    [action("n", node("hold_sync"))]),
        define_flow("hold-async", "an async tool that blocks the loop", "n",
                    [action("n", node("hold_async"))]),
    ]  # fmt: skip
    return [define_agent("leaser", "holds", None, tools, flows)]


async def rival(store: RunStore, session: str, lease_ttl: float, seconds: float) -> dict[str, Any]:
    """A second worker: until the session's run is no longer held (or ``seconds``
    pass), it tries, every 50 ms, to recover orphans and to drive the run (once
    the session has one). Returns what each try met: the holders of the
    ``LeaseHeldError`` refusals, other outcomes by name, the runs recovered."""
    runtime = Runtime(build_agents(), store=store, lease_ttl=lease_ttl, holder="rival")
    refused: Counter[str] = Counter()
    other: Counter[str] = Counter()
    recovered: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        recovered += await recover_orphaned_runs(runtime)
        run_ids = store.session_run_ids(session)
        if run_ids:
            run_id = run_ids[-1]
            try:
                result = await runtime.run(session, run_id=run_id).result()
            except LeaseHeldError as held:
                refused[held.holder] += 1
            except Exception as error:  # tallied, for the test to show
                other[type(error).__name__] += 1
            else:
                other[f"returned {result.status}"] += 1
                break  # the run is no longer held: worker A is done with it
        await asyncio.sleep(0.05)
    return {"refused": dict(refused), "other": dict(other), "recovered": recovered}


async def _start(url: str, session: str, flow: str, lease_ttl: str) -> None:
    with RunStore.from_url(url) as store:
        runtime = Runtime(build_agents(), store=store, lease_ttl=float(lease_ttl),
                          holder="worker-a")  # fmt: skip
        handle = runtime.run(session, kind="flow", flow_name=flow)
        print(await handle.run_id, flush=True)
        print((await handle.result()).status, flush=True)


async def _rival(url: str, session: str, lease_ttl: str, seconds: str) -> None:
    with RunStore.from_url(url) as store:
        print("ready", flush=True)
        tally = await rival(store, session, float(lease_ttl), float(seconds))
    print(json.dumps(tally), flush=True)


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "start":
        asyncio.run(_start(*rest))
    elif command == "rival":
        asyncio.run(_rival(*rest))
    else:
        raise SystemExit(f"unknown command {command!r}")
