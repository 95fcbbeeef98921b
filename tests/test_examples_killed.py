"""The four examples (kuralle_es/examples/, docs/examples.md), each SIGKILLed inside
a tool and recovered by ``kuralle-es worker``, with each effect once.

Each test runs the example as a real process (``tests/procs/examples_app.py``)
on PostgreSQL, whose outside systems keep their effects in a ledger table of
the same database, one row per idempotency key, and count every call. The
process stands still inside the tool the test names, right after the effect
is kept and before its result is journaled, and the test SIGKILLs it there.
A ``kuralle-es worker`` process, loading the example's own ``AGENTS``,
recovers the runs; the test checks how they ended and that each effect was
kept once (the killed tool ran twice, with one key).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import stripped

from kuralle_es import RunStore, Runtime
from kuralle_es.examples import checkout
from kuralle_es.examples.outside import LEDGER_ENV, Ledger

PROCS = Path(__file__).resolve().parent / "procs"
pytestmark = [pytest.mark.postgres, pytest.mark.timeout(120)]


def _env(dsn: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not stripped(k, ("KT_", "KURALLE_"))}
    return {**env, LEDGER_ENV: dsn, **extra}


def _killed_inside(
    example: str, action: str, dsn: str, tmp: Path, meanwhile: Callable[[str], None] | None = None
) -> tuple[str, str]:
    """Run ``example`` until it stands inside ``action``, call ``meanwhile`` (with
    what it printed so far), SIGKILL it; returns its (stdout, stderr)."""
    marker = tmp / "standing"
    doomed = subprocess.Popen(
        [sys.executable, str(PROCS / "examples_app.py"), example, dsn],
        env=_env(dsn, KT_STAND_IN=action, KT_MARKER=str(marker)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert doomed.poll() is None, doomed.communicate()
            assert time.monotonic() < deadline, f"{example} never reached {action}"
            time.sleep(0.05)
        if meanwhile is not None:
            assert doomed.stdout is not None
            meanwhile(doomed.stdout.readline())
    finally:
        doomed.send_signal(signal.SIGKILL)
        out, err = doomed.communicate(timeout=30)
    assert doomed.returncode == -signal.SIGKILL
    return out, err


def _recovered(dsn: str, app: str, done: Callable[[RunStore], bool]) -> str:
    """Run ``kuralle-es worker --app app`` until ``done``; returns its log."""
    worker = subprocess.Popen(
        [sys.executable, "-m", "kuralle_es.cli", "worker", "--store", dsn, "--app", app,
         "--interval", "0.2", "--holder", "rescuer"],
        env=_env(dsn), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    with RunStore.from_url(dsn) as store:
        try:
            deadline = time.monotonic() + 60
            while not done(store):
                assert worker.poll() is None, worker.communicate()
                assert time.monotonic() < deadline, "the worker did not recover the runs"
                time.sleep(0.1)
        finally:
            worker.send_signal(signal.SIGTERM)
            _, log = worker.communicate(timeout=30)
    assert worker.returncode in (0, -signal.SIGTERM), log
    return log


def _ended(run_id: str) -> Callable[[RunStore], bool]:
    def check(store: RunStore) -> bool:
        run = store.load(run_id)
        return run is not None and run.status in ("finished", "error", "aborted")

    return check


def _once(ledger: Ledger, action: str) -> str:
    """The key of ``action``'s one kept effect, asserting it was called twice with
    it (before the kill and by the recovery) and kept once."""
    (effect,) = [e for e in ledger.effects() if e.action == action]
    assert ledger.calls(action) == [effect.key, effect.key]
    return effect.key


def test_a_money_transfer_killed_inside_its_compensation_refunds_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    out, err = _killed_inside("transfer", "refund", pg_dsn, tmp_path)
    (run_id,) = out.split()
    assert "deposit to closed-007 failed" in err  # ctx.logger, in the pass that did it

    log = _recovered(pg_dsn, "kuralle_es.examples.money_transfer:AGENTS", _ended(run_id))

    assert "deposit to closed-007 failed" not in log  # quiet while the worker replays it
    with RunStore.from_url(pg_dsn) as store:
        run = store.load(run_id)
        assert run is not None and (run.status, run.outcome) == (
            "finished", "refunded 700 cents to alice"
        )  # fmt: skip
        steps = [(s.name, s.status) for s in run.step_records()]
    assert steps == [("withdraw", "finished"), ("deposit", "error"), ("refund", "finished")]
    ledger = Ledger(pg_dsn)
    _once(ledger, "refund")
    assert [e.action for e in ledger.effects()].count("withdraw") == 1
    assert ledger.calls("deposit") == []  # refused by the bank: nothing kept


def test_a_refund_agent_killed_inside_its_child_flows_refund_refunds_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    out, _ = _killed_inside("refund", "refund", pg_dsn, tmp_path)
    (conversation_id,) = out.split()

    _recovered(pg_dsn, "kuralle_es.examples.refund_agent:AGENTS", _ended(conversation_id))

    with RunStore.from_url(pg_dsn) as store:
        run = store.load(conversation_id)
        assert run is not None and run.status == "finished"
        reply = run.messages[-1]["content"]
        assert reply == "Update on your refund: refunded 4250 cents on order A17."
        (child_id,) = run.children
        assert sorted(store.session_run_ids("customer-1")) == sorted([conversation_id, child_id])
        child = store.load(child_id)
        assert child is not None and child.output == "refunded 4250 cents on order A17"
    _once(Ledger(pg_dsn), "refund")


def test_a_booking_agent_killed_inside_its_delegates_tool_books_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    _killed_inside("booking", "hold_fare", pg_dsn, tmp_path)
    with RunStore.from_url(pg_dsn) as store:
        runs = [store.load(run_id) for run_id in store.session_run_ids("traveller-1")]
    (booking,) = [r for r in runs if r is not None and r.parent_link is None]
    assert booking.status == "running" and len(booking.children) == 1

    _recovered(pg_dsn, "kuralle_es.examples.booking_agent:AGENTS", _ended(booking.run_id))

    with RunStore.from_url(pg_dsn) as store:
        run = store.load(booking.run_id)
        assert run is not None and run.status == "finished"
        ledger = Ledger(pg_dsn)
        (ticket,) = [e.data for e in ledger.effects() if e.action == "buy_ticket"]
        assert run.messages[-1]["content"] == f"Booked AK460: ticket {ticket['ticket']}."
        assert run.children == booking.children and len(store.session_run_ids("traveller-1")) == 2
        child = store.load(booking.children[0])
        assert child is not None and child.status == "finished"
        assert [s.name for s in child.step_records() if s.kind == "tool"] == [
            "list_flights", "hold_fare"
        ]  # fmt: skip
    _once(ledger, "hold_fare")
    assert len(ledger.calls("buy_ticket")) == 1


def test_a_checkout_killed_before_it_waits_takes_the_early_webhook_and_ships_once(
    pg_dsn: str, tmp_path: Path
) -> None:
    seen: dict[str, Any] = {}

    def webhook_comes(printed: str) -> None:
        """While the run stands in ``reserve_stock`` (before its ``receive``): the
        web page reads the published payment, and the provider's webhook comes."""
        run_id = seen["run_id"] = printed.strip()
        seen["page"], seen["sent"] = asyncio.run(_page_and_webhook(pg_dsn, run_id))

    _killed_inside("checkout", "reserve_stock", pg_dsn, tmp_path, meanwhile=webhook_comes)
    run_id, payment = seen["run_id"], seen["page"]
    assert payment["url"] == f"https://pay.example/{payment['payment_id']}"
    assert seen["sent"] == "running"  # kept in the mailbox: the run was not waiting yet

    _recovered(pg_dsn, "kuralle_es.examples.checkout:AGENTS", _ended(run_id))

    with RunStore.from_url(pg_dsn) as store:
        run = store.load(run_id)
        assert run is not None and run.status == "finished"
        assert run.outcome == f"paid ({payment['payment_id']}) and shipped"
        steps = run.step_records()
    assert [s.kind for s in steps] == ["tool", "publish", "tool", "receive", "tool"]
    assert steps[3].result["message_id"] == "evt_1"
    ledger = Ledger(pg_dsn)
    _once(ledger, "reserve_stock")
    assert (len(ledger.calls("create_payment")), len(ledger.calls("ship_order"))) == (1, 1)
    assert ledger.calls("release_stock") == []


async def _page_and_webhook(dsn: str, run_id: str) -> tuple[Any, str]:
    """What the web page reads while the run lives, and the webhook's send."""
    with RunStore.from_url(dsn) as store:
        runtime = Runtime(checkout.AGENTS, store=store)
        payment = await runtime.published(run_id, "order-9", "payment")
        event = checkout.PaymentEvent(
            event_id="evt_1", payment_id=payment["payment_id"], run_id=run_id,
            order_id="order-9", status="succeeded",
        )  # fmt: skip
        sent = await checkout.payment_webhook(runtime, event)
        return payment, sent.status
