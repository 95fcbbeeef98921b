"""Long conversations: what a user turn costs after 10, 100 and 1,000 earlier turns.

A conversation run lives as long as its session: every user turn is a new
epoch of the same run (its keys fresh, so a turn replays nothing of the
earlier ones), but the run's state still holds every message and every
step. This benchmark drives one conversation run, turn after turn, with a
model that answers at once (``ScriptedModel``: no network, the model's time
is not ours), and reports at each mark:

* **turn ms**: the median of the 9 turns just before the mark, each timed
  whole (``runtime.run(..., input=...)`` to its result: load, opening save,
  the model turn, close);
* **load ms**: ``RunStore.load`` of the run alone (latest snapshot plus the
  events after it), the median of 5;
* **ratio**: turn ms at the mark / turn ms at turn 10, in the same run.

Backends: memory and SQLite always, PostgreSQL when reachable
(``KURALLE_BENCH_POSTGRES_DSN``, default
``postgresql://postgres@127.0.0.1:5432/postgres``; a fresh database, dropped
afterwards).

Usage: ``python benchmarks/long_conversations.py [--turns 1000]
[--backends memory,sqlite,postgres]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from journal_overhead import DEFAULT_DSN, DSN_ENV, create_database, drop_database, with_dbname

from kuralle_es import ModelRequest, RunStore, Runtime, define_agent
from kuralle_es.testing import ScriptedModel

MARKS = (10, 100, 300, 1000, 3000)


def answer(request: ModelRequest) -> str:
    return f"noted ({len(request.messages)} messages so far)"


async def conversation(store: RunStore, turns: int) -> list[tuple[int, float, float, int]]:
    """(turn, median turn ms, median load ms, stored events) at each mark up to ``turns``."""
    runtime = Runtime([define_agent("chat", "answers", ScriptedModel(answer))], store=store)
    run_id = (await runtime.run("s-long", input="hello").result()).run_id
    timings: list[float] = []
    rows: list[tuple[int, float, float, int]] = []
    for turn in range(2, turns + 1):
        started = time.perf_counter()
        result = await runtime.run("s-long", run_id=run_id, input=f"turn {turn}").result()
        timings.append(time.perf_counter() - started)
        if result.status != "finished":
            raise RuntimeError(f"turn {turn} ended {result.status}")
        if turn in MARKS:
            loads = []
            for _ in range(5):
                began = time.perf_counter()
                run = store.load(run_id)
                loads.append(time.perf_counter() - began)
            assert run is not None
            rows.append(
                (
                    turn,
                    statistics.median(timings[-9:]) * 1000,
                    statistics.median(loads) * 1000,
                    run.version,
                )
            )
    return rows


def report(backend: str, rows: list[tuple[int, float, float, int]]) -> None:
    base = rows[0][1]
    print(f"\n{backend}")
    print(" turn | turn ms | load ms | events | turn vs turn 10")
    for turn, turn_ms, load_ms, events in rows:
        print(f"{turn:5d} | {turn_ms:7.2f} | {load_ms:7.2f} | {events:6d} | {turn_ms / base:6.2f}x")


async def main_async(turns: int, backends: list[str]) -> None:
    print(f"kuralle_es long conversations: {turns} turns, one run")
    for backend in backends:
        if backend == "memory":
            with RunStore.memory() as store:
                report(backend, await conversation(store, turns))
        elif backend == "sqlite":
            with (
                tempfile.TemporaryDirectory() as tmp,
                RunStore.sqlite(os.path.join(tmp, "runs.db")) as store,
            ):
                report(backend, await conversation(store, turns))
        elif backend == "postgres":
            admin = os.environ.get(DSN_ENV, DEFAULT_DSN)
            name = create_database(admin)
            if name is None:
                continue
            try:
                with RunStore.postgres(with_dbname(admin, name)) as store:
                    report(backend, await conversation(store, turns))
            finally:
                drop_database(admin, name)
        else:
            raise SystemExit(f"unknown backend {backend!r}: use memory, sqlite or postgres")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--backends", default="memory,sqlite,postgres")
    args = parser.parse_args()
    asyncio.run(main_async(args.turns, args.backends.split(",")))


if __name__ == "__main__":
    main()
