"""Execution-control flows, shared by the tests and the child processes they spawn.

    control.py BACKEND TARGET LEDGER SESSION start FLOW
    control.py BACKEND TARGET LEDGER SESSION resume RUN_ID

prints ``{"opened": run_id}`` as soon as the run is opened, then one JSON line:
the turn's result, or ``{"error": {...}}`` (exit 2) when the turn raised.
``KT_LEASE_TTL`` (default 0.5 s) is the child's lease.

- ``always_failing``: one node calls ``flaky`` (``RetryPolicy(max_attempts=3,
  initial_interval=KT_INTERVAL, backoff=1)``), which writes an ``attempt`` line
  to the ledger and raises ``ConnectionError`` every time.
- ``slow_then_after``: one node calls ``slow`` (writes ``slow-start``, sleeps
  ``KT_SLOW`` seconds, writes ``slow-done``) and then ``after`` (writes ``after``).

Ledger lines: ``{"tool", "key", "attempt", "pid", "at"}`` (``at``: wall-clock seconds).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    Agent,
    RetryPolicy,
    RunStore,
    Runtime,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)

ALWAYS_FAILING = "always_failing"
SLOW_THEN_AFTER = "slow_then_after"
MAX_ATTEMPTS = 3


class Empty(BaseModel):
    pass


def read_ledger(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _write(ledger: Path, tool: str, call: ToolCall, **extra: Any) -> None:
    entry = {
        "tool": tool,
        "key": call.idempotency_key,
        "pid": os.getpid(),
        "at": time.time(),
        **extra,
    }
    with ledger.open("a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def make_agent(ledger: Path) -> Agent:
    def flaky(args: Empty, call: ToolCall) -> Any:
        _write(ledger, "flaky", call)
        raise ConnectionError("the service is down")

    async def slow(args: Empty, call: ToolCall) -> Any:
        _write(ledger, "slow-start", call)
        await asyncio.sleep(float(os.environ.get("KT_SLOW", "2.0")))
        _write(ledger, "slow-done", call)
        return {"slow": True}

    def after(args: Empty, call: ToolCall) -> Any:
        _write(ledger, "after", call)
        return {"after": True}

    async def call_flaky(state: dict[str, Any], ctx: Any) -> Any:
        state["result"] = await ctx.tool("flaky", {})
        return end("done")

    async def slow_then_after(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("slow", {})
        await ctx.tool("after", {})
        return end("done")

    policy = RetryPolicy(
        max_attempts=MAX_ATTEMPTS,
        initial_interval=float(os.environ.get("KT_INTERVAL", "0.01")),
        backoff=1.0,
    )
    tools = [
        define_tool("flaky", "always fails", Empty, flaky, retry=policy),
        define_tool("slow", "takes a while", Empty, slow),
        define_tool("after", "runs after slow", Empty, after),
    ]
    flows = [
        define_flow(ALWAYS_FAILING, "retry a failing tool", "call", [action("call", call_flaky)]),
        define_flow(SLOW_THEN_AFTER, "slow, then after", "go", [action("go", slow_then_after)]),
    ]
    return define_agent("control", "execution control tests", None, tools, flows)


def spawn(
    backend: str, target: str, ledger: Path, session: str, *args: str, **env: str
) -> subprocess.Popen[str]:
    """Start a child running this module (its stdout piped, ``KT_*`` from ``env`` only)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KT_")}
    child_env.update(env)
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), backend, target, str(ledger), session,
         *args],
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


async def opened(child: subprocess.Popen[str]) -> str:
    """The id of the run a ``start`` child opened (its first line)."""
    assert child.stdout is not None
    return str(json.loads(await asyncio.to_thread(child.stdout.readline))["opened"])


async def until(check: Callable[[], bool], what: str) -> None:
    """Poll ``check`` until it holds (30 s at most)."""
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


def _store(backend: str, target: str) -> RunStore:
    return RunStore.sqlite(target) if backend == "sqlite" else RunStore.postgres(target)


async def _main(
    backend: str, target: str, ledger: str, session: str, command: str, arg: str
) -> int:
    store = _store(backend, target)
    runtime = Runtime(
        [make_agent(Path(ledger))],
        store=store,
        lease_ttl=float(os.environ.get("KT_LEASE_TTL", "0.5")),
    )
    try:
        if command == "start":
            handle = runtime.run(session, input="go", kind="flow", flow_name=arg)
            print(json.dumps({"opened": await handle.run_id}), flush=True)
        else:
            handle = runtime.run(session, run_id=arg)
        try:
            result = await handle.result()
        except Exception as e:
            print(json.dumps({"error": {"type": type(e).__name__, "message": str(e)}}), flush=True)
            return 2
        print(json.dumps(result.model_dump(mode="json")), flush=True)
        return 0
    finally:
        store.close()


if __name__ == "__main__":
    # The flows come from ``procs.control``, as in the parent, so every digest matches.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from procs.control import _main as main

    sys.exit(asyncio.run(main(*sys.argv[1:])))
