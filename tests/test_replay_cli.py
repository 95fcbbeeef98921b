"""``kuralle-es replay --since ... --app NEW --json`` over recorded runs, as a real process.

Thirty runs of the refund flow are recorded on PostgreSQL under
version 1 of tests/procs/replay_app.py, a third of them for amounts that
version 2's model reads wrong; a few chats too. The command, in another
process, re-drives the flow runs since a time under version 2 and prints one
JSON object: the runs that would decide differently are exactly those, each
diverging at its model step, the cost goes down (version 2's model is
cheaper), and nothing was written to the runs (the events table's row count
and its last notification id) and no charge was made (the tools' ledger).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from procs.replay_app import LEDGER_ENV, PRICES, Extractor, agents
from psycopg import sql
from test_cli_operator import _ok, kuralle

from kuralle_es import RunStore, Runtime, fire_timers
from kuralle_es.cli import main
from kuralle_es.testing import TestClock

TESTS = str(Path(__file__).resolve().parent)
#: Flow runs recorded, and every how-many-th asks for an amount version 2 misreads.
RUNS, MISREAD_EVERY = 30, 3


async def record(dsn: str) -> tuple[set[str], set[str]]:
    """The flow runs (all finished) and, of them, those for amounts over 5000 cents."""
    clock = TestClock()
    with RunStore.postgres(dsn) as store:
        runtime = Runtime(agents(Extractor(1)), store=store, clock=clock, prices=PRICES)

        async def one(n: int) -> tuple[str, int]:
            amount = 9000 + n if n % MISREAD_EVERY == 0 else 1000 + n
            session = f"s-{n}"
            paused = await runtime.run(
                session, input=f"refund {amount} cents", kind="flow", flow_name="refund"
            ).result()
            await runtime.approve(paused.run_id, session, by="ann")
            return paused.run_id, amount

        started = await asyncio.gather(*(one(n) for n in range(RUNS)))
        await asyncio.gather(
            *(runtime.run(f"chat-{n}", input=f"refund {7000 + n} cents").result() for n in range(3))
        )
        clock.advance(hours=2)
        flows = {run_id for run_id, _ in started}
        assert set(await fire_timers(runtime)) == flows
    return flows, {run_id for run_id, amount in started if amount > 5000}


def stored(dsn: str) -> tuple[Any, ...]:
    with RunStore.postgres(dsn) as store:
        head = store.recorder.max_notification_id()
        table = store.recorder.events_table_name  # type: ignore[attr-defined]
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table)))
        return head, rows.fetchone()


@pytest.mark.postgres
async def test_replay_since_a_time_under_new_code_reports_each_run_that_would_decide_differently(
    pg_dsn: str, tmp_path: Path
) -> None:
    since = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    flows, misread = await record(pg_dsn)
    before = stored(pg_dsn)
    ledger = tmp_path / "charges.txt"

    done = kuralle(
        "--store",
        pg_dsn,
        "replay",
        "--since",
        since,
        "--flow",
        "refund",
        "--app",
        "procs.replay_app:v2",
        "--json",
        PYTHONPATH=TESTS,
        KURALLE_PRICES=json.dumps({model: list(price) for model, price in PRICES.items()}),
        **{LEDGER_ENV: str(ledger)},
    )

    report = json.loads(_ok(done))
    runs = {run["run_id"]: run for run in report["runs"]}
    assert set(runs) == flows  # the flow's runs only: no chat
    differs = {run_id for run_id, run in runs.items() if run["decided_differently"]}
    assert differs == misread
    assert all(runs[run_id]["diverged_at"] == 0 for run_id in misread)
    assert all(runs[run_id]["would_execute"][0]["name"] == "charge" for run_id in misread)
    summary = report["summary"]
    assert (summary["runs"], summary["decided_differently"]) == (RUNS, len(misread))
    assert summary["skipped"] == 0
    assert summary["cost_change"] == pytest.approx(summary["cost_after"] - summary["cost_before"])
    assert summary["cost_change"] < 0
    assert not ledger.exists()  # no charge was made
    assert stored(pg_dsn) == before


def test_replay_of_one_run_prints_its_verdict_and_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "runs.db"

    async def one() -> str:
        with RunStore.sqlite(str(db)) as store:
            runtime = Runtime(agents(Extractor(1)), store=store)
            return (await runtime.run("s-one", input="refund 8000 cents").result()).run_id

    run_id = asyncio.run(one())
    store = f"sqlite:///{db}"
    assert main(["--store", store, "replay", run_id, "--app", "procs.replay_app:v2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"differs   {run_id}  finished -> running")
    assert "would execute" in lines[0]
    assert lines[1].startswith("1 run(s) replayed: 1 would decide differently")
    assert main(["--store", store, "replay", "--app", "procs.replay_app:v1"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"same      {run_id}")
    assert main(["--store", store, "replay", "--since", "yesterday", "--app", "x:y"]) == 2
