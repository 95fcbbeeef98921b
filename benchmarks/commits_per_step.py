"""Commits a step costs on PostgreSQL, counted on the server, not timed.

    python benchmarks/commits_per_step.py [--steps 200] [--dsn postgresql://postgres@127.0.0.1/postgres]

Creates a database of its own, then drives flow runs whose node makes
sequential tool steps, and others whose node makes ``ctx.now()`` reads, and
prints for each the server's ``pg_stat_database.xact_commit`` delta of a run
of ``2 * --steps`` steps less that of a run of ``--steps``, divided by the steps
(each run in a process of its own, so the fixed costs cancel; autovacuum is
off in the benchmark's database, whose transactions would count too)
(docs/guarantees.md, "One commit a step": a tool step's result rides the next
save, a clock read always does). A noisy machine does not move a count.

Targets: at most 1.05 commits a sequential tool step, at most 0.05 a ``now`` step.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from typing import Any
from uuid import uuid4

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pydantic import BaseModel

from kuralle_es import RunStore, Runtime, action, define_agent, define_flow, define_tool, end


class Step(BaseModel):
    n: int


def agent(steps: int) -> Any:
    def count(args: Step) -> dict[str, int]:
        return {"n": args.n}

    async def tools(state: dict[str, Any], ctx: Any) -> Any:
        for n in range(steps):
            await ctx.tool("count", {"n": n})
        return end("done")

    async def clock(state: dict[str, Any], ctx: Any) -> Any:
        for _ in range(steps):
            await ctx.now()
        return end("done")

    flows = [
        define_flow("tools", "tool steps", "t", [action("t", tools)]),
        define_flow("clock", "clock reads", "c", [action("c", clock)]),
    ]
    return define_agent("bench", "", None, [define_tool("count", "", Step, count)], flows)


def commits(admin: str, database: str) -> int:
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (database,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def settled_commits(admin: str, database: str) -> int:
    """The counter once every connection to ``database`` has gone: a backend reports
    its counts when it exits (or a second after a commit), not at each commit."""
    for _ in range(200):
        with psycopg.connect(admin, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)
            ).fetchone()
        if row is not None and row[0] == 0:
            break
        time.sleep(0.05)
    time.sleep(1.5)
    return commits(admin, database)


def quiet_tables(dsn: str) -> None:
    """No autovacuum in the benchmark's database: its transactions count there too."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT schemaname, tablename FROM pg_tables WHERE schemaname = 'public'"
        ).fetchall()
        for schema, table in tables:
            conn.execute(
                sql.SQL("ALTER TABLE {}.{} SET (autovacuum_enabled = false)").format(
                    sql.Identifier(schema), sql.Identifier(table)
                )
            )


def turn_commits(admin: str, database: str, dsn: str, flow: str, steps: int) -> int:
    """Commits of a process that opens the store, drives one run of ``flow`` with
    ``steps`` steps, and exits."""
    before = settled_commits(admin, database)
    subprocess.run(
        [sys.executable, __file__, "--child", flow, str(steps), dsn], check=True, timeout=600
    )
    return settled_commits(admin, database) - before


async def child(flow: str, steps: int, dsn: str) -> None:
    with RunStore.postgres(dsn) as store:
        runtime = Runtime([agent(steps)], store=store)
        result = await runtime.run("s", kind="flow", flow_name=flow).result()
        assert result.status == "finished", result


def measure(admin: str, database: str, dsn: str, flow: str, steps: int) -> float:
    """Commits a step: a run of ``2 * steps`` steps less one of ``steps`` (what a
    process costs to open the store, and a run to start and end, is the same in both)."""
    turn_commits(admin, database, dsn, flow, 1)  # the schema, once
    quiet_tables(dsn)
    short = turn_commits(admin, database, dsn, flow, steps)
    long = turn_commits(admin, database, dsn, flow, 2 * steps)
    return (long - short) / steps


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        flow, steps, dsn = args.child
        await child(flow, int(steps), dsn)
        return
    database = f"kuralle_commits_{uuid4().hex[:8]}"
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    params = conninfo_to_dict(args.dsn)
    params["dbname"] = database
    dsn = make_conninfo(**{k: str(v) for k, v in params.items() if v is not None})
    try:
        tool = measure(args.dsn, database, dsn, "tools", args.steps)
        now = measure(args.dsn, database, dsn, "clock", args.steps)
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
            )
    print(f"commits per sequential tool step: {tool:.3f}   (target <= 1.05)")
    print(f"commits per ctx.now() step:       {now:.3f}   (target <= 0.05)")


if __name__ == "__main__":
    asyncio.run(main())
