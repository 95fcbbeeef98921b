"""``replay_with``: recorded runs re-driven under new code or a new model, touching nothing.

Runs are recorded on memory, SQLite and PostgreSQL (a refund flow that
collects an amount, asks, sleeps an hour and charges; one denied by its
deadline; one still waiting for its approval; a chat whose model calls the
tool), then re-driven. Under the same code nothing diverges and the model is
never asked (every request is unchanged, so the recorded answers are
reused). Under a model that reads large amounts wrong, the runs it would
decide differently diverge at its model step, and the charge it would make
is reported in ``would_execute`` and never made. Either way the store's
bytes (SQLite's file, PostgreSQL's row count and last notification id) and
the tool's call counter are what they were.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from procs.replay_app import CHARGES, PRICES, Extractor, agents
from psycopg import sql

from kuralle_es import (
    InvalidArgumentError,
    ModelRequest,
    ModelResponse,
    RunNotFoundError,
    RunStore,
    Runtime,
    ToolCallRequest,
    action,
    define_agent,
    define_flow,
    end,
    fire_timers,
    sweep_deadlines,
)
from kuralle_es.testing import Counterfactual, ScriptedModel, TestClock, replay_with

#: The recorded runs, by what happened to them: (session, how much the customer asked).
CASES = {
    "asked-then-paid": ("s-asked", 4200),
    "paid-large": ("s-large", 9900),
    "deadline-denied": ("s-deadline", 3000),
    "waiting-large": ("s-waiting", 7000),
    "chat-large": ("s-chat", 6000),
}


async def record(store: RunStore) -> dict[str, str]:
    """The runs of ``CASES`` under version 1, each as its case says; their ids."""
    clock = TestClock()
    runtime = Runtime(agents(Extractor(1)), store=store, clock=clock, prices=PRICES)
    ids: dict[str, str] = {}

    async def start(case: str, text: str) -> str:
        session = CASES[case][0]
        result = await runtime.run(session, input=text, kind="flow", flow_name="refund").result()
        ids[case] = result.run_id
        return result.run_id

    run_id = await start("asked-then-paid", "I want a refund")
    await runtime.run("s-asked", run_id=run_id, input="4200 cents please").result()
    await runtime.approve(run_id, "s-asked", by="ann")
    run_id = await start("paid-large", "refund 9900 cents")
    await runtime.approve(run_id, "s-large", by="ann")
    clock.advance(hours=2)
    assert sorted(await fire_timers(runtime)) == sorted([ids["asked-then-paid"], run_id])
    await start("deadline-denied", "refund 3000 cents")
    clock.advance(hours=25)
    denied = await sweep_deadlines(runtime)
    assert ids["deadline-denied"] in denied
    # The one still waiting was asked after the jump: its deadline is a day away.
    await start("waiting-large", "refund 7000 cents")
    chat = await runtime.run("s-chat", input="please refund 6000 cents").result()
    ids["chat-large"] = chat.run_id
    states = {case: await runtime.get_run(i, CASES[case][0]) for case, i in ids.items()}
    ends = {case: (s.status, s.outcome) for case, s in states.items() if s is not None}
    assert ends == {
        "asked-then-paid": ("finished", "refunded 4200"),
        "paid-large": ("finished", "refunded 9900"),
        "deadline-denied": ("finished", "declined by deadline"),
        "waiting-large": ("paused", None),
        "chat-large": ("finished", None),
    }
    for case, run_id in ids.items():  # each run's stored stream written to its end
        assert [part async for part in runtime.stream(run_id, CASES[case][0])]
    return ids


def fingerprint(store: RunStore, factory: Any) -> Any:
    """What the store holds: the SQLite file's bytes; PostgreSQL's row count and last
    notification id; the memory store's stored events."""
    head = store.recorder.max_notification_id()
    if factory.backend == "sqlite":
        files = sorted(Path(factory.target).parent.glob(Path(factory.target).name + "*"))
        return head, [(f.name, f.read_bytes()) for f in files]
    if factory.backend == "postgres":
        table = store.recorder.events_table_name  # type: ignore[attr-defined]
        with psycopg.connect(factory.target) as conn:
            query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
            row = conn.execute(query).fetchone()
        return head, row
    notifications = store.recorder.select_notifications(start=None, limit=100_000)
    return head, [(n.originator_id, n.originator_version, n.state) for n in notifications]


async def test_the_same_code_replays_every_run_with_no_divergence_and_touches_nothing(
    open_store: Any,
) -> None:
    store = open_store()
    ids = await record(store)
    before, charges = fingerprint(store, open_store), list(CHARGES)
    model = Extractor(1)

    results: dict[str, Counterfactual] = {}
    for case, run_id in ids.items():
        results[case] = await replay_with(
            store, run_id, CASES[case][0], agents=agents(model), prices=PRICES
        )

    for case, result in results.items():
        assert result.diverged_at is None, (case, result.divergence)
        assert not result.decided_differently, case
        assert result.would_execute == [], case
        assert result.tool_calls_after == result.tool_calls_before, case
        assert result.usage_after == result.usage_before, case
        assert result.cost_change == 0, case
    assert results["paid-large"].output_after == "refunded 9900"
    assert results["waiting-large"].waiting_for_after is not None
    assert results["waiting-large"].waiting_for_after.title == "Refund 7000 cents?"
    assert model.asked == 0  # every request unchanged: the recorded answers were reused
    assert charges == CHARGES
    assert fingerprint(store, open_store) == before


async def test_a_model_that_asks_for_other_args_diverges_and_would_execute_without_executing(
    open_store: Any,
) -> None:
    store = open_store()
    ids = await record(store)
    before, charges = fingerprint(store, open_store), list(CHARGES)
    new_model = Extractor(2)

    results = {
        case: await replay_with(
            store, run_id, CASES[case][0], agents=agents(None), model=new_model, prices=PRICES
        )
        for case, run_id in ids.items()
    }

    differs = {case for case, r in results.items() if r.decided_differently}
    assert differs == {"paid-large", "waiting-large", "chat-large"}
    for case in ("asked-then-paid", "deadline-denied"):
        assert results[case].diverged_at is None, results[case].divergence
        assert results[case].tool_calls_after == results[case].tool_calls_before
    large = results["paid-large"]
    assert large.diverged_at == 0  # the extraction: 9900 cents read as 99
    assert large.divergence is not None and "decided otherwise" in large.divergence
    # The approval at that place is answered as recorded (a wait is matched by its
    # place and name, as on any replay); the charge of 99 it then asks for is new.
    assert [(c.name, c.args) for c in large.would_execute] == [("charge", {"amount_cents": 99})]
    assert large.status_after == "running" and large.output_after is None
    waiting = results["waiting-large"]
    assert waiting.diverged_at == 0 and waiting.would_execute == []
    assert waiting.waiting_for_after is not None
    assert waiting.waiting_for_after.title == "Refund 70 cents?"
    chat = results["chat-large"]
    assert chat.diverged_at == 0
    assert [(c.name, c.args) for c in chat.would_execute] == [("charge", {"amount_cents": 60})]
    assert chat.would_execute[0]["name"] == "charge"  # as a mapping too
    assert chat.tool_calls_before[0].args == {"amount_cents": 6000}
    assert chat.status_after == "running" and chat.note is not None
    # Cost: every run's model calls went to the cheaper model.
    paid = results["asked-then-paid"]
    assert paid.usage_before.model_calls == paid.usage_after.model_calls == 2
    assert paid.cost_before == pytest.approx(2 * (100 * 1.0 + 10 * 2.0) / 1000)
    assert paid.cost_after == pytest.approx(2 * (80 * 0.5 + 8 * 1.0) / 1000)
    assert paid.cost_change is not None and paid.cost_change < 0
    assert new_model.asked == sum(r.usage_after.model_calls for r in results.values())
    assert charges == CHARGES
    assert fingerprint(store, open_store) == before


async def test_a_changed_prompt_asks_the_model_again_and_a_same_answer_is_no_divergence() -> None:
    store = RunStore.memory()
    runtime = Runtime(agents(Extractor(1)), store=store)
    chat = await runtime.run("s-prompt", input="please refund 120 cents").result()
    model = Extractor(1)

    result = await replay_with(
        store, chat.run_id, "s-prompt", agents=agents(model, instructions="Be terse.")
    )

    assert model.asked == 2  # the request changed (its instructions): asked again
    assert result.diverged_at is None and not result.decided_differently
    assert result.output_after == "Done: refunded."


async def test_new_code_whose_model_calls_another_tool_is_reported_before_it_runs() -> None:
    store = RunStore.memory()
    runtime = Runtime(agents(Extractor(1)), store=store)
    run = await runtime.run("s-tool", input="please refund 120 cents").result()
    charges = list(CHARGES)
    (support,) = agents(None)
    credit = dataclasses.replace(support.tools["charge"], name="credit")
    new = dataclasses.replace(support, tools={**support.tools, "credit": credit})

    def asks_credit(request: ModelRequest) -> ModelResponse:
        return ModelResponse(tool_calls=[ToolCallRequest("c", "credit", {"amount_cents": 120})])

    result = await replay_with(
        store, run.run_id, "s-tool", agents=[new], model=ScriptedModel(asks_credit, id="m")
    )

    assert [(c.name, c.args) for c in result.would_execute] == [("credit", {"amount_cents": 120})]
    assert result.diverged_at == 0
    assert result.tool_calls_before[0].name == "charge"
    assert charges == CHARGES


async def test_an_unknown_run_a_foreign_one_and_a_fork_are_refused() -> None:
    store = RunStore.memory()
    runtime = Runtime(agents(Extractor(1)), store=store)
    paused = await runtime.run("s-x", input="refund 100", kind="flow", flow_name="refund").result()
    with pytest.raises(RunNotFoundError):
        await replay_with(store, "no-such-run", "s-x", agents=agents(None))
    with pytest.raises(RunNotFoundError):
        await replay_with(store, paused.run_id, "another-session", agents=agents(None))
    fork = await runtime.fork(paused.run_id, "s-x", 0)
    with pytest.raises(InvalidArgumentError, match="fork"):
        await replay_with(store, fork.run_id, "s-x", agents=agents(None))


async def test_new_code_that_sleeps_forever_is_stopped_after_a_bounded_number_of_turns() -> None:
    async def once(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.sleep(timedelta(days=1))
        return end("woke once")

    async def forever(state: dict[str, Any], ctx: Any) -> Any:
        while True:
            await ctx.sleep(timedelta(days=1))

    def app(node: Any) -> list[Any]:
        flow = define_flow("nap", "", "n", [action("n", node)])
        return [define_agent("sleeper", "", None, [], [flow])]

    store, clock = RunStore.memory(), TestClock()
    runtime = Runtime(app(once), store=store, clock=clock)
    run = await runtime.run("s-nap", kind="flow", flow_name="nap").result()
    clock.advance(days=2)
    await fire_timers(runtime)

    result = await replay_with(store, run.run_id, "s-nap", agents=app(forever))

    assert result.outcome_before == "woke once" and result.status_after == "paused"
    assert result.decided_differently and result.diverged_at == 1
    assert result.note is not None and "more than the recording took" in result.note


async def test_messages_a_run_received_are_sent_again_in_the_re_drive() -> None:
    async def two(state: dict[str, Any], ctx: Any) -> Any:
        first = await ctx.receive("note")
        second = await ctx.receive("note")
        return end(f"{first['n']}+{second['n']}")

    flow = define_flow("notes", "", "n", [action("n", two)])
    app = [define_agent("reader", "", None, [], [flow])]
    store = RunStore.memory()
    runtime = Runtime(app, store=store)
    run = await runtime.run("s-notes", kind="flow", flow_name="notes").result()
    await runtime.send(run.run_id, "s-notes", "note", {"n": 1}, message_id="m1")
    await runtime.send(run.run_id, "s-notes", "note", {"n": 2}, message_id="m2")

    result = await replay_with(store, run.run_id, "s-notes", agents=app)

    assert result.outcome_before == result.outcome_after == "1+2"
    assert result.diverged_at is None and not result.decided_differently
