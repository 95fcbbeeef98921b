"""The golden application of generation ``runs_0_4_0``: FROZEN FOR EVER.

These are the tools, flows and the agent that wrote the stored runs of this
folder (``runs.sqlite``, ``runs.pg.sql``) with kuralle_es at commit 2a3455d
(the 0.4 line; its ``pyproject.toml`` still said 0.1.0). Each stored flow run
is pinned to its flow's digest (and version label), and its idempotency keys
hash the model id, tool names, arguments and callsites, so
``tests/test_golden_runs.py`` must resume those runs with exactly these
definitions. Never edit this file (node ids, names, arguments, the order of
the calls, the model's answers: what the stored runs recorded). A new shape
of the app is a new generation in a new folder.

It is generation ``runs_0_3_0``'s app, copied unchanged but for its module
path (so its signal schema's stored topic is this generation's). What is new
is how that code stores runs: a payload whose JSON is 1 KB or more (a
snapshot's steps, the long model answer) is compressed before it is sealed
under its subject's key.

It uses only the public API (``kuralle_es``, ``kuralle_es.events`` and
``kuralle_es.testing``). It is imported as ``golden.runs_0_4_0.app``
(``tests/`` on ``sys.path``), by the generator and by the test alike: the
signal schema ``Shipment`` is stored in the runs under that topic
(``golden.runs_0_4_0.app:Shipment``).

Every tool with an outside effect appends one JSON line to the ledger (the
file set with ``use_ledger(path)``, or named by ``KURALLE_GOLDEN_LEDGER``):
``{"tool", "key", "run_id", "session_id", "args"}``, ``key`` being the call's
idempotency key, so a test can tell how often each effect executed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    Agent,
    Flow,
    ModelRequest,
    ModelResponse,
    RetryPolicy,
    RunContext,
    StepRecord,
    StreamPart,
    Tool,
    ToolCall,
    ToolCallRequest,
    action,
    collect,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
    reply,
)
from kuralle_es.events import (
    RunAborted,
    RunErrored,
    RunEvent,
    RunFinished,
    RunOpened,
    RunPaused,
    RunResumed,
    SignalAccepted,
    StepFailed,
    StepFinished,
    StepStarted,
    ValuePublished,
)
from kuralle_es.testing import ScriptedModel

__all__ = [
    "AGENT_ID",
    "FLOWS",
    "LEDGER_ENV",
    "LONG_VISITS",
    "MODEL_ID",
    "PARCEL_V1",
    "PARCEL_V2",
    "STORY",
    "TOOLS",
    "LedgerEntry",
    "Order",
    "Shipment",
    "build_agents",
    "build_first_deploy",
    "event_signature",
    "ledger_path",
    "part_signature",
    "read_ledger",
    "step_signature",
    "use_ledger",
]

AGENT_ID = "golden"
#: The answer to a user turn that starts with ``tell``: many words, many deltas.
STORY = "Once upon a time a durable run paused, slept, woke in another process and finished."
MODEL_ID = "golden-scripted"
LEDGER_ENV = "KURALLE_GOLDEN_LEDGER"
#: Visits of the ``long`` flow's ``tick`` node (one tool step each): enough events
#: for the store to take a snapshot of the run, its earlier steps archived.
LONG_VISITS = 40

# ------------------------------------------------------------------ ledger
_ledger: Path | None = None

LedgerEntry = dict[str, Any]


def use_ledger(path: str | Path | None) -> None:
    """Where the tools record their effects (None: back to ``KURALLE_GOLDEN_LEDGER``)."""
    global _ledger
    _ledger = None if path is None else Path(path)


def ledger_path() -> Path:
    if _ledger is not None:
        return _ledger
    named = os.environ.get(LEDGER_ENV)
    if not named:
        msg = f"golden app: no ledger; call use_ledger(path) or set {LEDGER_ENV}"
        raise RuntimeError(msg)
    return Path(named)


def read_ledger(path: str | Path | None = None) -> list[LedgerEntry]:
    """Every effect recorded so far, in order."""
    file = Path(path) if path is not None else ledger_path()
    if not file.exists():
        return []
    return [json.loads(line) for line in file.read_text("utf-8").splitlines() if line.strip()]


def _record(call: ToolCall, args: BaseModel) -> None:
    entry = {
        "tool": call.tool_name,
        "key": call.idempotency_key,
        "run_id": call.run_id,
        "session_id": call.session_id,
        "args": args.model_dump(mode="json"),
    }
    with ledger_path().open("a", encoding="utf-8") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")


# ------------------------------------------------------------------- tools
class Cents(BaseModel):
    cents: int


class Topic(BaseModel):
    topic: str


class Tracking(BaseModel):
    tracking: str


class Person(BaseModel):
    name: str
    email: str


class Nothing(BaseModel):
    pass


def _charge(args: Cents, call: ToolCall) -> dict[str, Any]:
    _record(call, args)
    return {"charged": args.cents}


def _quote(args: Cents, call: ToolCall) -> dict[str, Any]:
    _record(call, args)
    return {"quote": args.cents}


def _refund(args: Cents, call: ToolCall) -> dict[str, Any]:
    _record(call, args)
    return {"refunded": args.cents}


def _ship(args: Tracking, call: ToolCall) -> dict[str, Any]:
    _record(call, args)
    return {"shipped": args.tracking}


def _notify(args: Topic, call: ToolCall) -> dict[str, Any]:
    _record(call, args)
    return {"notified": args.topic}


def _register(args: Person, call: ToolCall) -> dict[str, Any]:
    _record(call, args)
    return {"registered": args.email}


def _lookup(args: Topic, call: ToolCall) -> dict[str, Any]:
    _record(call, args)
    return {"found": f"notes on {args.topic}"}


def _expedite(args: Cents, call: ToolCall) -> dict[str, Any]:
    _record(call, args)
    return {"expedited": args.cents}


def _settle(args: Cents, call: ToolCall) -> dict[str, Any]:
    _record(call, args)
    return {"settled": args.cents}


def _capture(args: Cents, call: ToolCall) -> dict[str, Any]:
    """An effect nobody may repeat blindly: a crash after it asks a human."""
    _record(call, args)
    return {"captured": args.cents}


def _explode(args: Nothing, call: ToolCall) -> dict[str, Any]:
    _record(call, args)
    msg = "the golden explode tool always fails"
    raise RuntimeError(msg)


def _double(args: Cents) -> dict[str, Any]:
    """No outside effect: not recorded in the ledger."""
    return {"doubled": args.cents * 2}


def _flaky(args: Cents, call: ToolCall) -> dict[str, Any]:
    """Fails the first time its key executes (the ledger says), then succeeds."""
    earlier = sum(1 for e in read_ledger() if e["key"] == call.idempotency_key)
    _record(call, args)
    if earlier == 0:
        msg = "flaky: first attempt refused"
        raise ConnectionError(msg)
    return {"flaky": args.cents, "attempt": earlier + 1}


TOOLS: list[Tool[Any]] = [
    define_tool("charge", "Charge a card", Cents, _charge),
    define_tool("quote", "Quote a price", Cents, _quote),
    define_tool("refund", "Refund a customer", Cents, _refund, needs_approval=True),
    define_tool("ship", "Ship a parcel", Tracking, _ship),
    define_tool("notify", "Notify someone", Topic, _notify),
    define_tool("register", "Register a person", Person, _register),
    define_tool("lookup", "Look a topic up", Topic, _lookup),
    define_tool("expedite", "Expedite an order", Cents, _expedite),
    define_tool("settle", "Settle a payment", Cents, _settle),
    define_tool("capture", "Capture a payment", Cents, _capture, on_in_doubt="ask"),
    define_tool("explode", "Always fails", Nothing, _explode),
    define_tool("double", "Double a number", Cents, _double),
    define_tool(
        "flaky",
        "Fails once, then works",
        Cents,
        _flaky,
        retry=RetryPolicy(max_attempts=3, initial_interval=0.05),
    ),
]


# ------------------------------------------------------------------- flows
class Shipment(BaseModel):
    """The payload schema of the ``shipped`` signal."""

    tracking: str


class Details(BaseModel):
    name: str | None = None
    email: str | None = None


async def _approval(state: dict[str, Any], ctx: RunContext) -> Any:
    state["ref"] = await ctx.uuid()
    decision = await ctx.approve("Charge 12.00?", description="golden approval")
    state["decided_by"] = decision.by
    if not decision.approved:
        return end("declined")
    state["receipt"] = await ctx.tool("charge", {"cents": 1200})
    return end("charged")


async def _tool_approval(state: dict[str, Any], ctx: RunContext) -> Any:
    state["refund"] = await ctx.tool("refund", {"cents": 4200})
    return end("refunded")


async def _signal(state: dict[str, Any], ctx: RunContext) -> Any:
    state["asked_at"] = (await ctx.now()).isoformat()
    shipment = await ctx.signal("shipped", schema=Shipment)
    state["shipped"] = await ctx.tool("ship", {"tracking": shipment.tracking})
    return end(f"shipped {shipment.tracking}")


async def _nap(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.sleep(2.0)
    state["notified"] = await ctx.tool("notify", {"topic": "woke up"})
    return end("woke")


def _ask(missing: list[str]) -> str:
    return f"Please give: {', '.join(missing)}"


def _details_complete(data: dict[str, Any]) -> Any:
    return goto("register")


async def _register_node(state: dict[str, Any], ctx: RunContext) -> Any:
    state["account"] = await ctx.tool("register", {"name": state["name"], "email": state["email"]})
    return goto("confirm")


async def _checkout(state: dict[str, Any], ctx: RunContext) -> Any:
    state["receipt"] = await ctx.tool("charge", {"cents": 300})
    state["at"] = (await ctx.now()).isoformat()
    state["order_id"] = await ctx.uuid()
    return end("paid")


async def _broken(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.tool("explode", {})
    return end("unreachable")


async def _order(state: dict[str, Any], ctx: RunContext) -> Any:
    quote = await ctx.tool("quote", {"cents": 1500})
    decision = await ctx.approve(f"Charge {quote['quote']}?")
    if not decision.approved:
        return end("declined")
    await ctx.tool("charge", {"cents": quote["quote"]})
    return end("ordered")


async def _settle_node(state: dict[str, Any], ctx: RunContext) -> Any:
    state["settled"] = await ctx.tool("settle", {"cents": 500})
    return end("settled")


async def _expiring(state: dict[str, Any], ctx: RunContext) -> Any:
    decision = await ctx.approve("Expedite?", deadline=1.0)
    if not decision.approved:
        return end(f"declined by {decision.by}")
    await ctx.tool("expedite", {"cents": 900})
    return end("expedited")


async def _retry(state: dict[str, Any], ctx: RunContext) -> Any:
    state["flaky"] = await ctx.tool("flaky", {"cents": 700})
    go = await ctx.signal("continue")
    state["go"] = go
    state["receipt"] = await ctx.tool("charge", {"cents": 700})
    return end("retried")


async def _tick(state: dict[str, Any], ctx: RunContext) -> Any:
    """One visit per tool step: each visit archives the steps of the one before."""
    n = int(state.get("n", 0))
    doubled = (await ctx.tool("double", {"cents": n}))["doubled"]
    total = int(state.get("total", 0)) + doubled
    if n + 1 < LONG_VISITS:
        return goto("tick", {"n": n + 1, "total": total})
    return goto("finish", {"total": total})


async def _finish(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.signal("finish")
    state["receipt"] = await ctx.tool("charge", {"cents": state["total"]})
    return end(f"long total {state['total']}")


async def _capture_node(state: dict[str, Any], ctx: RunContext) -> Any:
    state["captured"] = await ctx.tool("capture", {"cents": 800})
    return end("captured")


async def _batch(state: dict[str, Any], ctx: RunContext) -> Any:
    """Two quotes as one parallel batch (one ``gather``), then a signal, then a charge."""
    low, high = await asyncio.gather(
        ctx.tool("quote", {"cents": 100}), ctx.tool("quote", {"cents": 200})
    )
    state["quotes"] = [low["quote"], high["quote"]]
    await ctx.signal("go")
    state["receipt"] = await ctx.tool("charge", {"cents": low["quote"] + high["quote"]})
    return end("batched")


# ------------------------------------------- new in generation runs_0_3_0
class Order(BaseModel):
    """The typed input of ``dispatch``."""

    sku: str
    qty: int = 1


async def _research(state: dict[str, Any], ctx: RunContext) -> Any:
    """A child flow with typed input (``Topic``): asks a human, then looks up."""
    topic = ctx.input.topic
    decision = await ctx.approve(f"Research {topic}?")
    if not decision.approved:
        return end("skipped")
    found = await ctx.tool("lookup", {"topic": topic})
    return end(found["found"])


async def _survey(state: dict[str, Any], ctx: RunContext) -> Any:
    """Starts a child now, waits for it later; no effect of its own after the wait,
    so the child's approval ends both runs with the child's effect alone."""
    child = await ctx.start_child("research", {"topic": "oolong"})
    state["child"] = child
    notes = await ctx.wait_child(child)
    return end(f"report: {notes}")


async def _dispatch(state: dict[str, Any], ctx: RunContext) -> Any:
    """Typed input (``Order``), read as ``ctx.input`` on every pass."""
    order = ctx.input
    decision = await ctx.approve(f"Ship {order.qty} x {order.sku}?")
    if not decision.approved:
        return end("held")
    await ctx.tool("ship", {"tracking": f"{order.sku}-{order.qty}"})
    return end(f"shipped {order.qty} x {order.sku}")


async def _mailbox(state: dict[str, Any], ctx: RunContext) -> Any:
    item = await ctx.receive("item")
    state["item"] = item
    await ctx.tool("ship", {"tracking": item["sku"]})
    return end(f"received {item['sku']}")


async def _late_mail(state: dict[str, Any], ctx: RunContext) -> Any:
    """An approval first: a message sent meanwhile waits in the mailbox."""
    await ctx.approve("Open the mailbox?")
    item = await ctx.receive("item")
    await ctx.tool("ship", {"tracking": item["sku"]})
    return end(f"received {item['sku']}")


async def _progress(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.publish("progress", {"pct": 10})
    await ctx.publish("payment_url", "https://pay.example/golden")
    ctx.emit({"note": "asked for the charge"})
    decision = await ctx.approve("Charge 9.00?")
    if not decision.approved:
        return end("declined")
    await ctx.tool("charge", {"cents": 900})
    await ctx.publish("progress", {"pct": 100})
    return end("paid")


NEW_FLOWS: list[Flow] = [
    define_flow("research", "approve, then look a topic up", "go", [action("go", _research)],
                input=Topic),
    define_flow("survey", "a child run, waited for later", "go", [action("go", _survey)]),
    define_flow("dispatch", "typed input, approve, ship", "go", [action("go", _dispatch)],
                input=Order),
    define_flow("mailbox", "receive an item, ship it", "go", [action("go", _mailbox)]),
    define_flow("late_mail", "approve, receive, ship", "go", [action("go", _late_mail)]),
    define_flow("progress", "publish, approve, charge, publish", "go", [action("go", _progress)]),
]  # fmt: skip


def _pack(version: str) -> Any:
    async def pack(state: dict[str, Any], ctx: RunContext) -> Any:
        await ctx.tool("quote", {"cents": 800})  # step 0
        decision = await ctx.approve("Send parcel?")  # step 1
        if not decision.approved:
            return end(f"v{version}: held")
        await ctx.tool("ship", {"tracking": "PARCEL-1"})
        return goto("tell") if version == "2" else end(f"v{version}: sent")

    return pack


async def _tell(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.tool("notify", {"topic": "parcel sent"})
    return end("v2: sent")


#: The first deploy of ``parcel``: quote, approve, ship.
PARCEL_V1 = define_flow(
    "parcel", "quote, approve, ship", "pack", [action("pack", _pack("1"))], version="1"
)
#: The second: the same, then a node of its own that notifies (so its digest differs).
PARCEL_V2 = define_flow(
    "parcel",
    "quote, approve, ship, notify",
    "pack",
    [action("pack", _pack("2")), action("tell", _tell)],
    version="2",
)

FLOWS: list[Flow] = [
    define_flow("approval", "approve, then charge", "decide", [action("decide", _approval)]),
    define_flow(
        "tool_approval",
        "a refund that needs approval",
        "refund",
        [action("refund", _tool_approval)],
    ),
    define_flow("signal", "wait for the carrier, then ship", "wait", [action("wait", _signal)]),
    define_flow("nap", "sleep durably, then notify", "nap", [action("nap", _nap)]),
    define_flow(
        "intake",
        "collect name and email, register, confirm",
        "details",
        [
            collect("details", Details, ["name", "email"], ask=_ask, on_complete=_details_complete),
            action("register", _register_node),
            reply("confirm", "Confirm the registration.", end("registered")),
        ],
    ),
    define_flow(
        "checkout", "charge, read the clock, mint an id", "pay", [action("pay", _checkout)]
    ),
    define_flow("broken", "a tool that fails", "boom", [action("boom", _broken)]),
    define_flow("order", "quote, approve, charge", "order", [action("order", _order)]),
    define_flow("settle", "settle a payment", "settle", [action("settle", _settle_node)]),
    define_flow("expiring", "an approval with a short deadline", "ask", [action("ask", _expiring)]),
    define_flow("retry", "a retried tool, a signal, a charge", "work", [action("work", _retry)]),
    define_flow(
        "long",
        "enough node visits for a snapshot, a signal, a charge",
        "tick",
        [action("tick", _tick), action("finish", _finish)],
    ),
    define_flow("capture", "capture a payment", "capture", [action("capture", _capture_node)]),
    define_flow(
        "batch", "two quotes at once, a signal, a charge", "batch", [action("batch", _batch)]
    ),
    PARCEL_V1,
    PARCEL_V2,
    *NEW_FLOWS,
]


# ------------------------------------------------------------------- model
def golden_model(request: ModelRequest) -> ModelResponse | str:
    """Extraction: ``field=value`` pairs the user wrote. A conversation turn: look
    the user's last message up (or refund ``refund <cents>``), then answer; a turn
    starting ``tell``: ``STORY`` at once, no tool. A reply node: its instructions."""
    if request.purpose == "extract":
        said = " ".join(m.content or "" for m in request.messages if m.role == "user")
        return ModelResponse(data=dict(re.findall(r"(\w+)=(\S+)", said)))
    if request.purpose == "reply":
        return f"[{request.instructions}]"
    turns = sum(1 for m in request.messages if m.role == "user")
    last = request.messages[-1]
    if last.role == "user":
        said = last.content or ""
        if said.startswith("tell "):  # no tool: a long answer, streamed word by word
            return STORY
        if said.startswith("refund "):  # a tool that needs approval: the turn pauses
            cents = int(said.split()[1])
            call = ToolCallRequest(f"refund-{turns}", "refund", {"cents": cents})
        else:
            call = ToolCallRequest(f"lookup-{turns}", "lookup", {"topic": said})
        return ModelResponse(tool_calls=[call])
    return f"answered turn {turns}"


def build_agents() -> list[Agent]:
    """The golden agent (new instances each call): its model, every tool, every flow
    (both versions of ``parcel``)."""
    model = ScriptedModel(golden_model, id=MODEL_ID)
    return [define_agent(AGENT_ID, "The golden agent.", model, TOOLS, FLOWS)]


def build_first_deploy() -> list[Agent]:
    """The golden agent as first deployed: ``parcel`` in version 1 only, so the runs
    it starts pin version 1 (a runtime with both starts new runs on the newest)."""
    model = ScriptedModel(golden_model, id=MODEL_ID)
    flows = [flow for flow in FLOWS if flow is not PARCEL_V2]
    return [define_agent(AGENT_ID, "The golden agent.", model, TOOLS, flows)]


# ----------------------------------------------------- golden signatures
# How the manifest pins a run's journal and its public events in a few words.
# Frozen too: the manifest holds their output for the stored runs.
def step_signature(step: StepRecord) -> str:
    """``kind name status xattempts`` of a journal step."""
    return f"{step.kind} {step.name} {step.status} x{step.attempts}"


def event_signature(event: RunEvent) -> str:
    """The type of a public run event and the fields that say what happened."""
    words: list[str] = [event.type]
    if isinstance(event, RunOpened):
        words += [event.kind, str(event.flow)]
    elif isinstance(event, StepStarted):
        words += [str(event.index), event.kind, event.name, f"attempt={event.attempt}"]
    elif isinstance(event, StepFinished):
        words += [str(event.index), event.name]
    elif isinstance(event, StepFailed):
        words += [str(event.index), event.name, event.error.type, f"final={event.final}"]
    elif isinstance(event, RunPaused):
        words += [event.waiting_for.kind, event.waiting_for.name]
    elif isinstance(event, ValuePublished):
        words += [str(event.index), event.key]
    elif isinstance(event, SignalAccepted):
        words += [event.name, f"actor={event.actor}"]
    elif isinstance(event, RunResumed):
        words += [event.reason]
    elif isinstance(event, RunFinished | RunAborted):
        words += [str(event.outcome)]
    elif isinstance(event, RunErrored):
        words += [event.error.type]
    return " ".join(words)


def part_signature(part: StreamPart) -> str:
    """``offset type`` of a stored stream part, its step and attempt, and what it
    carries in words (a delta's or a text's JSON, a tool's name, a custom part's
    data; ``null`` where an erased subject's payload was)."""
    words = [str(part.offset), part.type]
    if part.step is not None:
        words += [f"step={part.step}", f"attempt={part.attempt}"]
    if part.type == "text-delta":
        words.append(json.dumps(part.delta))
    elif part.type == "text":
        words.append(json.dumps(part.text))
    elif part.type == "custom":
        words.append(json.dumps(part.data, sort_keys=True))
    elif part.tool_name is not None:
        words.append(part.tool_name)
    return " ".join(words)
