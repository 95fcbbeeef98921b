"""A child OS process that runs one turn over a shared SQLite or PostgreSQL database.

    worker.py BACKEND TARGET LEDGER SESSION start FLOW
    worker.py BACKEND TARGET LEDGER SESSION resume RUN_ID
    worker.py BACKEND TARGET LEDGER SESSION deliver RUN_ID|- SIGNAL_ID NAME PAYLOAD_JSON

It prints one JSON line: the turn's result (``run_id``, ``status``,
``waiting_for``, ...) and the child's ``pid``, or ``{"error": {...}}`` (exit 2)
when the turn raised. ``KT_LEASE_TTL`` (default 0.5 s) is the child's lease, so
that a parent may take over soon after a SIGKILL. Tests call ``run_child``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from kuralle_es import RunStore, Runtime, SignalDelivery  # noqa: E402
from procs.flows import make_agent  # noqa: E402

#: Process exit status of a child that SIGKILLed itself.
KILLED = -9


def _store(backend: str, target: str) -> RunStore:
    if backend == "sqlite":
        return RunStore.sqlite(target)
    if backend == "postgres":
        return RunStore.postgres(target)
    msg = f"backend {backend!r} cannot be shared with another process"
    raise ValueError(msg)


async def _main(
    backend: str, target: str, ledger: str, session: str, command: str, *rest: str
) -> int:
    store = _store(backend, target)
    runtime = Runtime(
        [make_agent(Path(ledger))],
        store=store,
        lease_ttl=float(os.environ.get("KT_LEASE_TTL", "0.5")),
    )
    try:
        if command == "start":
            (flow_name,) = rest
            handle = runtime.run(session, input="go", kind="flow", flow_name=flow_name)
        elif command == "resume":
            (run_id,) = rest
            handle = runtime.run(session, run_id=run_id)
        elif command == "deliver":
            run_id, signal_id, name, payload = rest
            delivery = SignalDelivery(
                signal_id=signal_id, name=name, payload=json.loads(payload), actor="child"
            )
            handle = runtime.run(
                session, run_id=None if run_id == "-" else run_id, signal_delivery=delivery
            )
        else:
            msg = f"unknown command {command!r}"
            raise SystemExit(msg)
        try:
            if command == "start":
                # Known as soon as the run is opened, before any node code runs.
                print(json.dumps({"opened": await handle.run_id}), flush=True)
            result = await handle.result()
        except Exception as e:
            print(json.dumps({"error": {"type": type(e).__name__, "message": str(e)}}))
            return 2
        print(json.dumps({**result.model_dump(mode="json"), "pid": os.getpid()}))
        return 0
    finally:
        store.close()


def run_child(
    backend: str,
    target: str,
    ledger: Path,
    session: str,
    *args: str,
    env: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any] | None]:
    """Run one child turn; its exit status and its JSON report (None if it died)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KT_")}
    child_env.update(env or {})
    done = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            backend,
            target,
            str(ledger),
            session,
            *args,
        ],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    report = json.loads(lines[-1]) if lines else None
    if done.returncode not in (0, 2, KILLED):
        msg = f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        raise AssertionError(msg)
    return done.returncode, report


async def wait_lease_expired(runtime: Runtime, run_id: str, session: str) -> None:
    """Sleep until the lease a killed child left on the run has expired."""
    state = await runtime.get_run(run_id, session)
    assert state is not None
    if state.lease_expires_at is not None:
        delay = (state.lease_expires_at - datetime.now(UTC)).total_seconds()
        if delay > 0:
            await asyncio.sleep(delay + 0.05)


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(*sys.argv[1:])))
