"""The event loop's work per journaled step, this checkout against an earlier one.

Timings on a shared machine swing by a tenth or more from one minute to the
next; what the loop does per step does not. For C runs at once (``--concurrency``,
default 1,32) of 10 no-op tool steps on PostgreSQL, driven from one event loop,
this counts per step the Python function calls the loop's thread makes
(``cProfile``; a resumed coroutine counts as a call) and the callbacks the loop
runs (wake-ups of tasks, settled futures), for this checkout and for
``--release`` (a git ref, checked out into a temporary worktree), each in a
process of its own on a fresh database, and prints both and their ratio. Fewer
calls is less CPU, which is what bounds a busy process (``concurrency.py``
prints its CPU per step); the counts are the same from run to run within a
few per cent.

Server: ``KURALLE_BENCH_POSTGRES_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``). Usage::

    python benchmarks/work_per_step.py [--release 82a5b9d] [--concurrency 1,32]
        [--runs 3] [--tool sync|async]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10


def _agent(tool: str) -> Any:
    """A flow of ``STEPS`` no-op tool steps, built from the public API only (so an
    earlier release runs it too)."""
    from pydantic import BaseModel

    from kuralle_es import action, define_agent, define_flow, define_tool, end

    class Step(BaseModel):
        x: int

    def sync_noop(args: Step) -> dict[str, int]:
        return {"x": args.x}

    async def async_noop(args: Step) -> dict[str, int]:
        return {"x": args.x}

    async def loop_node(state: dict[str, Any], ctx: Any) -> Any:
        for i in range(STEPS):
            await ctx.tool("noop", {"x": i})
        return end("done")

    execute = sync_noop if tool == "sync" else async_noop
    return define_agent(
        "bench", "", None, [define_tool("noop", "", Step, execute)],
        [define_flow("loop", "", "n", [action("n", loop_node)])],
    )  # fmt: skip


async def _count(dsn: str, tool: str, concurrency: int, runs: int) -> dict[str, float]:
    """Calls and loop callbacks per step of ``concurrency`` drivers of ``runs`` runs."""
    import asyncio.events

    from kuralle_es import RunStore, Runtime

    callbacks = [0]
    run_handle = asyncio.events.Handle._run

    def counted(handle: asyncio.events.Handle) -> None:
        callbacks[0] += 1
        run_handle(handle)

    store = RunStore.postgres(dsn)
    try:
        runtime = Runtime([_agent(tool)], store=store)
        for _ in range(2):  # connections, prepared statements, tool threads
            await runtime.run(f"warm-{uuid.uuid4().hex}", kind="flow", flow_name="loop").result()

        async def driver() -> None:
            for _ in range(runs):
                name = f"b-{uuid.uuid4().hex}"
                await runtime.run(name, kind="flow", flow_name="loop").result()

        profile = cProfile.Profile()
        asyncio.events.Handle._run = counted  # type: ignore[method-assign]
        profile.enable()
        try:
            await asyncio.gather(*(driver() for _ in range(concurrency)))
        finally:
            profile.disable()
            asyncio.events.Handle._run = run_handle  # type: ignore[method-assign]
        steps = concurrency * runs * STEPS
        calls = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
        return {"calls": calls / steps, "callbacks": callbacks[0] / steps}
    finally:
        store.close()


def _child(args: argparse.Namespace) -> int:
    """In a process whose ``PYTHONPATH`` is the checkout: print the counts as JSON."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from journal_overhead import DEFAULT_DSN, DSN_ENV, create_database, drop_database, with_dbname

    admin = os.environ.get(DSN_ENV, DEFAULT_DSN)
    name = create_database(admin)
    if name is None:
        raise SystemExit(f"the PostgreSQL server at {admin} is unreachable")
    try:
        counts = asyncio.run(
            _count(with_dbname(admin, str(name)), args.tool, args.child, args.runs)
        )
    finally:
        drop_database(admin, str(name))
    print(json.dumps(counts))
    return 0


def _measure(checkout: Path, args: argparse.Namespace, concurrency: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(concurrency), "--runs", str(args.runs),
         "--tool", args.tool],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the count of {checkout} failed:\n{done.stderr}")
    counts: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--release", default="82a5b9d", help="the git ref to compare with")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--runs", type=int, default=3, help="runs each driver makes")
    parser.add_argument("--tool", choices=("sync", "async"), default="sync")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "release"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), args.release],
            check=True,
        )
        try:
            rows = [(c, _measure(old, args, c), _measure(ROOT, args, c)) for c in levels]
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False
            )
    print(f"work per {args.tool} tool step on the event loop's thread: "
          f"release {args.release} vs this checkout")  # fmt: skip
    print(f"{'runs at once':>12} | {'what':<22} | {'release':>8} | {'now':>8} | now/release")
    for concurrency, before, now in rows:
        for key, label in (
            ("calls", "Python calls a step"),
            ("callbacks", "loop callbacks a step"),
        ):
            print(
                f"{concurrency:>12} | {label:<22} | {before[key]:>8.1f} | {now[key]:>8.1f} | "
                f"{now[key] / before[key]:.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
