"""A worker that drives flow runs of three tool steps, for the failover and pooler tests.

    three_steps.py STORE_URL LEDGER ACKS RUNS CONCURRENCY [PREFIX]

drives ``RUNS`` runs of the flow ``three`` (sessions ``PREFIX0``, ``PREFIX1``,
...), ``CONCURRENCY`` at a time on one event loop, each started with an
inbound idempotency key (a start retried after a lost connection returns
the first run). A turn that fails (a store away, a lease still held) is
tried again by resuming the run, until it finishes, for at most
``KT_RETRY_FOR`` seconds (default 120).

Each execution of the ``step`` tool appends ``{"key", "run_id", "pid",
"at"}`` to ``LEDGER`` (the payment system's log: a key twice is an effect
executed twice; ``crash_first`` makes the first execution in the process die
instead, as a ``SIGKILL`` would, leaving an orphan); each run acknowledged
finished appends ``{"run_id", "at", "steps"}`` to ``ACKS``, the moment the
caller was told. At the end it prints ``{"finished", "failed_turns",
"errors"}`` on one JSON line.

As ``--app three_steps:build_agents`` (``KT_LEDGER`` the ledger) it is what
``kuralle-es worker`` recovers such runs with.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kuralle_es import (
    RunContext,
    RunStore,
    Runtime,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es.testing import Crash


class Step(BaseModel):
    i: int


def append(path: Path, entry: dict[str, Any]) -> None:
    """One line, in one write (O_APPEND: lines of concurrent writers never mix)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def make_agent(ledger: Path, *, crash_first: bool = False) -> Any:
    crashes = [crash_first]

    def step(args: Step, call: ToolCall) -> dict[str, int]:
        if crashes[0]:
            crashes[0] = False
            raise Crash("the process died in the tool")
        append(
            ledger,
            {"key": call.idempotency_key, "run_id": call.run_id, "pid": os.getpid(),
             "at": time.time()},
        )  # fmt: skip
        return {"i": args.i}

    async def go(state: dict[str, Any], ctx: RunContext) -> Any:
        for i in range(3):
            await ctx.tool("step", {"i": i})
        return end("done")

    flow = define_flow("three", "", "go", [action("go", go)])
    return define_agent("stepper", "", None, [define_tool("step", "", Step, step)], [flow])


def build_agents() -> list[Any]:
    """The agents of ``kuralle-es worker --app three_steps:build_agents``."""
    return [make_agent(Path(os.environ["KT_LEDGER"]))]


async def drive(
    url: str, ledger: Path, acks: Path, runs: int, concurrency: int, prefix: str
) -> dict[str, Any]:
    retry_for = float(os.environ.get("KT_RETRY_FOR", "120"))
    gate = asyncio.Semaphore(concurrency)
    failed_turns = 0
    errors: dict[str, int] = {}
    finished = 0
    with RunStore.from_url(url) as store:
        runtime = Runtime([make_agent(ledger)], store=store, holder="three-steps", lease_ttl=3.0)

        async def one(i: int) -> None:
            nonlocal failed_turns, finished
            session = f"{prefix}{i}"
            run_id: str | None = None
            give_up = time.monotonic() + retry_for
            last: Exception | None = None
            async with gate:
                while True:
                    if run_id is None:
                        key = f"start-{session}"
                        handle = runtime.run(
                            session, kind="flow", flow_name="three", idempotency_key=key
                        )
                    else:
                        handle = runtime.run(session, run_id=run_id)
                    try:
                        result = await handle.result()
                        run_id = result.run_id
                        if result.status == "finished":
                            break
                    except Exception as error:  # a turn the failover cut short
                        last = error
                        failed_turns += 1
                        name = type(error).__name__
                        errors[name] = errors.get(name, 0) + 1
                        if run_id is None:
                            try:
                                run_id = await asyncio.wait_for(handle.run_id, 0.1)
                            except Exception:
                                run_id = None
                    if time.monotonic() > give_up:
                        msg = f"run {i} ({run_id}) did not finish: {last!r}"
                        raise RuntimeError(msg)
                    await asyncio.sleep(0.2)
            append(acks, {"run_id": run_id, "at": time.time(), "steps": 3})
            finished += 1

        await asyncio.gather(*(one(i) for i in range(runs)))
    return {"finished": finished, "failed_turns": failed_turns, "errors": errors}


def main() -> int:
    url, ledger, acks, runs, concurrency = sys.argv[1:6]
    prefix = sys.argv[6] if len(sys.argv) > 6 else "s"
    found = asyncio.run(drive(url, Path(ledger), Path(acks), int(runs), int(concurrency), prefix))
    print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
