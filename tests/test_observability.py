"""What an operator sees of a run: log lines under ``kuralle_es``, OpenTelemetry spans.

A paused and resumed run logs one line per turn opened and closed, naming the
wait and the delivery's signal and actor, never a payload unless
``KURALLE_LOG_PAYLOADS=1``; each turn is a ``kuralle.turn`` span with the run
id and its final status, and each step a ``kuralle.step`` span with its kind.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

from kuralle_es import (
    RunContext,
    RunStore,
    Runtime,
    SignalDelivery,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es.observability import log_event

SECRET = "card-4242-4242"

_exporter = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def tracer_provider() -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_exporter))
    trace.set_tracer_provider(provider)  # once per process; later calls are ignored


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    _exporter.clear()
    yield _exporter


class Card(BaseModel):
    number: str


async def pay(state: dict[str, Any], ctx: RunContext) -> Any:
    decision = await ctx.approve("Charge the card?")
    if not decision.approved:
        return end("declined")
    await ctx.tool("charge", {"number": SECRET})
    await ctx.now()
    return end("charged")


def make_runtime() -> Runtime:
    charge = define_tool("charge", "", Card, lambda args: {"charged": args.number})
    flow = define_flow("pay", "", "pay", [action("pay", pay)])
    return Runtime([define_agent("payer", "", None, [charge], [flow])], store=RunStore.memory())


async def paused_then_resumed(runtime: Runtime) -> str:
    paused = await runtime.run("s1", kind="flow", flow_name="pay").result()
    approval = SignalDelivery(
        signal_id="hook-1",
        name="__approval",
        payload={"approved": True, "by": "ann", "reason": SECRET},
        actor="ann",
    )
    done = await runtime.run("s1", run_id=paused.run_id, signal_delivery=approval).result()
    assert done.status == "finished"
    return paused.run_id


async def test_a_paused_and_resumed_run_logs_each_turn_without_payloads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kuralle_es")
    run_id = await paused_then_resumed(make_runtime())
    lines = [r.getMessage() for r in caplog.records if r.name == "kuralle_es"]
    assert [line.split(" run=")[0] for line in lines] == [
        "turn opened",
        "turn closed",
        "turn opened",
        "turn closed",
    ]
    assert all(f"run={run_id}" in line for line in lines)
    assert "command=StartFlow" in lines[0]
    assert "status=paused" in lines[1] and "waiting_for=__approval" in lines[1]
    assert "command=Deliver" in lines[2] and "signal=__approval" in lines[2]
    assert "actor=ann" in lines[2]
    assert "status=finished" in lines[3] and "outcome=charged" in lines[3]
    assert not any(SECRET in line for line in lines)
    structured = [r.kuralle for r in caplog.records if hasattr(r, "kuralle")]
    assert structured[1]["status"] == "paused" and structured[1]["run_id"] == run_id


def test_payloads_are_logged_only_when_asked(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="kuralle_es")
    log_event("delivery", "r1", payload={"card": SECRET}, signal="pay")
    monkeypatch.setenv("KURALLE_LOG_PAYLOADS", "1")
    log_event("delivery", "r1", payload={"card": SECRET}, signal="pay")
    first, second = (r.getMessage() for r in caplog.records)
    assert SECRET not in first and "signal=pay" in first
    assert SECRET in second


async def test_each_turn_is_a_span_with_its_run_id_and_status(
    spans: InMemorySpanExporter,
) -> None:
    run_id = await paused_then_resumed(make_runtime())
    turns = [s for s in spans.get_finished_spans() if s.name == "kuralle.turn"]
    assert [dict(s.attributes or {}).get("kuralle.status") for s in turns] == [
        "paused",
        "finished",
    ]
    for turn in turns:
        attributes = dict(turn.attributes or {})
        assert attributes["kuralle.run_id"] == run_id
        assert attributes["kuralle.session_id"] == "s1"
    assert [dict(s.attributes or {})["kuralle.command"] for s in turns] == [
        "StartFlow",
        "Deliver",
    ]


async def test_each_step_is_a_span_with_its_kind_name_and_how_it_ended(
    spans: InMemorySpanExporter,
) -> None:
    run_id = await paused_then_resumed(make_runtime())
    finished = spans.get_finished_spans()
    steps = [dict(s.attributes or {}) for s in finished if s.name == "kuralle.step"]
    assert all(step["kuralle.run_id"] == run_id for step in steps)
    seen = [(s["kuralle.step.kind"], s["kuralle.step.name"], s["kuralle.status"]) for s in steps]
    # The delivery journals the approval; the re-run node replays it, then
    # charges and reads the clock.
    assert seen == [
        ("approval", "__approval", "finished"),
        ("tool", "charge", "finished"),
        ("now", "now", "finished"),
    ]
    turns = [s for s in spans.get_finished_spans() if s.name == "kuralle.turn"]
    resumed = turns[-1].context.span_id
    assert all(
        s.parent is not None and s.parent.span_id == resumed
        for s in spans.get_finished_spans()
        if s.name == "kuralle.step"
    )
