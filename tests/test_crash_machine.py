"""Exactly-once effects under a crash at every journal boundary: a Hypothesis state machine.

The machine is a small world: users start *programs* (random effects spread
over the two action nodes of one flow, with an optional ``reply`` node — one
model turn — between them), a worker process is *killed* at a chosen journal
boundary, and a restarted worker with the same holder *re-enters* the run,
again and again, until it finishes. Every program also has a crash-free
*reference* run on a store of its own.

A program's effects: tool calls with small JSON args (``charge``/``echo``
deterministic, ``mint`` a fresh token, ``reject`` always fails: a frozen
error, ``pay`` with an ``idempotency_key`` override, ``flaky`` that fails a
given number of times under a ``RetryPolicy``, ``sluggish`` that overruns its
``timeout`` on a given number of attempts), ``now``, ``uuid``, a durable
``sleep`` short enough to run inline, ``asyncio.gather`` batches, approvals
(``ctx.approve``; the machine approves or denies, through ``runtime.approve``
/ ``deny`` or a raw ``SignalDelivery``) and signals (``ctx.signal``; the
machine delivers the program's payload).

Crashes are honest. Nothing of ``kuralle_es`` is mocked; the failing disk is
the public testing kit's ``CrashingStore`` (``kuralle_es.testing``): per its
``CrashPlan`` a save dies before it is written (``before_intent``), after a
step's intent is written (``after_intent``), just before a step's result is
written (``after_execute``) or after it (``after_finalize``). The tools also
reach ``after_execute`` themselves, right after their effect reached the
external ledger. ``Crash`` is a ``BaseException``, so the turn dies without
closing: the run stays ``running`` under the worker's lease, as after
``SIGKILL``. Re-entry is a NEW ``Runtime`` with the SAME holder (a lease is
re-entrant for its holder); on SQLite and PostgreSQL every turn opens a NEW
store over the database, so what a re-entry sees is what was durable. A
delivery can be killed too: then it was either durable (the run goes on) or
not (the run still waits, on the same wait).

Invariants (one guarantee each):

- the journal never has two steps, finished or not, with one key;
- every execution the ledger saw followed a durable intent (first attempt,
  retry or re-execution), under the key the journal recorded for that
  callsite: the retried attempts of a tool all carry its one key;
- a tool executes again only after a failed attempt its policy retries, or
  after a crash could have left it in doubt (or any crash while a gather
  batch was in flight);
- every value a node ever saw (tool results, frozen tool errors, ``now``,
  ``uuid``, approval decisions, signal payloads) is the journaled one, in
  every pass (a killed pass's values of steps whose results its death lost
  excepted: they were never journaled);
- a paused run stays on the same wait (name, callsite, ``request_id``)
  through plain re-entries and killed deliveries, and its waits are the
  reference run's waits, in order;
- a finished run has one finished step per callsite and none ``running``, the
  documented keys, the reference run's kinds, names, deterministic results
  and messages, and the ledger deduplicated by key shows exactly one effect
  per tool call (exactly its attempts, when no crash hit the run);
- a killed turn leaves its run ``running`` under the worker's lease, a
  finished one leaves no lease.

Budget: ``make test`` runs a small number of examples per backend; set
``KURALLE_CRASH_EXAMPLES=500`` for a longer hunt (README.md, "Tests and
benchmarks"). Run with ``-s`` to see the examples and crashes per backend.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pydantic import BaseModel

from kuralle_es import (
    ModelRequest,
    ModelResponse,
    RetryPolicy,
    RunStore,
    Runtime,
    SignalDelivery,
    StepRecord,
    Tool,
    ToolCall,
    ToolCallRequest,
    ToolExecutionError,
    TurnResult,
    WaitingFor,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
    idempotency_key,
    reply,
)
from kuralle_es._journal.leases import Lease
from kuralle_es._journal.run import Run, StepData
from kuralle_es._journal.store_url import postgres_address
from kuralle_es._runtime.suspensions import approval_decision
from kuralle_es.testing import BOUNDARIES, Crash, CrashingStore, CrashPlan, ScriptedModel

HOLDER = "worker"
FLOW = "program"
#: Crashes after which nobody knows whether the tool's effect happened.
IN_DOUBT = frozenset({"after_intent", "after_execute"})
#: Tools whose result depends only on their args (``mint`` returns a fresh token).
DETERMINISTIC_TOOLS = frozenset({"charge", "echo", "reject", "pay", "flaky", "sluggish"})
#: Tools whose outcome depends on how many times their key was executed.
RETRIED_TOOLS = frozenset({"flaky", "sluggish"})
#: Step kinds whose recorded value is the same in every run of one program.
DETERMINISTIC_KINDS = frozenset({"approval", "signal", "model"})
#: Every retried tool fails at most this many times before its last attempt.
RETRY = RetryPolicy(max_attempts=3, initial_interval=0.001, backoff=1.0, max_interval=0.001)
#: ``sluggish``'s timeout: an overrunning attempt sleeps far longer than this.
TIMEOUT = 0.3
SLEEP = 0.002  # a durable sleep well inside the inline limit
MODEL = "scripted"

#: Per backend: machines built (examples, shrinking included), turns, crashes, deliveries.
STATS: Counter[tuple[str, str]] = Counter()


@pytest.fixture(scope="module", autouse=True)
def crash_statistics() -> Iterator[None]:
    """Print what the machines did, per backend (visible with ``pytest -s``)."""
    yield
    for backend in sorted({b for b, _ in STATS}):
        figures = ", ".join(f"{what} {n}" for (b, what), n in sorted(STATS.items()) if b == backend)
        print(f"\ncrash machine on {backend}: {figures}")


# ------------------------------------------------------------------- the world
@dataclass(frozen=True)
class Execution:
    """One execution of a tool, as the external system saw it."""

    key: str
    tool: str
    args: Any
    run_id: str
    callsite: int


@dataclass
class Ledger:
    """The external system: it logs every execution and can deduplicate by key."""

    executions: list[Execution] = field(default_factory=list)
    plan: CrashPlan | None = None  # the current turn's, for "after execute"

    def record(self, tool: str, args: BaseModel, call: ToolCall) -> int:
        """Log one execution; returns how many this key has had (this one included)."""
        self.executions.append(
            Execution(
                call.idempotency_key,
                tool,
                args.model_dump(mode="json"),
                call.run_id,
                call.callsite,
            )
        )
        seen = sum(1 for e in self.executions if e.key == call.idempotency_key)
        if self.plan is not None:
            self.plan.reach("after_execute", call.idempotency_key)
        return seen


class ChargeArgs(BaseModel):
    amount: int
    currency: str


class Payload(BaseModel):
    payload: Any = None


class PayArgs(BaseModel):
    ref: str  # the business identity: "<session>/<order>"
    amount: int


class FlakyArgs(BaseModel):
    fails: int  # executions of this key that fail (or overrun) before one succeeds
    payload: int


def make_agent(ledger: Ledger) -> Any:
    """The agent of the flow, its tools bound to ``ledger``.

    The tools are async and yield once before their effect, so the calls of
    a gather batch really interleave (on every backend). ``flaky`` and
    ``sluggish`` decide from the ledger (executions of their key so far), so
    their outcome is a function of the call's key and attempt: a crash that
    re-executes an attempt uses one of the failures up, never adds one, and
    the run ends as its crash-free reference did.
    """

    async def charge(args: ChargeArgs, call: ToolCall) -> dict[str, Any]:
        await asyncio.sleep(0)
        ledger.record("charge", args, call)
        return {"charged": args.amount, "currency": args.currency}

    async def echo(args: Payload, call: ToolCall) -> dict[str, Any]:
        await asyncio.sleep(0)
        ledger.record("echo", args, call)
        return {"echo": args.payload}

    async def mint(args: Payload, call: ToolCall) -> dict[str, Any]:
        await asyncio.sleep(0)
        ledger.record("mint", args, call)
        return {"token": uuid4().hex}  # a fresh token per execution

    async def reject(args: Payload, call: ToolCall) -> None:
        await asyncio.sleep(0)
        ledger.record("reject", args, call)
        raise ValueError(f"rejected {args.payload!r}")

    async def pay(args: PayArgs, call: ToolCall) -> dict[str, Any]:
        await asyncio.sleep(0)
        ledger.record("pay", args, call)
        return {"paid": args.amount}

    async def flaky(args: FlakyArgs, call: ToolCall) -> dict[str, Any]:
        await asyncio.sleep(0)
        if ledger.record("flaky", args, call) <= args.fails:
            raise RuntimeError(f"flaky {args.payload} is down")
        return {"flaky": args.payload}

    async def sluggish(args: FlakyArgs, call: ToolCall) -> dict[str, Any]:
        await asyncio.sleep(0)
        if ledger.record("sluggish", args, call) <= args.fails:
            await asyncio.sleep(30)  # overruns its timeout: cancelled
        return {"sluggish": args.payload}

    tools: list[Tool[Any]] = [
        define_tool("charge", "charge an amount", ChargeArgs, charge),
        define_tool("echo", "echo the payload", Payload, echo, parallel_safe=True),
        define_tool("mint", "mint a token", Payload, mint),
        define_tool("reject", "always refuses", Payload, reject),
        define_tool("pay", "pay an order", PayArgs, pay, idempotency_key=lambda a: f"pay:{a.ref}"),
        define_tool("flaky", "fails, then works", FlakyArgs, flaky, retry=RETRY),
        define_tool(
            "sluggish", "overruns, then works", FlakyArgs, sluggish, retry=RETRY, timeout=TIMEOUT
        ),
    ]
    model = ScriptedModel(script, id=MODEL)
    return define_agent("agent", "runs programs", model, tools, [PROGRAM_FLOW])


def script(request: ModelRequest) -> ModelResponse | str:
    """The model: its answer is a function of the request, so every pass agrees.

    A reply node's turn notes how long the conversation is; a chat's agent
    turn asks for the tool calls of its program's next model turn (counted
    from the user's message, which names the session), then says "done".
    """
    if request.purpose == "reply":
        return f"noted {len(request.messages)} messages"
    users = [i for i, m in enumerate(request.messages) if m.role == "user"]
    session = str(request.messages[users[-1]].content)
    chat = REGISTRY[session].program.chat or ()
    turn = sum(1 for m in request.messages[users[-1] :] if m.role == "assistant")
    if turn == len(chat):
        return "done"
    return ModelResponse(
        tool_calls=[
            ToolCallRequest(f"call-{turn}-{j}", name, call_args(session, name, args))
            for j, (name, args) in enumerate(chat[turn])
        ]
    )


# --------------------------------------------------------------------- programs
#: ("tool", name, args) | ("gather", ((name, args), ...)) | ("now",) | ("uuid",)
#: | ("sleep",) | ("approve", approved, via) | ("signal", name, payload)
Effect = tuple[Any, ...]
WAITS = ("approve", "signal")


def call_args(session: str, name: str, args: Any) -> Any:
    """The args a node passes: ``pay``'s business reference names its session."""
    if name == "pay":
        return {"ref": f"{session}/{args['order']}", "amount": args["amount"]}
    return args


@dataclass(frozen=True)
class Site:
    """One callsite of a program: its step's kind, name and documented key payload."""

    effect: int | None  # None: the reply node's model turn
    kind: str
    name: str
    payload: Any
    override: str | None = None


@dataclass(frozen=True, eq=False)
class Program:
    """Effects ``[0, split)`` run in node "a", the rest in node "b"; with
    ``reply``, a reply node (one model turn) runs between them."""

    effects: tuple[Effect, ...]
    split: int
    reply: bool = False
    #: A chat instead of a flow: the tool calls of each model turn of the agent loop.
    chat: tuple[tuple[tuple[str, Any], ...], ...] | None = None

    def __repr__(self) -> str:
        def show(effect: Effect) -> str:
            if effect[0] == "tool":
                args = ", ".join(f"{k}={v!r}" for k, v in effect[2].items())
                return f"{effect[1]}({args})"
            if effect[0] == "gather":
                inner = ", ".join(show(("tool", *c)) for c in effect[1])
                return f"gather[{inner}]"
            return f"{effect[0]}{effect[1:]!r}"

        if self.chat is not None:
            turns = "; ".join(", ".join(show(("tool", *c)) for c in t) for t in self.chat)
            return f"Chat([{turns}])"
        a = ", ".join(show(e) for e in self.effects[: self.split])
        b = ", ".join(show(e) for e in self.effects[self.split :])
        return f"Program(a=[{a}],{' reply,' if self.reply else ''} b=[{b}])"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # how Hypothesis prints it in a failing example

    def calls(self, effect: Effect) -> list[tuple[str, Any]]:
        """(kind-or-tool-name, payload-args) of each callsite the effect takes."""
        if effect[0] == "tool":
            return [(effect[1], effect[2])]
        if effect[0] == "gather":
            return list(effect[1])
        return [(effect[0], None)]

    def sites(self, session: str) -> list[Site]:
        """Every callsite in order, with the documented key payloads."""
        out: list[Site] = []
        if self.chat is not None:
            agent_turn = Site(None, "model", MODEL, {"model": MODEL, "purpose": "agent"})
            for calls in self.chat:
                out.append(agent_turn)
                for name, args in calls:
                    actual = call_args(session, name, args)
                    override = f"pay:{actual['ref']}" if name == "pay" else None
                    out.append(Site(None, "tool", name, {"name": name, "args": actual}, override))
            return [*out, agent_turn]
        for i, effect in enumerate(self.effects):
            if i == self.split and self.reply:
                out.append(Site(None, "model", MODEL, {"model": MODEL, "purpose": "reply"}))
            kind = effect[0]
            if kind in ("tool", "gather"):
                for name, args in self.calls(effect):
                    actual = call_args(session, name, args)
                    override = f"pay:{actual['ref']}" if name == "pay" else None
                    out.append(Site(i, "tool", name, {"name": name, "args": actual}, override))
            elif kind in ("now", "uuid"):
                out.append(Site(i, kind, kind, kind))
            elif kind == "sleep":
                out.append(Site(i, "timer", "sleep", "timer"))
            elif kind == "approve":
                out.append(Site(i, "approval", "__approval", "__approval"))
            else:
                out.append(Site(i, "signal", effect[1], effect[1]))
        if self.reply and self.split == len(self.effects):
            out.append(Site(None, "model", MODEL, {"model": MODEL, "purpose": "reply"}))
        return out

    def callsites(self) -> list[list[int]]:
        """The callsites of each effect, in order (a gather takes one per call)."""
        out: list[list[int]] = [[] for _ in self.effects]
        for site, s in enumerate(self.sites("-")):
            if s.effect is not None:
                out[s.effect].append(site)
        return out

    def waits(self) -> list[tuple[str, int]]:
        """(wait name, callsite) of each pause the program makes, in order."""
        return [
            (s.name, site)
            for site, s in enumerate(self.sites("-"))
            if s.kind in ("approval", "signal")
        ]


@dataclass
class Entry:
    """What the nodes of a session's run read (the program) and saw (per pass)."""

    program: Program
    passes: list[dict[int, list[Any]]] = field(default_factory=list)
    open_batches: int = 0  # gathers entered and not returned from, this pass


#: The module-level registry the action nodes read, keyed by the state bag's "program".
REGISTRY: dict[str, Entry] = {}


async def guarded(call: Any) -> Any:
    """A tool's result, or its frozen failure as the node sees it."""
    try:
        return await call
    except ToolExecutionError as e:
        return {"error": e.error_type, "message": e.message}


async def perform(entry: Entry, ctx: Any, first: int, last: int) -> None:
    seen = entry.passes[-1]
    session = ctx.session_id
    for i in range(first, last):
        effect = entry.program.effects[i]
        kind = effect[0]
        if kind == "tool":
            seen[i] = [await guarded(ctx.tool(effect[1], call_args(session, *effect[1:])))]
        elif kind == "now":
            seen[i] = [(await ctx.now()).isoformat()]
        elif kind == "uuid":
            seen[i] = [await ctx.uuid()]
        elif kind == "sleep":
            await ctx.sleep(SLEEP)
            seen[i] = ["slept"]
        elif kind == "approve":
            decision = await ctx.approve(f"effect {i}")
            seen[i] = [{"approved": decision.approved, "by": decision.by}]
        elif kind == "signal":
            seen[i] = [await ctx.signal(effect[1])]
        else:
            entry.open_batches += 1
            calls = [
                guarded(ctx.tool(name, call_args(session, name, args))) for name, args in effect[1]
            ]
            seen[i] = list(await asyncio.gather(*calls))
            entry.open_batches -= 1


async def load_node(state: dict[str, Any], ctx: Any) -> Any:
    return goto("a", data={"program": ctx.session_id})


async def node_a(state: dict[str, Any], ctx: Any) -> Any:
    entry = REGISTRY[state["program"]]
    await perform(entry, ctx, 0, entry.program.split)
    return goto("r" if entry.program.reply else "b")


async def node_b(state: dict[str, Any], ctx: Any) -> Any:
    entry = REGISTRY[state["program"]]
    await perform(entry, ctx, entry.program.split, len(entry.program.effects))
    return end("done")


PROGRAM_FLOW = define_flow(
    FLOW,
    "runs a registered program",
    "load",
    [
        action("load", load_node),
        action("a", node_a),
        reply("r", "acknowledge the work so far", "b"),
        action("b", node_b),
    ],
)


def start(runtime: Runtime, session: str, program: Program) -> Any:
    """The first turn: a flow run, or a chat whose user message names the session."""
    if program.chat is not None:
        return runtime.run(session, input=session)
    return runtime.run(session, kind="flow", flow_name=FLOW)


async def deliver(
    runtime: Runtime, slot_session: str, run_id: str, program: Program, waiting: WaitingFor
) -> TurnResult:
    """Answer the wait the way the program says (approve/deny via a helper or a
    raw delivery; a signal's payload)."""
    site = program.sites(slot_session)[waiting.callsite]
    assert site.effect is not None and site.name == waiting.name, (site, waiting)
    effect = program.effects[site.effect]
    if effect[0] == "signal":
        return await runtime.signal(run_id, slot_session, effect[1], effect[2])
    _, approved, via = effect
    if via == "helper":
        decide = runtime.approve if approved else runtime.deny
        return await decide(run_id, slot_session, by="alice", reason="checked")
    delivery = SignalDelivery(
        signal_id=uuid4().hex,
        name="__approval",
        payload={"approved": approved, "by": "bob"},
        request_id=waiting.request_id,
        actor="bob",
    )
    return await runtime.run(slot_session, run_id=run_id, signal_delivery=delivery).result()


# ------------------------------------------------------------------ strategies
small_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-1000, 1000)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text("ab_é", max_size=4),
    lambda inner: (
        st.lists(inner, max_size=2) | st.dictionaries(st.text("ab_", max_size=3), inner, max_size=2)
    ),
    max_leaves=4,
)
tool_calls = st.one_of(
    st.builds(
        lambda amount, currency: ("charge", {"amount": amount, "currency": currency}),
        st.integers(0, 500),
        st.sampled_from(["EUR", "USD"]),
    ),
    st.tuples(
        st.sampled_from(["echo", "mint", "reject"]), small_json.map(lambda p: {"payload": p})
    ),
    st.builds(lambda amount: ("pay", {"order": 0, "amount": amount}), st.integers(1, 99)),
    # fails 0-2: succeeds within its 3 attempts; 5: its error is frozen after 3.
    st.builds(
        lambda fails, payload: ("flaky", {"fails": fails, "payload": payload}),
        st.sampled_from([0, 1, 2, 5]),
        st.integers(0, 9),
    ),
)
#: ``sluggish`` costs its timeout per overrun: kept out of gathers and rarer.
sluggish_calls = st.builds(
    lambda fails, payload: ("sluggish", {"fails": fails, "payload": payload}),
    st.sampled_from([0, 0, 1]),
    st.integers(0, 9),
)
effects = st.one_of(
    tool_calls.map(lambda call: ("tool", *call)),
    st.just(("now",)),
    st.just(("uuid",)),
    st.just(("sleep",)),
    st.lists(tool_calls, min_size=1, max_size=3).map(lambda calls: ("gather", tuple(calls))),
    st.tuples(st.just("approve"), st.booleans(), st.sampled_from(["helper", "delivery"])),
    st.tuples(st.just("signal"), st.sampled_from(["go", "ship"]), small_json),
    sluggish_calls.map(lambda call: ("tool", *call)),
)


def numbered(effects: list[Effect]) -> tuple[Effect, ...]:
    """The effects with every ``pay`` given its own order number (one key each)."""
    order = iter(range(1, 1000))

    def number(call: tuple[str, Any]) -> tuple[str, Any]:
        name, args = call
        return (name, {**args, "order": next(order)}) if name == "pay" else call

    out: list[Effect] = []
    for effect in effects:
        if effect[0] == "tool":
            out.append(("tool", *number((effect[1], effect[2]))))
        elif effect[0] == "gather":
            out.append(("gather", tuple(number(c) for c in effect[1])))
        elif effect[0] == "chat":
            out.append(("chat", tuple(tuple(number(c) for c in t) for t in effect[1])))
        else:
            out.append(effect)
    return tuple(out)


#: A chat's tools: deterministic ones, so its messages equal its reference's.
chat_calls = tool_calls.filter(lambda call: call[0] != "mint")


@st.composite
def programs(draw: st.DrawFn) -> Program:
    if draw(st.integers(0, 3)) == 0:
        turns = draw(st.lists(st.lists(chat_calls, min_size=1, max_size=3), max_size=3))
        (numbered_turns,) = numbered([("chat", tuple(tuple(t) for t in turns))])
        return Program((), 0, chat=numbered_turns[1])
    chosen = numbered(draw(st.lists(effects, max_size=6)))
    return Program(chosen, draw(st.integers(0, len(chosen))), draw(st.booleans()))


# ----------------------------------------------------------------- the machine
def seen_value(step: StepData) -> Any:
    """What was recorded for a journaled step: its result, or its frozen error."""
    if step["status"] == "finished":
        return None if step["result_json"] is None else json.loads(step["result_json"])
    if step["status"] == "error":
        error = step["error"] or {}
        return {"error": error.get("type"), "message": error.get("message")}
    return "<still running>"


def node_view(kind: str, value: Any) -> Any:
    """What a node sees of a recorded value: a decision for an approval, nothing of a sleep."""
    if kind == "timer":
        return "slept"
    if kind == "approval" and isinstance(value, dict) and "approved" in value:
        decision = approval_decision(value)
        return {"approved": decision.approved, "by": decision.by}
    return value


def record_value(record: StepRecord) -> Any:
    """``seen_value`` of a ``StepRecord`` (the reference run's journal)."""
    if record.error is not None:
        return {"error": record.error.type, "message": record.error.message}
    return record.result


def renamed(value: Any, old: str, new: str) -> Any:
    """``value`` with session ``old`` named ``new`` (a chat's user message and
    ``pay``'s refs name the session)."""
    return json.loads(json.dumps(value).replace(old, new))


def spec_keys(run_id: str, session: str, program: Program, epoch: int) -> list[str]:
    if program.chat is not None:
        logical = f"{run_id}#{epoch}"
    else:
        logical = f"{run_id}#{epoch}#{FLOW}@{PROGRAM_FLOW.digest}"
    return [
        s.override or idempotency_key(logical, site, s.payload)
        for site, s in enumerate(program.sites(session))
    ]


@dataclass
class Reference:
    """The same program's crash-free run, on a store and ledger of its own."""

    session: str
    run_id: str
    steps: list[StepRecord]
    messages: list[Any]
    waits: list[tuple[str, int]]


@dataclass(eq=False)
class Slot:
    """One program's run in the machine's store."""

    session: str
    program: Program
    reference: Reference
    run_id: str | None = None
    finished: bool = False
    killed: bool = False  # its last turn was killed
    waiting: WaitingFor | None = None  # the wait it is paused on
    waits: list[tuple[str, int]] = field(default_factory=list)  # every wait it paused on
    crashes: int = 0
    batch_crashes: int = 0  # crashes while a gather batch was in flight
    in_doubt: Counter[str] = field(default_factory=Counter)  # key -> in-doubt crashes on it

    def __repr__(self) -> str:
        return f"Slot({self.session})"


async def reference_run(program: Program) -> Reference:
    session = f"ref-{uuid4().hex[:8]}"
    entry = REGISTRY[session] = Entry(program, passes=[{}])
    ledger = Ledger()
    waits: list[tuple[str, int]] = []
    try:
        store = RunStore.memory()
        runtime = Runtime([make_agent(ledger)], store=store, holder=HOLDER)
        handle = start(runtime, session, program)
        result = await handle.result()
        run_id = await handle.run_id
        while result.status == "paused":
            assert result.waiting_for is not None
            waits.append((result.waiting_for.name, result.waiting_for.callsite))
            entry.passes.append({})
            result = await deliver(runtime, session, run_id, program, result.waiting_for)
        assert result.status == "finished", result
        steps = sorted(await runtime.get_steps(run_id, session), key=lambda s: s.callsite)
        run = store.load(run_id)
        assert run is not None
        messages = list(run.messages)
        assert result.output == "done" or program.reply, result
        store.close()
    finally:
        del REGISTRY[session]
    # A crash-free run takes every callsite once, under the documented keys, and
    # executes every tool exactly as often as it was attempted.
    assert [s.key for s in steps] == spec_keys(run_id, session, program, run.epoch)
    assert Counter(e.key for e in ledger.executions) == Counter(
        {s.key: s.attempts for s in steps if s.kind == "tool"}
    )
    assert waits == program.waits()
    assert set().union(*entry.passes) == set(range(len(program.effects)))
    return Reference(session, run_id, steps, messages, waits)


class CrashMachine(RuleBasedStateMachine):
    """Programs run, workers get killed at journal boundaries, restarted workers resume."""

    backend = "memory"
    dsn: str | None = None  # PostgreSQL: set by the test before it runs the machine
    runs = Bundle("runs")

    def __init__(self) -> None:
        super().__init__()
        STATS[self.backend, "examples"] += 1
        self.runner = asyncio.Runner()
        self.loop_errors: list[dict[str, Any]] = []
        self.runner.get_loop().set_exception_handler(lambda _, ctx: self.loop_errors.append(ctx))
        self.ledger = Ledger()
        self.slots: list[Slot] = []
        self.tmp: Path | None = None
        self.memory: CrashingStore | None = None
        if self.backend == "sqlite":
            self.tmp = Path(tempfile.mkdtemp(prefix="kuralle-crash-"))
        elif self.backend == "memory":
            self.memory = CrashingStore(env={"PERSISTENCE_MODULE": "eventsourcing.popo"})
        self._journals: dict[str, Run] | None = None
        self._leases: dict[str, Lease | None] = {}

    # ----------------------------------------------------------------- stores
    def env(self) -> dict[str, str]:
        if self.backend == "postgres":
            assert self.dsn is not None
            return postgres_address(self.dsn).env()
        assert self.tmp is not None
        return {
            "PERSISTENCE_MODULE": "eventsourcing.sqlite",
            "SQLITE_DBNAME": str(self.tmp / "runs.db"),
        }

    def open_store(self, plan: CrashPlan | None) -> RunStore:
        """The store a (re)started worker opens: on SQLite and PostgreSQL a new one."""
        if self.memory is not None:
            self.memory.plan = plan
            return self.memory
        if plan is None:
            return RunStore(env=self.env())
        store = CrashingStore(env=self.env())
        store.plan = plan
        return store

    def release_store(self, store: RunStore) -> None:
        if store is self.memory:
            self.memory.plan = None
        else:
            store.close()

    def journals(self) -> dict[str, Run]:
        """Every started run as the store now holds it (read by a fresh reader)."""
        if self._journals is None:
            store = self.open_store(None)
            try:
                self._journals = {}
                self._leases = {}
                for slot in self.slots:
                    if slot.run_id is not None:
                        run = store.load_history(slot.run_id)  # every step, archived too
                        assert run is not None, f"{slot} was never durable"
                        self._journals[slot.session] = run
                        self._leases[slot.session] = run.lease(store.lease(slot.run_id))
            finally:
                self.release_store(store)
        return self._journals

    def lease_holder(self, slot: Slot) -> str | None:
        """Who holds the slot's run's lease record, as the store now holds it."""
        self.journals()
        lease = self._leases.get(slot.session)
        return None if lease is None else lease.holder

    # ------------------------------------------------------------------ turns
    def turn(self, slot: Slot, plan: CrashPlan | None, *, answer: bool) -> Crash | None:
        """One turn of a (re)started worker: it answers the run's wait when
        ``answer`` (and the run waits), else it starts or re-enters the run.
        A killed turn returns its ``Crash``."""
        store = self.open_store(plan)
        self._journals = None
        entry = REGISTRY[slot.session]
        entry.passes.append({})
        entry.open_batches = 0
        self.ledger.plan = plan
        runtime = Runtime([make_agent(self.ledger)], store=store, holder=HOLDER)
        waiting = slot.waiting
        delivering = answer and waiting is not None
        STATS[self.backend, "deliveries" if delivering else "turns"] += 1

        async def drive() -> tuple[str, TurnResult | None, Crash | None]:
            # One turn at a time: a delivery is the turn (no re-entry beside it, whose
            # task could outlive this call and read a store that is then closed).
            try:
                if delivering:
                    assert waiting is not None and slot.run_id is not None
                    result = await deliver(
                        runtime, slot.session, slot.run_id, slot.program, waiting
                    )
                    return slot.run_id, result, None
                if slot.run_id is None:
                    handle = start(runtime, slot.session, slot.program)
                else:
                    handle = runtime.run(slot.session, run_id=slot.run_id)
                result = await handle.result()
                crash = None
            except Crash as killed:
                if delivering:
                    assert slot.run_id is not None
                    return slot.run_id, None, killed
                result, crash = None, killed
            return await handle.run_id, result, crash

        try:
            run_id, result, crash = self.runner.run(drive())
        finally:
            self.ledger.plan = None
            self.release_store(store)
        slot.run_id = run_id
        if crash is not None:
            self.killed(slot, plan, entry, waiting)
        else:
            assert plan is None or not plan.fired
            assert result is not None
            self.ended(slot, result, waiting if not delivering else None)
        return crash

    def killed(
        self, slot: Slot, plan: CrashPlan | None, entry: Entry, waiting: WaitingFor | None
    ) -> None:
        assert plan is not None and plan.fired, "a crash nobody planned"
        assert plan.key is not None
        STATS[self.backend, "crashes"] += 1
        STATS[self.backend, f"crashes {plan.boundary}"] += 1
        slot.crashes += 1
        run = self.journals()[slot.session]
        # A step's result rides the turn's next save (docs/guarantees.md, "One
        # commit a step"): every tool the dead turn left running is in doubt, and
        # what the pass saw of a step the journal did not keep was never journaled.
        in_doubt = {s["key"] for s in run.steps if s["kind"] == "tool" and s["status"] == "running"}
        if plan.boundary in IN_DOUBT:
            in_doubt.add(plan.key)
        for key in in_doubt:
            slot.in_doubt[key] += 1
        kept = {s["callsite"] for s in run.steps if s["status"] != "running"}
        sites = slot.program.callsites()
        seen = entry.passes[-1]
        for i in [i for i in seen if not set(sites[i]) <= kept]:
            del seen[i]
        if entry.open_batches or slot.program.chat is not None:
            # A crash while calls ran together (a gather, or a chat's parallel-safe
            # tools) may leave every one of them in doubt.
            slot.batch_crashes += 1
        wait = run.waiting
        if run.status == "finished" or (
            run.status == "paused"
            and wait is not None
            and (waiting is None or wait.request_id != waiting.request_id)
        ):
            # Killed after the turn's closing save (its last results, and a clock
            # read's or a uuid's intent and result, rode it): the turn had ended,
            # finished or paused on its next wait.
            assert plan.boundary in ("after_intent", "after_finalize"), (slot, plan, run.status)
            closed = TurnResult(
                run_id=run.run_id, status=run.status, output=run.output,
                waiting_for=run.public_wait(),
            )  # fmt: skip
            self.ended(slot, closed, None)
            event(f"killed {plan.boundary} after the turn's closing save")
            return
        if run.status == "paused":
            # A killed delivery that never became durable: the run still waits, on the same wait.
            assert waiting is not None, f"{slot} paused by a killed turn"
            wait = run.waiting
            assert wait is not None
            assert (wait.name, wait.callsite, wait.request_id) == (
                waiting.name,
                waiting.callsite,
                waiting.request_id,
            ), (slot, wait, waiting)
            slot.killed = False
            event(f"killed {plan.boundary} in a delivery that was lost")
            return
        slot.waiting = None
        slot.killed = True
        event(f"killed {plan.boundary}" + (" in a gather" if entry.open_batches else ""))

    def ended(self, slot: Slot, result: TurnResult, waited: WaitingFor | None) -> None:
        """A turn that ended: finished, or paused (on the same wait, if it was paused)."""
        slot.killed = False
        if result.status == "paused":
            wait = result.waiting_for
            assert wait is not None
            if waited is not None:
                # Re-addressed without an answer: the very same wait.
                assert (wait.name, wait.callsite, wait.request_id) == (
                    waited.name,
                    waited.callsite,
                    waited.request_id,
                ), (slot, wait, waited)
            elif slot.waiting is None or slot.waiting.request_id != wait.request_id:
                slot.waits.append((wait.name, wait.callsite))
                event(f"paused on {wait.kind}")
            slot.waiting = wait
            return
        assert result.status == "finished", result
        # The output is the turn's last text: the reply's, if this turn made it afresh.
        assert result.output == "done" or slot.program.reply, result
        if not slot.finished:
            event(f"finished after {min(slot.crashes, 3)}{'+' * (slot.crashes >= 3)} crashes")
        slot.finished = True
        slot.waiting = None

    # ------------------------------------------------------------------ rules
    @initialize(target=runs, program=programs())
    def start_first_program(self, program: Program) -> Slot:
        return self.register(program)

    @precondition(lambda self: len(self.slots) < 3)
    @rule(target=runs, program=programs())
    def start_program(self, program: Program) -> Slot:
        return self.register(program)

    def register(self, program: Program) -> Slot:
        """A user registers a program; its crash-free reference run is recorded first."""
        session = f"s{len(self.slots)}-{uuid4().hex[:8]}"
        REGISTRY[session] = Entry(program)
        slot = Slot(session, program, self.runner.run(reference_run(program)))
        self.slots.append(slot)
        return slot

    @rule(slot=runs, boundary=st.sampled_from(BOUNDARIES), nth=st.integers(1, 3))
    def crash_at(self, slot: Slot, boundary: Any, nth: int) -> None:
        """A worker drives the run (answering its wait, if it waits) and is killed
        at the nth ``boundary`` of its turn (if the turn has that many, it just ends)."""
        already_finished = slot.finished
        executions = len(self.ledger.executions)
        crash = self.turn(slot, CrashPlan(boundary, nth), answer=True)
        if already_finished:
            self.assert_finished_run_executes_nothing(slot, crash, executions)

    @rule(
        slot=runs,
        plans=st.lists(
            st.tuples(st.sampled_from(BOUNDARIES), st.integers(1, 3)), min_size=2, max_size=5
        ),
    )
    def crash_again_and_again(self, slot: Slot, plans: list[tuple[Any, int]]) -> None:
        """Worker after worker drives the run and is killed, each at its own boundary."""
        for boundary, nth in plans:
            self.crash_at(slot, boundary, nth)

    @rule(slot=runs)
    def reenter(self, slot: Slot) -> None:
        """A restarted worker (same holder) re-enters the run: a running one is
        driven on, a paused one stays on its wait, a finished one does nothing."""
        already_finished = slot.finished
        executions = len(self.ledger.executions)
        self.turn(slot, None, answer=False)
        if already_finished:
            self.assert_finished_run_executes_nothing(slot, None, executions)

    @rule(slot=runs)
    def answer(self, slot: Slot) -> None:
        """An operator answers the run's wait (or, if it does not wait, a worker re-enters)."""
        self.turn(slot, None, answer=True)

    def assert_finished_run_executes_nothing(
        self, slot: Slot, crash: Crash | None, executions: int
    ) -> None:
        assert crash is None, "re-addressing a finished run saved something"
        assert len(self.ledger.executions) == executions, "a finished run executed a tool"
        assert REGISTRY[slot.session].passes[-1] == {}, "a finished run ran a node"

    # ------------------------------------------------------------- invariants
    @invariant()
    def the_journal_never_has_two_steps_with_one_key(self) -> None:
        for session, run in self.journals().items():
            keys = Counter(s["key"] for s in run.steps)
            assert all(n == 1 for n in keys.values()), (session, keys)
            finished = [s["key"] for s in run.steps if s["status"] == "finished"]
            assert len(finished) == len(set(finished)), (session, finished)

    @invariant()
    def every_execution_follows_a_durable_intent_under_its_recorded_key(self) -> None:
        runs = {run.run_id: run for run in self.journals().values()}
        counts = Counter(e.key for e in self.ledger.executions)
        for e in self.ledger.executions:
            run = runs[e.run_id]
            steps = [s for s in run.steps if s["key"] == e.key]
            assert steps, f"{e} executed without a durable intent"
            (step,) = steps
            assert (step["kind"], step["name"], step["callsite"]) == ("tool", e.tool, e.callsite)
            assert step["args"] == e.args
            # Each execution was preceded by its own saved intent (first, retry or re-run).
            assert counts[e.key] <= step["attempts"], (e, counts[e.key], step["attempts"])

    @invariant()
    def a_tool_re_executes_only_after_a_retried_failure_or_a_crash_in_doubt(self) -> None:
        counts = Counter(e.key for e in self.ledger.executions)
        for slot in self.slots:
            run = self.journals().get(slot.session)
            if run is None:
                continue
            for step in run.steps:
                if step["kind"] != "tool":
                    continue
                failures = step.get("failures", 0)
                budget = 1 + failures + slot.in_doubt[step["key"]] + slot.batch_crashes
                assert counts[step["key"]] <= budget, (slot, step["callsite"], counts[step["key"]])
                if slot.crashes == 0:
                    # Exactly the attempts: the first, and one per retried failure.
                    assert counts[step["key"]] == step["attempts"], (slot, step["callsite"])

    @invariant()
    def every_value_a_node_saw_is_the_journaled_one(self) -> None:
        for slot in self.slots:
            run = self.journals().get(slot.session)
            if run is None:
                continue
            by_site = {s["callsite"]: s for s in run.steps}
            sites = slot.program.callsites()
            for number, seen in enumerate(REGISTRY[slot.session].passes):
                for i, values in seen.items():
                    journaled = [
                        node_view(by_site[c]["kind"], seen_value(by_site[c]))
                        for c in sites[i]
                        if c in by_site
                    ]
                    assert values == journaled, (slot, f"pass {number}", f"effect {i}")

    @invariant()
    def a_paused_run_waits_where_its_reference_waited(self) -> None:
        for slot in self.slots:
            assert slot.waits == slot.reference.waits[: len(slot.waits)], slot
            if slot.waiting is None:
                continue
            run = self.journals()[slot.session]
            assert run.status == "paused" and run.waiting is not None, slot
            assert run.waiting.request_id == slot.waiting.request_id, slot
            assert slot.waits[-1] == (run.waiting.name, run.waiting.callsite), slot

    @invariant()
    def a_finished_run_matches_its_crash_free_reference(self) -> None:
        for slot in self.slots:
            if not slot.finished:
                continue
            run = self.journals()[slot.session]
            ref = slot.reference
            program = slot.program
            assert run.status == "finished"
            assert run.outcome == ("done" if program.chat is None else None), run.outcome
            assert slot.waits == ref.waits, slot
            steps = sorted(run.steps, key=lambda s: s["callsite"])
            assert [s["callsite"] for s in steps] == list(range(len(program.sites("-"))))
            executions = Counter(e.key for e in self.ledger.executions)
            # A retried tool's outcome is its executions' (the tool's own state): a crash
            # can add an execution the crash-free reference never made (an attempt killed
            # before its failure was journaled), so it may end finished where the
            # reference gave up, never otherwise.
            retried = {
                s["callsite"]: "finished" if executions[s["key"]] > s["args"]["fails"] else "error"
                for s in steps
                if s["kind"] == "tool" and s["name"] in RETRIED_TOOLS
            }
            for s, r in zip(steps, ref.steps, strict=True):
                if s["callsite"] in retried:
                    assert s["status"] == retried[s["callsite"]], (slot, s["callsite"])
                    assert s["status"] == r.status or slot.crashes > 0, (slot, s["callsite"])
                else:
                    assert s["status"] == r.status, (slot, s["callsite"])
            assert all(s["status"] != "running" for s in steps)
            keys = spec_keys(slot.run_id or "", slot.session, program, run.epoch)
            assert [s["key"] for s in steps] == keys
            assert [(s["kind"], s["name"]) for s in steps] == [(r.kind, r.name) for r in ref.steps]
            for s, r in zip(steps, ref.steps, strict=True):
                if s["status"] != r.status:  # a retried tool that a crash let succeed
                    assert seen_value(s) == {s["name"]: s["args"]["payload"]}, (slot, s)
                elif s["kind"] in DETERMINISTIC_KINDS or s["name"] in DETERMINISTIC_TOOLS:
                    expected = renamed(record_value(r), ref.session, slot.session)
                    assert seen_value(s) == expected, (slot, s["callsite"])
            assert list(run.messages) == renamed(ref.messages, ref.session, slot.session), slot
            # The nodes saw every effect in some pass (and the values are the journal's).
            seen = set().union(*REGISTRY[slot.session].passes)
            assert seen == set(range(len(program.effects))), (slot, seen)
            # Deduplicated by key, the ledger shows exactly one effect per tool call.
            tool_keys = {s["key"] for s in steps if s["kind"] == "tool"}
            executed = {e.key for e in self.ledger.executions if e.run_id == slot.run_id}
            assert executed == tool_keys

    @invariant()
    def a_killed_turn_leaves_its_run_running_under_the_workers_lease(self) -> None:
        for slot in self.slots:
            run = self.journals().get(slot.session)
            if run is None:
                continue
            if slot.killed:
                assert run.status == "running" and self.lease_holder(slot) == HOLDER, slot
            elif slot.finished or slot.waiting is not None:
                assert self.lease_holder(slot) is None, slot

    @invariant()
    def the_event_loop_reported_no_lost_errors(self) -> None:
        assert self.loop_errors == []

    def teardown(self) -> None:
        try:
            if any(slot.crashes for slot in self.slots):
                # A task whose exception nobody retrieved reports it when collected.
                gc.collect()
            assert self.loop_errors == [], self.loop_errors
        finally:
            self.runner.close()
            if self.memory is not None:
                self.memory.close()
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            for slot in self.slots:
                REGISTRY.pop(slot.session, None)


class SqliteCrashMachine(CrashMachine):
    backend = "sqlite"


class PostgresCrashMachine(CrashMachine):
    backend = "postgres"


def budget(default: int) -> settings:
    """``default`` examples, or ``KURALLE_CRASH_EXAMPLES`` of them when set."""
    examples = int(os.environ.get("KURALLE_CRASH_EXAMPLES") or default)
    return settings(
        max_examples=examples,
        stateful_step_count=10,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


TestCrashMachineMemory = CrashMachine.TestCase
TestCrashMachineMemory.settings = budget(60)
TestCrashMachineSqlite = SqliteCrashMachine.TestCase
TestCrashMachineSqlite.settings = budget(20)


@pytest.mark.postgres
def test_crash_machine_postgres(pg_dsn: str) -> None:
    """The same machine over one PostgreSQL database (a new store per turn)."""
    PostgresCrashMachine.dsn = pg_dsn
    try:
        run_state_machine_as_test(PostgresCrashMachine, settings=budget(10))
    finally:
        PostgresCrashMachine.dsn = None


def test_a_resumed_chat_answers_each_model_turn_once() -> None:
    """Found by the machine: a chat killed after its second model turn was
    journaled resumed by answering the first turn's tool call again, after the
    second turn's assistant message (a tool message the model never asked for
    there, which an OpenAI-compatible server refuses)."""

    async def scenario() -> tuple[list[Any], list[Any]]:
        ledger = Ledger()
        store = CrashingStore.memory()
        program = Program((), 0, chat=((("echo", {"payload": 1}),), (("echo", {"payload": 2}),)))
        session = "chat"
        REGISTRY[session] = Entry(program)
        try:
            # Intents: model turn 0, echo 1, model turn 1 -> killed right after that save.
            store.plan = CrashPlan("after_intent", 3)
            handle = Runtime([make_agent(ledger)], store=store, holder=HOLDER).run(
                session, input=session
            )
            with pytest.raises(Crash):
                await handle.result()
            store.plan = None
            run_id = await handle.run_id
            runtime = Runtime([make_agent(ledger)], store=store, holder=HOLDER)
            result = await runtime.run(session, run_id=run_id).result()
            assert result.status == "finished" and result.output == "done"
            run = store.load(run_id)
            assert run is not None
            return list(run.messages), [e.args for e in ledger.executions]
        finally:
            del REGISTRY[session]

    messages, executed = asyncio.run(scenario())
    assert [(m["role"], m.get("tool_call_id")) for m in messages] == [
        ("user", None),
        ("assistant", None),
        ("tool", "call-0-0"),
        ("assistant", None),
        ("tool", "call-1-0"),
        ("assistant", None),
    ]
    assert executed == [{"payload": 1}, {"payload": 2}]
