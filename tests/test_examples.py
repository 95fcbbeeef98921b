"""The example applications (kuralle_es/examples/, docs/examples.md): their paths the
page's runnable blocks do not take, and the page itself kept true to the code.

The crash of each example is ``tests/test_examples_killed.py``; the page's
``python`` blocks run in ``tests/test_docs_snippets.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kuralle_es import RunStore, Runtime
from kuralle_es.examples import checkout, refund_agent
from kuralle_es.examples.outside import LEDGER_ENV, Ledger

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "examples.md").read_text(encoding="utf-8")
EXAMPLES = ROOT / "kuralle_es" / "examples"


@pytest.fixture(autouse=True)
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    """The outside world of this test: a ledger file of its own."""
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger.db"))
    return Ledger()


def test_the_pages_line_counts_are_the_files() -> None:
    rows = re.findall(r"^\| `(\w+\.py)`(?: \(shared\))? \| (\d+) \|", PAGE, re.MULTILINE)
    assert {name for name, _ in rows} == {
        "money_transfer.py", "refund_agent.py", "booking_agent.py", "checkout.py", "outside.py"
    }  # fmt: skip
    for name, lines in rows:
        text = (EXAMPLES / name).read_text(encoding="utf-8")
        assert text.count("\n") == int(lines), f"{name} has {text.count(chr(10))} lines"


def test_every_excerpt_on_the_page_is_the_examples_own_code() -> None:
    excerpts = re.findall(r"^```py\n(.*?)^```", PAGE, re.MULTILINE | re.DOTALL)
    sources = [p.read_text(encoding="utf-8") for p in EXAMPLES.glob("*.py")]
    assert len(excerpts) == 5
    for excerpt in excerpts:
        assert any(excerpt in source for source in sources), excerpt


async def test_a_declined_refund_is_told_to_the_customer_and_refunds_nothing(
    ledger: Ledger,
) -> None:
    runtime = Runtime(refund_agent.AGENTS, store=RunStore.memory())
    turn = await runtime.run("customer-2", input="Refund A17 please").result()
    assert turn.waiting_for is not None and turn.waiting_for.child_run_id is not None

    await runtime.deny(turn.waiting_for.child_run_id, "customer-2", by="ann", reason="used")

    state = await runtime.get_run(turn.run_id, "customer-2")
    assert state is not None
    assert state.messages[-1].content == "Update on your refund: declined by ann: used."
    assert ledger.effects() == []


async def test_a_failed_payment_releases_the_stock_and_ships_nothing(ledger: Ledger) -> None:
    runtime = Runtime(checkout.AGENTS, store=RunStore.memory())
    cart = checkout.Cart(order_id="order-3", cents=500)
    waiting = await runtime.run("order-3", kind="flow", flow_name="checkout", input=cart).result()
    assert waiting.waiting_for is not None and waiting.waiting_for.kind == "message"
    payment = await runtime.published(waiting.run_id, "order-3", "payment")
    failed = checkout.PaymentEvent(
        event_id="evt_9", payment_id=payment["payment_id"], run_id=waiting.run_id,
        order_id="order-3", status="failed",
    )  # fmt: skip

    done = await checkout.payment_webhook(runtime, failed)

    assert (done.status, done.output) == ("finished", "cancelled: not paid")
    assert sorted(e.action for e in ledger.effects()) == [
        "create_payment", "release_stock", "reserve_stock"
    ]  # fmt: skip
