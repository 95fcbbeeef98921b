"""The same workloads on kuralle_es, DBOS and LangGraph's Postgres checkpointer, in one run.

Two workloads, each measured in ``--rounds`` interleaved rounds (every system
once per round, in turn, so a noisy machine slows all of them alike) and
reported as the median:

* **a run of ``--steps`` no-op tool steps** (default 100), timed whole (open,
  steps, close), per step:

  - kuralle_es on PostgreSQL with the one-round-trip recorder (the default),
    and with ``eventsourcing``'s own ``PostgresApplicationRecorder``;
  - DBOS: a ``@DBOS.workflow`` calling a no-op ``@DBOS.step`` N times;
  - LangGraph: a one-node graph looping N times over a ``PostgresSaver``
    with ``durability="sync"`` (each checkpoint committed before the next
    step runs, as a journal must);
  - the floors: one and two single-row ``INSERT`` + ``COMMIT`` per step
    through one psycopg connection.

* **pause -> resume of a 3-node flow** (a, then b waits for an approval, then
  c): kuralle_es ``ctx.approve`` + a delivered ``__approval`` signal, against
  LangGraph's ``interrupt`` + ``Command(resume=...)``; both the first turn and
  the resume, on the same process and database.

DBOS and LangGraph come from the ``bench`` extra (``pip install -e '.[bench]'``);
one that cannot be imported or started is skipped with the reason printed.
Every system gets its own fresh database on the server named by
``KURALLE_BENCH_POSTGRES_DSN`` (default ``postgresql://postgres@127.0.0.1:5432/postgres``),
dropped at the end. ``--json FILE`` writes the medians for ``chart.py``.

Usage: ``python benchmarks/peers.py [--steps 100] [--rounds 7] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict

import psycopg
from journal_overhead import (
    DEFAULT_DSN,
    DSN_ENV,
    FLOOR_PAYLOAD,
    create_database,
    drop_database,
    server_settings,
    with_dbname,
)
from pydantic import BaseModel

from kuralle_es import (
    RunStore,
    Runtime,
    SignalDelivery,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
)
from kuralle_es._journal.store_url import postgres_address
from kuralle_es._runtime.context import RunContext

#: eventsourcing's own recorder, for the row "without the one-round-trip save".
DEFAULT_RECORDER = "eventsourcing.postgres:PostgresApplicationRecorder"


# ---------------------------------------------------------------- kuralle_es
class NoopArgs(BaseModel):
    x: int


STEPS = {"n": 100}


async def tool_loop(state: dict[str, Any], ctx: RunContext) -> Any:
    for i in range(STEPS["n"]):
        await ctx.tool("noop", {"x": i})
    return end("done")


async def node_a(state: dict[str, Any], ctx: RunContext) -> Any:
    return goto("b")


async def node_b(state: dict[str, Any], ctx: RunContext) -> Any:
    decision = await ctx.approve("go on?")
    return goto("c") if decision.approved else end("declined")


async def node_c(state: dict[str, Any], ctx: RunContext) -> Any:
    return end("approved")


NOOP = define_tool("noop", "does nothing", NoopArgs, lambda a: {"x": a.x})
LOOP = define_flow("bench_loop", "N no-op tool steps", "n", [action("n", tool_loop)])
PAUSE = define_flow(
    "bench_pause",
    "a, b (approval), c",
    "a",
    [action("a", node_a), action("b", node_b), action("c", node_c)],
)
AGENT = define_agent("bench", "benchmark agent", None, [NOOP], [LOOP, PAUSE])


def approval() -> SignalDelivery:
    return SignalDelivery(
        signal_id=uuid.uuid4().hex, name="__approval", payload={"approved": True, "by": "bench"}
    )


class Kuralle:
    """kuralle_es over one PostgreSQL database, with a given recorder."""

    def __init__(self, dsn: str, recorder: str | None) -> None:
        env: dict[str, str] = postgres_address(dsn).env()
        if recorder is not None:
            # In the env mapping of this store only: in os.environ it would reach SQLite stores.
            env["APPLICATION_RECORDER_TOPIC"] = recorder
        self.store = RunStore(env=env)
        self.runtime = Runtime([AGENT], store=self.store)

    async def loop(self, steps: int) -> None:
        STEPS["n"] = steps
        result = await self.runtime.run(
            f"s-{uuid.uuid4().hex[:8]}", kind="flow", flow_name=LOOP.name
        ).result()
        if result.status != "finished":
            raise RuntimeError(f"kuralle_es loop ended {result.status}")

    async def pause_resume(self) -> None:
        session = f"p-{uuid.uuid4().hex[:8]}"
        paused = await self.runtime.run(session, kind="flow", flow_name=PAUSE.name).result()
        if paused.status != "paused":
            raise RuntimeError(f"kuralle_es pause flow ended {paused.status}, not paused")
        done = await self.runtime.run(
            session, run_id=paused.run_id, signal_delivery=approval()
        ).result()
        if done.status != "finished" or done.output != "approved":
            raise RuntimeError(f"kuralle_es resume ended {done.status} {done.output}")

    def close(self) -> None:
        self.store.close()


# ---------------------------------------------------------------------- DBOS
class Dbos:
    """DBOS (one per process: it is a singleton) on its own system database."""

    def __init__(self, dsn: str) -> None:
        from dbos import DBOS, DBOSConfig

        logging.getLogger("dbos").setLevel(logging.WARNING)
        config: DBOSConfig = {
            "name": "kuralle_bench",
            "system_database_url": dsn,
            "run_admin_server": False,
            "log_level": "WARNING",
        }
        self.dbos = DBOS
        DBOS(config=config)

        @DBOS.step()
        def noop(x: int) -> dict[str, int]:
            return {"x": x}

        @DBOS.workflow()
        def loop(n: int) -> int:
            for i in range(n):
                noop(i)
            return n

        self._loop = loop
        DBOS.launch()

    def loop(self, steps: int) -> None:
        if self._loop(steps) != steps:
            raise RuntimeError("DBOS workflow returned the wrong count")

    def close(self) -> None:
        self.dbos.destroy()


# ----------------------------------------------------------------- LangGraph
class State(TypedDict):
    """The LangGraph graphs' state (at module level: LangGraph resolves its hints)."""

    i: int
    n: int


class LangGraph:
    """LangGraph graphs over a ``PostgresSaver`` (one autocommit psycopg connection)."""

    def __init__(self, dsn: str) -> None:
        from langgraph.checkpoint.postgres import PostgresSaver
        from langgraph.graph import END, START, StateGraph
        from langgraph.types import Command, interrupt
        from psycopg.rows import dict_row

        def step(s: State) -> dict[str, int]:
            return {"i": s["i"] + 1}

        def route(s: State) -> str:
            return "step" if s["i"] < s["n"] else END

        self.conn = psycopg.Connection.connect(
            dsn, autocommit=True, prepare_threshold=0, row_factory=dict_row
        )
        saver = PostgresSaver(self.conn)  # type: ignore[arg-type]
        saver.setup()
        loop = StateGraph(State)
        loop.add_node("step", step)
        loop.add_edge(START, "step")
        loop.add_conditional_edges("step", route)
        self._loop = loop.compile(checkpointer=saver)

        def a(s: State) -> dict[str, int]:
            return {"i": 1}

        def b(s: State) -> dict[str, int]:
            approved = interrupt("go on?")
            return {"i": 2 if approved else 0}

        def c(s: State) -> dict[str, int]:
            return {"i": s["i"] + 1}

        pause = StateGraph(State)
        pause.add_node("a", a)
        pause.add_node("b", b)
        pause.add_node("c", c)
        pause.add_edge(START, "a")
        pause.add_edge("a", "b")
        pause.add_edge("b", "c")
        pause.add_edge("c", END)
        self._pause = pause.compile(checkpointer=saver)
        self._command = Command

    def loop(self, steps: int) -> None:
        config: Any = {
            "configurable": {"thread_id": uuid.uuid4().hex},
            "recursion_limit": steps + 10,
        }
        out = self._loop.invoke({"i": 0, "n": steps}, config, durability="sync")
        if out["i"] != steps:
            raise RuntimeError("LangGraph loop ended early")

    def pause_resume(self) -> None:
        config: Any = {"configurable": {"thread_id": uuid.uuid4().hex}}
        first = self._pause.invoke({"i": 0, "n": 0}, config, durability="sync")
        if "__interrupt__" not in first:
            raise RuntimeError("LangGraph graph did not interrupt")
        done = self._pause.invoke(self._command(resume=True), config, durability="sync")
        if done["i"] != 3:
            raise RuntimeError(f"LangGraph resume ended with {done}")

    def close(self) -> None:
        self.conn.close()


# -------------------------------------------------------------------- floors
class Floor:
    """``commits`` single-row INSERT + COMMIT per step on one psycopg connection."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn)
        self.conn.execute("CREATE TABLE floor (id BIGSERIAL PRIMARY KEY, payload BYTEA NOT NULL)")
        self.conn.commit()

    def loop(self, steps: int, commits: int) -> None:
        for _ in range(steps * commits):
            self.conn.execute("INSERT INTO floor (payload) VALUES (%s)", (FLOOR_PAYLOAD,))
            self.conn.commit()

    def close(self) -> None:
        self.conn.close()


# -------------------------------------------------------------------- driver
@dataclass
class Series:
    label: str
    #: What one sample is divided by (steps per run, or 1 for a whole pause -> resume).
    per: int
    run: Callable[[], Any]
    samples: list[float] = field(default_factory=list)

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples) / self.per * 1e6


@contextlib.contextmanager
def databases(admin_dsn: str, names: list[str]) -> Iterator[dict[str, str]]:
    created: dict[str, str] = {}
    try:
        for name in names:
            db = create_database(admin_dsn)
            if db is None:
                raise SystemExit(f"PostgreSQL at {admin_dsn} is unreachable")
            created[name] = db
        yield {name: with_dbname(admin_dsn, db) for name, db in created.items()}
    finally:
        for db in created.values():
            drop_database(admin_dsn, db)


async def measure(series: list[Series], rounds: int) -> None:
    for s in series:  # warm-up
        r = s.run()
        if asyncio.iscoroutine(r):
            await r
    for _ in range(rounds):
        for s in series:
            gc.collect()
            start = time.perf_counter()
            r = s.run()
            if asyncio.iscoroutine(r):
                await r
            s.samples.append(time.perf_counter() - start)


def table(title: str, series: list[Series], base: Series, unit: str) -> list[str]:
    scale = 1e-3 if unit == "ms" else 1.0
    lines = [f"{title}", f"{'system':<52} | {unit:>8} | vs {base.label}"]
    for s in series:
        lines.append(
            f"{s.label:<52} | {s.median_us * scale:>8.0f} | {s.median_us / base.median_us:.2f}x"
        )
    return lines


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    admin_dsn = os.environ.get(DSN_ENV, DEFAULT_DSN)
    steps = args.steps
    closers: list[Callable[[], None]] = []
    skipped: dict[str, str] = {}
    with databases(admin_dsn, ["kuralle", "kuralle_default", "dbos", "langgraph", "floor"]) as dsn:
        print(f"postgres: {server_settings(dsn['floor'])}", flush=True)
        one_trip = Kuralle(dsn["kuralle"], None)
        default = Kuralle(dsn["kuralle_default"], DEFAULT_RECORDER)
        floor = Floor(dsn["floor"])
        closers += [one_trip.close, default.close, floor.close]
        kuralle_row = Series(
            "kuralle_es tool step (one-trip recorder)", steps, lambda: one_trip.loop(steps)
        )
        loop_series = [
            Series("floor: 1x INSERT+COMMIT", steps, lambda: floor.loop(steps, 1)),
            Series("floor: 2x INSERT+COMMIT", steps, lambda: floor.loop(steps, 2)),
            kuralle_row,
            Series(
                "kuralle_es tool step (eventsourcing's recorder)",
                steps,
                lambda: default.loop(steps),
            ),
        ]
        pause_series = [
            Series("kuralle_es ctx.approve + approval delivery", 1, one_trip.pause_resume)
        ]
        try:
            dbos = Dbos(dsn["dbos"])
            closers.append(dbos.close)
            loop_series.append(Series("DBOS step", steps, lambda: dbos.loop(steps)))
        except Exception as e:  # an optional peer: say why and go on
            skipped["DBOS"] = f"{type(e).__name__}: {e}"
        try:
            graph = LangGraph(dsn["langgraph"])
            closers.append(graph.close)
            loop_series.append(
                Series(
                    "LangGraph + PostgresSaver node (durability=sync)",
                    steps,
                    lambda: graph.loop(steps),
                )
            )
            pause_series.append(
                Series("LangGraph interrupt + Command(resume=...)", 1, graph.pause_resume)
            )
        except Exception as e:
            skipped["LangGraph"] = f"{type(e).__name__}: {e}"
        for name, why in skipped.items():
            print(f"skipped {name}: {why}", flush=True)
        try:
            await measure(loop_series, args.rounds)
            await measure(pause_series, args.rounds)
        finally:
            for close in reversed(closers):
                close()
    print()
    print(f"{steps}-step runs of no-op tool steps, median of {args.rounds} interleaved rounds")
    print("\n".join(table("per step", loop_series, kuralle_row, "us")))
    print()
    print("\n".join(table("pause -> resume of a 3-node flow", pause_series, pause_series[0], "ms")))
    floor_two = loop_series[1].median_us
    print()
    print(
        f"kuralle_es tool step / 2x INSERT+COMMIT floor: {kuralle_row.median_us / floor_two:.2f}x"
    )
    return {
        "steps": steps,
        "rounds": args.rounds,
        "per_step_us": {s.label: s.median_us for s in loop_series},
        "pause_resume_ms": {s.label: s.median_us / 1e3 for s in pause_series},
        "skipped": skipped,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=100, help="steps per run (default 100)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--json", help="write the medians to this file (for chart.py)")
    args = parser.parse_args()
    print(
        f"kuralle_es vs peers: python {sys.version.split()[0]}, {os.cpu_count()} cpus",
        flush=True,
    )
    result = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
