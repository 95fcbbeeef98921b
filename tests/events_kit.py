"""Helpers shared by the run-event tests (and the processes they spawn)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from kuralle_es import RunStore, Runtime, SignalDelivery
from kuralle_es.events import Consumer, RunEvent


async def refund_run(runtime: Runtime, session: str, *, approve: bool | None) -> str:
    """A refund run: amount asked for, given, then approved / denied / left waiting (None)."""
    first = runtime.run(session, input="I want a refund", kind="flow", flow_name="refund")
    result = await first.result()
    result = await runtime.run(session, run_id=result.run_id, input="It was $42.50").result()
    assert result.status == "paused"
    if approve is not None:
        payload: dict[str, Any] = {"approved": approve, "by": "supervisor"}
        delivery = SignalDelivery(
            signal_id=f"decision-{result.run_id}", name="__approval", payload=payload,
            actor="supervisor",
        )  # fmt: skip
        done = await runtime.run(session, run_id=result.run_id, signal_delivery=delivery).result()
        assert done.status == "finished"
    return result.run_id


async def everything(store: RunStore) -> list[RunEvent]:
    """Every public event stored so far, through a consumer of a fresh name."""
    seen: list[RunEvent] = []
    consumer = Consumer(store, f"reader-{os.urandom(4).hex()}", seen.append)
    await consumer.run_until_caught_up()
    return seen


async def take(events: AsyncIterator[RunEvent], n: int) -> list[RunEvent]:
    return [await asyncio.wait_for(anext(events), 10.0) for _ in range(n)]


def dumps(events: list[RunEvent]) -> list[dict[str, Any]]:
    return [e.model_dump(mode="json") for e in events]
