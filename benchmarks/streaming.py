"""What streaming a turn costs: saves a second per streaming run, and the latency a
delta gains on its way from the model to a consumer, beside a consumer that reads
the model directly, in the same run.

A model (``Ticker``) sends ``--deltas`` text deltas ``--interval`` seconds apart
and stamps each as it sends it. For each backend (memory, a SQLite file,
PostgreSQL) and each number of runs streaming at once (``--runs``, default
1 and 16), in interleaved rounds (``--rounds``, default 3):

* **direct**: as many consumers read as many ``Ticker`` streams themselves
  (``async for`` over ``model.stream``): the floor of an ``async for`` hop;
* **handle**: as many turns of an agent with that model, each read through
  its ``TurnHandle`` (the turn's consumer): the deltas are numbered, queued
  for the stored stream, and handed to the consumer;
* **stored**: beside each turn, a follower of the run's stored stream
  (``Runtime.stream``) over a second store object on the same database, as
  another process would follow it: it sees a delta once its batch is stored.

Printed per backend and runs at once: the stream's saves a second per
streaming run (the writes that carried the run's parts, less one, over the
seconds from its first delta sent to its last part stored: the rate of the
gaps between its saves; the target is at most 20), the store's writes a
second (one write carries every run's parts), the median (and p95) latency of each consumer in
milliseconds, and the median latency the handle adds to the direct read (the
target is under 5 ms). The journal is unchanged by streaming: the model step's
events are the same as without it.

Usage: ``python benchmarks/streaming.py [--deltas 200] [--interval 0.01]
[--runs 1,16] [--rounds 3]``. PostgreSQL: ``KURALLE_BENCH_POSTGRES_DSN``
(default ``postgresql://postgres@127.0.0.1:5432/postgres``), a fresh
database, dropped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from journal_overhead import DEFAULT_DSN, DSN_ENV, create_database, drop_database, with_dbname

from kuralle_es import (
    ModelRequest,
    ModelResponse,
    RunStore,
    Runtime,
    define_agent,
)


class Ticker:
    """Streams ``deltas`` pieces ``interval`` seconds apart; ``sent`` has each one's
    send time (a piece names its run, so concurrent runs never share one)."""

    id = "ticker"

    def __init__(self, deltas: int, interval: float) -> None:
        self.deltas = deltas
        self.interval = interval
        self.sent: dict[str, float] = {}

    async def respond(self, request: ModelRequest) -> ModelResponse:
        raise AssertionError("the runtime streams this model")

    async def stream(self, request: ModelRequest) -> AsyncIterator[str | ModelResponse]:
        marker = request.messages[-1].content or ""
        for n in range(self.deltas):
            await asyncio.sleep(self.interval)
            piece = f"{marker}.{n} "
            self.sent[piece] = time.perf_counter()
            yield piece


@dataclass
class Round:
    """One round's latencies (seconds) per consumer, and the stream's saves."""

    direct: list[float] = field(default_factory=list)
    handle: list[float] = field(default_factory=list)
    stored: list[float] = field(default_factory=list)
    saves_per_run_second: list[float] = field(default_factory=list)
    writes_per_second: float = 0.0


async def direct_round(model: Ticker, runs: int) -> list[float]:
    async def read(k: int) -> list[float]:
        request = ModelRequest(purpose="agent", messages=[{"role": "user", "content": f"d{k}"}])
        seen = []
        async for piece in model.stream(request):
            assert isinstance(piece, str)
            seen.append(time.perf_counter() - model.sent[piece])
        return seen

    per_run = await asyncio.gather(*(read(k) for k in range(runs)))
    return [latency for run in per_run for latency in run]


async def turns_round(
    model: Ticker, runs: int, store: RunStore, follower_store: RunStore, tag: str
) -> Round:
    runtime = Runtime([define_agent("bench", "", model, [])], store=store)
    follower = Runtime([define_agent("bench", "", model, [])], store=follower_store)
    result = Round()
    log_writes = [store.stream_log(p).writes for p in range(len(store.partitions))]

    async def one(k: int) -> tuple[list[float], list[float], float, str]:
        session = f"{tag}-{k}"
        handle = runtime.run(session, input=f"{tag}.{k}")
        run_id = await handle.run_id
        stored: list[float] = []
        stored_at = [0.0]

        async def follow() -> None:
            async for part in follower.stream(run_id, session):
                stored_at[0] = time.perf_counter()
                if part.type == "text-delta" and part.delta:
                    stored.append(stored_at[0] - model.sent[part.delta])

        following = asyncio.create_task(follow())
        seen: list[float] = []
        first_sent = 0.0
        async for part in handle:
            if part.type == "text-delta" and part.delta:
                seen.append(time.perf_counter() - model.sent[part.delta])
                first_sent = first_sent or model.sent[part.delta]
        await asyncio.wait_for(following, 30)
        # From the first delta sent to the last part stored: every save of the run.
        return seen, stored, stored_at[0] - first_sent, run_id

    started = time.perf_counter()
    outcomes = await asyncio.gather(*(one(k) for k in range(runs)))
    took = time.perf_counter() - started
    for seen, stored, streamed_for, run_id in outcomes:
        result.handle += seen
        result.stored += stored
        log = store.stream_log(store.partition_of(run_id) or 0)
        # n saves at least 50 ms apart span n - 1 gaps: (n - 1) / span is their rate.
        result.saves_per_run_second.append((log.saves[run_id] - 1) / max(streamed_for, 1e-9))
    writes = sum(store.stream_log(p).writes for p in range(len(store.partitions)))
    result.writes_per_second = (writes - sum(log_writes)) / took
    return result


def ms(values: Sequence[float], q: float = 0.5) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(
    name: str,
    open_stores: Callable[[], tuple[RunStore, RunStore]],
    runs: int,
    args: argparse.Namespace,
) -> list[str]:
    store, follower_store = open_stores()
    try:
        rounds: list[tuple[list[float], Round]] = []
        for n in range(args.rounds):
            model = Ticker(args.deltas, args.interval)
            direct = await direct_round(model, runs)
            turned = await turns_round(model, runs, store, follower_store, f"at{runs}.r{n}")
            rounds.append((direct, turned))
    finally:
        for opened in {id(store): store, id(follower_store): follower_store}.values():
            opened.close()
    direct = [x for d, _ in rounds for x in d]
    handle = [x for _, t in rounds for x in t.handle]
    stored = [x for _, t in rounds for x in t.stored]
    saves = [x for _, t in rounds for x in t.saves_per_run_second]
    writes = statistics.median(t.writes_per_second for _, t in rounds)
    added = ms(handle) - ms(direct)
    return [
        f"| {name} | {runs} | {1 / args.interval:,.0f} | {max(saves):.1f} "
        f"(median {statistics.median(saves):.1f}) | {writes:.1f} | "
        f"{ms(direct):.3f} | {ms(handle):.3f} (p95 {ms(handle, 0.95):.3f}) | **{added:.3f}** | "
        f"{ms(stored):.1f} (p95 {ms(stored, 0.95):.1f}) |"
    ]


async def main_async(args: argparse.Namespace) -> None:
    counts = [int(n) for n in args.runs.split(",")]
    rows: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="kuralle-stream-bench-"))
    admin = os.environ.get(DSN_ENV) or DEFAULT_DSN
    database = create_database(admin)

    def memory() -> tuple[RunStore, RunStore]:
        store = RunStore.memory()  # a memory store is one object: its follower reads it
        return store, store

    def sqlite() -> tuple[RunStore, RunStore]:
        path = str(folder / "runs.db")
        return RunStore.sqlite(path), RunStore.sqlite(path)

    backends: list[tuple[str, Callable[[], tuple[RunStore, RunStore]]]] = [
        ("memory", memory),
        ("sqlite", sqlite),
    ]
    if database is not None:
        dsn = with_dbname(admin, database)
        backends.append(("postgres", lambda: (RunStore.postgres(dsn), RunStore.postgres(dsn))))
    try:
        for name, opener in backends:
            for runs in counts:
                rows += await measure(name, opener, runs, args)
                print(rows[-1], flush=True)
    finally:
        if database is not None:
            drop_database(admin, database)
    print()
    print(
        "| backend | runs at once | deltas/s a run | stream saves/s a run, max | "
        "stream writes/s, all runs | direct read, median ms | handle, median ms | "
        "added by the handle, ms | stored-stream follower, median ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deltas", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.01)
    parser.add_argument("--runs", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
