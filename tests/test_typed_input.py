"""Typed input (docs/child-runs.md): ``define_flow(..., input=Model)`` on memory, SQLite
and PostgreSQL.

A start validates its input (a mapping, a JSON string or the model) and a
refusal names the fields and writes nothing; node code reads the validated
model as ``ctx.input``, taken from the journal: the same on a replay and in
another runtime over a fresh store. A flow without ``input=`` takes text as
it always did, and keeps its digest.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

from kuralle_es import (
    InvalidArgumentError,
    InvalidDefinitionError,
    Runtime,
    action,
    define_agent,
    define_flow,
    end,
)

SESSION = "typed"
SEEN: list[Any] = []


class Order(BaseModel):
    sku: str
    qty: int = 1


async def take(state: dict[str, Any], ctx: Any) -> Any:
    SEEN.append(ctx.input)
    await ctx.approve("Ship it?")
    SEEN.append(ctx.input)
    return end(f"{ctx.input.qty}x{ctx.input.sku}")


async def untyped(state: dict[str, Any], ctx: Any) -> Any:
    SEEN.append(ctx.input)
    return end("text")


ORDER = define_flow("order", "", "take", [action("take", take)], input=Order)
TEXT = define_flow("text", "", "go", [action("go", untyped)])
AGENTS = [define_agent("shop", "", None, [], [ORDER, TEXT])]


@pytest.fixture(autouse=True)
def _clear() -> None:
    SEEN.clear()


def _no_runs(store: Any) -> None:
    assert store.session_run_ids(SESSION) == []


async def test_a_typed_start_is_refused_with_the_field_names_and_nothing_written(
    open_store: Any,
) -> None:
    store = open_store()
    runtime = Runtime(AGENTS, store=store)
    for bad in ({"qty": "many"}, '{"sku": 5, "qty": 1}', "not json", ["sku"]):
        with pytest.raises(InvalidArgumentError) as refused:
            await runtime.run(SESSION, input=bad, kind="flow", flow_name="order").result()
        assert "order" in str(refused.value) and "Order" in str(refused.value)
    with pytest.raises(InvalidArgumentError, match=r"fields \['qty', 'sku'\]"):
        await runtime.run(SESSION, input={"qty": "x"}, kind="flow", flow_name="order").result()
    with pytest.raises(InvalidArgumentError, match="takes text input"):
        await runtime.run(SESSION, input={"a": 1}, kind="flow", flow_name="text").result()
    _no_runs(store)
    assert await runtime.views.list_runs() == []
    assert SEEN == []


@pytest.mark.parametrize(
    "given", [{"sku": "tea", "qty": 3}, '{"sku": "tea", "qty": 3}', Order(sku="tea", qty=3)]
)
async def test_ctx_input_is_the_model_on_the_first_pass_on_replay_and_in_another_runtime(
    open_store: Any, given: Any
) -> None:
    first = Runtime(AGENTS, store=open_store())
    paused = await first.run(SESSION, input=given, kind="flow", flow_name="order").result()
    assert paused.status == "paused"
    state = await first.get_run(paused.run_id, SESSION)
    assert state is not None
    assert state.messages[0].content == '{"sku": "tea", "qty": 3}'
    # Another runtime over a fresh store (another process would see the same).
    second = Runtime(AGENTS, store=open_store())
    done = await second.approve(paused.run_id, SESSION, by="ann")
    assert (done.status, done.output) == ("finished", "3xtea")
    assert [Order(sku="tea", qty=3)] * 3 == SEEN
    assert all(isinstance(seen, Order) for seen in SEEN)


async def test_a_flow_without_input_keeps_taking_text_and_reads_no_ctx_input(
    open_store: Any,
) -> None:
    runtime = Runtime(AGENTS, store=open_store())
    done = await runtime.run(SESSION, input="hello", kind="flow", flow_name="text").result()
    assert (done.status, done.output) == ("finished", "text")
    state = await runtime.get_run(done.run_id, SESSION)
    assert state is not None and state.messages[0].content == "hello"
    assert SEEN == [None]


def test_the_input_schema_enters_the_digest_only_when_given() -> None:
    nodes = [action("take", take)]
    plain = define_flow("order", "", "take", nodes)
    typed = define_flow("order", "", "take", nodes, input=Order)

    class Bigger(Order):
        note: str = ""

    assert plain.digest != typed.digest
    assert typed.digest == define_flow("order", "", "take", nodes, input=Order).digest
    assert define_flow("order", "", "take", nodes, input=Bigger).digest != typed.digest
    with pytest.raises(InvalidDefinitionError, match="pydantic model class"):
        define_flow("order", "", "take", nodes, input=dict)  # type: ignore[arg-type]


async def test_a_keyed_typed_start_retried_is_one_run_and_another_input_is_a_conflict(
    open_store: Any,
) -> None:
    from kuralle_es import IdempotencyConflictError

    runtime = Runtime(AGENTS, store=open_store())
    starts = [
        runtime.run(SESSION, input=given, kind="flow", flow_name="order", idempotency_key="k1")
        for given in ({"sku": "tea", "qty": 3}, Order(sku="tea", qty=3))
    ]
    first, second = await asyncio.gather(*(h.result() for h in starts))
    assert first.run_id == second.run_id
    with pytest.raises(IdempotencyConflictError):
        await runtime.run(
            SESSION, input={"sku": "tea", "qty": 4}, kind="flow", flow_name="order",
            idempotency_key="k1",
        ).result()  # fmt: skip
