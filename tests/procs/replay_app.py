"""The app of the replay tests: a refund flow and a support chat, in two model versions.

``refund`` collects an amount (the model extracts it from what the customer
wrote, asking again while it is missing), asks a supervisor, sleeps an hour,
reads the clock and charges exactly that amount. ``support`` is a chat whose
model calls ``charge`` with the amount the customer names, then replies.
Version 1's model (``extractor-v1``) reads amounts right; version 2's
(``extractor-v2``), cheaper, reads amounts above 5000 cents as dollars (a
hundredth of them), so on those runs it would charge another amount. Both
answer from the request alone (``answer``), so any process replays them.

Each charge appends a line to the file named by ``KURALLE_REPLAY_LEDGER``
(when set) and counts in ``CHARGES``, so a test sees every execution, in
this process or another. As ``--app procs.replay_app:v1`` / ``v2``.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    Agent,
    ModelRequest,
    ModelResponse,
    ToolCallRequest,
    action,
    collect,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
)

LEDGER_ENV = "KURALLE_REPLAY_LEDGER"
PRICES = {"extractor-v1": (1.0, 2.0), "extractor-v2": (0.5, 1.0)}
#: Every charge executed in this process, as (amount, idempotency key).
CHARGES: list[tuple[int, str]] = []


class Amount(BaseModel):
    amount_cents: int | None = None


class Charge(BaseModel):
    amount_cents: int


def charge(args: Charge, call: Any) -> dict[str, int]:
    CHARGES.append((args.amount_cents, call.idempotency_key))
    ledger = os.environ.get(LEDGER_ENV)
    if ledger:
        with open(ledger, "a", encoding="utf-8") as out:
            out.write(f"{args.amount_cents} {call.idempotency_key}\n")
    return {"charged": args.amount_cents}


def _amount(request: ModelRequest, version: int) -> int | None:
    said = [m.content or "" for m in request.messages if m.role == "user"]
    numbers = re.findall(r"\d+", " ".join(said))
    if not numbers:
        return None
    cents = int(numbers[-1])
    return cents // 100 if version == 2 and cents > 5000 else cents


def answer(version: int) -> Any:
    """The model of a version: a function of the request alone."""
    tokens = (100, 10) if version == 1 else (80, 8)
    usage = {"input_tokens": tokens[0], "output_tokens": tokens[1]}

    def respond(request: ModelRequest) -> ModelResponse:
        amount = _amount(request, version)
        if request.purpose == "extract":
            return ModelResponse(data={"amount_cents": amount}, usage=usage)
        if request.messages[-1].role == "tool":
            return ModelResponse(content="Done: refunded.", usage=usage)
        call = ToolCallRequest(id="call-1", name="charge", args={"amount_cents": amount})
        return ModelResponse(tool_calls=[call], usage=usage)

    return respond


class Extractor:
    """A model of a version, counting what it was asked."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.asked = 0
        self._respond = answer(version)

    @property
    def id(self) -> str:
        return f"extractor-v{self.version}"

    async def respond(self, request: ModelRequest) -> ModelResponse:
        self.asked += 1
        response: ModelResponse = self._respond(request)
        return response


async def pay(state: dict[str, Any], ctx: Any) -> Any:
    amount = state["amount_cents"]
    decision = await ctx.approve(f"Refund {amount} cents?", deadline=timedelta(hours=24))
    if not decision.approved:
        return end(f"declined by {decision.by}")
    await ctx.sleep(timedelta(hours=1))
    await ctx.now()
    await ctx.tool("charge", {"amount_cents": amount})
    return end(f"refunded {amount}")


def agents(model: Any, *, instructions: str = "You refund customers.") -> list[Agent]:
    refund = define_flow(
        "refund",
        "collect an amount, ask, wait an hour, charge it",
        "amount",
        [
            collect(
                "amount",
                Amount,
                ["amount_cents"],
                lambda missing: "How much, in cents?",
                lambda data: goto("pay"),
            ),
            action("pay", pay),
        ],
    )
    tools = [define_tool("charge", "Refund a customer", Charge, charge)]
    return [define_agent("support", instructions, model, tools, [refund])]


def v1() -> list[Agent]:
    return agents(Extractor(1))


def v2() -> list[Agent]:
    return agents(Extractor(2))
