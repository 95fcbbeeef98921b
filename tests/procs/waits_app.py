"""The app of the every-wait tests: one flow per kind of wait a run can pause on
(``--app waits_app:build_agents``, importable from this folder; docs/operators.md).

Each flow ends with what answered its wait:

- ``asks``: an approval (``ctx.approve``);
- ``waits``: the signal ``go`` (``ctx.signal``);
- ``intake``: a ``collect`` node's input (the amount);
- ``captures``: the ``capture`` tool, ``on_in_doubt="ask"``; each execution writes a
  JSON line to ``WAITS_LEDGER``. ``build_agents(crash=True)`` makes its first
  execution die after writing (``testing.Crash``: the process stopped mid-call),
  so the run's next turn pauses on ``__in_doubt``;
- ``spends``: two ``reply`` model turns; started with ``Budget(max_model_calls=1)``
  it pauses on ``__budget`` before the second;
- ``receives``: publishes its progress, then takes a message ``item`` (``ctx.receive``);
- ``household``: a child run of ``asks`` (``ctx.child``), so the parent waits for the
  child and the child for an approval;
- ``rests``: a durable sleep of ``WAITS_SLEEP`` seconds (default 0.3) under
  ``inline_sleep_limit=0``.

``start_every_wait(runtime, prefix)`` starts one run of each, each in its own session,
and returns their ids by the kind of wait.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    Agent,
    Budget,
    ModelRequest,
    ModelResponse,
    RunContext,
    Runtime,
    SuspendError,
    ToolCall,
    ToolExecutionError,
    action,
    collect,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
    reply,
)
from kuralle_es.testing import Crash, ScriptedModel

LEDGER_ENV = "WAITS_LEDGER"
SLEEP_ENV = "WAITS_SLEEP"
#: The kinds of wait, as docs/operators.md names them, and the flow that makes each.
FLOWS = {
    "input": "intake",
    "approval": "asks",
    "signal": "waits",
    "in-doubt": "captures",
    "budget": "spends",
    "message": "receives",
    "child": "household",
    "timer": "rests",
}


class Empty(BaseModel):
    pass


class Amount(BaseModel):
    amount: float | None = None


def ledger(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _capture_tool(crash: bool) -> Any:
    dies = [crash]

    def capture(args: Empty, call: ToolCall) -> dict[str, Any]:
        with Path(os.environ[LEDGER_ENV]).open("a", encoding="utf-8") as f:
            f.write(json.dumps({"run": call.run_id, "key": call.idempotency_key}) + "\n")
        if dies[0]:
            dies[0] = False
            raise Crash("the process dies inside capture, after it captured")
        return {"captured": True}

    return define_tool("capture", "capture a payment", Empty, capture, on_in_doubt="ask")


async def asks(state: dict[str, Any], ctx: RunContext) -> Any:
    decision = await ctx.approve("Ship the parcel?")
    return end(f"approved by {decision.by}" if decision.approved else "denied")


async def waits(state: dict[str, Any], ctx: RunContext) -> Any:
    return end(f"went {json.dumps(await ctx.signal('go'))}")


async def captures(state: dict[str, Any], ctx: RunContext) -> Any:
    try:
        receipt = await ctx.tool("capture", {})
    except SuspendError:
        raise
    except ToolExecutionError as e:
        return end(f"failed: {e.message}")
    return end(f"captured {json.dumps(receipt)}")


async def receives(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.publish("progress", {"step": "waiting for the item"})
    item = await ctx.receive("item")
    return end(f"got {json.dumps(item)}")


async def household(state: dict[str, Any], ctx: RunContext) -> Any:
    return end(f"the child says: {await ctx.child('asks')}")


async def rests(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.sleep(float(os.environ.get(SLEEP_ENV, "0.3")))
    return end("rested")


def _model(request: ModelRequest) -> ModelResponse:
    if request.purpose == "extract":
        said = " ".join(m.content or "" for m in request.messages if m.role == "user")
        number = re.search(r"\d+(?:\.\d+)?", said)
        return ModelResponse(data={"amount": float(number[0])} if number else {})
    usage = {"input_tokens": 40, "output_tokens": 20, "total_tokens": 60}
    return ModelResponse(content="ok", usage=usage)


def build_agents(crash: bool = False) -> list[Agent]:
    amount = collect(
        "amount",
        Amount,
        ["amount"],
        lambda missing: "How much, in dollars?",
        lambda data: end(f"amount {data['amount']}"),
    )
    flows = [
        define_flow("intake", "asks for an amount", "amount", [amount]),
        define_flow("asks", "an approval", "go", [action("go", asks)]),
        define_flow("waits", "the signal go", "go", [action("go", waits)]),
        define_flow("captures", "a call that may be in doubt", "go", [action("go", captures)]),
        define_flow(
            "spends",
            "two model turns",
            "first",
            [
                reply("first", "Say hello.", goto("second")),
                reply("second", "Say more.", end("said")),
            ],
        ),
        define_flow("receives", "a message", "go", [action("go", receives)]),
        define_flow("household", "a child run", "go", [action("go", household)]),
        define_flow("rests", "a durable sleep", "go", [action("go", rests)]),
    ]
    model = ScriptedModel(_model, id="waits-model")
    return [define_agent("waiter", "waits", model, [_capture_tool(crash)], flows)]


async def start_every_wait(runtime: Runtime, prefix: str) -> dict[str, str]:
    """One run paused on each kind of wait (``runtime`` built from ``build_agents(crash=True)``
    with ``inline_sleep_limit=0``), each in session ``<prefix>-<kind>``: run ids by kind."""
    started: dict[str, str] = {}
    for kind, flow in FLOWS.items():
        session = f"{prefix}-{kind}"
        budget = Budget(max_model_calls=1) if kind == "budget" else None
        handle = runtime.run(session, kind="flow", flow_name=flow, budget=budget)
        started[kind] = await handle.run_id
        try:
            await handle.result()
        except Crash:  # the in-doubt run: its next turn asks what to do
            await runtime.run(session, run_id=started[kind]).result()
    return started
