"""Code that runs in child OS processes of the tests (and the flows they share).

- ``python tests/workers.py crash BACKEND TARGET LEDGER SESSION`` runs the
  ``crashy`` flow; its tool appends its call to LEDGER and then SIGKILLs its
  own process, so the journal keeps the step's intent and never its result.
- ``race_saves`` is a ``multiprocessing`` (spawn) target: load a run, wait at
  a barrier, append one event, save; report the outcome on a queue.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    Agent,
    Message,
    RunStore,
    Runtime,
    StaleWriteError,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)

CRASH_FLOW = "crashy"


def open_store(backend: str, target: str) -> RunStore:
    if backend == "sqlite":
        return RunStore.sqlite(target)
    if backend == "postgres":
        return RunStore.postgres(target)
    msg = f"backend {backend!r} cannot be shared with another process"
    raise ValueError(msg)


class Amount(BaseModel):
    x: int


def read_ledger(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def crash_agent(ledger: Path, *, die_in_tool: bool) -> Agent:
    """The ``crashy`` flow: one node, one ``charge`` tool call, then ``end("charged")``.

    ``charge`` appends ``{run_id, key, pid}`` to ``ledger`` (flushed to disk),
    then, if ``die_in_tool``, SIGKILLs its own process: the intent is already
    journaled, the result never is.
    """

    def charge(args: Amount, call: ToolCall) -> dict[str, Any]:
        line = json.dumps({"run_id": call.run_id, "key": call.idempotency_key, "pid": os.getpid()})
        with ledger.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        if die_in_tool:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"charged": args.x, "pid": os.getpid()}

    async def pay(state: dict[str, Any], ctx: Any) -> Any:
        state["receipt"] = await ctx.tool("charge", {"x": 5})
        return end("charged")

    tool = define_tool("charge", "charge a card", Amount, charge)
    flow = define_flow(CRASH_FLOW, "charge once, even across a crash", "pay", [action("pay", pay)])
    return define_agent("crasher", "crash tests", None, [tool], [flow])


async def _crash_main(backend: str, target: str, ledger: str, session_id: str) -> None:
    store = open_store(backend, target)
    # A short lease, so that the parent may take the run over soon after the kill.
    runtime = Runtime([crash_agent(Path(ledger), die_in_tool=True)], store=store, lease_ttl=1.0)
    handle = runtime.run(session_id, input="pay", kind="flow", flow_name=CRASH_FLOW)
    await handle.result()
    # Unreachable when the tool kills the process.
    sys.exit(3)


def race_saves(
    backend: str,
    target: str,
    run_id: str,
    name: str,
    rounds: int,
    barrier: Any,
    results: Any,
) -> None:
    """For each round: load the run, meet the other writer, append, save, report."""
    store = open_store(backend, target)
    try:
        for round_no in range(rounds):
            run = store.load(run_id)
            assert run is not None, f"{name}: run {run_id} not found"
            loaded_version = run.version
            run.append_message(Message(role="user", content=f"{name}:{round_no}"))
            barrier.wait(timeout=60)
            try:
                store.save_run(run)
                outcome = "saved"
            except StaleWriteError:
                outcome = "stale"
            except Exception as e:  # reported, so the parent can show it
                outcome = f"{type(e).__name__}: {e}"
            results.put((round_no, name, loaded_version, outcome))
            barrier.wait(timeout=60)
    finally:
        store.close()


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "crash":
        asyncio.run(_crash_main(*rest))
    else:
        raise SystemExit(f"unknown command {command!r}")
