"""Misbehaving node code cannot break the guarantees: a Hypothesis state machine.

The machine's world is one flow of two action nodes, ``a`` then ``b``, whose
code is a *program* of habits drawn at random (docs/node-code.md), each
written the way careless users write it:

- ``swallow``: ``try: await <wait> / except Exception`` (or ``BaseException``)
  ``: pass``, then a ``charge`` anyway (unless an approval came back denied),
  that charge itself maybe inside a broad ``except`` too (the node goes on);
- ``finally``: ``try: await <wait> / finally: await charge(...)`` inside a
  broad ``except``;
- ``gather``: ``asyncio.gather(<waits and charges>, return_exceptions=True)``,
  then maybe a charge;
- ``raise after``: ``except SuspendError: raise RuntimeError(...)``;
- ``guarded``: a broad ``except`` around one or two other habits, swallowing
  whatever they raise (a suspension, a denial, a refused replay, the error
  raised after a suspension);
- ``stray``: a task left running (``asyncio.ensure_future``), not awaited by
  the node, that asks ``ctx`` for a charge once its node is over (node a's as
  soon as node b starts, in the same turn), or awaits a charge the node asked
  for and never awaited;
- ``keyed``: a tool called with a nonce from ``random`` or ``datetime.now()``
  (or, as it should be, from ``ctx.now()`` / ``ctx.uuid()``; or through a
  tool with an ``idempotency_key=`` override);
- ``slow``: a blocking sync tool (``time.sleep`` longer than the lease) while a
  second worker (its own ``Runtime``, another holder, its own event loop in a
  thread) sweeps ``recover_orphaned_runs``;
- ``plain``: correct code, ``await <wait>`` then a charge if it was granted.

A ``<wait>`` is ``ctx.approve``, ``ctx.signal`` or a gated tool (``refund``,
``needs_approval=True``). The rules start runs, approve, deny, deliver the
signal the run waits for, deliver what it does not wait for (refused), let two
approvers approve one request at once (one wins, the other is refused), resume
a run, and let a second worker sweep for orphans. Every tool writes to an
external, thread-safe ledger: tool, idempotency key, and the approvals and
signals the run had received at that moment.

A pure model of the program (no ``kuralle_es`` in it) predicts each turn: the
wait the run pauses on, or that it finishes, or the error it ends in; which
effects execute; which tasks are refused. Each turn is checked against it, and
the invariants (one guarantee each) are:

- no gated effect before its approval: a charge requested after a wait never
  executes before the run received an answer to it (an approval, for a charge
  the node only makes when approved, and for the gated tool itself), and a
  sync tool never runs on the event loop's thread;
- no key executed twice (no crashes here, so no in-doubt re-run is allowed);
- nothing executed or written after a turn closed: a task left running never
  gets an effect executed, and the run's stored version does not move after
  the turn returned (the run is read again once the tasks ran);
- every refusal is a ``KuralleError`` whose message says what to do;
- a paused run waits on the first wait its turn hit.

Budget: ``make test`` runs 60 examples on memory, 20 on SQLite and 12 on
PostgreSQL (8 steps each); set ``KURALLE_MISBEHAVING_EXAMPLES=500`` for a
longer hunt (that many on every backend). Run with ``-s`` to see what the
machines did per backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn
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
    KuralleError,
    LeaseHeldError,
    NonDeterminismError,
    RunContext,
    RunState,
    RunStore,
    Runtime,
    SignalDelivery,
    SignalMismatchError,
    StaleWriteError,
    SuspendError,
    ToolApprovalDeniedError,
    ToolCall,
    TurnClosedError,
    TurnResult,
    WaitingFor,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
    recover_orphaned_runs,
)

FLOW = "misbehaving"
WORKER = "worker-a"
SWEEPER = "worker-b"
#: The lease of a turn that runs the blocking tool (and of the sweeping worker).
LEASE = 0.3
#: How long the blocking tool blocks its thread: longer than the lease.
SLOW = 0.5
#: Per backend: machines built, turns, refusals, outcomes, slow turns.
STATS: Counter[tuple[str, str]] = Counter()


@pytest.fixture(scope="module", autouse=True)
def misbehaving_statistics() -> Iterator[None]:
    """Print what the machines did, per backend (visible with ``pytest -s``)."""
    yield
    for backend in sorted({b for b, _ in STATS}):
        figures = ", ".join(f"{what} {n}" for (b, what), n in sorted(STATS.items()) if b == backend)
        print(f"\nmisbehaving machine on {backend}: {figures}")


# ------------------------------------------------------------------ the ledger
@dataclass(frozen=True)
class Execution:
    """One execution of a tool, as the external system saw it."""

    tool: str
    key: str
    session: str
    label: str
    #: The answers the run had received when the tool executed (label -> answer).
    answers: dict[str, str]
    #: Whether it ran on the thread of the worker's event loop.
    on_loop_thread: bool


class Ledger:
    """The external system: every execution, with the run's answers at that moment.

    Sync tools run on threads of their own: everything is under one lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.executions: list[Execution] = []
        self._answers: dict[str, dict[str, str]] = {}
        self.loop_thread: int | None = None

    def answer(self, session: str, label: str, answer: str) -> None:
        """The machine is about to deliver ``answer`` to the wait ``label``."""
        with self._lock:
            self._answers.setdefault(session, {})[label] = answer

    def forget(self, session: str, label: str) -> None:
        """A delivery the machine expected to be accepted was refused."""
        with self._lock:
            self._answers.get(session, {}).pop(label, None)

    def record(self, tool: str, ref: str, call: ToolCall) -> None:
        session, _, label = ref.rpartition("/")
        with self._lock:
            self.executions.append(
                Execution(
                    tool,
                    call.idempotency_key,
                    session,
                    label,
                    dict(self._answers.get(session, {})),
                    threading.get_ident() == self.loop_thread,
                )
            )

    def of(self, session: str) -> list[Execution]:
        with self._lock:
            return [e for e in self.executions if e.session == session]

    def snapshot(self) -> list[Execution]:
        with self._lock:
            return list(self.executions)


class Ref(BaseModel):
    ref: str  # "<session>/<label>": the effect of the program it is
    nonce: str = ""


def make_agent(ledger: Ledger) -> Any:
    """The flow's agent, its tools writing to ``ledger``.

    ``charge`` is async; ``pay`` (matched by its ``idempotency_key``
    override), ``refund`` (needs approval) and ``slow`` (blocks its thread
    longer than the lease) are sync, so they run on threads.
    """

    async def charge(args: Ref, call: ToolCall) -> dict[str, Any]:
        await asyncio.sleep(0)
        ledger.record("charge", args.ref, call)
        return {"charged": args.ref}

    def pay(args: Ref, call: ToolCall) -> dict[str, Any]:
        ledger.record("pay", args.ref, call)
        return {"paid": args.ref}

    def refund(args: Ref, call: ToolCall) -> dict[str, Any]:
        ledger.record("refund", args.ref, call)
        return {"refunded": args.ref}

    def slow(args: Ref, call: ToolCall) -> dict[str, Any]:
        ledger.record("slow", args.ref, call)
        time.sleep(SLOW)  # a payment API called without a timeout
        return {"slow": args.ref}

    tools = [
        define_tool("charge", "charges a card", Ref, charge),
        define_tool("pay", "pays an order", Ref, pay, idempotency_key=lambda a: f"pay:{a.ref}"),
        define_tool("refund", "refunds, once approved", Ref, refund, needs_approval=True),
        define_tool("slow", "blocks its thread", Ref, slow),
    ]
    return define_agent("agent", "runs misbehaving nodes", None, tools, [MISBEHAVING_FLOW])


# ------------------------------------------------------------- the model's pass
class MSuspend(Exception):
    """The model's ``SuspendError``."""


class MDenied(Exception):
    """The model's ``ToolApprovalDeniedError``."""


class MNonDeterminism(Exception):
    """The model's ``NonDeterminismError``."""


class MNodeError(Exception):
    """The model's error a node raises after catching a suspension."""


#: What ``except Exception`` (and ``return_exceptions=True``) catches in the model.
BROAD = (MSuspend, MDenied, MNonDeterminism, MNodeError)

MODEL_ERRORS = {MDenied: "ToolApprovalDeniedError", MNonDeterminism: "NonDeterminismError"}


class ModelPass:
    """One pass of the nodes as the documented rules say it goes."""

    def __init__(self, answers: dict[str, str], executed: set[str]) -> None:
        self.answers = answers
        self.prior = frozenset(executed)
        self.executed = set(executed)
        self.new: list[str] = []
        self.first_wait: str | None = None
        #: A replay refused (a new key at a recorded callsite): like a suspension,
        #: it stops the turn, whatever the node does with the error.
        self.mismatch = False
        self.strays = 0  # tasks left running, each refused with TurnClosedError
        self.refused_strays = 0  # effects a stray segment asked for after the suspension
        self.swallowed: set[str] = set()  # what a ``Guarded`` swallowed (statistics)

    def request(self) -> None:
        """Node code asks for an effect: refused once the turn suspended, or
        once a replay was refused (the turn ends in that error)."""
        if self.first_wait is not None:
            raise MSuspend
        if self.mismatch:
            raise MNonDeterminism

    def refuse_replay(self) -> NoReturn:
        """A recorded callsite asked for under another key: nothing executes,
        and every later effect of the pass is refused the same way."""
        self.mismatch = True
        raise MNonDeterminism

    def wait(self, wait: Wait) -> bool:
        """An admitted wait runs: its recorded answer, or the turn suspends on it."""
        answer = self.answers.get(wait.label)
        if answer is None:
            if self.first_wait is None:
                self.first_wait = wait.label
            raise MSuspend
        if wait.kind == "approve":
            return answer == "approved"
        if wait.kind == "gated":
            if answer == "denied":
                raise MDenied
            self.execute(wait.label)
        return True

    def execute(self, label: str) -> None:
        if label not in self.executed:
            self.executed.add(label)
            self.new.append(label)


# --------------------------------------------------------------------- programs
Guards = dict[str, list[tuple[str, str]]]


@dataclass(frozen=True)
class Wait:
    """``ctx.approve(label)``, ``ctx.signal(label)`` or the gated ``refund`` tool."""

    kind: str  # "approve" | "signal" | "gated"
    label: str

    def request(self, ctx: RunContext) -> Awaitable[Any]:
        """Ask ``ctx`` for the wait now (the coroutine is awaited by the caller)."""
        if self.kind == "approve":
            return ctx.approve(self.label)
        if self.kind == "signal":
            return ctx.signal(self.label)
        return ctx.tool("refund", {"ref": ref(ctx, self.label)})

    @property
    def needs(self) -> str:
        """What a charge the node makes only when this wait went its way requires."""
        return "answered" if self.kind == "signal" else "approved"

    def __repr__(self) -> str:
        if self.kind == "gated":
            return f"refund({self.label!r})"
        return f"ctx.{self.kind}({self.label!r})"


def ref(ctx: RunContext, label: str) -> str:
    return f"{ctx.session_id}/{label}"


async def awaited(ctx: RunContext, wait: Wait) -> bool:
    """Whether the node goes on after the wait (an approval may come back denied)."""
    value = await wait.request(ctx)
    return wait.kind != "approve" or bool(value.approved)


async def charge(ctx: RunContext, label: str, tool: str = "charge") -> None:
    await ctx.tool(tool, {"ref": ref(ctx, label)})


class Habit:
    """One habit of a node: what it does (``run``) and what the model says (``model``)."""

    async def run(self, ctx: RunContext, entry: Entry) -> None:
        raise NotImplementedError

    def model(self, p: ModelPass) -> None:
        raise NotImplementedError

    def waits(self) -> list[Wait]:
        return []

    def passed(self) -> list[Wait]:
        """The waits that were answered if code after the habit runs unsuspended."""
        return self.waits()

    def guards(self, earlier: list[tuple[str, str]]) -> Guards:
        """What each effect of the habit needs answered before it may execute."""
        return {}

    def habits(self) -> list[Habit]:
        """The habit and those inside it."""
        return [self]


@dataclass(frozen=True, repr=False)
class Plain(Habit):
    """Correct code: ``await <wait>``, then a charge if it went the node's way."""

    wait: Wait
    charge: str | None

    async def run(self, ctx: RunContext, entry: Entry) -> None:
        try:
            go_on = await awaited(ctx, self.wait)
        except ToolApprovalDeniedError:
            go_on = False
        if self.charge is not None and go_on:
            await charge(ctx, self.charge)

    def model(self, p: ModelPass) -> None:
        p.request()
        try:
            go_on = p.wait(self.wait)
        except MDenied:
            go_on = False
        if self.charge is not None and go_on:
            p.request()
            p.execute(self.charge)

    def waits(self) -> list[Wait]:
        return [self.wait]

    def guards(self, earlier: list[tuple[str, str]]) -> Guards:
        out = gated_guards([self.wait], earlier)
        if self.charge is not None:
            out[self.charge] = [*earlier, (self.wait.label, self.wait.needs)]
        return out

    def __repr__(self) -> str:
        then = f"; if granted: charge({self.charge!r})" if self.charge else ""
        return f"await {self.wait!r}{then}"


@dataclass(frozen=True, repr=False)
class Swallow(Habit):
    """``try: await <wait> / except Exception: pass``, then charge anyway."""

    wait: Wait
    catch: str  # "Exception" | "BaseException"
    charge: str
    shielded: bool  # the charge is in a broad except too: the node goes on

    async def run(self, ctx: RunContext, entry: Entry) -> None:
        decision: bool | None = None
        if self.catch == "Exception":
            try:  # noqa: SIM105 - the habit under test
                decision = await awaited(ctx, self.wait)
            except Exception:
                pass  # "log and go on"
        else:
            try:  # noqa: SIM105 - the habit under test
                decision = await awaited(ctx, self.wait)
            except BaseException:
                pass
        if decision is None or decision:  # None: "it failed, charge anyway"
            if self.shielded:
                try:  # noqa: SIM105 - the habit under test
                    await charge(ctx, self.charge)
                except Exception:
                    pass
            else:
                await charge(ctx, self.charge)

    def model(self, p: ModelPass) -> None:
        decision: bool | None = None
        try:
            p.request()
            decision = p.wait(self.wait)
        except BROAD:
            pass
        if decision is None or decision:
            try:
                p.request()
                p.execute(self.charge)
            except BROAD:
                if not self.shielded:
                    raise

    def waits(self) -> list[Wait]:
        return [self.wait]

    def guards(self, earlier: list[tuple[str, str]]) -> Guards:
        out = gated_guards([self.wait], earlier)
        # A denied gated tool raises, and the broad except charges: answered, not approved.
        need = "approved" if self.wait.kind == "approve" else "answered"
        out[self.charge] = [*earlier, (self.wait.label, need)]
        return out

    def __repr__(self) -> str:
        charge_ = f"charge({self.charge!r})"
        if self.shielded:
            charge_ = f"try: {charge_} except Exception: pass"
        return f"try: await {self.wait!r} except {self.catch}: pass; {charge_}"


@dataclass(frozen=True, repr=False)
class Finally(Habit):
    """``try: await <wait> / finally: await charge(...)``, in a broad except."""

    wait: Wait
    charge: str

    async def run(self, ctx: RunContext, entry: Entry) -> None:
        try:
            try:
                await awaited(ctx, self.wait)
            finally:
                await charge(ctx, self.charge)  # the finally goes on
        except Exception:
            pass

    def model(self, p: ModelPass) -> None:
        try:
            try:
                p.request()
                p.wait(self.wait)
            finally:
                p.request()
                p.execute(self.charge)
        except BROAD:
            pass

    def waits(self) -> list[Wait]:
        return [self.wait]

    def guards(self, earlier: list[tuple[str, str]]) -> Guards:
        out = gated_guards([self.wait], earlier)
        out[self.charge] = [*earlier, (self.wait.label, "answered")]
        return out

    def __repr__(self) -> str:
        return (
            f"try: (try: await {self.wait!r} finally: charge({self.charge!r})) "
            "except Exception: pass"
        )


@dataclass(frozen=True, repr=False)
class Gather(Habit):
    """``asyncio.gather(<waits and charges>, return_exceptions=True)``, then a charge."""

    items: tuple[Wait | str, ...]  # a str is a charge's label
    after: str | None
    shielded: bool

    async def run(self, ctx: RunContext, entry: Entry) -> None:
        calls = [
            item.request(ctx)
            if isinstance(item, Wait)
            else ctx.tool("charge", {"ref": ref(ctx, item)})
            for item in self.items
        ]
        await asyncio.gather(*calls, return_exceptions=True)
        if self.after is None:
            return
        if self.shielded:
            try:  # noqa: SIM105 - the habit under test
                await charge(ctx, self.after)
            except Exception:
                pass
        else:
            await charge(ctx, self.after)

    def model(self, p: ModelPass) -> None:
        for _ in self.items:
            p.request()  # every call is asked for before any of them runs
        for item in self.items:
            if isinstance(item, Wait):
                with contextlib.suppress(*BROAD):  # return_exceptions=True
                    p.wait(item)
            else:
                p.execute(item)  # admitted before the suspension: it runs
        if self.after is not None:
            try:
                p.request()
                p.execute(self.after)
            except BROAD:
                if not self.shielded:
                    raise

    def waits(self) -> list[Wait]:
        return [i for i in self.items if isinstance(i, Wait)]

    def guards(self, earlier: list[tuple[str, str]]) -> Guards:
        out = gated_guards(self.waits(), earlier)
        for item in self.items:
            if isinstance(item, str):
                out[item] = list(earlier)
        if self.after is not None:
            out[self.after] = [*earlier, *((w.label, "answered") for w in self.waits())]
        return out

    def __repr__(self) -> str:
        items = ", ".join(repr(i) if isinstance(i, Wait) else f"charge({i!r})" for i in self.items)
        out = f"gather({items}, return_exceptions=True)"
        if self.after is not None:
            after = f"charge({self.after!r})"
            out += f"; try: {after} except Exception: pass" if self.shielded else f"; {after}"
        return out


@dataclass(frozen=True, repr=False)
class RaiseAfter(Habit):
    """``except SuspendError: raise RuntimeError(...)`` around a wait."""

    wait: Wait

    async def run(self, ctx: RunContext, entry: Entry) -> None:
        try:
            await awaited(ctx, self.wait)
        except SuspendError as e:
            raise RuntimeError("a pause is not a failure") from e

    def model(self, p: ModelPass) -> None:
        try:
            p.request()
            p.wait(self.wait)
        except MSuspend as e:
            raise MNodeError from e

    def waits(self) -> list[Wait]:
        return [self.wait]

    def guards(self, earlier: list[tuple[str, str]]) -> Guards:
        return gated_guards([self.wait], earlier)

    def __repr__(self) -> str:
        return f"try: await {self.wait!r} except SuspendError: raise RuntimeError"


@dataclass(frozen=True, repr=False)
class Stray(Habit):
    """A task left running: once its node is over (node a's as soon as node b
    starts, in the same turn) it asks for a charge (``late call``), or awaits a
    charge the node asked for and never awaited (``late await``)."""

    late: str  # "call" | "await"
    label: str

    async def run(self, ctx: RunContext, entry: Entry) -> None:
        stray = ref(ctx, self.label)
        # A task of node a acts as soon as node b starts (the turn still going on),
        # one of node b once the turn is over.
        over = entry.left_a if entry.node == "a" else entry.turn_over
        if self.late == "call":

            async def later() -> None:
                await over.wait()
                await asyncio.sleep(0)
                try:
                    await ctx.tool("charge", {"ref": stray})
                except Exception as e:
                    entry.outcomes.append(e)
                else:
                    entry.outcomes.append(None)

            entry.strays.append(asyncio.ensure_future(later()))
            return
        try:
            kept = ctx.tool("charge", {"ref": stray})
        except SuspendError as refused:  # asked for after the turn suspended
            entry.outcomes.append(refused)
            return

        async def await_later() -> None:
            await over.wait()
            try:
                await kept
            except Exception as e:
                entry.outcomes.append(e)
            else:
                entry.outcomes.append(None)

        entry.strays.append(asyncio.ensure_future(await_later()))

    def model(self, p: ModelPass) -> None:
        if self.late == "call":
            p.strays += 1
            return
        try:
            p.request()
        except MSuspend:
            p.refused_strays += 1
        else:
            p.strays += 1

    def __repr__(self) -> str:
        if self.late == "call":
            return f"ensure_future(later: charge({self.label!r}))"
        return f"ensure_future(later: await <charge({self.label!r}) asked now>)"


UNRECORDED = frozenset({"random", "datetime.now()"})


@dataclass(frozen=True, repr=False)
class Keyed(Habit):
    """A tool called with a nonce: from ``random`` or ``datetime.now()`` (a new
    key on replay), or from ``ctx.now()`` / ``ctx.uuid()`` (recorded); through
    ``pay`` when ``override`` (matched by its ``idempotency_key``)."""

    source: str
    override: bool
    label: str

    async def run(self, ctx: RunContext, entry: Entry) -> None:
        if self.source == "random":
            nonce = str(random.random())
        elif self.source == "datetime.now()":
            nonce = datetime.now(UTC).isoformat()
        elif self.source == "ctx.now()":
            nonce = (await ctx.now()).isoformat()
        else:
            nonce = await ctx.uuid()
        tool = "pay" if self.override else "charge"
        await ctx.tool(tool, {"ref": ref(ctx, self.label), "nonce": nonce})

    def model(self, p: ModelPass) -> None:
        if self.source not in UNRECORDED:
            p.request()  # ctx.now() / ctx.uuid()
        p.request()
        if self.label in p.prior and self.source in UNRECORDED and not self.override:
            p.refuse_replay()
        p.execute(self.label)

    def guards(self, earlier: list[tuple[str, str]]) -> Guards:
        return {self.label: list(earlier)}

    def __repr__(self) -> str:
        tool = "pay" if self.override else "charge"
        return f"{tool}({self.label!r}, nonce={self.source})"


@dataclass(frozen=True, repr=False)
class Effect(Habit):
    """A plain ``charge``, or the blocking sync tool ``slow``."""

    tool: str  # "charge" | "slow"
    label: str

    async def run(self, ctx: RunContext, entry: Entry) -> None:
        await charge(ctx, self.label, self.tool)

    def model(self, p: ModelPass) -> None:
        p.request()
        p.execute(self.label)

    def guards(self, earlier: list[tuple[str, str]]) -> Guards:
        return {self.label: list(earlier)}

    def __repr__(self) -> str:
        return f"{self.tool}({self.label!r})"


@dataclass(frozen=True, repr=False)
class Guarded(Habit):
    """``try: <habits> / except Exception: pass`` (or ``BaseException``) around
    other habits: whatever they raise (a suspension, a denial, a refused replay,
    an error raised after a suspension) is swallowed, and the node goes on."""

    inner: tuple[Habit, ...]
    catch: str

    async def run(self, ctx: RunContext, entry: Entry) -> None:
        if self.catch == "Exception":
            try:
                for habit in self.inner:
                    await habit.run(ctx, entry)
            except Exception:
                pass
        else:
            try:
                for habit in self.inner:
                    await habit.run(ctx, entry)
            except BaseException:
                pass

    def model(self, p: ModelPass) -> None:
        try:
            for habit in self.inner:
                habit.model(p)
        except BROAD as e:
            p.swallowed.add(type(e).__name__)

    def waits(self) -> list[Wait]:
        return [w for h in self.inner for w in h.waits()]

    def passed(self) -> list[Wait]:
        return []  # a wait inside may have been skipped by an earlier error

    def guards(self, earlier: list[tuple[str, str]]) -> Guards:
        out: Guards = {}
        for habit in self.inner:
            out.update(habit.guards(earlier))
            earlier = [*earlier, *((w.label, "answered") for w in habit.passed())]
        return out

    def habits(self) -> list[Habit]:
        return [self, *(h for inner in self.inner for h in inner.habits())]

    def __repr__(self) -> str:
        inner = "; ".join(f"<{h!r}>" for h in self.inner)
        return f"try: [{inner}] except {self.catch}: pass"


def gated_guards(waits: list[Wait], earlier: list[tuple[str, str]]) -> Guards:
    """A gated tool executes only once approved."""
    return {w.label: [*earlier, (w.label, "approved")] for w in waits if w.kind == "gated"}


@dataclass(frozen=True, eq=False)
class Program:
    """The habits of node ``a``, then of node ``b``."""

    a: tuple[Habit, ...]
    b: tuple[Habit, ...]

    def __repr__(self) -> str:
        def node(habits: tuple[Habit, ...]) -> str:
            return "[" + "; ".join(f"<{h!r}>" for h in habits) + "]"

        return f"Program(a={node(self.a)}, b={node(self.b)})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # how Hypothesis prints it in a failing example

    @property
    def habits(self) -> list[Habit]:
        """Every habit, those inside a ``Guarded`` too."""
        return [h for top in self.a + self.b for h in top.habits()]

    def waits(self) -> dict[str, Wait]:
        return {w.label: w for h in self.a + self.b for w in h.waits()}

    def guards(self) -> Guards:
        """For each effect of the program: (wait label, "answered" | "approved")."""
        out: Guards = {}
        earlier: list[tuple[str, str]] = []
        for habit in self.a + self.b:
            out.update(habit.guards(earlier))
            earlier = [*earlier, *((w.label, "answered") for w in habit.passed())]
        return out

    def strays(self) -> set[str]:
        return {h.label for h in self.habits if isinstance(h, Stray)}

    def slow_labels(self) -> set[str]:
        return {h.label for h in self.habits if isinstance(h, Effect) and h.tool == "slow"}


# ---------------------------------------------------------------- the flow
@dataclass
class Entry:
    """What the nodes of a session's run read (the program) and leave (tasks)."""

    program: Program
    node: str = "a"  # the node running
    left_a: asyncio.Event = field(default_factory=asyncio.Event)  # node b started
    turn_over: asyncio.Event = field(default_factory=asyncio.Event)
    strays: list[asyncio.Future[None]] = field(default_factory=list)
    outcomes: list[BaseException | None] = field(default_factory=list)


#: The module-level registry the action nodes read, keyed by session.
REGISTRY: dict[str, Entry] = {}


async def node_a(state: dict[str, Any], ctx: RunContext) -> Any:
    entry = REGISTRY[ctx.session_id]
    entry.node = "a"
    for habit in entry.program.a:
        await habit.run(ctx, entry)
    return goto("b")


async def node_b(state: dict[str, Any], ctx: RunContext) -> Any:
    entry = REGISTRY[ctx.session_id]
    entry.node = "b"
    entry.left_a.set()
    for habit in entry.program.b:
        await habit.run(ctx, entry)
    return end("done")


MISBEHAVING_FLOW = define_flow(
    FLOW, "runs a misbehaving program", "a", [action("a", node_a), action("b", node_b)]
)


# ------------------------------------------------------------------ strategies
#: Drawn evenly (``keyed`` twice: it needs a wait after it to be replayed).
HABITS = (
    "swallow",
    "finally",
    "gather",
    "raise after",
    "stray",
    "keyed",
    "keyed",
    "plain",
    "charge",
    "guarded",  # last: not inside another
)
CATCHES = ("Exception", "BaseException")
KINDS = ("approve", "signal", "gated")


@st.composite
def programs(draw: st.DrawFn) -> Program:
    labels = itertools.count()
    slow_drawn = False

    def wait() -> Wait:
        return Wait(draw(st.sampled_from(KINDS)), f"w{next(labels)}")

    def charge_label() -> str:
        return f"c{next(labels)}"

    def habit(top: bool) -> Habit:
        nonlocal slow_drawn
        kind = draw(st.sampled_from(HABITS if top else HABITS[:-1]))
        if kind == "swallow":
            w = wait()
            catch = draw(st.sampled_from(CATCHES))
            return Swallow(w, catch, charge_label(), draw(st.booleans()))
        if kind == "finally":
            return Finally(wait(), charge_label())
        if kind == "gather":
            shape = draw(st.lists(st.sampled_from(["wait", "charge"]), min_size=1, max_size=3))
            items = tuple(wait() if s == "wait" else charge_label() for s in shape)
            after = charge_label() if draw(st.booleans()) else None
            return Gather(items, after, draw(st.booleans()))
        if kind == "raise after":
            return RaiseAfter(wait())
        if kind == "stray":
            return Stray(draw(st.sampled_from(["call", "await"])), f"s{next(labels)}")
        if kind == "keyed":
            source = draw(st.sampled_from(["random", "datetime.now()", "ctx.now()", "ctx.uuid()"]))
            return Keyed(source, draw(st.sampled_from([False, False, True])), charge_label())
        if kind == "plain":
            w = wait()
            return Plain(w, charge_label() if draw(st.booleans()) else None)
        if kind == "guarded":
            inner = tuple(habit(top=False) for _ in range(draw(st.integers(1, 2))))
            return Guarded(inner, draw(st.sampled_from(CATCHES)))
        if not slow_drawn and draw(st.integers(0, 5)) == 0:
            # The blocking tool costs SLOW seconds each time it runs: rare, once a program.
            slow_drawn = True
            return Effect("slow", charge_label())
        return Effect("charge", charge_label())

    habits = [habit(top=True) for _ in range(draw(st.integers(1, 5)))]
    split = draw(st.integers(0, len(habits)))
    return Program(tuple(habits[:split]), tuple(habits[split:]))


# ----------------------------------------------------------------- the machine
@dataclass(frozen=True)
class Prediction:
    """What the model says one pass does."""

    status: str  # "paused" | "finished" | "error"
    node: str  # where the run is after the pass
    wait: str | None = None
    error: str | None = None
    new: tuple[str, ...] = ()
    executed: frozenset[str] = frozenset()
    strays: int = 0
    refused_strays: int = 0
    swallowed: frozenset[str] = frozenset()


@dataclass(eq=False)
class Slot:
    """One program's run, and the model's view of it."""

    session: str
    program: Program
    run_id: str | None = None
    status: str = "new"  # "new" | "paused" | "finished" | "error"
    node: str = "a"
    waiting: str | None = None  # the label of the wait it is paused on
    error: str | None = None
    answers: dict[str, str] = field(default_factory=dict)
    executed: set[str] = field(default_factory=set)

    def __repr__(self) -> str:
        return f"Slot({self.session})"

    def predict(self) -> Prediction:
        p = ModelPass(dict(self.answers), self.executed)
        node = self.node
        while True:
            habits = self.program.a if node == "a" else self.program.b
            raised: Exception | None = None
            try:
                for habit in habits:
                    habit.model(p)
            except (MSuspend, MNodeError, MDenied, MNonDeterminism) as e:
                raised = e
            seen = Prediction(
                "",
                node,
                new=tuple(p.new),
                executed=frozenset(p.executed),
                strays=p.strays,
                refused_strays=p.refused_strays,
                swallowed=frozenset(p.swallowed),
            )
            if p.first_wait is not None:  # whatever the node returned or raised
                return replace(seen, status="paused", wait=p.first_wait)
            if p.mismatch:  # likewise: the turn ends in the refused replay
                return replace(seen, status="error", error=MODEL_ERRORS[MNonDeterminism])
            if raised is not None:
                return replace(seen, status="error", error=MODEL_ERRORS[type(raised)])
            if node == "b":
                return replace(seen, status="finished")
            node = "b"

    def waiting_wait(self) -> Wait | None:
        return self.program.waits()[self.waiting] if self.waiting is not None else None


def awaits(slot: Slot, kind: str) -> bool:
    """Whether the run is paused on an approval (``ctx.approve``, a gated tool) or a signal."""
    wait = slot.waiting_wait()
    return wait is not None and (wait.kind == "signal") == (kind == "signal")


def label_of(wait: WaitingFor | None) -> str | None:
    """The program's label of the wait a run waits on."""
    if wait is None:
        return None
    if wait.kind == "approval" and wait.operation is not None:  # the gated tool
        return str(wait.operation.args["ref"]).rpartition("/")[2]
    if wait.kind == "approval":
        return wait.title
    return wait.name


#: What each refusal's message must say (what to change, or what happened instead).
ADVICE: dict[type[KuralleError], tuple[str, ...]] = {
    NonDeterminismError: ("ctx.now()", "idempotency_key", "nothing was executed"),
    TurnClosedError: ("await every effect before the node returns", "nothing was executed"),
    SuspendError: ("deliver it with SignalDelivery",),
    SignalMismatchError: (),  # which signal to deliver, or that none is awaited: below
    ToolApprovalDeniedError: ("was denied", "must not be retried"),
    LeaseHeldError: ("wait for that turn to end",),
    StaleWriteError: ("Reload the run and try again",),
}

#: A delivery the run does not wait for: which signal to deliver, that the run
#: waits for none, or (an answer to an older request) to read the wait again.
MISMATCH = ("deliver the signal it waits for", "waits for no signal", "read waiting_for again")


def says_what_to_do(error: BaseException) -> str | None:
    """None if ``error`` is a KuralleError whose message says what to do, else why not."""
    if not isinstance(error, KuralleError):
        return f"{type(error).__name__} is not a KuralleError: {error!r}"
    advice = ADVICE.get(type(error))
    if advice is None:
        return f"unexpected refusal {type(error).__name__}: {error}"
    missing = [a for a in advice if a not in str(error)]
    if isinstance(error, SignalMismatchError) and not any(a in str(error) for a in MISMATCH):
        missing.append("which signal to deliver")
    if missing:
        return f"{type(error).__name__}'s message lacks {missing}: {error}"
    return None


class MisbehavingMachine(RuleBasedStateMachine):
    """Programs of misbehaving habits run; operators answer, workers resume and sweep."""

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
        self.ledger.loop_thread = threading.get_ident()  # the runner runs here
        self.agent = make_agent(self.ledger)
        self.slots: list[Slot] = []
        #: Every refusal raised to a caller, and every effect refused to a stray task.
        self.refusals: list[BaseException] = []
        self.tmp: Path | None = None
        if self.backend == "sqlite":
            self.tmp = Path(tempfile.mkdtemp(prefix="kuralle-misbehaving-"))
        self.store = self.open_store()
        self._states: dict[str, RunState] | None = None

    # ----------------------------------------------------------------- stores
    def open_store(self) -> RunStore:
        if self.backend == "memory":
            return RunStore.memory()
        if self.backend == "sqlite":
            assert self.tmp is not None
            return RunStore.sqlite(str(self.tmp / "runs.db"))
        assert self.dsn is not None
        return RunStore.postgres(self.dsn)

    def states(self) -> dict[str, RunState]:
        """Every started run as the store now holds it (cached until the next turn)."""
        if self._states is None:
            runtime = Runtime([self.agent], store=self.store, holder=WORKER)

            async def read() -> dict[str, RunState]:
                out: dict[str, RunState] = {}
                for slot in self.slots:
                    if slot.run_id is not None:
                        state = await runtime.get_run(slot.run_id, slot.session)
                        assert state is not None, f"{slot} was never stored"
                        out[slot.session] = state
                return out

            self._states = self.runner.run(read())
        return self._states

    # ----------------------------------------------------------------- sweeps
    def sweep(self, stop: threading.Event | None) -> int:
        """A second worker, on its own event loop (run in a thread): sweeps for
        orphans until ``stop`` is set (once, without one); how many runs it drove."""
        store = self.store if self.backend == "memory" else self.open_store()

        async def sweeping() -> int:
            runtime = Runtime([self.agent], store=store, holder=SWEEPER, lease_ttl=LEASE)
            drove = 0
            while True:
                drove += len(await recover_orphaned_runs(runtime))
                if stop is None or stop.is_set():
                    return drove
                await asyncio.sleep(0.03)

        try:
            return asyncio.run(sweeping())
        finally:
            if store is not self.store:
                store.close()

    # ------------------------------------------------------------------ turns
    def turn(
        self,
        slot: Slot,
        call: Callable[[Runtime], Awaitable[TurnResult]],
        prediction: Prediction | None,
    ) -> tuple[TurnResult | None, BaseException | None]:
        """One turn of the worker; a second worker sweeps meanwhile when the
        model says the blocking tool runs in it. Checks what no turn may do:
        take the run over, let a stray task act, write after it returned."""
        entry = REGISTRY[slot.session]
        sweeping = prediction is not None and bool(set(prediction.new) & slot.program.slow_labels())
        before = self.states().get(slot.session)
        self._states = None
        executions = len(self.ledger.executions)
        STATS[self.backend, "turns"] += 1
        if sweeping:
            STATS[self.backend, "turns with a blocking tool and a sweeper"] += 1

        async def go() -> tuple[TurnResult | None, BaseException | None, int, int, int]:
            entry.left_a = asyncio.Event()
            entry.turn_over = asyncio.Event()
            entry.strays = []
            entry.outcomes = []
            runtime = Runtime(
                [self.agent], store=self.store, holder=WORKER, lease_ttl=LEASE if sweeping else 30
            )
            stop = threading.Event()
            sweeper = (
                asyncio.ensure_future(asyncio.to_thread(self.sweep, stop)) if sweeping else None
            )
            result: TurnResult | None = None
            error: BaseException | None = None
            try:
                result = await call(runtime)
            except Exception as e:
                error = e
            finally:
                stop.set()
            drove = await sweeper if sweeper is not None else 0
            run_id = result.run_id if result is not None else slot.run_id
            assert run_id is not None, error
            state = await runtime.get_run(run_id, slot.session)
            assert state is not None
            # The turn is over: the tasks it left running try their effects now.
            entry.left_a.set()
            entry.turn_over.set()
            await asyncio.wait_for(asyncio.gather(*entry.strays), 10)
            await asyncio.sleep(0.01)
            later = await runtime.get_run(run_id, slot.session)
            assert later is not None
            return result, error, drove, state.version, later.version

        result, error, drove, version, later = self.runner.run(go())
        if result is not None and slot.run_id is None:
            slot.run_id = result.run_id
        if error is not None:
            self.refusals.append(error)
            STATS[self.backend, f"refused {type(error).__name__}"] += 1
        self.refusals.extend(o for o in entry.outcomes if o is not None)

        # The guarantees first (a failure names the one broken), then the model.
        self.no_gated_effect_ran_before_its_approval()
        self.no_key_was_executed_twice()
        self.no_task_left_running_got_an_effect_through()
        self.every_refusal_is_a_kuralle_error_that_says_what_to_do()
        assert drove == 0, "the second worker took over a run whose turn was still going"
        assert later == version, "the run was written to after its turn returned"
        assert None not in entry.outcomes, "a task left running had an effect executed"
        if prediction is None:
            # Nothing was driven: nothing executed, nothing stored.
            assert len(self.ledger.executions) == executions, "a refused call executed a tool"
            assert before is not None and version == before.version, "a refused call wrote"
            return result, error
        self.check_pass(slot, prediction, result, error, entry)
        return result, error

    def check_pass(
        self,
        slot: Slot,
        prediction: Prediction,
        result: TurnResult | None,
        error: BaseException | None,
        entry: Entry,
    ) -> None:
        """The turn did what the model predicted, and the slot follows it."""
        executed = {e.label for e in self.ledger.of(slot.session) if not e.label.startswith("s")}
        assert executed == set(prediction.executed), (
            f"the run executed {sorted(executed)}; by the rules it executes "
            f"{sorted(prediction.executed)}"
        )
        turn_closed = sum(isinstance(o, TurnClosedError) for o in entry.outcomes)
        refused_at_once = sum(isinstance(o, SuspendError) for o in entry.outcomes)
        assert (turn_closed, refused_at_once) == (prediction.strays, prediction.refused_strays), (
            entry.outcomes
        )
        state = self.states()[slot.session]
        if prediction.status == "error":
            assert error is not None and type(error).__name__ == prediction.error, (
                f"by the rules the turn ends in {prediction.error}; it raised {error!r} "
                f"and returned {result}"
            )
            assert state.status == "error" and state.error is not None
            assert state.error.type == prediction.error, state.error
            event(f"ended in {prediction.error}")
        else:
            assert error is None, f"by the rules the run is {prediction.status}; {error!r}"
            assert result is not None and result.status == prediction.status, (
                f"the run is {result.status}; by the rules it is {prediction.status}"
                + (f" on its first wait {prediction.wait}" if prediction.wait else "")
            )
            if prediction.status == "paused":
                assert label_of(result.waiting_for) == prediction.wait, (
                    f"paused on {label_of(result.waiting_for)}, its first wait was "
                    f"{prediction.wait}"
                )
                assert state.error is None, "an error raised after a suspension was kept"
                event(f"paused on {slot.program.waits()[prediction.wait].kind}")
            else:
                event("finished")
        for what in sorted(prediction.swallowed):
            event(f"a broad except swallowed {what[1:]}")
        slot.status = prediction.status
        slot.node = prediction.node
        slot.waiting = prediction.wait
        slot.error = prediction.error
        slot.executed = set(prediction.executed)

    # ------------------------------------------------------------------ rules
    @initialize(target=runs, program=programs())
    def a_user_starts_a_run(self, program: Program) -> Slot:
        return self.start(program)

    @precondition(lambda self: len(self.slots) < 3)
    @rule(target=runs, program=programs())
    def another_user_starts_a_run(self, program: Program) -> Slot:
        return self.start(program)

    def start(self, program: Program) -> Slot:
        session = f"m{len(self.slots)}-{uuid4().hex[:8]}"
        REGISTRY[session] = Entry(program)
        slot = Slot(session, program)
        self.slots.append(slot)

        async def call(runtime: Runtime) -> TurnResult:
            return await runtime.run(session, kind="flow", flow_name=FLOW).result()

        self.turn(slot, call, slot.predict())
        return slot

    @precondition(lambda self: any(awaits(s, "approval") for s in self.slots))
    @rule(slot=runs.filter(lambda s: awaits(s, "approval")))
    def an_approver_approves(self, slot: Slot) -> None:
        """Approve the approval (``ctx.approve`` or a gated tool) the run waits for."""
        self.decide(slot, approved=True, accepted=True)

    @precondition(lambda self: any(awaits(s, "approval") for s in self.slots))
    @rule(slot=runs.filter(lambda s: awaits(s, "approval")))
    def an_approver_denies(self, slot: Slot) -> None:
        """Deny the approval (``ctx.approve`` or a gated tool) the run waits for."""
        self.decide(slot, approved=False, accepted=True)

    @precondition(lambda self: any(awaits(s, "signal") for s in self.slots))
    @rule(slot=runs.filter(lambda s: awaits(s, "signal")))
    def the_awaited_signal_arrives(self, slot: Slot) -> None:
        """Deliver the signal the run waits for."""
        assert slot.waiting is not None
        self.signal(slot, slot.waiting, accepted=True)

    @rule(slot=runs)
    def a_delivery_the_run_does_not_wait_for(self, slot: Slot) -> None:
        """An approval for a run that waits for a signal (or for nothing any more),
        or a signal (the program's next one, too early) for a run that waits for
        an approval: refused."""
        wait = slot.waiting_wait()
        if wait is None or wait.kind == "signal":
            self.decide(slot, approved=True, accepted=False)
            return
        pending = [
            w.label
            for w in slot.program.waits().values()
            if w.kind == "signal" and w.label not in slot.answers
        ]
        self.signal(slot, pending[0] if pending else "nobody-waits", accepted=False)

    @precondition(lambda self: any(awaits(s, "approval") for s in self.slots))
    @rule(slot=runs.filter(lambda s: awaits(s, "approval")))
    def two_approvers_approve_at_once(self, slot: Slot) -> None:
        """Two workers (another holder, its own store) deliver an approval of the
        same request at once: one drives the run, the other is refused."""
        waiting = self.states()[slot.session].waiting_for
        assert waiting is not None and slot.run_id is not None
        run_id, request_id = slot.run_id, waiting.request_id
        losers: list[BaseException] = []

        def delivery(by: str) -> SignalDelivery:
            payload = {"approved": True, "by": by}
            return SignalDelivery(
                signal_id=uuid4().hex,
                name="__approval",
                payload=payload,
                request_id=request_id,
                actor=by,
            )

        async def call(runtime: Runtime) -> TurnResult:
            store = self.store if self.backend == "memory" else self.open_store()
            other = Runtime([self.agent], store=store, holder="worker-c")
            try:
                answers = await asyncio.gather(
                    runtime.run(
                        slot.session, run_id=run_id, signal_delivery=delivery("alice")
                    ).result(),
                    other.run(
                        slot.session, run_id=run_id, signal_delivery=delivery("bob")
                    ).result(),
                    return_exceptions=True,
                )
            finally:
                if store is not self.store:
                    store.close()
            # The loser is refused before its turn drives anything; the winner's
            # turn ends as the model says (paused, finished, or in an error).
            refused = (LeaseHeldError, StaleWriteError, SignalMismatchError)
            won = [a for a in answers if not isinstance(a, refused)]
            losers.extend(a for a in answers if isinstance(a, refused))
            assert len(won) == 1, f"one approval delivered twice, or by nobody: {answers}"
            if isinstance(won[0], BaseException):
                raise won[0]
            return won[0]

        self.deliver(slot, slot.waiting, "approved", call)
        self.refusals.extend(losers)
        for loser in losers:
            event(f"the second approver was refused with {type(loser).__name__}")
            STATS[self.backend, f"refused {type(loser).__name__}"] += 1

    def decide(self, slot: Slot, *, approved: bool, accepted: bool) -> None:
        async def call(runtime: Runtime) -> TurnResult:
            assert slot.run_id is not None
            decide = runtime.approve if approved else runtime.deny
            return await decide(slot.run_id, slot.session, by="alice", reason="checked")

        label = slot.waiting if accepted else None
        self.deliver(slot, label, "approved" if approved else "denied", call)

    def signal(self, slot: Slot, name: str, *, accepted: bool) -> None:
        async def call(runtime: Runtime) -> TurnResult:
            assert slot.run_id is not None
            return await runtime.signal(slot.run_id, slot.session, name, {"by": "machine"})

        self.deliver(slot, name if accepted else None, "delivered", call)

    def deliver(
        self,
        slot: Slot,
        label: str | None,
        answer: str,
        call: Callable[[Runtime], Awaitable[TurnResult]],
    ) -> None:
        """Deliver an answer: to ``label`` (the wait it is paused on), or refused."""
        if label is None:
            _, error = self.turn(slot, call, None)
            assert isinstance(error, SignalMismatchError), (
                f"a delivery to a run {slot.status} on {slot.waiting} was not refused: {error!r}"
            )
            event("a delivery was refused")
            return
        # Recorded before delivering: the tools see it from the moment the turn opens.
        slot.answers[label] = answer
        self.ledger.answer(slot.session, label, answer)
        STATS[self.backend, f"answers {answer}"] += 1
        self.turn(slot, call, slot.predict())

    @rule(slot=runs)
    def a_worker_resumes_the_run(self, slot: Slot) -> None:
        """A plain call on the run: a paused or finished run stays as it is, an
        errored one is driven again (and errs again)."""

        async def call(runtime: Runtime) -> TurnResult:
            assert slot.run_id is not None
            return await runtime.run(slot.session, run_id=slot.run_id).result()

        if slot.status == "error":
            self.turn(slot, call, slot.predict())
            return
        result, error = self.turn(slot, call, None)
        assert error is None, error
        assert result is not None and result.status == slot.status, (result, slot.status)
        assert label_of(result.waiting_for) == slot.waiting, (result.waiting_for, slot.waiting)

    @rule()
    def a_second_worker_sweeps_for_orphans(self) -> None:
        """No run is orphaned (none is running without a live lease): it drives none."""
        self._states = None
        drove = self.runner.run(asyncio.to_thread(self.sweep, None))
        assert drove == 0, "a sweeper drove a run nobody had orphaned"

    # ------------------------------------------------------------- invariants
    @invariant()
    def no_gated_effect_ran_before_its_approval(self) -> None:
        guards = {s.session: s.program.guards() for s in self.slots}
        for e in self.ledger.snapshot():
            if e.label.startswith("s"):
                continue  # a stray's: the next invariant's
            for label, need in guards[e.session][e.label]:
                answer = e.answers.get(label)
                assert answer is not None, f"{e.tool} {e.label} ran before {label} was answered"
                assert need != "approved" or answer == "approved", (
                    f"{e.tool} {e.label} ran with {label} {answer}"
                )
            assert e.tool == "charge" or not e.on_loop_thread, (
                f"the sync tool {e.tool} ran on the event loop's thread"
            )

    @invariant()
    def no_key_was_executed_twice(self) -> None:
        executions = self.ledger.snapshot()
        keys = Counter(e.key for e in executions)
        twice = [e for e in executions if keys[e.key] > 1]
        assert twice == [], f"one idempotency key executed more than once: {twice}"
        effects = Counter((e.session, e.label) for e in executions)
        again = [e for e in executions if effects[e.session, e.label] > 1]
        assert again == [], f"one effect of a program executed more than once: {again}"

    @invariant()
    def no_task_left_running_got_an_effect_through(self) -> None:
        strays = {s.session: s.program.strays() for s in self.slots}
        through = [e for e in self.ledger.snapshot() if e.label in strays[e.session]]
        assert through == [], through

    @invariant()
    def every_refusal_is_a_kuralle_error_that_says_what_to_do(self) -> None:
        problems = [p for p in map(says_what_to_do, self.refusals) if p is not None]
        assert problems == [], problems

    @invariant()
    def a_paused_run_waits_on_the_first_wait_its_turn_hit(self) -> None:
        for slot in self.slots:
            if slot.run_id is None:
                continue
            state = self.states()[slot.session]
            assert state.status == slot.status, (slot, state.status, slot.status)
            assert label_of(state.waiting_for) == slot.waiting, (slot, state.waiting_for)
            assert state.lease_holder is None, (slot, state.lease_holder)

    @invariant()
    def the_event_loop_reported_no_lost_errors(self) -> None:
        assert self.loop_errors == []

    def teardown(self) -> None:
        try:
            assert self.loop_errors == [], self.loop_errors
        finally:
            self.runner.close()
            self.store.close()
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            for slot in self.slots:
                REGISTRY.pop(slot.session, None)


class SqliteMisbehavingMachine(MisbehavingMachine):
    backend = "sqlite"


class PostgresMisbehavingMachine(MisbehavingMachine):
    backend = "postgres"


def budget(default: int) -> settings:
    """``default`` examples, or ``KURALLE_MISBEHAVING_EXAMPLES`` of them when set."""
    examples = int(os.environ.get("KURALLE_MISBEHAVING_EXAMPLES") or default)
    return settings(
        max_examples=examples,
        stateful_step_count=8,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


TestMisbehavingMachineMemory = MisbehavingMachine.TestCase
TestMisbehavingMachineMemory.settings = budget(60)
TestMisbehavingMachineSqlite = SqliteMisbehavingMachine.TestCase
TestMisbehavingMachineSqlite.settings = budget(20)


@pytest.mark.postgres
def test_misbehaving_machine_postgres(pg_dsn: str) -> None:
    """The same machine over one PostgreSQL database."""
    PostgresMisbehavingMachine.dsn = pg_dsn
    try:
        run_state_machine_as_test(PostgresMisbehavingMachine, settings=budget(12))
    finally:
        PostgresMisbehavingMachine.dsn = None


async def test_a_swallowed_refusal_never_replays_one_approval_as_another(open_store: Any) -> None:
    """Found by the machine: a replay's ``NonDeterminismError``, swallowed by a
    broad ``except`` around a random-keyed charge and an approval, left the turn
    going; the next ``ctx.approve`` took the swallowed one's callsite, got the
    decision recorded there (given for another question) and charged 1000 that
    nobody approved. Now the mismatch stops the turn: it ends in that error."""
    charged: list[int] = []

    class Amount(BaseModel):
        amount: int
        nonce: str = ""

    def charge_(args: Amount) -> dict[str, Any]:
        charged.append(args.amount)
        return {"charged": args.amount}

    async def node(state: dict[str, Any], ctx: RunContext) -> Any:
        try:
            await ctx.tool("charge", {"amount": 1, "nonce": str(random.random())})
            await ctx.approve("Ship order 1?")
        except Exception:
            pass  # swallows the suspension, and on the replay the NonDeterminismError
        decision = await ctx.approve("Refund 1000?")
        if decision.approved:
            await ctx.tool("charge", {"amount": 1000})
        return end("done")

    agent = define_agent(
        "agent",
        "",
        None,
        [define_tool("charge", "charges a card", Amount, charge_)],
        [define_flow("f", "", "n", [action("n", node)])],
    )
    runtime = Runtime([agent], store=open_store())
    paused = await runtime.run("s", kind="flow", flow_name="f").result()
    assert paused.waiting_for is not None and paused.waiting_for.title == "Ship order 1?"
    try:
        after = await runtime.approve(paused.run_id, "s", by="alice")
    except KuralleError:
        pass  # refused: the turn ends in error
    else:
        assert after.waiting_for is not None, f"{after.status} without asking 'Refund 1000?'"
        assert after.waiting_for.title == "Refund 1000?"
    assert charged == [1], "1000 was charged on the approval given for 'Ship order 1?'"
