"""A flight booking agent on Pydantic AI that delegates the search to another agent.

    python -m kuralle_es.examples.booking_agent [--store URL] TEXT

``booking`` talks to the traveller. Its ``find_flight`` tool delegates to the
``flight_search`` agent with ``delegate(...).run``: that agent's turn is a
child run of the booking's run, its model requests and tool calls journaled
one by one there. The search holds the fare, the booking buys the ticket,
each once per key at the airline (``outside.Ledger``, the agents' deps).
Offline the models are scripted; ``KURALLE_MODEL=openai:gpt-4o-mini`` uses a
real one. A worker that dies is recovered by ``kuralle-es worker --app
kuralle_es.examples.booking_agent:AGENTS``. See docs/examples.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from typing import Any

from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import Model
from pydantic_ai.models.function import AgentInfo, FunctionModel

from kuralle_es import RunStore, Runtime
from kuralle_es.examples.outside import Ledger
from kuralle_es.integrations.pydantic_ai import definition, delegate, durable, tool_call


class Flight(BaseModel):
    number: str
    origin: str
    destination: str
    cents: int


FLIGHTS = [
    Flight(number="AK456", origin="SFO", destination="ANC", cents=32000),
    Flight(number="AK460", origin="SFO", destination="ANC", cents=29500),
    Flight(number="NZ14", origin="SFO", destination="AKL", cents=98000),
]


def _route(messages: list[ModelMessage]) -> dict[str, str]:
    said = [p.content for m in messages for p in m.parts if isinstance(p, UserPromptPart)]
    origin, destination = re.findall(r"\b[A-Z]{3}\b", str(said[-1]))[:2]
    return {"origin": origin, "destination": destination}


def _returned(messages: list[ModelMessage]) -> tuple[str | None, Any]:
    """The tool that answered last, and what it returned (None, None at first)."""
    done = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
    return (done[0].tool_name, done[0].content) if done else (None, None)


def search_script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The offline search model: list the route's flights, hold the cheapest, answer."""
    tool, content = _returned(messages)
    if tool is None:
        return ModelResponse(parts=[ToolCallPart("list_flights", _route(messages))])
    if tool == "list_flights":
        cheapest = min(content, key=lambda flight: flight["cents"])
        return ModelResponse(parts=[ToolCallPart("hold_fare", {"number": cheapest["number"]})])
    return ModelResponse(parts=[ToolCallPart(info.output_tools[0].name, content)])


def booking_script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The offline booking model: find the flight, buy its ticket, confirm."""
    tool, content = _returned(messages)
    if tool is None:
        return ModelResponse(parts=[ToolCallPart("find_flight", _route(messages))])
    if tool == "find_flight":
        flight = {"number": content["number"], "cents": content["cents"]}
        return ModelResponse(parts=[ToolCallPart("buy_ticket", flight)])
    booked = f"Booked {content['number']}: ticket {content['ticket']}."
    return ModelResponse(parts=[TextPart(booked)])


def pick_model(script: Any) -> Model | str:
    """``KURALLE_MODEL=openai:<model>`` for a real model, else the scripted one."""
    name = os.environ.get("KURALLE_MODEL", "scripted")
    return name if name.startswith("openai:") else FunctionModel(script)


search_agent = Agent(
    pick_model(search_script), name="flight_search", deps_type=Ledger, output_type=Flight,
    instructions="Find the cheapest flight of the route, hold its fare, answer with it.",
)  # fmt: skip
booking_agent = Agent(
    pick_model(booking_script), name="booking", deps_type=Ledger,
    instructions="Book the traveller's flight: find the cheapest, then buy its ticket.",
)  # fmt: skip


def _key() -> str:
    """The journaled call's idempotency key, which the airline keeps one effect per."""
    call = tool_call()
    assert call is not None, "called by a durable agent's tool"
    return call.idempotency_key


@search_agent.tool_plain
def list_flights(origin: str, destination: str) -> list[Flight]:
    """The flights of a route."""
    return [f for f in FLIGHTS if (f.origin, f.destination) == (origin, destination)]


@search_agent.tool
def hold_fare(ctx: RunContext[Ledger], number: str) -> Flight:
    """Hold a flight's fare while the traveller books."""
    flight = next(f for f in FLIGHTS if f.number == number)
    ctx.deps.record(_key(), "airline", "hold_fare", flight.model_dump())
    return flight


@booking_agent.tool(sequential=True)
async def find_flight(ctx: RunContext[Ledger], origin: str, destination: str) -> Flight:
    """Find the cheapest flight of a route, its fare held."""
    found = await delegate(search_agent).run(f"From {origin} to {destination}", deps=ctx.deps)
    flight: Flight = found.output
    return flight


@booking_agent.tool
def buy_ticket(ctx: RunContext[Ledger], number: str, cents: int) -> dict[str, Any]:
    """Buy the ticket of a held fare."""
    key = _key()
    ticket = {"number": number, "cents": cents, "ticket": f"T-{key[:8]}"}
    return ctx.deps.record(key, "airline", "buy_ticket", ticket)


AGENTS = [definition(booking_agent, deps=Ledger()), definition(search_agent, deps=Ledger())]


async def main(store_url: str, text: str) -> None:
    with RunStore.from_url(store_url) as store:
        booking = durable(booking_agent, Runtime(AGENTS, store=store))
        result = await booking.run(text, session_id="traveller-1", deps=Ledger())
        print(result.run_id, result.status, result.output)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="sqlite:///bookings.db")
    parser.add_argument("text")
    args = parser.parse_args()
    asyncio.run(main(args.store, args.text))
