"""Usage read from the views: ``RunViews.usage`` and ``kuralle-es runs usage``.

What the views sum must be what the journals say (``runtime.get_steps``:
model steps' attempts and the usage their responses reported, tool steps'
attempts), on memory, SQLite and PostgreSQL, whatever the filters (run,
session, agent, since) and with or without prices. View tables of the
shape 0.1.0 made are upgraded and rebuilt from the log once, also when
several processes open them at the same time.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import psycopg
import pytest
from conftest import StoreFactory
from pydantic import BaseModel

from kuralle_es import (
    InvalidArgumentError,
    ModelResponse,
    RunStore,
    Runtime,
    RunViews,
    ToolCallRequest,
    define_agent,
    define_tool,
)
from kuralle_es._journal.run import Run
from kuralle_es._journal.sites import Effect, Site
from kuralle_es._journal.spending import ModelUsage, normalise_usage, total
from kuralle_es.shapes import StepRecord, Usage
from kuralle_es.views.query import ADDED_COLUMNS, VIEWS_GENERATION

PRICES = {"m-a": (0.5, 1.5), "m-b": (0.25, 0.75), "m-old": (2.0, 4.0)}


class Lookup(BaseModel):
    sku: str


def lookup(args: Lookup) -> dict[str, Any]:
    return {"sku": args.sku, "stock": 3}


def _spent(i: int, o: int) -> dict[str, int]:
    return {"input_tokens": i, "output_tokens": o, "total_tokens": i + o}


def alpha() -> Any:
    """An agent whose model calls the tool once a turn, then answers; all reported."""
    script = []
    for n in range(1, 4):
        call = ToolCallRequest(id=f"c{n}", name="lookup", args={"sku": f"sku-{n}"})
        script.append(ModelResponse(tool_calls=[call], usage=_spent(10 * n, n)))
        script.append(ModelResponse(content=f"in stock {n}", usage=_spent(20 * n, 2 * n)))
    tool = define_tool("lookup", "Find stock", Lookup, lookup)
    return define_agent("alpha", "stock clerk", _model(script, "m-a"), [tool])


def beta() -> Any:
    """An agent whose model reports part of its usage, or none."""
    script = [
        ModelResponse(content="one", usage={"input_tokens": 7}),
        ModelResponse(content="two", usage=None),
    ]
    return define_agent("beta", "greeter", _model(script, "m-b"), [])


def _model(script: list[ModelResponse], model_id: str) -> Any:
    from kuralle_es.testing import ScriptedModel

    return ScriptedModel(script, id=model_id)


@dataclass(frozen=True)
class Spent:
    """One step of the journal, with the run's session and the agent it ran under."""

    run_id: str
    session_id: str
    agent: str
    step: StepRecord


@dataclass
class Made:
    store: RunStore
    runtime: Runtime
    steps: list[Spent]

    def expected(self, keep: Callable[[Spent], bool] = lambda s: True, prices: Any = None) -> Usage:
        """What the journals say the kept steps spent."""
        by_model: dict[str, ModelUsage] = {}
        tool_calls = 0
        for s in filter(keep, self.steps):
            if s.step.kind == "tool":
                tool_calls += s.step.attempts
            if s.step.kind != "model":
                continue
            result = s.step.result if isinstance(s.step.result, dict) else {}
            reported = normalise_usage(result.get("usage")) or {}
            seen = by_model.get(s.step.name) or ModelUsage(model=s.step.name)
            by_model[s.step.name] = ModelUsage(
                model=s.step.name,
                calls=seen.calls + s.step.attempts,
                input_tokens=seen.input_tokens + (reported.get("input_tokens") or 0),
                output_tokens=seen.output_tokens + (reported.get("output_tokens") or 0),
                total_tokens=seen.total_tokens + (reported.get("total_tokens") or 0),
            )
        return total(list(by_model.values()), tool_calls, prices)


def crafted_run(store: RunStore) -> tuple[str, str]:
    """A conversation stored as an older version and a crash left it: a model step
    retried (two attempts), OpenAI-style usage, then a handoff to another agent and
    a step under it. Returns (run id, session)."""
    session = f"crafted-{uuid4().hex[:8]}"
    run = Run(uuid4(), session, "conversation", "gamma", None, None)
    first = run.start_step(Effect(Site("lr", 0), "model", "m-old", {}, override="k0"))
    run.retry_step(first)
    old_style = {"content": "x", "usage": {"prompt_tokens": 100, "completion_tokens": 20}}
    run.finish_step(first, json.dumps(old_style))
    run.finish(None, None, "delta", {})
    run.start_turn(1, None, None)
    second = run.start_step(Effect(Site("lr1", 0), "model", "m-old", {}, override="k1"))
    run.finish_step(second, json.dumps({"content": "y", "usage": _spent(1, 2)}))
    tool = run.start_step(Effect(Site("lr1", 1), "tool", "lookup", {}, override="k2"))
    run.retry_step(tool)
    run.finish_step(tool, "{}")
    store.create_run(run)
    return run.run_id, session


async def make(store: RunStore) -> Made:
    """Runs of two agents in three sessions, and a crafted older run."""
    runtime = Runtime([alpha()], store=store)
    greeter = Runtime([beta()], store=store)
    runs: list[tuple[str, str, str]] = []
    first = await runtime.run("s1", input="stock of sku-1?").result()
    second = await runtime.run("s1", input="and sku-2?").result()
    runs.append((first.run_id, "s1", "alpha"))
    other = await runtime.run("s2", input="sku-3?").result()
    runs.append((other.run_id, "s2", "alpha"))
    greeted = await greeter.run("s3", input="hi").result()
    again = await greeter.run("s3", input="again").result()
    runs.append((greeted.run_id, "s3", "beta"))
    for result in (first, second, other, greeted, again):
        assert result.status == "finished", result
    assert (second.run_id, again.run_id) == (first.run_id, greeted.run_id)
    steps = [
        Spent(run_id, session, agent, step)
        for run_id, session, agent in runs
        for step in await runtime.get_steps(run_id, session)
    ]
    crafted, session = crafted_run(store)
    journal = await runtime.get_steps(crafted, session)
    assert [s.attempts for s in journal] == [2, 1, 2]
    steps += [Spent(crafted, session, "gamma" if s.index == 0 else "delta", s) for s in journal]
    return Made(store, runtime, steps)


# ------------------------------------------------------------------ views
async def test_usage_from_the_views_is_what_the_journals_say_under_every_filter(
    open_store: StoreFactory,
) -> None:
    made = await make(open_store())
    views = RunViews(made.store)
    everything = made.expected()
    assert everything.model_calls == 11  # 6 + 2 alpha, 2 beta, 2 + 1 crafted attempts
    assert everything.tool_calls == 5  # 3 alpha, 2 attempts crafted
    assert everything.total_tokens == 198 + 120 + 3  # beta reported no total
    assert everything.input_tokens == 180 + 7 + 100 + 1
    assert everything.output_tokens == 18 + 20 + 2
    assert await views.usage() == everything
    assert everything.cost is None

    run_ids = sorted({s.run_id for s in made.steps})
    for run_id in run_ids:
        assert await views.usage(run_id=run_id) == made.expected(lambda s, r=run_id: s.run_id == r)
    for session in sorted({s.session_id for s in made.steps}):
        assert await views.usage(session_id=session) == made.expected(
            lambda s, k=session: s.session_id == k
        )
    for agent in ("alpha", "beta", "gamma", "delta"):
        found = await views.usage(agent_id=agent)
        assert found == made.expected(lambda s, a=agent: s.agent == a), agent
        assert found.model_calls > 0, agent
    # Every start time as a bound: the steps started at or after it.
    for spent in made.steps:
        at = spent.step.started_at
        assert await views.usage(since=at) == made.expected(lambda s, t=at: s.step.started_at >= t)
    later = max(s.step.started_at for s in made.steps) + timedelta(seconds=1)
    assert await views.usage(since=later.isoformat()) == Usage()
    # Filters combine.
    beta_run = next(s.run_id for s in made.steps if s.agent == "beta")
    assert await views.usage(session_id="s3", agent_id="beta") == made.expected(
        lambda s: s.run_id == beta_run
    )
    assert await views.usage(run_id=beta_run, agent_id="alpha") == Usage()
    assert await views.usage(session_id="nobody") == Usage()

    by_agent = dict(await views.usage_by("agent"))
    assert set(by_agent) == {"alpha", "beta", "gamma", "delta"}
    assert by_agent["alpha"] == made.expected(lambda s: s.agent == "alpha")
    by_run = await views.usage_by("run", limit=2)
    assert [u.total_tokens for _, u in by_run] == sorted(
        (made.expected(lambda s, r=r: s.run_id == r).total_tokens for r in run_ids), reverse=True
    )[:2]


async def test_cost_comes_from_the_prices_of_the_models_the_steps_recorded(
    open_store: StoreFactory,
) -> None:
    made = await make(open_store())
    priced = RunViews(made.store, prices=PRICES)
    found = await priced.usage()
    assert found == made.expected(prices=PRICES)
    by_hand = (
        (180 * 0.5 + 18 * 1.5) / 1000  # m-a
        + (7 * 0.25) / 1000  # m-b: only input tokens reported
        + (101 * 2.0 + 22 * 4.0) / 1000  # m-old
    )
    assert found.cost == pytest.approx(by_hand)
    alpha_only = await priced.usage(agent_id="alpha")
    assert alpha_only.cost == pytest.approx((180 * 0.5 + 18 * 1.5) / 1000)

    # A model that reported tokens but has no price: the cost is unknown, not a part.
    partial = RunViews(made.store, prices={"m-a": (0.5, 1.5)})
    assert (await partial.usage()).cost is None
    assert (await partial.usage(agent_id="alpha")).cost == alpha_only.cost
    # Nothing spent costs nothing once prices are known.
    assert (await priced.usage(session_id="nobody")).cost == 0.0
    assert (await RunViews(made.store).usage(agent_id="alpha")).cost is None


async def test_usage_refuses_bad_filters_and_prices(open_store: StoreFactory) -> None:
    views = RunViews(open_store())
    bad: Any
    for bad in ("yesterday", 12, datetime.now().date()):
        with pytest.raises(InvalidArgumentError, match="since"):
            await views.usage(since=bad)
    with pytest.raises(InvalidArgumentError, match="run_id"):
        await views.usage(run_id=7)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="group"):
        await views.usage_by("session")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="limit"):
        await views.usage_by("agent", limit=3)
    with pytest.raises(InvalidArgumentError, match="prices"):
        RunViews(open_store(), prices={"m-a": (1.0,)})  # type: ignore[dict-item]


# ------------------------------------------------- tables of an older shape
def make_old_shape(backend: str, target: str) -> None:
    """The view tables as 0.1.0 left them: without the columns added since, no
    generation, rows and position as they were projected."""
    statements = [
        f"ALTER TABLE runviews_{table} DROP COLUMN {column}"
        for table, columns in ADDED_COLUMNS.items()
        for column, _ in columns
    ]
    statements.append("DROP TABLE runviews_meta")
    if backend == "sqlite":
        with sqlite3.connect(target) as conn:
            for statement in statements:
                conn.execute(statement)
        conn.close()
    else:
        with psycopg.connect(target, autocommit=True) as pg:
            for statement in statements:
                pg.execute(statement.encode())


def step_columns(backend: str, target: str) -> set[str]:
    if backend == "sqlite":
        with sqlite3.connect(target) as conn:
            found = {str(r[1]) for r in conn.execute("PRAGMA table_info(runviews_steps)")}
        conn.close()
        return found
    with psycopg.connect(target) as pg:
        rows = pg.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = %s",
            ("runviews_steps",),
        ).fetchall()
    return {str(r[0]) for r in rows}


def generation(backend: str, target: str) -> int:
    query = "SELECT value FROM runviews_meta WHERE name = 'generation'"
    if backend == "sqlite":
        with sqlite3.connect(target) as conn:
            (value,) = conn.execute(query).fetchone()
        conn.close()
        return int(value)
    with psycopg.connect(target) as pg:
        row = pg.execute(query).fetchone()
    assert row is not None
    return int(row[0])


async def test_view_tables_of_an_older_shape_are_upgraded_and_rebuilt_once(
    backend: str, open_store: StoreFactory
) -> None:
    if backend == "memory":
        pytest.skip("in-memory views never outlive the process that made them")
    made = await make(open_store())
    live = RunViews(made.store)
    await live.catch_up()
    target = open_store.target
    assert target is not None
    make_old_shape(backend, target)
    assert "input_tokens" not in step_columns(backend, target)

    store = open_store()
    upgraded = RunViews(store, prices=PRICES)
    assert await upgraded.position() is None  # emptied, to be rebuilt from the log
    assert {c for c, _ in ADDED_COLUMNS["steps"]} <= step_columns(backend, target)
    assert generation(backend, target) == VIEWS_GENERATION
    assert await upgraded.usage() == made.expected(prices=PRICES)
    assert await upgraded.position() == store.recorder.max_notification_id()
    fresh = RunViews(store, name="fresh")
    await fresh.catch_up()
    assert await upgraded.rows() == await fresh.rows()

    # Opened again: current already, so nothing is emptied.
    position = await upgraded.position()
    again = RunViews(open_store())
    assert await again.position() == position


UPGRADE_SCRIPT = """
import asyncio, json, sys
from kuralle_es import RunStore, RunViews
backend, target = sys.argv[1], sys.argv[2]
store = RunStore.sqlite(target) if backend == "sqlite" else RunStore.postgres(target)
usage = asyncio.run(RunViews(store).usage())
print(json.dumps(usage.model_dump()))
store.close()
"""


def open_at_once(backend: str, target: str, n: int) -> list[tuple[int, str, str]]:
    """``n`` processes started together, each opening the views and summing usage."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", UPGRADE_SCRIPT, backend, target],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(n)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


async def test_processes_opening_older_views_at_once_upgrade_them_once_and_agree(
    backend: str, open_store: StoreFactory
) -> None:
    if backend == "memory":
        pytest.skip("in-memory views cannot be shared between processes")
    made = await make(open_store())
    await RunViews(made.store).catch_up()
    target = open_store.target
    assert target is not None
    make_old_shape(backend, target)
    for returncode, out, err in open_at_once(backend, target, 3):
        assert returncode == 0, err
        assert Usage.model_validate_json(out) == made.expected()
    assert generation(backend, target) == VIEWS_GENERATION
    views = RunViews(open_store())
    fresh = RunViews(views.store, name="fresh")
    await fresh.catch_up()
    assert await views.rows() == await fresh.rows()


# -------------------------------------------------------------------- CLI
def cli(
    db: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "KURALLE_PRICES"}
    return subprocess.run(
        [sys.executable, "-m", "kuralle_es.cli", "--sqlite", str(db), "runs", "usage", *args],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        timeout=60,
    )


async def test_runs_usage_prints_the_sums_and_json_from_another_process(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    with RunStore.sqlite(str(db)) as store:
        made = await make(store)
    everything = made.expected()
    alpha_only = made.expected(lambda s: s.agent == "alpha")

    shown = cli(db)
    assert shown.returncode == 0, shown.stderr
    lines = {line[:14].strip(): line[14:] for line in shown.stdout.splitlines()}
    assert lines == {
        "model calls": str(everything.model_calls),
        "input tokens": str(everything.input_tokens),
        "output tokens": str(everything.output_tokens),
        "total tokens": str(everything.total_tokens),
        "tool calls": str(everything.tool_calls),
        "cost": "unknown (no price for a model: --prices or KURALLE_PRICES)",
    }

    as_json = cli(db, "--json", "--agent", "alpha", "--app", "no_such_module:agents")
    assert as_json.returncode == 0, as_json.stderr  # read-only: --app is never imported
    assert json.loads(as_json.stdout) == alpha_only.model_dump()
    assert set(json.loads(as_json.stdout)) == {
        "model_calls", "input_tokens", "output_tokens", "total_tokens", "tool_calls", "cost",
    }  # fmt: skip

    run_id = next(s.run_id for s in made.steps if s.agent == "beta")
    priced = cli(db, "--json", "--run", run_id, "--prices", json.dumps(PRICES))
    assert priced.returncode == 0, priced.stderr
    expected = made.expected(lambda s: s.run_id == run_id, prices=PRICES)
    assert Usage.model_validate_json(priced.stdout) == expected
    assert expected.cost == pytest.approx(7 * 0.25 / 1000)

    from_env = cli(db, "--json", "--session", "s1", env={"KURALLE_PRICES": json.dumps(PRICES)})
    assert from_env.returncode == 0, from_env.stderr
    assert Usage.model_validate_json(from_env.stdout) == made.expected(
        lambda s: s.session_id == "s1", prices=PRICES
    )
    cost = made.expected(prices=PRICES).cost
    assert cost is not None
    text = cli(db, "--prices", json.dumps(PRICES))
    assert f"cost          {cost:.6f}".rstrip("0") in text.stdout

    since = sorted(s.step.started_at for s in made.steps)[3]
    bounded = cli(db, "--json", "--since", since.isoformat())
    assert bounded.returncode == 0, bounded.stderr
    assert Usage.model_validate_json(bounded.stdout) == made.expected(
        lambda s: s.step.started_at >= since
    )

    for bad, why in (
        (["--since", "last tuesday"], "--since"),
        (["--prices", "{not json"], "--prices is not JSON"),
        (["--prices", '{"m-a": [1]}'], "--prices"),
    ):
        refused = cli(db, *bad)
        assert refused.returncode == 2, refused
        assert why in refused.stderr and "Traceback" not in refused.stderr
    refused = cli(db, env={"KURALLE_PRICES": "[1, 2]"})
    assert refused.returncode == 2 and "KURALLE_PRICES" in refused.stderr
