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
from uuid import UUID

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
from kuralle_es._runtime.observability import log_event

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


# ------------------------------------------------------------ replay and traces
def _step_spans(spans: InMemorySpanExporter) -> list[dict[str, Any]]:
    return [
        dict(s.attributes or {}) for s in spans.get_finished_spans() if s.name == "kuralle.step"
    ]


async def test_a_replayed_step_is_marked_replayed_and_an_executed_one_is_not(
    spans: InMemorySpanExporter,
) -> None:
    await paused_then_resumed(make_runtime())
    marked = [(s["kuralle.step.name"], s["kuralle.replayed"]) for s in _step_spans(spans)]
    # Each step is journaled in the turn that made it: none was replayed yet.
    assert marked == [("__approval", False), ("charge", False), ("now", False)]


async def waits_twice(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.now()
    await ctx.signal("first")
    await ctx.signal("second")
    return end("both")


async def resumed_twice() -> str:
    flow = define_flow("twice", "", "go", [action("go", waits_twice)])
    runtime = Runtime([define_agent("waiter", "", None, [], [flow])], store=RunStore.memory())
    run_id = (await runtime.run("s2", kind="flow", flow_name="twice").result()).run_id
    for name in ("first", "second"):
        await runtime.signal(run_id, "s2", name, {"ok": True}, signal_id=name)
    state = await runtime.get_run(run_id, "s2")
    assert state is not None and state.status == "finished"
    return run_id


async def test_a_run_resumed_twice_reports_its_first_step_executed_once(
    spans: InMemorySpanExporter,
) -> None:
    await resumed_twice()
    nows = [s["kuralle.replayed"] for s in _step_spans(spans) if s["kuralle.step.name"] == "now"]
    assert nows == [False, True, True]  # executed in the first turn, replayed in two resumes


async def test_replayed_steps_make_no_span_when_told_to_omit_them(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KURALLE_TRACE_REPLAYED", "omit")
    await resumed_twice()
    steps = _step_spans(spans)
    assert [s["kuralle.step.name"] for s in steps if s["kuralle.step.kind"] == "now"] == ["now"]
    assert not any(s["kuralle.replayed"] for s in steps)
    # Each signal is journaled once and executed once: only those spans are left.
    assert sorted(s["kuralle.step.name"] for s in steps) == ["first", "now", "second"]


async def test_the_turns_of_one_run_share_a_trace_whose_id_is_the_run_id(
    spans: InMemorySpanExporter,
) -> None:
    run_id = await resumed_twice()
    turns = [s for s in spans.get_finished_spans() if s.name == "kuralle.turn"]
    assert len(turns) == 3
    assert {t.context.trace_id for t in turns} == {UUID(run_id).int}
    assert {f"{t.context.trace_id:032x}" for t in turns} == {UUID(run_id).hex}
    # Each turn hangs under the run's own span context (never exported).
    parents = {t.parent.span_id for t in turns if t.parent is not None}
    assert len(parents) == 1 and all(t.parent is not None and t.parent.is_remote for t in turns)
    steps = [s for s in spans.get_finished_spans() if s.name == "kuralle.step"]
    assert {s.context.trace_id for s in steps} == {UUID(run_id).int}


async def test_a_turn_under_a_callers_span_stays_in_its_trace_and_links_to_the_run(
    spans: InMemorySpanExporter,
) -> None:
    runtime = make_runtime()
    with trace.get_tracer("caller").start_as_current_span("http request") as request:
        paused = await runtime.run("s1", kind="flow", flow_name="pay").result()
    [turn] = [s for s in spans.get_finished_spans() if s.name == "kuralle.turn"]
    assert turn.context.trace_id == request.get_span_context().trace_id
    assert turn.parent is not None and turn.parent.span_id == request.get_span_context().span_id
    assert [link.context.trace_id for link in turn.links] == [UUID(paused.run_id).int]
