"""Flows shared by the tests and the child processes they spawn.

Both sides import this one module as ``procs.flows``, so every flow digest and
every schema topic is identical in every process.

A child's behaviour is steered by environment variables, read at call time:

- ``KT_DIE_AT=node``: the ``pay`` node SIGKILLs its own process as it starts.
  In a process that resumes a paused run with a delivery, that is right after
  the delivery was saved and before the tool's intent is journaled.
- ``KT_DIE_AT=tool``: a tool's ``execute`` writes its ``attempt`` line to the
  ledger and then SIGKILLs its own process: the step's intent is journaled,
  its result never is.
- ``KT_AMOUNT``: the amount the ``pay`` node computes *now* (default 100), the
  switch that changes a tool's args between turns.

The ledger is a JSON-lines file: ``{"phase": "attempt" | "done", "tool", "key",
"args", "pid"}`` for every execution that began / completed.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    Agent,
    ToolApprovalDeniedError,
    ToolCall,
    ToolExecutionError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)

APPROVE_FLOW = "approved_transfer"
IN_DOUBT_ASK_FLOW = "in_doubt_ask"
IN_DOUBT_RETRY_FLOW = "in_doubt_retry"
TYPED_SIGNAL_FLOW = "typed_signal"
DEFAULT_AMOUNT = 100


class Transfer(BaseModel):
    amount: int
    to: str


class Charge(BaseModel):
    amount: int


class Address(BaseModel):
    street: str
    zip: str


def maybe_die(where: str) -> None:
    if os.environ.get("KT_DIE_AT") == where:
        os.kill(os.getpid(), signal.SIGKILL)


def current_amount() -> int:
    return int(os.environ.get("KT_AMOUNT", str(DEFAULT_AMOUNT)))


def read_ledger(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _write(ledger: Path, entry: dict[str, Any]) -> None:
    with ledger.open("a") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _executor(ledger: Path, tool: str, result: dict[str, Any]) -> Any:
    def execute(args: BaseModel, call: ToolCall) -> dict[str, Any]:
        entry = {
            "tool": tool,
            "key": call.idempotency_key,
            "args": args.model_dump(mode="json"),
            "pid": os.getpid(),
        }
        _write(ledger, {"phase": "attempt", **entry})
        maybe_die("tool")
        _write(ledger, {"phase": "done", **entry})
        return {**result, **args.model_dump(mode="json")}

    return execute


async def _pay(state: dict[str, Any], ctx: Any) -> Any:
    maybe_die("node")
    try:
        receipt = await ctx.tool("transfer", {"amount": current_amount(), "to": "acct-1"})
    except ToolApprovalDeniedError as e:
        state["denied"] = {"tool_name": e.tool_name, "denied_by": e.denied_by, "reason": e.reason}
        return end("denied")
    state["receipt"] = receipt
    return end("paid")


def _charge_with(tool: str) -> Any:
    async def charge(state: dict[str, Any], ctx: Any) -> Any:
        try:
            state["receipt"] = await ctx.tool(tool, {"amount": 5})
        except ToolExecutionError as e:
            state["failed"] = {
                "type": type(e).__name__,
                "tool_name": e.tool_name,
                "error_type": e.error_type,
                "message": e.message,
            }
            return end("failed")
        return end("charged")

    return charge


async def _address(state: dict[str, Any], ctx: Any) -> Any:
    value = await ctx.signal("address", schema=Address)
    state["is_address"] = isinstance(value, Address)
    state["address"] = value.model_dump()
    return end("addressed")


FLOWS = [
    define_flow(APPROVE_FLOW, "transfer after a human approves", "pay", [action("pay", _pay)]),
    define_flow(
        IN_DOUBT_ASK_FLOW,
        "charge; ask a human if in doubt",
        "charge",
        [action("charge", _charge_with("pay_ask"))],
    ),
    define_flow(
        IN_DOUBT_RETRY_FLOW,
        "charge; retry if in doubt",
        "charge",
        [action("charge", _charge_with("pay_retry"))],
    ),
    define_flow(TYPED_SIGNAL_FLOW, "wait for an address", "wait", [action("wait", _address)]),
]


def make_agent(ledger: Path) -> Agent:
    tools = [
        define_tool(
            "transfer",
            "move money",
            Transfer,
            _executor(ledger, "transfer", {"transferred": True}),
            needs_approval=True,
        ),
        define_tool(
            "pay_ask",
            "charge a card (ask when in doubt)",
            Charge,
            _executor(ledger, "pay_ask", {"charged": True}),
            on_in_doubt="ask",
        ),
        define_tool(
            "pay_retry",
            "charge a card (retry when in doubt)",
            Charge,
            _executor(ledger, "pay_retry", {"charged": True}),
        ),
    ]
    return define_agent("procs", "cross-process tests", None, tools, FLOWS)
