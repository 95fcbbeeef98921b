"""The promise at the edges, as a Hypothesis state machine (docs/guarantees.md).

Beside the crash machine (crashes at every journal boundary) and the
misbehaving-code machine, this one drives a run from where real applications
meet it: keyed conversation turns and keyed flow starts, retries of both
(the same key and request, and the same key with another request), a worker
that dies inside a tool (the testing kit's ``Crash``, what ``SIGKILL``
leaves: the effect done, its result not journaled, the dead worker's lease
on the run), recovery by a second worker, approvals racing cancels and
denials, and tools that mutate their args, raise ``SystemExit`` or return a
value the journal cannot hold.

Invariants (one guarantee each):

- one turn per inbound key: a conversation holds one user message per key;
- one run per start key: every retry of a keyed start answers with its run;
- each approved operation executed with exactly its approved args, on every
  attempt (the tool converts them in place, which must change nothing);
- no key executed twice except an in-doubt retry (a crash inside the tool);
- no run left ``running`` without a lease record (a turn driving it, or a
  dead worker's, for recovery to find);
- every refusal is a ``KuralleError`` whose message says what to do.

Budget: ``make test`` runs a few examples per backend; set
``KURALLE_EDGE_EXAMPLES=200`` for a longer hunt (README.md, "Tests and
benchmarks"); run with ``-s`` to see the counts per backend.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import psycopg
import pytest
from conftest import dsn_for
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from psycopg import sql
from pydantic import BaseModel

from kuralle_es import (
    IdempotencyConflictError,
    InvalidArgumentError,
    KuralleError,
    LeaseHeldError,
    ModelRequest,
    ModelResponse,
    RetryPolicy,
    RunContext,
    RunStore,
    Runtime,
    StaleWriteError,
    ToolApprovalDeniedError,
    ToolCall,
    ToolCallRequest,
    ToolExecutionError,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    recover_orphaned_runs,
)
from kuralle_es.testing import Crash, ScriptedModel

TTL = 0.05
#: How each call's tool behaves: in a crash, it dies after its effect happened.
BEHAVIOURS = ("ok", "mutates", "exits", "unrecordable", "crash")
#: Counts per backend, printed at the end of a session run with ``-s``.
STATS: Counter[tuple[str, str]] = Counter()


class Amount(BaseModel):
    amount: float
    behaviour: str = "ok"


@dataclass
class Ledger:
    """What the payment system saw: (tool, key, amount) per execution."""

    executions: list[tuple[str, str, float]] = field(default_factory=list)
    #: Keys whose execution a crash cut off (each may run once more, in doubt).
    in_doubt: Counter[str] = field(default_factory=Counter)
    #: Keys whose tool raised SystemExit on its first attempt.
    exited: set[str] = field(default_factory=set)

    def per_key(self) -> Counter[str]:
        return Counter(key for _, key, _ in self.executions)


def build(ledger: Ledger) -> list[Any]:
    """The world's agents: a ``clerk`` whose model calls ``hold`` each user turn, and
    an ``order`` flow that holds, then pays once approved."""

    def hold(args: Amount, call: ToolCall) -> Any:
        behaviour = args.behaviour
        args.amount = round(args.amount * 100)  # converted in place, as ported apps do
        ledger.executions.append(("hold", call.idempotency_key, args.amount))
        if behaviour == "exits" and call.idempotency_key not in ledger.exited:
            ledger.exited.add(call.idempotency_key)
            raise SystemExit(2)
        if behaviour == "crash" and not ledger.in_doubt[call.idempotency_key]:
            ledger.in_doubt[call.idempotency_key] += 1
            raise Crash("the worker dies inside hold, after the hold was placed")
        if behaviour == "unrecordable":
            return {"note": "cut \ud83d"}
        return {"held": args.amount}

    def pay(args: Amount, call: ToolCall) -> Any:
        args.amount = round(args.amount * 100)
        ledger.executions.append(("pay", call.idempotency_key, args.amount))
        return {"paid": args.amount}

    retry = RetryPolicy(max_attempts=2, initial_interval=0.001)
    tools = [
        define_tool("hold", "", Amount, hold, retry=retry),
        define_tool("pay", "", Amount, pay, needs_approval=True, retry=retry),
    ]

    def order(behaviour: str) -> Any:
        async def run(state: dict[str, Any], ctx: RunContext) -> Any:
            try:
                await ctx.tool("hold", {"amount": 10.5, "behaviour": behaviour})
            except ToolExecutionError:
                return end("hold failed")
            try:
                await ctx.tool("pay", {"amount": 42.5})
            except ToolApprovalDeniedError:
                return end("declined")
            return end("paid")

        return run

    def model(request: ModelRequest) -> ModelResponse | str:
        last = request.messages[-1]
        if last.role == "tool":
            return f"done: {last.content}"
        behaviour = (last.content or "ok").split()[0]
        call = ToolCallRequest(id="h", name="hold", args={"amount": 1.5, "behaviour": behaviour})
        return ModelResponse(tool_calls=[call])

    flows = [define_flow(f"order-{b}", "", "go", [action("go", order(b))]) for b in BEHAVIOURS]
    return [
        define_agent("shop", "", ScriptedModel(model), tools, flows),
        define_agent("clerk", "", ScriptedModel(model), tools),
    ]


@dataclass
class Keyed:
    """A keyed call the machine made: what it asked, and the run that answers it."""

    key: str
    kind: str  # "flow" or "conversation"
    session: str
    behaviour: str
    text: str
    run_id: str | None = None


class EdgeMachine(RuleBasedStateMachine):
    backend = "memory"
    #: PostgreSQL: the admin DSN of the server; each example gets a database of its own.
    admin_dsn: str | None = None

    def __init__(self) -> None:
        super().__init__()
        STATS[self.backend, "examples"] += 1
        self.runner = asyncio.Runner()
        self.ledger = Ledger()
        self.tmp: Path | None = None
        self.memory: RunStore | None = None
        if self.backend == "sqlite":
            self.tmp = Path(tempfile.mkdtemp(prefix="kuralle-edge-"))
        elif self.backend == "memory":
            self.memory = RunStore.memory()
        self.dsn: str | None = None
        if self.backend == "postgres":
            assert self.admin_dsn is not None
            self.database = f"kuralle_edge_{uuid4().hex[:12]}"
            with psycopg.connect(self.admin_dsn, autocommit=True) as admin:
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))
            self.dsn = dsn_for(self.admin_dsn, self.database)
        self.stores: dict[str, RunStore] = {}
        self.calls: list[Keyed] = []
        self.approved: set[str] = set()
        self.counter = 0

    # ---------------------------------------------------------------- helpers
    def store(self, holder: str = "reader") -> RunStore:
        """The store of one worker (each its own, as separate processes would have)."""
        if self.memory is not None:
            return self.memory
        if holder not in self.stores:
            if self.backend == "sqlite":
                assert self.tmp is not None
                self.stores[holder] = RunStore.sqlite(str(self.tmp / "runs.db"))
            else:
                assert self.dsn is not None
                self.stores[holder] = RunStore.postgres(self.dsn)
        return self.stores[holder]

    def runtime(self, holder: str) -> Runtime:
        return Runtime(build(self.ledger), store=self.store(holder), lease_ttl=TTL, holder=holder)

    def run(self, coroutine: Any) -> Any:
        return self.runner.run(coroutine)

    def refused(self, error: BaseException) -> None:
        """Every refusal is a KuralleError that says what to do."""
        assert isinstance(error, KuralleError), repr(error)
        assert len(str(error)) > 30, str(error)
        STATS[self.backend, f"refused {type(error).__name__}"] += 1

    def send(self, call: Keyed, text: str, holder: str) -> Any:
        runtime = self.runtime(holder)

        async def go() -> tuple[str | None, Any]:
            if call.kind == "flow":
                handle = runtime.run(
                    call.session,
                    input=text,
                    kind="flow",
                    flow_name=f"order-{call.behaviour}",
                    idempotency_key=call.key,
                )
            else:
                handle = runtime.run(
                    call.session, input=text, agent="clerk", idempotency_key=call.key
                )
            try:
                result = await handle.result()
            except Crash:
                STATS[self.backend, "crashes"] += 1
                return await handle.run_id, "crashed"
            except KuralleError as e:
                self.refused(e)
                try:
                    opened: str | None = await handle.run_id
                except KuralleError:
                    opened = None
                return opened, e
            return result.run_id, result

        run_id, outcome = self.run(go())
        STATS[self.backend, "turns"] += 1
        if run_id is not None and call.run_id is None:
            call.run_id = run_id
        if run_id is not None:
            assert run_id == call.run_id, "one run per inbound key"
        return outcome

    # ------------------------------------------------------------------ rules
    @rule(
        kind=st.sampled_from(["flow", "conversation"]),
        behaviour=st.sampled_from(BEHAVIOURS),
    )
    def make_a_keyed_call(self, kind: str, behaviour: str) -> None:
        self.counter += 1
        session = f"s{self.counter}" if kind == "flow" else f"chat{self.counter}"
        call = Keyed(f"key-{self.counter}", kind, session, behaviour, f"{behaviour} please")
        self.calls.append(call)
        self.send(call, call.text, "worker-a")

    @precondition(lambda self: self.calls)
    @rule(data=st.data())
    def retry_a_keyed_call_with_the_same_request(self, data: st.DataObject) -> None:
        call = data.draw(st.sampled_from(self.calls))
        outcome = self.send(call, call.text, "worker-b")
        if isinstance(outcome, LeaseHeldError):
            return  # a dead worker's lease still live: retried later
        if isinstance(outcome, KuralleError):
            # A turn the journal refused (an unrecordable value) ends the run error;
            # its retry answers with the run, never with a mismatch.
            assert not isinstance(outcome, IdempotencyConflictError), outcome

    @precondition(lambda self: any(c.run_id for c in self.calls))
    @rule(data=st.data())
    def retry_a_keyed_call_with_another_request(self, data: st.DataObject) -> None:
        call = data.draw(st.sampled_from([c for c in self.calls if c.run_id]))
        before = self.version(call)
        outcome = self.send(call, call.text + " and more", "worker-b")
        assert isinstance(outcome, IdempotencyConflictError | LeaseHeldError), outcome
        assert self.version(call) == before, "a refusal writes nothing"

    @rule()
    def a_second_worker_recovers_the_orphans(self) -> None:
        async def go() -> list[str]:
            await asyncio.sleep(TTL * 1.5)
            return await recover_orphaned_runs(self.runtime("rescuer"))

        recovered = self.run(go())
        STATS[self.backend, "recoveries"] += len(recovered)

    @precondition(lambda self: self.paused())
    @rule(data=st.data(), answer=st.sampled_from(["approve", "deny", "approve+cancel"]))
    def an_operator_answers_an_approval(self, data: st.DataObject, answer: str) -> None:
        call = data.draw(st.sampled_from(self.paused()))
        assert call.run_id is not None
        approver, operator = self.runtime("approver"), self.runtime("operator")

        async def go() -> list[Any]:
            assert call.run_id is not None
            decide = (
                approver.deny(call.run_id, call.session, by="bo")
                if answer == "deny"
                else approver.approve(call.run_id, call.session, by="ann")
            )
            racing = [decide]
            if answer == "approve+cancel":
                racing.append(operator.cancel(call.run_id, call.session, "changed my mind"))
            return await asyncio.gather(*racing, return_exceptions=True)

        for outcome in self.run(go()):
            if isinstance(outcome, BaseException):
                if isinstance(outcome, StaleWriteError):
                    assert outcome.recorded or "nothing of this write" in str(outcome)
                elif not isinstance(outcome, InvalidArgumentError | KuralleError):
                    raise outcome
                self.refused(outcome)
        if answer != "deny":
            self.approved.add(call.run_id)

    # -------------------------------------------------------------- reading
    def states(self) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            runtime = self.runtime("reader")
            found = {}
            for call in self.calls:
                if call.run_id is not None:
                    state = await runtime.get_run(call.run_id, call.session)
                    assert state is not None
                    found[call.key] = (state, await runtime.get_steps(call.run_id, call.session))
            return found

        found: dict[str, Any] = self.run(go())
        return found

    def version(self, call: Keyed) -> int:
        state, _ = self.states()[call.key]
        return int(state.version)

    def paused(self) -> list[Keyed]:
        states = self.states()
        return [
            c
            for c in self.calls
            if c.key in states
            and states[c.key][0].status == "paused"
            and states[c.key][0].waiting_for is not None
            and states[c.key][0].waiting_for.kind == "approval"
        ]

    # ------------------------------------------------------------ invariants
    @invariant()
    def one_turn_per_inbound_key(self) -> None:
        for key, (state, _) in self.states().items():
            call = next(c for c in self.calls if c.key == key)
            users = [m.content for m in state.messages if m.role == "user"]
            assert users == [call.text], (key, users)

    @invariant()
    def each_approved_operation_ran_with_exactly_its_approved_args(self) -> None:
        # Every attempt converts its own copy: a retried hold or pay never sees the
        # cents a previous attempt wrote (10.5 -> 1050, never 105000).
        for tool, key, amount in self.ledger.executions:
            assert amount in ({4250} if tool == "pay" else {1050, 150}), (tool, key, amount)

    @invariant()
    def no_key_executed_twice_but_an_in_doubt_retry_or_a_retried_exit(self) -> None:
        for key, count in self.ledger.per_key().items():
            allowed = 1 + self.ledger.in_doubt[key] + (key in self.ledger.exited)
            assert count <= allowed, (key, count, allowed)

    @invariant()
    def no_run_is_left_running_without_a_lease(self) -> None:
        async def go() -> None:
            store = self.store()
            for call in self.calls:
                if call.run_id is None:
                    continue
                run = await store.load_async(call.run_id)
                assert run is not None
                if run.status == "running":
                    assert await store.lease_async(call.run_id) is not None, call

        self.run(go())

    def teardown(self) -> None:
        try:
            for store in self.stores.values():
                store.close()
            if self.memory is not None:
                self.memory.close()
        finally:
            self.runner.close()
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            if self.dsn is not None and self.admin_dsn is not None:
                with psycopg.connect(self.admin_dsn, autocommit=True) as admin:
                    admin.execute(
                        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                            sql.Identifier(self.database)
                        )
                    )


class SqliteEdgeMachine(EdgeMachine):
    backend = "sqlite"


class PostgresEdgeMachine(EdgeMachine):
    backend = "postgres"


def budget(default: int) -> settings:
    """``default`` examples, or ``KURALLE_EDGE_EXAMPLES`` of them when set."""
    examples = int(os.environ.get("KURALLE_EDGE_EXAMPLES") or default)
    return settings(
        max_examples=examples,
        stateful_step_count=10,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


TestEdgeMachineMemory = EdgeMachine.TestCase
TestEdgeMachineMemory.settings = budget(25)
TestEdgeMachineSqlite = SqliteEdgeMachine.TestCase
TestEdgeMachineSqlite.settings = budget(8)


@pytest.mark.postgres
def test_edge_machine_postgres(postgres_admin_dsn: str) -> None:
    PostgresEdgeMachine.admin_dsn = postgres_admin_dsn
    try:
        run_state_machine_as_test(PostgresEdgeMachine, settings=budget(8))
    finally:
        PostgresEdgeMachine.admin_dsn = None


def teardown_module() -> None:
    for (backend, what), count in sorted(STATS.items()):
        print(f"edge machine [{backend}] {what}: {count}")
