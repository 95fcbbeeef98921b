"""A checkout whose payment webhook may arrive before the run waits for it.

    python -m kuralle_es.examples.checkout [--store URL] ORDER_ID CENTS

The ``checkout`` flow creates a payment and publishes its id and link
(``ctx.publish``: a web page reads them with ``runtime.published`` or ``GET
/api/runs/{run_id}/published`` while the run lives), reserves the stock, and
then takes the payment provider's webhook from its mailbox (``ctx.receive``,
within a deadline). The web app hands each webhook to the run with
``runtime.send`` (``payment_webhook``; over HTTP, ``POST
/api/runs/{run_id}/messages``) whenever it comes: one that arrives while the
stock is still being reserved waits in the mailbox. Each effect happens once
per key (``outside.Ledger``). See docs/examples.md.
"""

from __future__ import annotations

import argparse
import asyncio
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, Field

from kuralle_es import (
    Agent,
    DeadlineExpiredError,
    RunContext,
    RunStore,
    Runtime,
    Tool,
    ToolCall,
    TurnResult,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es.examples.outside import Ledger

PAY_WITHIN = timedelta(minutes=30)


class Cart(BaseModel):
    order_id: str
    cents: int = Field(gt=0)


class PaymentEvent(BaseModel):
    """The payment provider's webhook: which payment, of which run, and how it went."""

    event_id: str
    payment_id: str
    run_id: str
    order_id: str
    status: Literal["succeeded", "failed"]


async def checkout(state: dict[str, Any], ctx: RunContext) -> Any:
    cart: Cart = ctx.input
    payment = await ctx.tool("create_payment", cart.model_dump())
    await ctx.publish("payment", payment)  # the web page shows the link from now on
    await ctx.tool("reserve_stock", {"order_id": cart.order_id})
    try:
        paid = await ctx.receive("payment", deadline=PAY_WITHIN, schema=PaymentEvent)
    except DeadlineExpiredError:
        paid = None
    if paid is None or paid.status != "succeeded":
        await ctx.tool("release_stock", {"order_id": cart.order_id})
        return end("cancelled: not paid")
    await ctx.tool("ship_order", {"order_id": cart.order_id})
    return end(f"paid ({paid.payment_id}) and shipped")


class Order(BaseModel):
    order_id: str


def build_agents(world: Ledger | None = None) -> list[Agent]:
    """The shop agent and its ``checkout`` flow, whose tools change ``world``."""
    ledger = world or Ledger()

    def create_payment(cart: Cart, call: ToolCall) -> dict[str, Any]:
        payment_id = f"pay_{call.idempotency_key[:12]}"
        payment = {"payment_id": payment_id, "url": f"https://pay.example/{payment_id}",
                   "cents": cart.cents, "run_id": call.run_id}  # fmt: skip
        return ledger.record(call.idempotency_key, "payments", "create_payment", payment)

    def warehouse(name: str) -> Tool[Order]:
        def execute(order: Order, call: ToolCall) -> dict[str, Any]:
            return ledger.record(call.idempotency_key, "warehouse", name, order.model_dump())

        return define_tool(name, f"{name} (once per key)", Order, execute)

    tools: list[Tool[Any]] = [define_tool("create_payment", "Pay", Cart, create_payment)]
    tools += [warehouse(name) for name in ("reserve_stock", "release_stock", "ship_order")]
    flow = define_flow("checkout", "pay, then ship", "go", [action("go", checkout)], input=Cart)
    return [define_agent("shop", "sells and ships", None, tools, [flow])]


AGENTS = build_agents()


async def payment_webhook(runtime: Runtime, event: PaymentEvent) -> TurnResult:
    """What the web app does with a webhook: a message to the run (its session is
    the order), once per event id, whatever the run is doing."""
    payload = event.model_dump()
    return await runtime.send(
        event.run_id, event.order_id, "payment", payload, message_id=event.event_id
    )


async def main(store_url: str, cart: Cart) -> None:
    with RunStore.from_url(store_url) as store:
        runtime = Runtime(AGENTS, store=store)
        handle = runtime.run(cart.order_id, kind="flow", flow_name="checkout", input=cart)
        run_id = await handle.run_id
        payment = await runtime.wait_published(run_id, cart.order_id, "payment", timeout=30)
        print("the page shows:", payment["url"])
        paid = PaymentEvent(event_id="evt_1", payment_id=payment["payment_id"], run_id=run_id,
                            order_id=cart.order_id, status="succeeded")  # fmt: skip
        await payment_webhook(runtime, paid)  # maybe before the run waits: kept
        await handle.result()
        state = await runtime.get_run(run_id, cart.order_id)
        assert state is not None
        print(run_id, state.status, state.outcome)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="sqlite:///checkout.db")
    parser.add_argument("order_id")
    parser.add_argument("cents", type=int)
    args = parser.parse_args()
    asyncio.run(main(args.store, Cart.model_validate(vars(args))))
