"""The app of the kill tests: a ``charge`` flow whose tool writes a ledger TABLE.

As ``--app charge_app:build_agents`` (importable from this folder) it is what
``kuralle-es worker`` recovers runs with. Run as a script it is the worker
that dies:

    charge_app.py start STORE_URL SESSION [N]

starts N runs (default 1) of the ``charge`` flow and prints each run id as
it opens;

    charge_app.py start-keyed STORE_URL SESSION KEY flow|conversation

makes one keyed call, as a ported application does: a keyed start of the
``charge`` flow, or a keyed user turn of the ``clerk`` agent's conversation
(whose model asks for one ``charge`` a turn).

``KT_LEDGER`` is where the payment system keeps its ledger: a
``postgresql://`` DSN or a SQLite file. The ledger has one row per
idempotency key in ``charges`` (``INSERT ... ON CONFLICT DO NOTHING``: the
payment system deduplicates) and one row per execution in
``charge_attempts`` (so a re-execution is visible).

``KT_KILL_AT`` stops the process at one point of every run, for the test to
``SIGKILL`` it there: ``before-intent`` (the node runs, the tool's intent is
not journaled), ``in-tool`` (the charge is written, the result is not
journaled), ``after-result`` (the result is journaled, the run not closed: the
node waits until another reader sees it, since a result rides the turn's next
save).
Once all N runs stand there, the file ``KT_MARKER`` is written.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from pydantic import BaseModel

from kuralle_es import (
    Agent,
    ModelRequest,
    ModelResponse,
    RunStore,
    Runtime,
    ToolCall,
    ToolCallRequest,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es.testing import ScriptedModel

FLOW = "charge"
KILL_POINTS = ("before-intent", "in-tool", "after-result")
_reached: list[str] = []


class Amount(BaseModel):
    cents: int


@contextmanager
def ledger(target: str | None = None) -> Iterator[Any]:
    """A connection to the ledger (``KT_LEDGER`` by default), its tables created."""
    target = target or os.environ["KT_LEDGER"]
    if target.startswith("postgresql://"):
        with psycopg.connect(target, autocommit=True) as pg:
            pg.execute(
                "CREATE TABLE IF NOT EXISTS charges (key text PRIMARY KEY, run_id text, cents int)"
            )
            pg.execute(
                "CREATE TABLE IF NOT EXISTS charge_attempts "
                "(id serial PRIMARY KEY, key text, pid int)"
            )
            yield pg
        return
    lite = sqlite3.connect(target, timeout=30, isolation_level=None)
    try:
        lite.execute(
            "CREATE TABLE IF NOT EXISTS charges (key TEXT PRIMARY KEY, run_id TEXT, cents INTEGER)"
        )
        lite.execute(
            "CREATE TABLE IF NOT EXISTS charge_attempts "
            "(id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT, pid INTEGER)"
        )
        yield lite
    finally:
        lite.close()


def placeholders(conn: Any, sql: str) -> str:
    return sql.replace("?", "%s") if isinstance(conn, psycopg.Connection) else sql


def record_charge(key: str, run_id: str, cents: int) -> None:
    with ledger() as conn:
        conn.execute(
            placeholders(conn, "INSERT INTO charge_attempts (key, pid) VALUES (?, ?)"),
            (key, os.getpid()),
        )
        conn.execute(
            placeholders(
                conn,
                "INSERT INTO charges (key, run_id, cents) VALUES (?, ?, ?) "
                "ON CONFLICT (key) DO NOTHING",
            ),
            (key, run_id, cents),
        )


def read_ledger(target: str) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(charges rows, attempts rows) of the ledger at ``target`` (its tables created)."""
    with ledger(target) as conn:
        charges = list(conn.execute("SELECT key, run_id, cents FROM charges ORDER BY key"))
        attempts = list(conn.execute("SELECT key, pid FROM charge_attempts ORDER BY id"))
    return charges, attempts


async def reach(point: str) -> None:
    """Stand still at ``point`` if this process is to die there (the test kills it)."""
    if os.environ.get("KT_KILL_AT") != point:
        return
    _reached.append(point)
    if len(_reached) == int(os.environ.get("KT_RUNS", "1")):
        await asyncio.to_thread(Path(os.environ["KT_MARKER"]).write_text, point)
    await asyncio.sleep(600)


#: The store the process drives (the ``start`` command's URL).
_store_url: list[str] = []


async def _journaled(run_id: str) -> None:
    """Wait until every step of the run is journaled finished, as another reader sees it."""
    with RunStore.from_url(_store_url[0]) as store:
        while True:
            run = await store.load_async(run_id)
            if run is not None and run.steps and all(s["status"] == "finished" for s in run.steps):
                return
            await asyncio.sleep(0.01)


def build_agents() -> list[Agent]:
    async def charge(args: Amount, call: ToolCall) -> dict[str, Any]:
        await asyncio.to_thread(record_charge, call.idempotency_key, call.run_id, args.cents)
        await reach("in-tool")
        return {"charged": args.cents}

    async def pay(state: dict[str, Any], ctx: Any) -> Any:
        await reach("before-intent")
        state["receipt"] = await ctx.tool("charge", {"cents": 500})
        if os.environ.get("KT_KILL_AT") == "after-result":
            # The result rides the turn's next save (alone after a few ms of
            # nothing): stand here once it is journaled.
            await _journaled(ctx.run_id)
        await reach("after-result")
        return end("charged")

    async def hold(state: dict[str, Any], ctx: Any) -> Any:
        decision = await ctx.approve("Charge?", deadline=timedelta(seconds=0.5))
        return end(f"approved={decision.approved}")

    async def nap(state: dict[str, Any], ctx: Any) -> Any:
        await ctx.sleep(1.5)
        return end("rested")

    tool = define_tool("charge", "charge a card once", Amount, charge)
    flows = [
        define_flow(FLOW, "charge once, whoever dies", "pay", [action("pay", pay)]),
        define_flow("hold", "an approval with a short deadline", "hold", [action("hold", hold)]),
        define_flow("nap", "a durable sleep", "nap", [action("nap", nap)]),
    ]
    return [
        define_agent("cashier", "charges", None, [tool], flows),
        define_agent("clerk", "charges in a conversation", ScriptedModel(_clerk), [tool]),
    ]


def _clerk(request: ModelRequest) -> ModelResponse | str:
    """The clerk's model: one ``charge`` after each user message, then a reply."""
    last = request.messages[-1]
    if last.role == "tool":
        return f"charged: {last.content}"
    return ModelResponse(tool_calls=[ToolCallRequest(id="c1", name="charge", args={"cents": 700})])


async def _start_keyed(url: str, session: str, key: str, kind: str) -> None:
    with RunStore.from_url(url) as store:
        runtime = Runtime(
            build_agents(), store=store, lease_ttl=1.0, holder=f"doomed-{os.getpid()}"
        )
        if kind == "flow":
            handle = runtime.run(
                session, input="pay", kind="flow", flow_name=FLOW, idempotency_key=key
            )
        else:
            handle = runtime.run(session, input="pay me", agent="clerk", idempotency_key=key)
        print(await handle.run_id, flush=True)
        await handle.result()


async def _start(url: str, session: str, runs: str = "1") -> None:
    os.environ["KT_RUNS"] = runs
    _store_url.append(url)
    with RunStore.from_url(url) as store:
        runtime = Runtime(
            build_agents(), store=store, lease_ttl=1.0, holder=f"doomed-{os.getpid()}"
        )
        handles = [
            runtime.run(f"{session}-{n}", input="pay", kind="flow", flow_name=FLOW)
            for n in range(int(runs))
        ]
        for handle in handles:
            print(await handle.run_id, flush=True)
        await asyncio.gather(*(h.result() for h in handles))


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command not in ("start", "start-keyed"):
        raise SystemExit(f"unknown command {command!r}")
    asyncio.run(_start(*rest) if command == "start" else _start_keyed(*rest))
