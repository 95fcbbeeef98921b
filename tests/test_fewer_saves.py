"""Which saves a turn makes, and which it shares (README.md, "Architecture").

The intents of a parallel batch share one save on a store whose saves
block. What must not change: what opens a turn (a delivery) is saved before
the node runs, a turn waiting on the outside world (a model) holds a live
lease, and racing deliveries store one delivery and execute its tool once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from kuralle_es import (
    KuralleError,
    LeaseHeldError,
    ModelRequest,
    ModelResponse,
    RunStore,
    Runtime,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
)
from kuralle_es._journal.leases import LeaseOp
from kuralle_es._journal.run import Run
from kuralle_es._journal.store_url import postgres_address

STORES = ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
BLOCKING_STORES = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


class CountingStore(RunStore):
    """The real store, keeping the event types of every save it made."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(env=env)
        self.saves: list[list[str]] = []

    async def save_run_async(self, run: Run, lease: LeaseOp | None = None) -> None:
        kinds = [type(event).TOPIC.rsplit(".", 1)[-1] for event in run.pending_events]
        await super().save_run_async(run, lease)
        self.saves.append(kinds)


@pytest.fixture
def counting_store(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[], CountingStore]]:
    """A new ``CountingStore`` over the backend's one database at each call; all closed after."""
    if backend == "memory":
        env = {"PERSISTENCE_MODULE": "eventsourcing.popo"}
    elif backend == "sqlite":
        env = {
            "PERSISTENCE_MODULE": "eventsourcing.sqlite",
            "SQLITE_DBNAME": str(tmp_path / "r.db"),
        }
    else:
        env = postgres_address(request.getfixturevalue("pg_dsn")).env()
    opened: list[CountingStore] = []

    def open_store() -> CountingStore:
        opened.append(CountingStore(env))
        return opened[-1]

    yield open_store
    for store in opened:
        store.close()


class Amount(BaseModel):
    n: int


class Ledger:
    def __init__(self) -> None:
        self.paid: list[int] = []

    def pay(self, args: Amount) -> dict[str, int]:
        self.paid.append(args.n)
        return {"paid": args.n}


def runtime_for(store: RunStore, ledger: Ledger, holder: str = "w1", model: Any = None) -> Runtime:
    async def ask(state: dict[str, Any], ctx: Any) -> Any:
        decision = await ctx.approve("pay?")
        return goto("pay") if decision.approved else end("declined")

    async def pay(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.tool("pay", {"n": 1})
        return end("paid")

    async def batch(state: dict[str, Any], ctx: Any) -> Any:
        await asyncio.gather(*(ctx.tool("pay", {"n": n}) for n in (1, 2, 3)))
        return end("paid")

    flows = [
        define_flow("pay", "approve, then pay", "ask", [action("ask", ask), action("pay", pay)]),
        define_flow("batch", "three payments at once", "b", [action("b", batch)]),
    ]
    tool = define_tool("pay", "pays n", Amount, ledger.pay, parallel_safe=True)
    agent = define_agent("a", "pays", model, [tool], flows)
    return Runtime([agent], store=store, holder=holder)


@pytest.mark.parametrize("backend", STORES)
async def test_a_delivery_is_saved_before_the_node_runs(
    counting_store: Callable[[], CountingStore],
) -> None:
    store = counting_store()
    ledger = Ledger()
    runtime = runtime_for(store, ledger)
    paused = await runtime.run("s", kind="flow", flow_name="pay").result()
    before = len(store.saves)
    done = await runtime.approve(paused.run_id, "s", by="alice")
    assert done.output == "paid" and ledger.paid == [1]
    opening, intent, close = store.saves[before:]
    # The approval and its step (intent and result at once), before the tool's intent.
    assert "SignalAccepted" in opening and opening.count("StepFinished") == 1, opening
    assert intent.count("StepStarted") == 1 and "StepFinished" not in intent
    # The tool's result rides the turn's next save, here its end (one commit a step).
    assert "StepFinished" in close and "Finished" in close, close


@pytest.mark.parametrize("backend", STORES)
async def test_a_sequential_tool_step_costs_one_save_and_a_clock_read_none(
    counting_store: Callable[[], CountingStore],
) -> None:
    calls: list[int] = []

    def count(args: Amount) -> dict[str, int]:
        calls.append(args.n)
        return {"n": args.n}

    async def steps(state: dict[str, Any], ctx: Any) -> Any:
        for n in range(20):
            await ctx.tool("count", {"n": n})
            await ctx.now()
            await ctx.uuid()
        return end("done")

    tool = define_tool("count", "counts", Amount, count)
    flow = define_flow("steps", "twenty steps", "s", [action("s", steps)])
    store = counting_store()
    runtime = Runtime([define_agent("a", "x", None, [tool], [flow])], store=store)
    done = await runtime.run("s", kind="flow", flow_name="steps").result()
    assert done.status == "finished" and calls == list(range(20))
    # The opening, one save per tool step (its intent, carrying the previous
    # step's result and the clock reads and uuids between), and the turn's end.
    assert len(store.saves) <= 20 + 2, store.saves
    steps_ = await runtime.get_steps(done.run_id, "s")
    assert [s.status for s in steps_] == ["finished"] * 60


@pytest.mark.parametrize("backend", BLOCKING_STORES)
async def test_a_parallel_batch_saves_its_intents_together(
    counting_store: Callable[[], CountingStore],
) -> None:
    store = counting_store()
    ledger = Ledger()
    runtime = runtime_for(store, ledger)
    done = await runtime.run("s", kind="flow", flow_name="batch").result()
    assert done.status == "finished" and sorted(ledger.paid) == [1, 2, 3]
    with_intents = [save for save in store.saves if "StepStarted" in save]
    assert [save.count("StepStarted") for save in with_intents] == [3]
    steps = await runtime.get_steps(done.run_id, "s")
    assert [(s.status, s.attempts) for s in steps] == [("finished", 1)] * 3


@pytest.mark.parametrize("backend", BLOCKING_STORES)
async def test_racing_deliveries_store_one_and_execute_once(
    counting_store: Callable[[], CountingStore],
) -> None:
    ledger = Ledger()
    first, second = counting_store(), counting_store()
    a = runtime_for(first, ledger, holder="w1")
    b = runtime_for(second, ledger, holder="w2")
    paused = await a.run("s", kind="flow", flow_name="pay").result()
    outcomes = await asyncio.gather(
        a.approve(paused.run_id, "s", by="alice", signal_id="from-a"),
        b.approve(paused.run_id, "s", by="bob", signal_id="from-b"),
        return_exceptions=True,
    )
    won = [o for o in outcomes if not isinstance(o, BaseException)]
    lost = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(won) == 1 and won[0].output == "paid", outcomes
    # The loser read the run after the winner saved, or lost its first save.
    assert len(lost) == 1 and isinstance(lost[0], KuralleError), outcomes
    assert ledger.paid == [1]
    steps = await a.get_steps(paused.run_id, "s")
    assert [(s.kind, s.status) for s in steps] == [
        ("approval", "finished"),
        ("tool", "finished"),
    ]


class GatedModel:
    """A model that answers only once the test opens its gate."""

    id = "gated"

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.gate = asyncio.Event()

    async def respond(self, request: ModelRequest) -> ModelResponse:
        self.asked.set()
        await self.gate.wait()
        return ModelResponse(content="hello")


@pytest.mark.parametrize("backend", BLOCKING_STORES)
async def test_a_turn_waiting_on_its_model_holds_a_live_lease(
    counting_store: Callable[[], CountingStore],
) -> None:
    model = GatedModel()
    first, second = counting_store(), counting_store()
    a = runtime_for(first, Ledger(), holder="w1", model=model)
    b = runtime_for(second, Ledger(), holder="w2", model=model)
    model.gate.set()
    opened = await a.run("chat", input="hi").result()
    model.gate.clear()
    model.asked.clear()
    turn = a.run("chat", run_id=opened.run_id, input="again")
    await asyncio.wait_for(model.asked.wait(), timeout=10)
    # The new turn's opening was saved before the model was asked.
    with pytest.raises(LeaseHeldError) as refused:
        await b.run("chat", run_id=opened.run_id, input="meanwhile").result()
    assert refused.value.holder == "w1"
    model.gate.set()
    assert (await turn.result()).status == "finished"
