"""The examples of ``kuralle_es/examples/`` run as the worker that dies.

    examples_app.py EXAMPLE STORE_URL

makes the example's first call on ``STORE_URL``, as its own ``main`` would,
with its outside systems on a ledger (``EXAMPLES_LEDGER``) that stands still
right after keeping the effect of the action named by ``KT_STAND_IN``, once
it wrote ``KT_MARKER``: the test SIGKILLs the process there, inside that tool.

- ``transfer``: a money transfer to a closed account (the deposit fails and
  the withdrawal is refunded); prints the run id;
- ``refund``: a customer asks for a refund; the supervisor's approval of the
  child flow is given here too; prints the conversation's run id;
- ``booking``: a traveller books a flight (the search is delegated);
- ``checkout``: a checkout; prints the run id.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from kuralle_es import RunStore, Runtime
from kuralle_es.examples import booking_agent, checkout, money_transfer, refund_agent
from kuralle_es.examples.outside import Ledger
from kuralle_es.integrations.pydantic_ai import durable


class StandingLedger(Ledger):
    """A ledger whose ``KT_STAND_IN`` action stands still once its effect is kept."""

    def record(self, key: str, system: str, action: str, data: dict[str, Any]) -> dict[str, Any]:
        kept = super().record(key, system, action, data)
        if action == os.environ.get("KT_STAND_IN"):
            Path(os.environ["KT_MARKER"]).write_text(action, encoding="utf-8")
            time.sleep(600)  # a tool's thread: the test kills the process meanwhile
        return kept


def _runtime(store: RunStore, agents: Any = ()) -> Runtime:
    return Runtime(list(agents), store=store, lease_ttl=1.0, holder=f"doomed-{os.getpid()}")


async def transfer(store: RunStore) -> None:
    runtime = _runtime(store, money_transfer.build_agents(StandingLedger()))
    order = money_transfer.Transfer(source="alice", target="closed-007", cents=700)
    handle = runtime.run("bank", kind="flow", flow_name="money_transfer", input=order)
    print(await handle.run_id, flush=True)
    await handle.result()


async def refund(store: RunStore) -> None:
    runtime = _runtime(store, refund_agent.build_agents(StandingLedger()))
    paused = await runtime.run("customer-1", input="Please refund order A17").result()
    print(paused.run_id, flush=True)
    assert paused.waiting_for is not None and paused.waiting_for.child_run_id is not None
    await runtime.approve(paused.waiting_for.child_run_id, "customer-1", by="ann")


async def booking(store: RunStore) -> None:
    runtime, standing = _runtime(store), StandingLedger()
    durable(booking_agent.search_agent, runtime, deps=standing)
    traveller = durable(booking_agent.booking_agent, runtime, deps=standing)
    await traveller.run("The cheapest flight SFO to ANC", session_id="traveller-1", deps=standing)


async def buy(store: RunStore) -> None:
    runtime = _runtime(store, checkout.build_agents(StandingLedger()))
    cart = checkout.Cart(order_id="order-9", cents=2599)
    handle = runtime.run("order-9", kind="flow", flow_name="checkout", input=cart)
    print(await handle.run_id, flush=True)
    await handle.result()


EXAMPLES = {"transfer": transfer, "refund": refund, "booking": booking, "checkout": buy}


async def _main(example: str, url: str) -> None:
    with RunStore.from_url(url) as store:
        await EXAMPLES[example](store)


if __name__ == "__main__":
    asyncio.run(_main(*sys.argv[1:]))
