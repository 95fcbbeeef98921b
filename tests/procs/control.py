"""Execution-control flows, shared by the tests and the child processes they spawn.

Both sides import this one module as ``procs.control`` (a child runs it as
``child.py control ...``), so every flow digest is identical in every process.

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
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    Agent,
    RetryPolicy,
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
