"""The approval notifier as a crash-test process: ``python approval_consumer.py TARGET``.

``TARGET`` is a SQLite path or a PostgreSQL DSN. It runs the example's
handler, slowed down after writing an outbox row and before the transaction
commits; it says ``inserted POSITION`` then, so the test can kill it in that window.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from kuralle_es.events import Consumer, RunEvent, RunPaused
from kuralle_es.examples import approval_notifier as notifier


def main(target: str) -> None:
    store = (
        notifier.open_store(target, None) if "://" in target else notifier.open_store(None, target)
    )
    notifier.create_outbox(store)

    def slow(event: RunEvent, tx: Any) -> None:
        notifier.notify_approval(event, tx)
        if isinstance(event, RunPaused) and event.waiting_for.kind == "approval":
            print(f"inserted {event.position}", flush=True)  # written, not yet committed
            time.sleep(0.05)
        else:
            time.sleep(0.002)

    consumer = Consumer(store, notifier.CONSUMER_NAME, slow, poll_interval=0.02)
    print("ready", flush=True)
    asyncio.run(consumer.run())


if __name__ == "__main__":
    main(sys.argv[1])
