"""Published values (``ctx.publish``) and the node logger quiet on replay (``ctx.logger``),
on memory, SQLite and PostgreSQL. docs/messages.md.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from events_kit import everything
from pydantic import BaseModel

from kuralle_es import (
    NotPublishedError,
    RunNotFoundError,
    RunStore,
    Runtime,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    recover_orphaned_runs,
)
from kuralle_es.events import StepStarted, ValuePublished
from kuralle_es.testing import Crash

SESSION = "s-publish"


class Nothing(BaseModel):
    pass


class Checkout:
    """A checkout that publishes its progress and a payment link."""

    def __init__(self, *, charge_dies: bool = False) -> None:
        self.charge_dies = charge_dies
        self.charges = 0

    def charge(self, args: Nothing, call: ToolCall) -> str:
        self.charges += 1
        if self.charge_dies:
            raise Crash("the worker dies inside charge")
        return "charged"

    def agent(self) -> Any:
        async def checkout(state: dict[str, Any], ctx: Any) -> Any:
            await ctx.publish("progress", {"pct": 10})
            await ctx.approve("ready to pay?")
            await ctx.publish("payment_url", "https://pay.example/abc")
            await ctx.publish("progress", {"pct": 90})
            await ctx.tool("charge", {})
            return end("paid")

        async def chatty(state: dict[str, Any], ctx: Any) -> Any:
            ctx.logger.info("looking the order up")
            await ctx.now()
            ctx.logger.info("asking ann", extra={"who": "ann"})
            await ctx.approve("ok?")
            ctx.logger.info("ann said yes")
            got = await ctx.receive("item")
            ctx.logger.warning("received %s", got)
            return end("done")

        tool = define_tool("charge", "", Nothing, self.charge)
        flows = [
            define_flow("checkout", "", "checkout", [action("checkout", checkout)]),
            define_flow("chatty", "", "chatty", [action("chatty", chatty)]),
        ]
        return define_agent("shop", "", None, [tool], flows)


def runtime(checkout: Checkout, store: RunStore, **kwargs: Any) -> Runtime:
    return Runtime([checkout.agent()], store=store, **kwargs)


async def test_published_values_are_the_latest_of_each_key_while_the_run_lives(
    open_store: Any,
) -> None:
    rt = runtime(Checkout(), open_store())
    paused = await rt.run(SESSION, kind="flow", flow_name="checkout").result()
    run_id = paused.run_id
    assert await rt.published(run_id, SESSION) == {"progress": {"pct": 10}}
    assert await rt.published(run_id, SESSION, "payment_url") is None
    await rt.approve(run_id, SESSION, by="ann")
    assert await rt.published(run_id, SESSION) == {
        "progress": {"pct": 90}, "payment_url": "https://pay.example/abc",
    }  # fmt: skip
    assert await rt.published(run_id, SESSION, "progress") == {"pct": 90}
    with pytest.raises(RunNotFoundError):
        await rt.published(run_id, "another-session")
    steps = await rt.get_steps(run_id, SESSION)
    assert [(s.kind, s.name) for s in steps if s.kind == "publish"] == [
        ("publish", "progress"), ("publish", "payment_url"), ("publish", "progress"),
    ]  # fmt: skip


async def test_a_replayed_publish_publishes_nothing(open_store: Any) -> None:
    """The worker dies in ``charge``, after three publishes were journaled; the
    recovery replays them: one step each, and one public event each."""
    dying = runtime(Checkout(charge_dies=True), open_store(), lease_ttl=0.3, holder="dead")
    paused = await dying.run(SESSION, kind="flow", flow_name="checkout").result()
    with pytest.raises(Crash):
        await dying.approve(paused.run_id, SESSION, by="ann")
    await asyncio.sleep(0.4)
    sweeper = runtime(Checkout(), open_store(), holder="sweeper")
    assert await recover_orphaned_runs(sweeper) == [paused.run_id]
    state = await sweeper.get_run(paused.run_id, SESSION)
    assert state is not None and state.status == "finished"
    steps = await sweeper.get_steps(paused.run_id, SESSION)
    assert [s.name for s in steps if s.kind == "publish"] == ["progress", "payment_url", "progress"]
    events = await everything(sweeper.store)
    published = [(e.key, e.value) for e in events if isinstance(e, ValuePublished)]
    assert published == [
        ("progress", {"pct": 10}), ("payment_url", "https://pay.example/abc"),
        ("progress", {"pct": 90}),
    ]  # fmt: skip
    assert not [e for e in events if isinstance(e, StepStarted) and e.kind == "publish"]


async def test_wait_published_returns_once_published_from_another_task(open_store: Any) -> None:
    rt = runtime(Checkout(), open_store())
    paused = await rt.run(SESSION, kind="flow", flow_name="checkout").result()
    waiting = asyncio.ensure_future(
        rt.wait_published(paused.run_id, SESSION, "payment_url", timeout=20)
    )
    await asyncio.sleep(0.1)
    assert not waiting.done()
    await rt.approve(paused.run_id, SESSION, by="ann")
    assert await asyncio.wait_for(waiting, 10) == "https://pay.example/abc"


async def test_wait_published_gives_up_after_its_timeout_or_when_the_run_ended(
    open_store: Any,
) -> None:
    rt = runtime(Checkout(), open_store())
    paused = await rt.run(SESSION, kind="flow", flow_name="checkout").result()
    with pytest.raises(TimeoutError) as timed_out:
        await rt.wait_published(paused.run_id, SESSION, "payment_url", timeout=0.2)
    assert isinstance(timed_out.value, NotPublishedError)
    assert (timed_out.value.key, timed_out.value.status) == ("payment_url", "paused")
    await rt.cancel(paused.run_id, SESSION, "gone")
    with pytest.raises(NotPublishedError, match="aborted and never published"):
        await rt.wait_published(paused.run_id, SESSION, "payment_url", timeout=60)
    assert await rt.wait_published(paused.run_id, SESSION, "progress", timeout=1) == {"pct": 10}
    with pytest.raises(RunNotFoundError):
        await rt.wait_published(paused.run_id, "another-session", "progress", timeout=1)


async def test_the_logger_is_silent_for_the_replayed_part_of_a_turn_and_speaks_for_the_new(
    open_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rt = runtime(Checkout(), open_store())
    caplog.set_level(logging.INFO, logger="kuralle.run")

    def said() -> list[tuple[str, str, Any]]:
        ours = [r for r in caplog.records if r.name == "kuralle.run"]
        lines = [(r.getMessage(), r.node, r.step) for r in ours]
        caplog.clear()
        return lines

    paused = await rt.run(SESSION, kind="flow", flow_name="chatty").result()
    assert said() == [("looking the order up", "chatty", 0), ("asking ann", "chatty", 1)]
    await rt.approve(paused.run_id, SESSION, by="ann")
    assert said() == [("ann said yes", "chatty", 2)]
    await rt.send(paused.run_id, SESSION, "item", "A-1", message_id="m1")
    records = [r for r in caplog.records if r.name == "kuralle.run"]
    assert [(r.getMessage(), r.levelname) for r in records] == [("received A-1", "WARNING")]
    assert records[0].run_id == paused.run_id and records[0].step == 3
    assert rt.store.load(paused.run_id).status == "finished"  # type: ignore[union-attr]


async def test_the_dashboard_run_page_shows_the_published_values_as_text(
    open_store: Any,
) -> None:
    from starlette.testclient import TestClient

    from kuralle_es.dashboard import create_app

    store = open_store()
    rt = runtime(Checkout(), store)
    paused = await rt.run(SESSION, kind="flow", flow_name="checkout").result()
    await rt.approve(paused.run_id, SESSION, by="ann")
    client = TestClient(create_app(store, lambda s: rt), base_url="http://127.0.0.1")
    page = await asyncio.to_thread(client.get, f"/runs/{paused.run_id}")
    assert page.status_code == 200
    section = page.text.split('id="published"', 1)[1].split("</table>", 1)[0]
    assert "<code>payment_url</code>" in section and "https://pay.example/abc" in section
    assert "<code>progress</code>" in section and "90" in section
