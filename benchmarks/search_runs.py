"""How fast the dashboard's search answers over 10,000 runs on PostgreSQL, next to a plain
``SELECT`` of the same rows.

On a fresh database (``KURALLE_BENCH_POSTGRES_DSN``, default
``postgresql://postgres@127.0.0.1:5432/postgres``; created and dropped here),
``--runs`` real runs (default 10,000) are made through the library, 64 at a
time, in 1,000 sessions: 70 % finish at once (flows ``quick-a``, ``quick-b``),
20 % pause on a signal (``wait``), 5 % fail (``fail``), 5 % are cancelled. The
run views then catch up over the whole log (timed too).

Each search is what the dashboard's front page asks for (``RunViews.list_runs``
with a page of 50, plus one to know if a next page exists): the first page, a
status, a session, a flow within a time range, a run id's first characters, the
41st page through the cursor, and status, flow and time range together. Each is
timed through ``RunViews`` (the catch-up check, the SQL with the lease join,
building the ``RunSummary`` objects) and as a plain ``SELECT`` of the same rows
from the view table over one psycopg connection (no lease join, no objects):
median and 95th percentile of ``--reps``, after a warm-up. The plan's scan line
says how PostgreSQL reads the rows of the plain query (which index).

Usage: ``python benchmarks/search_runs.py [--runs N] [--reps R]``. It prints a
table and whether every search answered within 100 ms (median).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlparse, urlunparse

import psycopg
from psycopg import sql

from kuralle_es import RunStore, Runtime, RunViews, action, define_agent, define_flow, end

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DSN_ENV = "KURALLE_BENCH_POSTGRES_DSN"
PAGE = 50
TARGET_MS = 100.0
SESSIONS = 1000


async def _quick(state: dict[str, Any], ctx: Any) -> Any:
    return end("done")


async def _wait(state: dict[str, Any], ctx: Any) -> Any:
    await ctx.signal("go")
    return end("went")


async def _fail(state: dict[str, Any], ctx: Any) -> Any:
    raise RuntimeError("this flow always fails")


def _agent() -> Any:
    flows = [
        define_flow("quick-a", "ends at once", "go", [action("go", _quick)]),
        define_flow("quick-b", "ends at once", "go", [action("go", _quick)]),
        define_flow("wait", "waits for go", "wait", [action("wait", _wait)]),
        define_flow("fail", "fails", "go", [action("go", _fail)]),
    ]
    return define_agent("bench", "search benchmark", None, [], flows)


def _flow_of(i: int) -> str:
    roll = i % 20
    if roll < 14:
        return "quick-a" if roll % 2 else "quick-b"
    if roll < 18:
        return "wait"
    return "fail" if roll == 18 else "cancel"


async def make_runs(runtime: Runtime, count: int) -> None:
    gate = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        flow = _flow_of(i)
        session = f"session-{i % SESSIONS}"
        async with gate:
            handle = runtime.run(
                session, kind="flow", flow_name="wait" if flow == "cancel" else flow
            )
            try:
                result = await handle.result()
            except RuntimeError:
                return
            if flow == "cancel":
                await runtime.cancel(result.run_id, session, "benchmark")

    await asyncio.gather(*(one(i) for i in range(count)))


@dataclass(frozen=True)
class Search:
    name: str
    views: Callable[[RunViews], Awaitable[list[Any]]]
    where: str
    params: tuple[Any, ...]


def searches(
    middle: datetime, prefix: str, cursor: str, deep: tuple[datetime, str]
) -> list[Search]:
    window = (middle - timedelta(seconds=5), middle + timedelta(seconds=5))
    n = PAGE + 1
    return [
        Search("first page", lambda v: v.list_runs(limit=n), "", ()),
        Search("status=paused", lambda v: v.list_runs(status="paused", limit=n),
               "WHERE status = %s", ("paused",)),
        Search("session=session-421", lambda v: v.list_runs(session_id="session-421", limit=n),
               "WHERE session_id = %s", ("session-421",)),
        Search("flow=wait, 10 s range",
               lambda v: v.list_runs(flow="wait", since=window[0], until=window[1], limit=n),
               "WHERE flow = %s AND updated_at >= %s AND updated_at < %s", ("wait", *window)),
        Search(f"run id starts {prefix}", lambda v: v.list_runs(run_id=prefix, limit=n),
               'WHERE run_id COLLATE "C" >= %s AND run_id COLLATE "C" < %s',
               (prefix, prefix + "\U0010ffff")),
        Search("page 41 (cursor)", lambda v: v.list_runs(after=cursor, limit=n),
               "WHERE (updated_at, run_id) < (%s, %s)", deep),
        Search("finished, quick-a, since",
               lambda v: v.list_runs(status="finished", flow="quick-a", since=window[0], limit=n),
               "WHERE status = %s AND flow = %s AND updated_at >= %s",
               ("finished", "quick-a", window[0])),
    ]  # fmt: skip


def _ms(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]


async def time_it(fn: Callable[[], Awaitable[Any]], reps: int) -> tuple[list[float], Any]:
    found = await fn()  # warm-up
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - started) * 1000)
    return times, found


async def run(dsn: str, runs: int, reps: int) -> bool:
    with RunStore.postgres(dsn) as store:
        runtime = Runtime([_agent()], store=store)
        started = time.perf_counter()
        await make_runs(runtime, runs)
        made = time.perf_counter() - started
        views = RunViews(store)
        started = time.perf_counter()
        applied = await views.catch_up()
        caught = time.perf_counter() - started
        print(f"{runs} runs made in {made:.1f} s; the views applied {applied} events in "
              f"{caught:.1f} s")  # fmt: skip

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("ANALYZE runviews_runs")
            every = conn.execute(
                "SELECT run_id, updated_at FROM runviews_runs ORDER BY updated_at DESC, run_id DESC"
            ).fetchall()
            assert len(every) == runs, (len(every), runs)
            middle = every[len(every) // 2][1]
            prefix = every[len(every) // 3][0][:4]
            summaries = await views.list_runs(limit=40 * PAGE)
            cursor = summaries[-1].cursor
            deep = (summaries[-1].updated_at, summaries[-1].run_id)
            print(f"{'search (a page of 50) over ' + str(runs) + ' runs':<34} | rows | "
                  f"RunViews ms p50 / p95 | plain SELECT ms p50 / p95 | within "
                  f"{TARGET_MS:.0f} ms | how the plain SELECT reads")  # fmt: skip
            within = True
            for search in searches(middle, prefix, cursor, deep):
                view_times, found = await time_it(lambda s=search: s.views(views), reps)
                statement = (
                    f"SELECT * FROM runviews_runs {search.where} "
                    f"ORDER BY updated_at DESC, run_id DESC LIMIT {PAGE + 1}"
                )

                async def plain(statement: str = statement, params: Any = search.params) -> Any:
                    # A blocking call on the loop, on purpose: nothing else runs, it is timed.
                    return conn.execute(statement, params).fetchall()

                plain_times, rows = await time_it(plain, reps)
                assert [r[0] for r in rows] == [s.run_id for s in found], search.name
                plan = conn.execute("EXPLAIN " + statement, search.params).fetchall()
                scan = next((line[0].strip() for line in plan if "Scan" in line[0]), "?")
                v50, v95 = _ms(view_times)
                p50, p95 = _ms(plain_times)
                ok = v50 < TARGET_MS
                within &= ok
                print(f"{search.name:<34} | {len(found):4d} | {v50:9.1f} / {v95:7.1f} | "
                      f"{p50:13.1f} / {p95:7.1f} | {'yes' if ok else 'NO':<9} | "
                      f"{scan.removeprefix('->  ').split('  (cost')[0]}")  # fmt: skip
    return within


def _db_dsn(admin: str, name: str) -> str:
    return urlunparse(urlparse(admin)._replace(path=f"/{name}"))


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=10_000, help="runs to search over")
    parser.add_argument("--reps", type=int, default=30, help="repetitions of each search")
    args = parser.parse_args()
    admin = os.environ.get(DSN_ENV, DEFAULT_DSN)
    name = f"kuralle_bench_search_{os.getpid()}"
    with psycopg.connect(admin, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    print(
        f"kuralle_es search: PostgreSQL {version[0] if version else '?'}, "
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, database {name}"
    )
    try:
        within = await run(_db_dsn(admin, name), args.runs, args.reps)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
    print(f"every search answered within {TARGET_MS:.0f} ms (median): {'yes' if within else 'NO'}")
    return 0 if within else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
