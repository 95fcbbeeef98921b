"""How long ``kuralle-es replay --since ... --app NEW --json`` takes over recorded runs.

``--runs`` runs (200) of a refund flow are recorded on PostgreSQL under
version 1 of the app below: the model extracts the amount from the
customer's message, a supervisor approves, the ``charge`` tool charges it.
Version 2 swaps in a cheaper model that reads amounts above 5000 cents as
dollars (every third run asks for one). Then the command is timed, as a
process of its own, re-driving every run since the recording began under
version 2 (``--reps`` times, the median kept). Next to it, measured in the
same run against the same database: the same process doing nothing
(``kuralle-es --version``: the interpreter and the imports) and reading the
same runs from the views (``kuralle-es runs list --flow refund --json``).

PostgreSQL is ``KURALLE_BENCH_POSTGRES_DSN`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``; a database is created and
dropped). Usage: ``python benchmarks/replay_runs.py [--runs N] [--reps R]``.
No assertion is made on speed; this prints the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import psycopg
from psycopg import sql
from pydantic import BaseModel

from kuralle_es import (
    Agent,
    ModelRequest,
    ModelResponse,
    RunStore,
    Runtime,
    action,
    collect,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
)

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DSN_ENV = "KURALLE_BENCH_POSTGRES_DSN"
HERE = Path(__file__).resolve().parent
PRICES = {"reader-v1": [1.0, 2.0], "reader-v2": [0.5, 1.0]}
KURALLE = Path(sys.executable).with_name("kuralle-es")


class Amount(BaseModel):
    amount_cents: int | None = None


class Charge(BaseModel):
    amount_cents: int


def _charge(args: Charge) -> dict[str, int]:
    return {"charged": args.amount_cents}


class Reader:
    """The model of a version: reads the amount the customer wrote (version 2
    reads one above 5000 cents as dollars)."""

    def __init__(self, version: int) -> None:
        self.version = version

    @property
    def id(self) -> str:
        return f"reader-v{self.version}"

    async def respond(self, request: ModelRequest) -> ModelResponse:
        said = " ".join(m.content or "" for m in request.messages if m.role == "user")
        found = re.findall(r"\d+", said)
        cents = int(found[-1]) if found else None
        if cents is not None and self.version == 2 and cents > 5000:
            cents //= 100
        tokens = (120, 12) if self.version == 1 else (90, 9)
        usage = {"input_tokens": tokens[0], "output_tokens": tokens[1]}
        return ModelResponse(data={"amount_cents": cents}, usage=usage)


def _ask(missing: list[str]) -> str:
    return "How much, in cents?"


async def _pay(state: dict[str, Any], ctx: Any) -> Any:
    amount = state["amount_cents"]
    decision = await ctx.approve(f"Refund {amount} cents?")
    if not decision.approved:
        return end("declined")
    await ctx.tool("charge", {"amount_cents": amount})
    return end(f"refunded {amount}")


def _agents(version: int) -> list[Agent]:
    refund = define_flow(
        "refund",
        "read an amount, ask, charge it",
        "amount",
        [
            collect(
                "amount", Amount, ["amount_cents"], lambda m: "How much?", lambda d: goto("pay")
            ),
            action("pay", _pay),
        ],
    )
    charge = define_tool("charge", "Refund a customer", Charge, _charge)
    return [define_agent("support", "You refund customers.", Reader(version), [charge], [refund])]


def v1() -> list[Agent]:
    return _agents(1)


def v2() -> list[Agent]:
    return _agents(2)


@contextmanager
def postgres_url() -> Iterator[str]:
    admin = os.environ.get(DSN_ENV, DEFAULT_DSN)
    name = f"kuralle_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield urlunparse(urlparse(admin)._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


async def record(url: str, runs: int) -> float:
    """Record ``runs`` finished runs under version 1, 20 at a time; the seconds it took."""
    started = time.perf_counter()
    with RunStore.postgres(url) as store:
        runtime = Runtime(v1(), store=store)

        async def one(n: int) -> None:
            amount = 9000 + n if n % 3 == 0 else 1000 + n
            session = f"s-{n}"
            paused = await runtime.run(
                session, input=f"refund {amount} cents", kind="flow", flow_name="refund"
            ).result()
            await runtime.approve(paused.run_id, session, by="ann")

        for first in range(0, runs, 20):
            await asyncio.gather(*(one(n) for n in range(first, min(runs, first + 20))))
    return time.perf_counter() - started


def timed(*args: str) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": str(HERE), "KURALLE_PRICES": json.dumps(PRICES)}
    command = [str(KURALLE)] if KURALLE.exists() else [sys.executable, "-m", "kuralle_es.cli"]
    started = time.perf_counter()
    done = subprocess.run([*command, *args], env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}): {done.stderr}")
    return seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    options = parser.parse_args()
    with postgres_url() as url:
        since = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
        recorded = asyncio.run(record(url, options.runs))
        replay = ["--store", url, "replay", "--since", since, "--app", "replay_runs:v2", "--json"]
        listing = ["--store", url, "runs", "list", "--flow", "refund", "--limit", "1000", "--json"]
        replays, starts, lists, report = [], [], [], ""
        for _ in range(options.reps):
            starts.append(timed("--version")[0])
            lists.append(timed(*listing)[0])
            seconds, report = timed(*replay)
            replays.append(seconds)
    summary = json.loads(report)["summary"]
    replay_s, start_s, list_s = (statistics.median(x) for x in (replays, starts, lists))
    print(f"kuralle-es replay over {options.runs} runs on PostgreSQL, median of {options.reps}")
    print(f"  recording the runs (in-process, 20 at a time): {recorded:.1f} s")
    print(f"  kuralle-es --version (process start):          {start_s:.2f} s")
    print(f"  kuralle-es runs list --flow refund --json:     {list_s:.2f} s")
    print(f"  kuralle-es replay --since ... --app v2 --json: {replay_s:.2f} s")
    per_run = (replay_s - start_s) / max(1, summary["runs"]) * 1000
    print(f"  replay beyond process start: {per_run:.1f} ms a run")
    print(
        f"  summary: {summary['runs']} runs, {summary['decided_differently']} would decide "
        f"differently, cost {summary['cost_before']:.4f} -> {summary['cost_after']:.4f}"
    )


if __name__ == "__main__":
    main()
