"""PostgreSQL faults: connections killed mid-turn and at every save, a server away at start.

A killed connection is what a database failover, a restart or an idle-session
reaper does to a worker. The store's saves retry on a fresh connection (a save
is one statement in its own transaction, so a retry cannot apply it twice: a
clash would be a version conflict, never a duplicate); if a turn fails anyway,
it fails with a ``KuralleError`` or a driver error, nothing is lost, and the
run resumes to the same end with one effect per idempotency key.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from pydantic import BaseModel

from kuralle_es import (
    RunContext,
    RunStore,
    Runtime,
    StoreUnavailableError,
    ToolCall,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es._journal.leases import LeaseOp
from kuralle_es._journal.run import Run
from kuralle_es.testing import ExactlyOnceLedger

pytestmark = pytest.mark.postgres


def terminate_backends(admin_dsn: str, dbname: str) -> int:
    """Kill every connection to ``dbname`` (the store's pool), as a failover would."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        ).fetchall()
    return len(rows)


class Amount(BaseModel):
    cents: int


def make_agent(ledger: ExactlyOnceLedger, on_charge: Any = None) -> Any:
    def charge(args: Amount, call: ToolCall) -> dict[str, int]:
        ledger.record(call, args.cents)
        if on_charge is not None:
            on_charge()
        return {"charged": args.cents}

    async def pay(state: dict[str, Any], ctx: RunContext) -> Any:
        total = 0
        for cents in (100, 200, 300):
            total += (await ctx.tool("charge", {"cents": cents}))["charged"]
            await ctx.now()
        return end(f"charged {total}")

    flow = define_flow("pay", "", "pay", [action("pay", pay)])
    return define_agent("payer", "", None, [define_tool("charge", "", Amount, charge)], [flow])


class KillingStore(RunStore):
    """Kills every connection of its database right before each save it makes."""

    admin_dsn = ""
    dbname = ""
    kills = 0

    async def save_run_async(self, run: Run, lease: LeaseOp | None = None) -> None:
        type(self).kills += terminate_backends(self.admin_dsn, self.dbname) > 0
        await super().save_run_async(run, lease)


async def finish(agent: Any, dsn: str, run_id: str) -> Any:
    """Resume the run from a fresh store until it ends (same worker name)."""
    for _ in range(5):
        with RunStore.postgres(dsn) as store:
            try:
                return (
                    await Runtime([agent], store=store, holder="w").run("s", run_id=run_id).result()
                )
            except Exception:  # a fault the resume itself met: try again
                continue
    raise AssertionError(f"run {run_id} did not finish")


async def test_connections_killed_before_every_save_lose_nothing(
    pg_dsn: str, postgres_admin_dsn: str
) -> None:
    ledger = ExactlyOnceLedger()
    agent = make_agent(ledger)
    KillingStore.admin_dsn = postgres_admin_dsn
    KillingStore.dbname = str(conninfo_to_dict(pg_dsn)["dbname"])
    KillingStore.kills = 0
    store = KillingStore.postgres(pg_dsn)
    try:
        handle = Runtime([agent], store=store, holder="w").run("s", kind="flow", flow_name="pay")
        try:
            result = await handle.result()
        except Exception:
            result = await finish(agent, pg_dsn, await handle.run_id)
    finally:
        store.close()
    # The connections really died, save after save: the three intents and the
    # close (a tool step is one commit: its result rides the next save).
    assert KillingStore.kills >= 4
    assert result.status == "finished" and result.output == "charged 600"
    ledger.assert_exactly_once()
    assert sorted(data for _, _, data in ledger.entries) == [100, 200, 300]


async def test_connections_killed_while_a_tool_runs_lose_nothing(
    pg_dsn: str, postgres_admin_dsn: str
) -> None:
    ledger = ExactlyOnceLedger()
    dbname = str(conninfo_to_dict(pg_dsn)["dbname"])
    agent = make_agent(ledger, on_charge=lambda: terminate_backends(postgres_admin_dsn, dbname))
    with RunStore.postgres(pg_dsn) as store:
        handle = Runtime([agent], store=store, holder="w").run("s", kind="flow", flow_name="pay")
        try:
            result = await handle.result()
        except Exception:
            result = await finish(agent, pg_dsn, await handle.run_id)
    assert result.status == "finished" and result.output == "charged 600"
    ledger.assert_exactly_once()
    assert len(ledger.effects()) == 3
    with RunStore.postgres(pg_dsn) as store:
        steps = await Runtime([agent], store=store).get_steps(result.run_id, "s")
    assert [s.status for s in steps] == ["finished"] * 6


@pytest.mark.parametrize(
    ("dsn", "reason"),
    [
        ("postgresql://postgres@127.0.0.1:1/kuralle", "127.0.0.1:1, database 'kuralle'"),
        (None, "does not exist"),
    ],
)
def test_a_store_whose_server_is_away_fails_fast_with_a_clear_message(
    postgres_admin_dsn: str, dsn: str | None, reason: str
) -> None:
    if dsn is None:  # a live server, a database that is not there
        params = conninfo_to_dict(postgres_admin_dsn)
        dsn = (
            f"postgresql://{params.get('user') or 'postgres'}@{params.get('host') or '127.0.0.1'}"
            f":{params.get('port') or 5432}/kuralle_no_such_database"
        )
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="cannot reach PostgreSQL") as refused:
        RunStore.postgres(dsn)
    assert time.monotonic() - started < 5
    assert reason in str(refused.value)
