"""Per-step cost of encryption on PostgreSQL: off against on, in the same run.

Three stores, each in a fresh database on the same server, run the same flow
(one ``action`` node looping N tool steps whose args and result carry a short
text, as a real tool call does):

* ``off``: payloads in the clear and no store key: ``eventsourcing``'s plain
  mapper (``MAPPER_TOPIC=eventsourcing.persistence:Mapper``), what a store
  was before subjects had keys;
* ``sealed``: the default: each payload sealed under its subject's data key
  (docs/privacy.md), no store key;
* ``on``: sealed, and every stored event encrypted with ``KURALLE_CIPHER_KEY``.

The three are timed in turns (off, sealed, on, off, ...), so a load that
comes and goes on the machine falls on each alike; each figure is the median
of ``--reps`` repetitions (default 5) of N steps (default 300), timed around
the loop only. It prints the per-step times and the ratios to ``off``
(the target: ``on`` within 1.15x).

``KURALLE_BENCH_POSTGRES_DSN`` names the server (default
``postgresql://postgres@127.0.0.1:5432/postgres``); the databases are dropped
at the end. No assertion is made on speed.

Usage: ``python benchmarks/encryption.py [--steps N] [--reps R]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from pydantic import BaseModel

from kuralle_es import (
    RunStore,
    Runtime,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    generate_cipher_key,
)
from kuralle_es.testing import ScriptedModel

ADMIN = os.environ.get(
    "KURALLE_BENCH_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)


class Note(BaseModel):
    text: str


def _agent(steps: int) -> Any:
    def echo(args: Note) -> dict[str, str]:
        return {"echo": args.text}

    async def loop(state: dict[str, Any], ctx: Any) -> Any:
        for i in range(steps):
            await ctx.tool("echo", {"text": f"customer note {i}: deliver to 12 Acacia Avenue"})
        return end("done")

    flow = define_flow("bench", "bench", "loop", [action("loop", loop)])
    tool = define_tool("echo", "echo", Note, echo)
    return define_agent("a", "bench", ScriptedModel(["ok"]), [tool], flows=[flow])


@contextmanager
def _database() -> Iterator[str]:
    name = f"kuralle_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _store(dbname: str, mode: str, key: str) -> RunStore:
    info = psycopg.conninfo.conninfo_to_dict(ADMIN)
    env = {
        "PERSISTENCE_MODULE": "eventsourcing.postgres",
        "POSTGRES_DBNAME": dbname,
        "POSTGRES_HOST": str(info.get("host") or "127.0.0.1"),
        "POSTGRES_PORT": str(info.get("port") or "5432"),
        "POSTGRES_USER": str(info.get("user") or "postgres"),
        "POSTGRES_PASSWORD": str(info.get("password") or ""),
    }
    if mode == "off":
        env["MAPPER_TOPIC"] = "eventsourcing.persistence:Mapper"
    return RunStore(env=env, cipher_key=key if mode == "on" else None)


async def _per_step(runtime: Runtime, steps: int) -> float:
    started = time.perf_counter()
    result = await runtime.run(
        session_id=uuid.uuid4().hex, kind="flow", flow_name="bench", input="go"
    ).result()
    assert result.status == "finished", result
    return (time.perf_counter() - started) / steps


async def main(steps: int, reps: int) -> None:
    modes = ("off", "sealed", "on")
    key = generate_cipher_key()
    with _database() as off_db, _database() as sealed_db, _database() as on_db:
        names = {"off": off_db, "sealed": sealed_db, "on": on_db}
        runtimes = {
            m: Runtime(agents=[_agent(steps)], store=_store(names[m], m, key)) for m in modes
        }
        try:
            for mode in modes:  # warm-up: tables, pools, caches
                await _per_step(runtimes[mode], steps)
            times: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(reps):
                for mode in modes:
                    times[mode].append(await _per_step(runtimes[mode], steps))
        finally:
            for runtime in runtimes.values():
                runtime.store.close()
    median = {m: statistics.median(t) for m, t in times.items()}
    print(f"PostgreSQL, {steps} tool steps a run, median of {reps} runs each")
    for mode in modes:
        ratio = median[mode] / median["off"]
        print(f"  {mode:7s} {median[mode] * 1e3:7.3f} ms/step   {ratio:5.2f}x off")
    print(f"encryption on vs off: {median['on'] / median['off']:.2f}x (target within 1.15x)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.reps))
