"""A Pydantic AI agent for the tests that decide its runs from another process:
``--app pai_app:AGENTS`` (from ``tests/procs``) or ``procs.pai_app:AGENTS``.

``shop`` looks an order up, then asks to refund it with ``refund_order``, a
tool that needs approval; it appends one line per execution to the JSON-lines
file named by ``PAI_LEDGER`` (``{"order_id", "cents", "pid"}``), so a test sees
in which process, and how often, the refund ran.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from kuralle_es.integrations.pydantic_ai import definition

LEDGER_ENV = "PAI_LEDGER"


def ledger(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line]


def shop_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    returns = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
    if not returns:
        return ModelResponse(parts=[ToolCallPart("lookup_order", {"order_id": "A1"})])
    if returns[0].tool_name == "lookup_order":
        refund = {"order_id": "A1", "cents": returns[0].content["total_cents"]}
        return ModelResponse(parts=[ToolCallPart("refund_order", refund)])
    return ModelResponse(parts=[TextPart(f"Done: {returns[0].content}")])


def build_agent() -> Agent[None, str]:
    agent: Agent[None, str] = Agent(FunctionModel(shop_model), name="shop")

    @agent.tool_plain
    def lookup_order(order_id: str) -> dict[str, Any]:
        """Find an order."""
        return {"order_id": order_id, "total_cents": 4250}

    @agent.tool_plain(requires_approval=True)
    def refund_order(order_id: str, cents: int) -> str:
        """Refund an order."""
        entry = {"order_id": order_id, "cents": cents, "pid": os.getpid()}
        with Path(os.environ[LEDGER_ENV]).open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        return f"refunded {cents} cents on {order_id}"

    return agent


AGENTS = [definition(build_agent())]
