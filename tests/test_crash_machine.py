"""Exactly-once effects under a crash at every journal boundary: a Hypothesis state machine.

The machine is a small world: users start *programs* (random effects — tool
calls with small JSON args, ``now``, ``uuid``, ``asyncio.gather`` batches —
spread over the two action nodes of one flow), a worker process is *killed*
at a chosen journal boundary, and a restarted worker with the same holder
*re-enters* the run until it finishes. Every program also has a crash-free
*reference* run on a store of its own.

Crashes are honest. Nothing of ``kuralle_es`` is mocked:

- ``CrashingStore`` is a ``RunStore`` subclass, a failing disk: per its
  ``CrashPlan`` its ``save_run`` raises ``Crash`` before delegating to
  ``RunStore.save_run`` (nothing saved) or after it (saved, then the process
  dies). It tells the boundaries apart by the run's pending events: an
  *intent* save carries ``Run.StepStarted`` (or ``Run.StepRetried``, the intent
  of a re-execution), a *finalize* save carries ``Run.StepFinished`` or
  ``Run.StepFailed``. ``now``/``uuid`` save intent and result in one save,
  which is both. A process that died saves nothing more.
- "after execute": the tool itself raises ``Crash`` right after its effect
  reached the external ledger.

``Crash`` is a ``BaseException``, so the turn dies without closing: the run
stays ``running`` under the worker's lease, as after ``SIGKILL``. Re-entry is
a NEW ``Runtime`` with the SAME holder (a lease is re-entrant for its holder);
on SQLite every turn opens a NEW store over the file (a plain ``RunStore``
for crash-free turns), so what a re-entry sees is what was durable.

Invariants (one guarantee each):

- the journal never has two steps, finished or not, with one key;
- every execution the ledger saw followed a durable intent, under the key the
  journal recorded for that callsite (re-executions reuse the recorded key);
- a tool executes again only after a crash could have left it in doubt
  (after intent, after execute, before finalize — or any crash while a
  gather batch was in flight);
- every value a node ever saw (tool results, frozen tool errors, ``now``,
  ``uuid``) is the journaled one, in every pass;
- a finished run has one finished step per callsite and none ``running``, the
  documented keys, the reference run's kinds, names and deterministic results,
  and the ledger deduplicated by key shows exactly one effect per tool call;
- a killed turn leaves its run ``running`` under the worker's lease, a
  finished one leaves no lease.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from pydantic import BaseModel

from kuralle_es import (
    RunStore,
    Runtime,
    StepRecord,
    ToolCall,
    ToolExecutionError,
    TurnResult,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
    idempotency_key,
)
from kuralle_es.domain import Run, StepData

HOLDER = "worker"
FLOW = "program"
BOUNDARIES = ("before_intent", "after_intent", "after_execute", "before_finalize", "after_finalize")
#: Crashes after which nobody knows whether the tool's effect happened.
IN_DOUBT = frozenset({"after_intent", "after_execute", "before_finalize"})
#: Tools whose result depends only on their args (``mint`` returns a fresh token).
DETERMINISTIC = frozenset({"charge", "echo", "reject"})


class Crash(BaseException):
    """The worker process dies: not an ``Exception``, so nothing catches or journals it."""


# ------------------------------------------------------------------ crash plans
@dataclass
class CrashPlan:
    """Kill the process at the ``nth`` occurrence (1-based) of ``boundary`` in one turn."""

    boundary: str
    nth: int
    seen: int = 0
    fired: bool = False
    key: str | None = None  # the idempotency key of the step the crash hit

    def reach(self, boundary: str, key: str) -> None:
        if self.fired or boundary != self.boundary:
            return
        self.seen += 1
        if self.seen == self.nth:
            self.fired = True
            self.key = key
            raise Crash(f"killed {boundary.replace('_', ' ')} #{self.nth} (step {key[:12]})")


def _step_keys(run: Run, kinds: tuple[type[Any], ...]) -> list[str]:
    """Keys of the steps that the run's pending events of ``kinds`` touch."""
    keys: list[str] = []
    for pending in run.pending_events:
        if not isinstance(pending, kinds):
            continue
        started = isinstance(pending, Run.StepStarted)
        keys.append(pending.key if started else run.steps[pending.index]["key"])
    return keys


class CrashingStore(RunStore):
    """A failing disk: ``save_run`` dies at the boundary its ``CrashPlan`` names."""

    def __init__(self, env: dict[str, str], plan: CrashPlan | None = None) -> None:
        super().__init__(env=env)
        self.plan = plan

    def save_run(self, run: Run) -> None:
        plan = self.plan
        if plan is None:
            super().save_run(run)
            return
        if plan.fired:
            raise Crash("the process is dead: it saves nothing more")
        intents = _step_keys(run, (Run.StepStarted, Run.StepRetried))
        finals = _step_keys(run, (Run.StepFinished, Run.StepFailed))
        for key in intents:
            plan.reach("before_intent", key)
        for key in finals:
            plan.reach("before_finalize", key)
        super().save_run(run)
        for key in intents:
            plan.reach("after_intent", key)
        for key in finals:
            plan.reach("after_finalize", key)


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

    def record(self, tool: str, args: BaseModel, call: ToolCall) -> None:
        self.executions.append(
            Execution(
                call.idempotency_key,
                tool,
                args.model_dump(mode="json"),
                call.run_id,
                call.callsite,
            )
        )
        if self.plan is not None:
            self.plan.reach("after_execute", call.idempotency_key)


class ChargeArgs(BaseModel):
    amount: int
    currency: str


class Payload(BaseModel):
    payload: Any = None


def make_agent(ledger: Ledger) -> Any:
    """The agent of the flow, its tools bound to ``ledger``.

    The tools are async and yield once before their effect, so the calls of
    a gather batch really interleave (on every backend).
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

    tools = [
        define_tool("charge", "charge an amount", ChargeArgs, charge),
        define_tool("echo", "echo the payload", Payload, echo),
        define_tool("mint", "mint a token", Payload, mint),
        define_tool("reject", "always refuses", Payload, reject),
    ]
    return define_agent("agent", "runs programs", None, tools, [PROGRAM_FLOW])


# --------------------------------------------------------------------- programs
Effect = tuple[Any, ...]  # ("tool", name, args) | ("now",) | ("uuid",) | ("gather", calls)


@dataclass(frozen=True, eq=False)
class Program:
    """Effects ``[0, split)`` run in node "a", the rest in node "b"."""

    effects: tuple[Effect, ...]
    split: int

    def __repr__(self) -> str:
        def show(effect: Effect) -> str:
            if effect[0] == "tool":
                args = ", ".join(f"{k}={v!r}" for k, v in effect[2].items())
                return f"{effect[1]}({args})"
            if effect[0] == "gather":
                inner = ", ".join(show(("tool", *c)) for c in effect[1])
                return f"gather[{inner}]"
            return f"{effect[0]}()"

        a = ", ".join(show(e) for e in self.effects[: self.split])
        b = ", ".join(show(e) for e in self.effects[self.split :])
        return f"Program(a=[{a}], b=[{b}])"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # how Hypothesis prints it in a failing example

    def calls(self, effect: Effect) -> list[tuple[str, Any]]:
        """(kind-or-tool-name, payload-args) of each callsite the effect takes."""
        if effect[0] == "tool":
            return [(effect[1], effect[2])]
        if effect[0] == "gather":
            return list(effect[1])
        return [(effect[0], None)]

    def callsites(self) -> list[list[int]]:
        """The callsites of each effect, in order (a gather takes one per call)."""
        out: list[list[int]] = []
        site = 0
        for effect in self.effects:
            n = len(self.calls(effect))
            out.append(list(range(site, site + n)))
            site += n
        return out

    def sites(self) -> list[tuple[str, str, Any]]:
        """(kind, name, key payload) per callsite: the documented key payloads."""
        out: list[tuple[str, str, Any]] = []
        for effect in self.effects:
            for name, args in self.calls(effect):
                if effect[0] in ("now", "uuid"):
                    out.append((name, name, name))
                else:
                    out.append(("tool", name, {"name": name, "args": args}))
        return out


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
    for i in range(first, last):
        effect = entry.program.effects[i]
        if effect[0] == "tool":
            seen[i] = [await guarded(ctx.tool(effect[1], effect[2]))]
        elif effect[0] == "now":
            seen[i] = [(await ctx.now()).isoformat()]
        elif effect[0] == "uuid":
            seen[i] = [await ctx.uuid()]
        else:
            entry.open_batches += 1
            calls = [guarded(ctx.tool(name, args)) for name, args in effect[1]]
            seen[i] = list(await asyncio.gather(*calls))
            entry.open_batches -= 1


async def load_node(state: dict[str, Any], ctx: Any) -> Any:
    return goto("a", data={"program": ctx.session_id})


async def node_a(state: dict[str, Any], ctx: Any) -> Any:
    entry = REGISTRY[state["program"]]
    await perform(entry, ctx, 0, entry.program.split)
    return goto("b")


async def node_b(state: dict[str, Any], ctx: Any) -> Any:
    entry = REGISTRY[state["program"]]
    await perform(entry, ctx, entry.program.split, len(entry.program.effects))
    return end("done")


PROGRAM_FLOW = define_flow(
    FLOW,
    "runs a registered program",
    "load",
    [action("load", load_node), action("a", node_a), action("b", node_b)],
)


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
)
effects = st.one_of(
    tool_calls.map(lambda call: ("tool", *call)),
    st.just(("now",)),
    st.just(("uuid",)),
    st.lists(tool_calls, min_size=1, max_size=3).map(lambda calls: ("gather", tuple(calls))),
)


@st.composite
def programs(draw: st.DrawFn) -> Program:
    chosen = draw(st.lists(effects, max_size=6))
    return Program(tuple(chosen), draw(st.integers(0, len(chosen))))


# ----------------------------------------------------------------- the machine
def seen_value(step: StepData) -> Any:
    """What a node sees for a journaled step: its result, or its frozen error."""
    if step["status"] == "finished":
        return None if step["result_json"] is None else json.loads(step["result_json"])
    if step["status"] == "error":
        error = step["error"] or {}
        return {"error": error.get("type"), "message": error.get("message")}
    return "<still running>"


def record_value(record: StepRecord) -> Any:
    """``seen_value`` of a ``StepRecord`` (the reference run's journal)."""
    if record.error is not None:
        return {"error": record.error.type, "message": record.error.message}
    return record.result


def spec_keys(run_id: str, program: Program) -> list[str]:
    logical = f"{run_id}#0#{FLOW}@{PROGRAM_FLOW.digest}"
    return [idempotency_key(logical, site, p) for site, (_, _, p) in enumerate(program.sites())]


@dataclass
class Reference:
    """The same program's crash-free run, on a store and ledger of its own."""

    run_id: str
    steps: list[StepRecord]


@dataclass(eq=False)
class Slot:
    """One program's run in the machine's store."""

    session: str
    program: Program
    reference: Reference
    run_id: str | None = None
    finished: bool = False
    killed: bool = False  # its last turn was killed
    crashes: int = 0
    batch_crashes: int = 0  # crashes while a gather batch was in flight
    in_doubt: Counter[str] = field(default_factory=Counter)  # key -> in-doubt crashes on it

    def __repr__(self) -> str:
        return f"Slot({self.session})"


async def reference_run(program: Program) -> Reference:
    session = f"ref-{uuid4().hex[:8]}"
    entry = REGISTRY[session] = Entry(program, passes=[{}])
    ledger = Ledger()
    try:
        runtime = Runtime([make_agent(ledger)], store=RunStore.memory(), holder=HOLDER)
        handle = runtime.run(session, kind="flow", flow_name=FLOW)
        result = await handle.result()
        run_id = await handle.run_id
        assert result.status == "finished", result
        steps = await runtime.get_steps(run_id, session)
    finally:
        del REGISTRY[session]
    # A crash-free run executes every tool exactly once, under the documented keys.
    assert [s.key for s in steps] == spec_keys(run_id, program)
    assert Counter(e.key for e in ledger.executions) == Counter(
        s.key for s in steps if s.kind == "tool"
    )
    assert sorted(entry.passes[0]) == list(range(len(program.effects)))
    return Reference(run_id, steps)


class CrashMachine(RuleBasedStateMachine):
    """Programs run, workers get killed at journal boundaries, restarted workers resume."""

    backend = "memory"
    runs = Bundle("runs")

    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner()
        self.loop_errors: list[dict[str, Any]] = []
        self.runner.get_loop().set_exception_handler(lambda _, ctx: self.loop_errors.append(ctx))
        self.ledger = Ledger()
        self.slots: list[Slot] = []
        self.tmp: Path | None = None
        self.memory: CrashingStore | None = None
        if self.backend == "sqlite":
            self.tmp = Path(tempfile.mkdtemp(prefix="kuralle-crash-"))
        else:
            self.memory = CrashingStore(env={"PERSISTENCE_MODULE": "eventsourcing.popo"})
        self._journals: dict[str, Run] | None = None

    # ----------------------------------------------------------------- stores
    @property
    def sqlite_env(self) -> dict[str, str]:
        assert self.tmp is not None
        return {
            "PERSISTENCE_MODULE": "eventsourcing.sqlite",
            "SQLITE_DBNAME": str(self.tmp / "runs.db"),
        }

    def open_store(self, plan: CrashPlan | None) -> RunStore:
        """The store a (re)started worker opens: on SQLite always a new one."""
        if self.memory is not None:
            self.memory.plan = plan
            return self.memory
        if plan is None:
            return RunStore.sqlite(self.sqlite_env["SQLITE_DBNAME"])
        return CrashingStore(env=self.sqlite_env, plan=plan)

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
                for slot in self.slots:
                    if slot.run_id is not None:
                        run = store.load(slot.run_id)
                        assert run is not None, f"{slot} was never durable"
                        self._journals[slot.session] = run
            finally:
                self.release_store(store)
        return self._journals

    # ------------------------------------------------------------------ turns
    def turn(self, slot: Slot, plan: CrashPlan | None) -> tuple[TurnResult | None, Crash | None]:
        """One turn of a (re)started worker; a killed turn returns its ``Crash``."""
        store = self.open_store(plan)
        self._journals = None
        entry = REGISTRY[slot.session]
        entry.passes.append({})
        entry.open_batches = 0
        self.ledger.plan = plan
        runtime = Runtime([make_agent(self.ledger)], store=store, holder=HOLDER)

        async def drive() -> tuple[str, TurnResult | None, Crash | None]:
            if slot.run_id is None:
                handle = runtime.run(slot.session, kind="flow", flow_name=FLOW)
            else:
                handle = runtime.run(slot.session, run_id=slot.run_id)
            try:
                result, crash = await handle.result(), None
            except Crash as killed:
                result, crash = None, killed
            return await handle.run_id, result, crash

        try:
            run_id, result, crash = self.runner.run(drive())
        finally:
            self.ledger.plan = None
            self.release_store(store)
        slot.run_id = run_id
        if crash is not None:
            assert plan is not None and plan.fired, f"a crash nobody planned: {crash!r}"
            assert plan.key is not None
            slot.crashes += 1
            slot.killed = True
            if plan.boundary in IN_DOUBT:
                slot.in_doubt[plan.key] += 1
            if entry.open_batches:
                slot.batch_crashes += 1
            event(f"killed {plan.boundary}" + (" in a gather" if entry.open_batches else ""))
        else:
            assert plan is None or not plan.fired
            assert result is not None
            assert result.status == "finished", result
            assert result.output == "done", result
            if not slot.finished:
                event(f"finished after {min(slot.crashes, 3)}{'+' * (slot.crashes >= 3)} crashes")
            slot.finished = True
            slot.killed = False
        return result, crash

    # ------------------------------------------------------------------ rules
    @initialize(target=runs, program=programs())
    def start_first_program(self, program: Program) -> Slot:
        return self.start_program(program)

    @precondition(lambda self: len(self.slots) < 3)
    @rule(target=runs, program=programs())
    def start_program(self, program: Program) -> Slot:
        """A user registers a program; its crash-free reference run is recorded first."""
        session = f"s{len(self.slots)}-{uuid4().hex[:8]}"
        REGISTRY[session] = Entry(program)
        slot = Slot(session, program, self.runner.run(reference_run(program)))
        self.slots.append(slot)
        return slot

    @rule(slot=runs, boundary=st.sampled_from(BOUNDARIES), nth=st.integers(1, 3))
    def crash_at(self, slot: Slot, boundary: str, nth: int) -> None:
        """A worker drives the run and is killed at the nth ``boundary`` of its turn
        (if the turn has that many, it just finishes)."""
        already_finished = slot.finished
        executions = len(self.ledger.executions)
        _, crash = self.turn(slot, CrashPlan(boundary, nth))
        if already_finished:
            self.assert_finished_run_executes_nothing(slot, crash, executions)

    @rule(slot=runs)
    def reenter(self, slot: Slot) -> None:
        """A restarted worker (same holder) re-enters the run and drives it to the end."""
        already_finished = slot.finished
        executions = len(self.ledger.executions)
        self.turn(slot, None)
        if already_finished:
            self.assert_finished_run_executes_nothing(slot, None, executions)

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
            # Each execution was preceded by its own saved intent (first or retry).
            assert counts[e.key] <= step["attempts"], (e, counts[e.key], step["attempts"])

    @invariant()
    def a_tool_re_executes_only_after_a_crash_left_it_in_doubt(self) -> None:
        counts = Counter(e.key for e in self.ledger.executions)
        for slot in self.slots:
            run = self.journals().get(slot.session)
            if run is None:
                continue
            for step in run.steps:
                if step["kind"] != "tool":
                    continue
                budget = 1 + slot.in_doubt[step["key"]] + slot.batch_crashes
                assert counts[step["key"]] <= budget, (slot, step["callsite"], counts[step["key"]])
                if slot.crashes == 0:
                    assert counts[step["key"]] == 1

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
                    journaled = [seen_value(by_site[c]) for c in sites[i] if c in by_site]
                    assert values == journaled, (slot, f"pass {number}", f"effect {i}")

    @invariant()
    def a_finished_run_matches_its_crash_free_reference(self) -> None:
        for slot in self.slots:
            if not slot.finished:
                continue
            run = self.journals()[slot.session]
            ref = slot.reference
            program = slot.program
            assert run.status == "finished" and run.outcome == "done"
            steps = sorted(run.steps, key=lambda s: s["callsite"])
            assert [s["callsite"] for s in steps] == list(range(len(program.sites())))
            assert [s["status"] for s in steps] == [r.status for r in ref.steps]
            assert all(s["status"] != "running" for s in steps)
            assert [s["key"] for s in steps] == spec_keys(slot.run_id or "", program)
            assert [(s["kind"], s["name"]) for s in steps] == [(r.kind, r.name) for r in ref.steps]
            for s, r in zip(steps, ref.steps, strict=True):
                if s["kind"] == "tool" and s["name"] in DETERMINISTIC:
                    assert seen_value(s) == record_value(r), (slot, s["callsite"])
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
                assert run.status == "running" and run.lease_holder == HOLDER, slot
            elif slot.finished:
                assert run.lease_holder is None, slot

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


TestCrashMachineMemory = CrashMachine.TestCase
TestCrashMachineMemory.settings = settings(
    max_examples=150,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCrashMachineSqlite = SqliteCrashMachine.TestCase
TestCrashMachineSqlite.settings = settings(
    max_examples=60,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
