"""A child OS process that runs one turn of the refund example, then exits.

    refund_turn.py BACKEND TARGET SESSION start TEXT
    refund_turn.py BACKEND TARGET SESSION input RUN_ID TEXT
    refund_turn.py BACKEND TARGET SESSION decide RUN_ID SIGNAL_ID approved|declined BY

``BACKEND`` is ``sqlite`` (``TARGET`` a file) or ``postgres`` (``TARGET`` a
DSN). The refund ledger is the file named by ``REFUND_LEDGER``. It prints one
JSON line: the turn's result and the child's ``pid``, or ``{"error": ...}``
(exit 2) when the turn raised.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from kuralle_es import RunStore, Runtime, SignalDelivery
from kuralle_es.examples.refund import build_agent


def _store(backend: str, target: str) -> RunStore:
    if backend == "sqlite":
        return RunStore.sqlite(target)
    if backend == "postgres":
        return RunStore.postgres(target)
    msg = f"backend {backend!r} cannot be shared with another process"
    raise SystemExit(msg)


async def _main(backend: str, target: str, session: str, command: str, *rest: str) -> int:
    store = _store(backend, target)
    runtime = Runtime([build_agent()], store=store)
    try:
        if command == "start":
            (text,) = rest
            handle = runtime.run(session, input=text, kind="flow", flow_name="refund")
        elif command == "input":
            run_id, text = rest
            handle = runtime.run(session, run_id=run_id, input=text)
        elif command == "decide":
            run_id, signal_id, decision, by = rest
            payload = {"approved": decision == "approved", "by": by}
            if decision != "approved":
                payload["reason"] = "not eligible"
            delivery = SignalDelivery(
                signal_id=signal_id, name="__approval", payload=payload, actor=by
            )
            handle = runtime.run(session, run_id=run_id, signal_delivery=delivery)
        else:
            msg = f"unknown command {command!r}"
            raise SystemExit(msg)
        try:
            result = await handle.result()
        except Exception as e:
            print(json.dumps({"error": {"type": type(e).__name__, "message": str(e)}}))
            return 2
        print(json.dumps({**result.model_dump(mode="json"), "pid": os.getpid()}))
        return 0
    finally:
        store.close()


if __name__ == "__main__":
    raise SystemExit(asyncio.run(_main(*sys.argv[1:])))
