"""The ``crashy`` flow, shared by the tests and the child processes they spawn.

One node makes one ``charge`` tool call, then ``end("charged")``. ``charge``
appends ``{run_id, key, pid}`` to a JSON-lines ledger (flushed to disk) and,
in a child built with ``die_in_tool=True``, then SIGKILLs its own process: the
journal keeps the step's intent and never its result.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import Agent, ToolCall, action, define_agent, define_flow, define_tool, end

CRASH_FLOW = "crashy"


class Amount(BaseModel):
    x: int


def read_ledger(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def crash_agent(ledger: Path, *, die_in_tool: bool) -> Agent:
    """The ``crashy`` flow: one node, one ``charge`` tool call, then ``end("charged")``.

    ``charge`` appends ``{run_id, key, pid}`` to ``ledger`` (flushed to disk),
    then, if ``die_in_tool``, SIGKILLs its own process: the intent is already
    journaled, the result never is.
    """

    def charge(args: Amount, call: ToolCall) -> dict[str, Any]:
        line = json.dumps({"run_id": call.run_id, "key": call.idempotency_key, "pid": os.getpid()})
        with ledger.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        if die_in_tool:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"charged": args.x, "pid": os.getpid()}

    async def pay(state: dict[str, Any], ctx: Any) -> Any:
        state["receipt"] = await ctx.tool("charge", {"x": 5})
        return end("charged")

    tool = define_tool("charge", "charge a card", Amount, charge)
    flow = define_flow(CRASH_FLOW, "charge once, even across a crash", "pay", [action("pay", pay)])
    return define_agent("crasher", "crash tests", None, [tool], [flow])
