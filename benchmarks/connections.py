"""Connections a store holds, counted on the server: 4 partitions under 32 runs, and runs list.

Counted, not timed. A fresh database gets a store of ``--partitions`` (4)
partitions; in this process ``--runs`` (32) tasks drive flow runs of three
tool steps at once for ``--seconds`` (3), the views answering a query
meanwhile; then ``kuralle-es runs list`` runs on the same store in a
subprocess. A sampler on a connection of its own reads ``pg_stat_activity``
every few milliseconds and keeps the most connections each of the two held at
once (each is told apart by the ``application_name`` its store URL gives
it). Targets: at most 10 for the store (its ``pool_size``), at most 2 for the
read-only command.

Server: ``KURALLE_BENCH_POSTGRES_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``); a fresh database is
created and dropped, unless ``--dsn`` names the database to use. Usage::

    python benchmarks/connections.py [--partitions 4] [--runs 32] [--seconds 3]
        [--dsn URL] [--json]

``--json`` prints ``{"store": N, "runs_list": M, ...}`` on one line (the test
``tests/test_connections.py`` reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from pydantic import BaseModel

from kuralle_es import (
    RunContext,
    RunStore,
    Runtime,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)

DSN_ENV = "KURALLE_BENCH_POSTGRES_DSN"
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
STORE_APP = "kuralle-bench-store"
LIST_APP = "kuralle-bench-runs-list"


class Step(BaseModel):
    x: int


async def three_steps(state: dict[str, Any], ctx: RunContext) -> Any:
    for i in range(3):
        await ctx.tool("work", {"x": i})
    return end("done")


def work(args: Step) -> dict[str, int]:
    time.sleep(0.002)  # a little work, so that the runs overlap
    return {"x": args.x}


AGENT = define_agent(
    "bench",
    "",
    None,
    [define_tool("work", "", Step, work)],
    [define_flow("three", "", "go", [action("go", three_steps)])],
)


class Sampler:
    """Peak connections per ``application_name`` of one database, sampled on a thread."""

    def __init__(self, dsn: str, dbname: str) -> None:
        self.dsn = dsn
        self.dbname = dbname
        self.peak: dict[str, int] = {}
        self.seen: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                rows = conn.execute(
                    "SELECT application_name, pid FROM pg_stat_activity WHERE datname = %s",
                    (self.dbname,),
                ).fetchall()
                counts: dict[str, int] = {}
                for name, pid in rows:
                    counts[name] = counts.get(name, 0) + 1
                    self.seen.setdefault(name, set()).add(pid)
                for name, count in counts.items():
                    self.peak[name] = max(self.peak.get(name, 0), count)
                time.sleep(0.005)


def with_query(url: str, **params: str) -> str:
    return url + ("&" if "?" in url else "?") + "&".join(f"{k}={v}" for k, v in params.items())


async def drive(url: str, runs: int, seconds: float) -> int:
    """``runs`` tasks driving flow runs one after another for ``seconds``; runs finished."""
    finished = 0
    with RunStore.from_url(url) as store:
        runtime = Runtime([AGENT], store=store)
        stop = time.monotonic() + seconds

        async def driver(slot: int) -> None:
            nonlocal finished
            while time.monotonic() < stop:
                session = f"s{slot}-{uuid.uuid4().hex[:8]}"
                handle = runtime.run(session, kind="flow", flow_name="three")
                result = await handle.result()
                assert result.status == "finished", result
                finished += 1

        async def views() -> None:
            await asyncio.sleep(seconds / 2)
            await runtime.views.list_runs(limit=5)

        await asyncio.gather(*(driver(i) for i in range(runs)), views())
    return finished


def runs_list(url: str) -> None:
    kuralle = Path(sys.executable).with_name("kuralle-es")
    command = [str(kuralle)] if kuralle.exists() else [sys.executable, "-m", "kuralle_es.cli"]
    subprocess.run(
        [*command, "runs", "list", "--store", url, "--limit", "5"],
        check=True,
        capture_output=True,
        timeout=60,
    )


def count(dsn: str, partitions: int, runs: int, seconds: float) -> dict[str, Any]:
    """The peaks, measured on the database ``dsn`` names."""
    dbname = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
    base = with_query(dsn, partitions=str(partitions))
    with RunStore.from_url(base):
        pass  # the partitions, created before anything is counted
    store_url = with_query(base, application_name=STORE_APP)
    list_url = with_query(base, application_name=LIST_APP)
    with Sampler(dsn, dbname) as sampler:
        finished = asyncio.run(drive(store_url, runs, seconds))
        runs_list(list_url)
        time.sleep(0.05)
    return {
        "partitions": partitions,
        "runs_at_once": runs,
        "runs_finished": finished,
        "store": sampler.peak.get(STORE_APP, 0),
        "store_opened": len(sampler.seen.get(STORE_APP, ())),
        "runs_list": sampler.peak.get(LIST_APP, 0),
        "runs_list_opened": len(sampler.seen.get(LIST_APP, ())),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--runs", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--dsn", help="the database to use (default: a fresh one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    admin = os.environ.get(DSN_ENV) or DEFAULT_DSN
    dbname = None
    dsn = args.dsn
    if dsn is None:
        dbname = f"kuralle_bench_conn_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')
        dsn = psycopg.conninfo.make_conninfo(admin, dbname=dbname)
        params = psycopg.conninfo.conninfo_to_dict(dsn)
        dsn = (
            f"postgresql://{params.get('user', 'postgres')}@{params.get('host', '127.0.0.1')}:"
            f"{params.get('port', 5432)}/{dbname}"
        )
    try:
        found = count(dsn, args.partitions, args.runs, args.seconds)
    finally:
        if dbname is not None:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
    if args.json:
        print(json.dumps(found))
        return 0
    print(
        f"{found['partitions']}-partition store, {found['runs_at_once']} runs at once "
        f"({found['runs_finished']} runs of 3 tool steps finished): at most "
        f"{found['store']} connections at once ({found['store_opened']} opened in all); "
        f"target <= 10"
    )
    print(
        f"kuralle-es runs list on it: at most {found['runs_list']} connections at once "
        f"({found['runs_list_opened']} opened in all); target <= 2"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
