"""The script that wrote generation ``runs_0_2_0`` (kuralle_es at commit ecbe8d2).

KEPT FOR THE RECORD. NEVER RE-RUN IT TO OVERWRITE THIS FOLDER: the files here
are users' data as the code of commit ecbe8d2 stored it (the 0.2 line: leases
in a record apart from the journal, flow versions, migrations, budgets,
in-doubt questions, parallel batches), history that later releases must keep
loading and resuming. It refuses to write over existing files. To pin a later
release, copy it (and ``app.py``) into a NEW folder (``runs_<version>``) and
run the copy against that release's code.

It was run from a worktree of that commit, so that ``import kuralle_es`` is
that code and not the working tree's::

    git worktree add /tmp/golden-src-020 ecbe8d2
    GOLDEN_SOURCE=/tmp/golden-src-020 PYTHONPATH=/tmp/golden-src-020 \
        .venv/bin/python tests/golden/runs_0_2_0/generate.py
    git worktree remove --force /tmp/golden-src-020

It writes the same set of runs (``RUNS`` below: generation ``runs_0_1_0``'s,
then the new ones) into a SQLite store (``runs.sqlite``, views projected in
the same file) and into a fresh PostgreSQL database (dumped as
``runs.pg.sql`` with ``pg_dump --no-owner --no-privileges``, then dropped),
and ``manifest.json``: the flow digests (keyed ``name`` or
``name@version``), what each run is, how it stands, how it should be resumed
and what the resume adds to the ledger, and per store its run ids and the
effects the generation itself executed. A run id inside a shared text (the
migrated run's outcome, its ``RunAborted`` event) is written
``{run:<label>}``, since ids differ between the stores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any
from uuid import uuid4

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent.parent
sys.path.insert(0, str(TESTS))

import kuralle_es  # noqa: E402

SOURCE = Path(os.environ.get("GOLDEN_SOURCE", "/tmp/golden-src-020")).resolve()
if not Path(kuralle_es.__file__).resolve().is_relative_to(SOURCE):
    sys.exit(f"kuralle_es is {kuralle_es.__file__}, not under {SOURCE}: PYTHONPATH={SOURCE}")

import psycopg  # noqa: E402
from golden.runs_0_2_0 import app  # noqa: E402
from psycopg import sql  # noqa: E402

from kuralle_es import (  # noqa: E402
    Budget,
    RunStore,
    Runtime,
    ToolExecutionError,
)
from kuralle_es.events import RunEvent, follow  # noqa: E402
from kuralle_es.testing import Crash, CrashingStore, CrashPlan  # noqa: E402

GENERATION = "runs_0_2_0"
COMMIT = "ecbe8d2"
ADMIN_DSN = os.environ.get(
    "KURALLE_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)
FILES = ("runs.sqlite", "runs.pg.sql", "manifest.json")
#: Where the files go: this folder (``GOLDEN_OUT`` only for trial runs elsewhere).
OUT = Path(os.environ.get("GOLDEN_OUT", str(HERE))).resolve()

# label -> what the run is, how it is left, how a later release resumes it.
# ``resume.do`` is what tests/test_golden_runs.py does; ``adds`` the ledger entries
# (tool names, in order) that the resume must add for this run, each with a key
# never executed before, except ``reexecutes``: tools whose in-doubt step runs again
# under the key the generation already executed once. ``steps``, where given, is the
# journal the resume must leave (``app.step_signature`` of each step).
RUNS: dict[str, dict[str, Any]] = {
    "approval": {
        "flow": "approval",
        "what": "paused on ctx.approve (title 'Charge 12.00?') after a ctx.uuid",
        "session_id": "golden-approval",
        "resume": {"do": "approve", "by": "ann", "status": "finished", "outcome": "charged",
                   "adds": ["charge"]},
    },
    "tool_approval": {
        "flow": "tool_approval",
        "what": "paused on a needs_approval tool (refund 4200): the frozen operation",
        "session_id": "golden-tool-approval",
        "resume": {"do": "approve", "by": "ann", "status": "finished", "outcome": "refunded",
                   "adds": ["refund"]},
    },
    "signal": {
        "flow": "signal",
        "what": "paused on ctx.signal('shipped', schema=Shipment) after a ctx.now",
        "session_id": "golden-signal",
        "resume": {"do": "signal", "name": "shipped", "payload": {"tracking": "1Z999"},
                   "bad_payload": {"parcel": 1}, "status": "finished",
                   "outcome": "shipped 1Z999", "adds": ["ship"]},
    },
    "timer": {
        "flow": "nap",
        "what": "paused on a durable ctx.sleep(2.0) (inline_sleep_limit 1.0), due since",
        "session_id": "golden-timer",
        "resume": {"do": "fire_timers", "status": "finished", "outcome": "woke",
                   "adds": ["notify"]},
    },
    "collect": {
        "flow": "intake",
        "what": "paused on a collect node's input: name given, email missing",
        "session_id": "golden-collect",
        "resume": {"do": "input", "input": "email=ann@example.com", "status": "finished",
                   "outcome": "registered", "adds": ["register"]},
    },
    "finished": {
        "flow": "checkout",
        "what": "finished: charge, ctx.now, ctx.uuid; started with idempotency_key 'checkout-1'",
        "session_id": "golden-finished",
        "resume": {"do": "readdress", "restart_key": "checkout-1", "status": "finished",
                   "outcome": "paid", "adds": []},
    },
    "failed": {
        "flow": "broken",
        "what": "error: its tool raised RuntimeError (a frozen ToolExecutionError)",
        "session_id": "golden-failed",
        "resume": {"do": "readdress", "raises": "ToolExecutionError", "status": "error",
                   "outcome": None, "adds": []},
    },
    "cancelled": {
        "flow": "approval",
        "what": "aborted: paused on an approval, then runtime.cancel(reason='customer left')",
        "session_id": "golden-cancelled",
        "resume": {"do": "readdress", "refused_approval": True, "status": "aborted",
                   "outcome": "cancelled: customer left", "adds": []},
    },
    "conversation": {
        "flow": None,
        "what": "a conversation run after two user turns, each a lookup tool call and an answer",
        "session_id": "golden-conversation",
        "resume": {"do": "converse", "input": "third question", "output": "answered turn 3",
                   "status": "finished", "outcome": None, "adds": ["lookup"]},
    },
    "chat_approval": {
        "flow": None,
        "what": "a conversation paused mid-turn: its model asked for the refund tool, which "
        "needs approval (the model turn replays on resume)",
        "session_id": "golden-chat-approval",
        "resume": {"do": "approve", "by": "ann", "status": "finished", "outcome": None,
                   "output": "answered turn 1", "adds": ["refund"]},
    },
    "fork_origin": {
        "flow": "order",
        "what": "finished: quote, approved, charge; the origin of the fork",
        "session_id": "golden-order",
        "resume": {"do": "readdress", "status": "finished", "outcome": "ordered", "adds": []},
    },
    "fork": {
        "flow": "order",
        "what": "runtime.fork(fork_origin, at_step=1): paused on a new approval",
        "session_id": "golden-order",
        "resume": {"do": "approve", "by": "bob", "status": "finished", "outcome": "ordered",
                   "adds": ["charge"]},
    },
    "expired_deadline": {
        "flow": "expiring",
        "what": "paused on an approval whose 1 s deadline passed",
        "session_id": "golden-expiring",
        "resume": {"do": "sweep_deadlines", "status": "finished",
                   "outcome": "declined by deadline", "adds": []},
    },
    "retried": {
        "flow": "retry",
        "what": "a RetryPolicy tool that failed once and then worked, then paused on 'continue'",
        "session_id": "golden-retried",
        "resume": {"do": "signal", "name": "continue", "payload": {"go": True},
                   "status": "finished", "outcome": "retried", "adds": ["charge"]},
    },
    "long": {
        "flow": "long",
        "what": f"{app.LONG_VISITS} visits of a node, one tool step each (the store holds a "
        "snapshot of it, earlier steps archived), paused on 'finish'",
        "session_id": "golden-long",
        "resume": {"do": "signal", "name": "finish", "payload": {}, "status": "finished",
                   "outcome": f"long total {sum(2 * n for n in range(app.LONG_VISITS))}",
                   "adds": ["charge"]},
    },
    "orphan": {
        "flow": "settle",
        "what": "running: its worker died after the settle tool executed, before its result "
        "was saved (CrashPlan after_execute); its lease, a lease record (no LeaseTaken "
        "event), expired",
        "session_id": "golden-orphan",
        "resume": {"do": "recover", "status": "finished", "outcome": "settled", "adds": ["settle"],
                   "reexecutes": ["settle"]},
    },
    # What generation runs_0_1_0 could not store.
    "versioned": {
        "flow": "parcel",
        "what": "parcel version '1' (started by a runtime with only that version), paused on "
        "its approval; resumed by one with versions '1' and '2', it stays on '1'",
        "session_id": "golden-versioned",
        "resume": {"do": "approve", "by": "ann", "status": "finished", "outcome": "v1: sent",
                   "adds": ["ship"]},
    },
    "migrated_origin": {
        "flow": "parcel",
        "what": "parcel version '1' paused on its approval, then runtime.migrate(at_step=1) "
        "onto version '2': aborted, migrated_to the fork (run 'migrated')",
        "session_id": "golden-parcel",
        "resume": {"do": "readdress", "refused_approval": True, "status": "aborted",
                   "outcome": "migrated: {run:migrated}", "adds": []},
    },
    "migrated": {
        "flow": "parcel",
        "what": "the migration's fork on parcel version '2': its quote replayed from the "
        "original, paused on a new approval",
        "session_id": "golden-parcel",
        "resume": {"do": "approve", "by": "bob", "status": "finished", "outcome": "v2: sent",
                   "adds": ["ship", "notify"],
                   "steps": ["tool quote finished x1", "approval __approval finished x1",
                             "tool ship finished x1", "tool notify finished x1"]},
    },
    "batch": {
        "flow": "batch",
        "what": "two quotes run as one parallel batch (asyncio.gather), then paused on 'go'",
        "session_id": "golden-batch",
        "resume": {"do": "signal", "name": "go", "payload": {}, "status": "finished",
                   "outcome": "batched", "adds": ["charge"]},
    },
    "keyed_conversation": {
        "flow": None,
        "what": "a conversation whose one turn was started with idempotency_key 'turn-1' "
        "(its result stored: TurnRecorded)",
        "session_id": "golden-keyed",
        "resume": {"do": "converse", "restart_key": "turn-1", "restart_input": "keyed question",
                   "restart_output": "answered turn 1", "input": "second question",
                   "output": "answered turn 2", "status": "finished", "outcome": None,
                   "adds": ["lookup"]},
    },
    "budget": {
        "flow": None,
        "what": "a conversation turn run with Budget(max_model_calls=1, on_exceed='ask'): "
        "its lookup done, paused on __budget before its second model call",
        "session_id": "golden-budget",
        "resume": {"do": "approve", "by": "finance", "raise_to": {"max_model_calls": 10},
                   "status": "finished", "outcome": None, "output": "answered turn 1",
                   "adds": []},
    },
    "in_doubt": {
        "flow": "capture",
        "what": "its worker died after the capture tool (on_in_doubt='ask') executed, before "
        "its result was saved; re-addressed after its lease expired, it asks: paused on "
        "__in_doubt",
        "session_id": "golden-in-doubt",
        "resume": {"do": "signal", "name": "__in_doubt",
                   "payload": {"action": "resolve", "result": {"captured": 800}},
                   "bad_payload": {"action": "perhaps"}, "status": "finished",
                   "outcome": "captured", "adds": [], "steps": ["tool capture finished x1"]},
    },
}  # fmt: skip


async def populate(
    open_store: Callable[[], RunStore], open_crashing: Callable[[], CrashingStore]
) -> dict[str, str]:
    """Write every run of ``RUNS``; returns label -> run id."""
    store = open_store()
    runtime = Runtime(app.build_agents(), store=store, holder="golden-generator")
    ids: dict[str, str] = {}

    async def start(label: str, flow: str, input: str | None = None, **kw: Any) -> Any:
        session = RUNS[label]["session_id"]
        assert RUNS[label]["flow"] == flow, label
        result = await runtime.run(session, input=input, kind="flow", flow_name=flow, **kw).result()
        ids[label] = result.run_id
        return result

    assert (await start("approval", "approval")).status == "paused"
    assert (await start("tool_approval", "tool_approval")).status == "paused"
    assert (await start("signal", "signal")).status == "paused"
    assert (await start("timer", "nap")).status == "paused"
    assert (await start("collect", "intake", input="hi, name=Ann")).status == "paused"
    done = await start("finished", "checkout", idempotency_key="checkout-1")
    assert done.status == "finished"

    session = RUNS["failed"]["session_id"]
    handle = runtime.run(session, kind="flow", flow_name=RUNS["failed"]["flow"])
    try:
        await handle.result()
        raise AssertionError("the broken flow finished")
    except ToolExecutionError:
        ids["failed"] = await handle.run_id

    paused = await start("cancelled", "approval")
    session = RUNS["cancelled"]["session_id"]
    cancelled = await runtime.cancel(paused.run_id, session, "customer left")
    assert cancelled.status == "aborted"

    session = RUNS["conversation"]["session_id"]
    first = await runtime.run(session, input="first question").result()
    second = await runtime.run(session, input="second question").result()
    assert first.run_id == second.run_id and second.output == "answered turn 2", second
    ids["conversation"] = second.run_id
    session = RUNS["chat_approval"]["session_id"]
    asked = await runtime.run(session, input="refund 2500").result()
    assert asked.status == "paused" and asked.waiting_for is not None, asked
    ids["chat_approval"] = asked.run_id

    origin = await start("fork_origin", "order")
    approved = await runtime.approve(origin.run_id, RUNS["fork_origin"]["session_id"], by="ann")
    assert approved.status == "finished"
    fork = await runtime.fork(origin.run_id, RUNS["fork"]["session_id"], 1)
    assert fork.status == "paused" and fork.waiting_for is not None
    ids["fork"] = fork.run_id

    assert (await start("expired_deadline", "expiring")).status == "paused"
    assert (await start("retried", "retry")).status == "paused"
    assert (await start("long", "long")).status == "paused"

    # Generation runs_0_1_0's set ends here (but its orphan, made last). Flow versions:
    # the first deploy (parcel '1' only) starts two runs; the runtime with both
    # versions migrates one of them onto '2'.
    first_deploy = Runtime(app.build_first_deploy(), store=open_store(), holder="golden-first")
    for label in ("versioned", "migrated_origin"):
        spec = RUNS[label]
        handle = first_deploy.run(spec["session_id"], kind="flow", flow_name=spec["flow"])
        paused = await handle.result()
        assert paused.status == "paused", (label, paused)
        ids[label] = paused.run_id
    moved = await runtime.migrate(ids["migrated_origin"], RUNS["migrated_origin"]["session_id"], 1)
    assert moved.status == "paused" and moved.waiting_for is not None, moved
    ids["migrated"] = moved.run_id
    assert (await start("batch", "batch")).status == "paused"

    session = RUNS["keyed_conversation"]["session_id"]
    keyed = await runtime.run(session, input="keyed question", idempotency_key="turn-1").result()
    assert keyed.status == "finished" and keyed.output == "answered turn 1", keyed
    ids["keyed_conversation"] = keyed.run_id
    session = RUNS["budget"]["session_id"]
    capped = await runtime.run(
        session, input="costly question", budget=Budget(max_model_calls=1, on_exceed="ask")
    ).result()
    assert capped.status == "paused" and capped.waiting_for is not None, capped
    assert capped.waiting_for.name == "__budget", capped
    ids["budget"] = capped.run_id

    async def die_after_execute(label: str) -> str:
        """Start ``label``'s flow on a worker whose store dies after the tool's effect."""
        crashing = open_crashing()
        crashing.plan = CrashPlan("after_execute")
        dying = Runtime(
            app.build_agents(), store=crashing, holder="golden-dead-worker", lease_ttl=0.5
        )
        handle = dying.run(RUNS[label]["session_id"], kind="flow", flow_name=RUNS[label]["flow"])
        try:
            await handle.result()
            raise AssertionError(f"the {label} run's worker did not die")
        except Crash:
            run_id = await handle.run_id
        crashing.plan = None
        crashing.close()
        return run_id

    # The in-doubt question: a dead worker's capture, re-addressed once its lease expired.
    ids["in_doubt"] = await die_after_execute("in_doubt")
    await asyncio.sleep(0.7)
    asked = await runtime.run(RUNS["in_doubt"]["session_id"], run_id=ids["in_doubt"]).result()
    assert asked.status == "paused" and asked.waiting_for is not None, asked
    assert asked.waiting_for.name == "__in_doubt", asked

    # The orphan: a worker whose store dies after the settle tool's effect.
    ids["orphan"] = await die_after_execute("orphan")
    await asyncio.sleep(1.2)  # its lease (0.5 s), the expiring deadline (1 s) pass

    await runtime.views.wait_until_caught_up(30.0)
    return ids


async def public_events(store: RunStore) -> list[RunEvent]:
    """Every public event stored so far (read-only: ``follow`` until it waits; the
    timeout cancels the follower)."""
    seen: list[RunEvent] = []
    events = follow(store)
    while True:
        try:
            seen.append(await asyncio.wait_for(anext(events), 2.0))
        except TimeoutError:
            return seen


def labelled(text: str | None, ids: dict[str, str]) -> str | None:
    """``text`` with each run id in it written ``{run:<label>}``: the same in every store."""
    if text is None:
        return None
    for label, run_id in ids.items():
        text = text.replace(run_id, f"{{run:{label}}}")
    return text


def flow_key(name: str, version: str | None) -> str:
    """A flow's key in the manifest's ``flows``: its name, and its version if it has one."""
    return name if version is None else f"{name}@{version}"


async def describe(store: RunStore, ids: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(facts shared by every store, facts of this store) of each run."""
    runtime = Runtime(app.build_agents(), store=store, holder="golden-describer")
    events = await public_events(store)
    assert all(e.run_id in ids.values() for e in events), "an event of an unknown run"
    shared: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for label, run_id in ids.items():
        session = RUNS[label]["session_id"]
        state = await runtime.get_run(run_id, session)
        assert state is not None, label
        steps = await runtime.get_steps(run_id, session)
        wait = state.waiting_for
        shared[label] = {
            "kind": state.kind,
            "status": state.status,
            "active_flow": state.active_flow,
            "active_node": state.active_node,
            "flow_version": state.flow_version,
            "outcome": labelled(state.outcome, ids),
            "error": None if state.error is None else state.error.type,
            "waiting_for": None if wait is None else {
                "kind": wait.kind,
                "name": wait.name,
                "title": wait.title,
                "operation": None if wait.operation is None else {
                    "tool_name": wait.operation.tool_name, "args": wait.operation.args,
                },
            },
            "lease": state.lease_holder,
            "step_count": state.step_count,
            "steps": [app.step_signature(s) for s in steps],
            "messages": [m.role for m in state.messages],
            "events": [labelled(app.event_signature(e), ids) for e in events
                       if e.run_id == run_id],
        }  # fmt: skip
        own[label] = {
            "run_id": run_id,
            "session_id": session,
            "flow_digest": state.flow_digest,
            "forked_from": None if state.forked_from is None else dict(state.forked_from),
            "migrated_to": state.migrated_to,
            "state": state.state,
            "step_keys": [s.key for s in steps],
        }
    return shared, own


def _snapshots(store: RunStore, run_id: str) -> int:
    from uuid import UUID

    assert store.snapshots is not None
    return len(list(store.snapshots.get(UUID(run_id))))


def _check_leases(rows: list[tuple[str, int]], leased: list[str], ids: dict[str, str]) -> None:
    """The store keeps leases as records: no lease event (``rows``: topic, count), and
    the one lease left (``leased``: its run ids) is the orphan's."""
    lease_events = [row for row in rows if row[0].startswith("kuralle_es:Run.Lease")]
    assert not lease_events, f"lease events stored: {lease_events}"
    assert [str(run_id) for run_id in leased] == [ids["orphan"]], leased


def _checkpoint(path: str) -> None:
    """Everything in the one file: the write-ahead log checkpointed and gone."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    for suffix in ("-wal", "-shm"):
        Path(path + suffix).unlink(missing_ok=True)


async def generate_sqlite(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    path = str(work / "runs.sqlite")
    ledger = work / "ledger.sqlite.jsonl"
    app.use_ledger(ledger)
    stores: list[RunStore] = []

    def open_store() -> RunStore:
        stores.append(RunStore.sqlite(path))
        return stores[-1]

    def open_crashing() -> CrashingStore:
        store = CrashingStore.sqlite(path)
        assert isinstance(store, CrashingStore)
        return store

    ids = await populate(open_store, open_crashing)
    shared, own = await describe(open_store(), ids)
    snapshots = _snapshots(stores[0], ids["long"])
    for store in stores:
        store.close()
    await asyncio.to_thread(_checkpoint, path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        topics = "SELECT topic, count(*) FROM stored_events GROUP BY topic"
        leased = [r[0] for r in conn.execute("SELECT run_id FROM stored_leases")]
        _check_leases(conn.execute(topics).fetchall(), leased, ids)
    assert snapshots >= 1, "the long run has no snapshot"
    return shared, {"file": "runs.sqlite", "runs": own, "ledger": app.read_ledger(ledger),
                    "long_snapshots": snapshots}  # fmt: skip


async def generate_postgres(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    name = f"golden_gen_{uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = psycopg.conninfo.conninfo_to_dict(ADMIN_DSN)
    dsn = psycopg.conninfo.make_conninfo(ADMIN_DSN, dbname=name)
    url = (
        f"postgresql://{params.get('user') or 'postgres'}@{params.get('host') or '127.0.0.1'}:"
        f"{params.get('port') or 5432}/{name}"
    )
    ledger = work / "ledger.pg.jsonl"
    app.use_ledger(ledger)
    stores: list[RunStore] = []
    try:

        def open_store() -> RunStore:
            stores.append(RunStore.postgres(url))
            return stores[-1]

        def open_crashing() -> CrashingStore:
            store = CrashingStore.postgres(url)
            assert isinstance(store, CrashingStore)
            return store

        ids = await populate(open_store, open_crashing)
        shared, own = await describe(open_store(), ids)
        snapshots = _snapshots(stores[0], ids["long"])
        for store in stores:
            store.close()
        with psycopg.connect(dsn) as conn:
            topics = "SELECT topic, count(*) FROM runstore_events GROUP BY topic"
            leased = [r[0] for r in conn.execute("SELECT run_id FROM runstore_leases")]
            _check_leases(conn.execute(topics).fetchall(), leased, ids)
        await asyncio.to_thread(
            subprocess.run,
            ["pg_dump", "--no-owner", "--no-privileges", "--file", str(work / "runs.pg.sql"),
             "--dbname", dsn],
            check=True,
        )  # fmt: skip
    finally:
        for store in stores:
            store.close()
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
    assert snapshots >= 1, "the long run has no snapshot"
    return shared, {"file": "runs.pg.sql", "runs": own, "ledger": app.read_ledger(ledger),
                    "long_snapshots": snapshots}  # fmt: skip


def _versions() -> dict[str, str]:
    """What else the stored bytes depend on."""
    dump = subprocess.run(["pg_dump", "--version"], capture_output=True, text=True, check=True)
    with psycopg.connect(ADMIN_DSN) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return {
        "python": platform.python_version(),
        "eventsourcing": metadata.version("eventsourcing"),
        "pydantic": metadata.version("pydantic"),
        "psycopg": metadata.version("psycopg"),
        "sqlite": sqlite3.sqlite_version,
        "postgres_server": str(row[0] if row else None),
        "pg_dump": dump.stdout.strip(),
    }


def _check_source() -> None:
    """The code imported is the commit's, unchanged."""
    head = subprocess.run(["git", "-C", str(SOURCE), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert head.startswith(COMMIT), head
    dirty = subprocess.run(["git", "-C", str(SOURCE), "status", "--porcelain"],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert not dirty.strip(), dirty


async def main() -> None:
    # The release its pyproject.toml says (at ecbe8d2 still 0.1.0: the 0.2 line unreleased).
    release = tomllib.loads((SOURCE / "pyproject.toml").read_text("utf-8"))["project"]["version"]
    existing = [f for f in FILES if (OUT / f).exists()]
    if existing:
        sys.exit(f"refusing to overwrite {existing} in {OUT}: write a NEW generation instead")
    with tempfile.TemporaryDirectory(prefix="golden-gen-") as tmp:
        work = Path(tmp)
        sqlite_shared, sqlite_own = await generate_sqlite(work)
        pg_shared, pg_own = await generate_postgres(work)
        if sqlite_shared != pg_shared:
            diff = {k: (sqlite_shared[k], pg_shared[k]) for k in RUNS
                    if sqlite_shared[k] != pg_shared[k]}  # fmt: skip
            raise AssertionError(f"the stores differ: {json.dumps(diff, indent=1, default=str)}")
        flows = {flow_key(flow.name, flow.version): flow.digest for flow in app.FLOWS}
        manifest = {
            "generation": GENERATION,
            "kuralle_es_version": release,
            "commit": COMMIT,
            "generated_at": datetime.now(UTC).isoformat(),
            "versions": _versions(),
            "flows": flows,
            "runs": {label: {**spec, **sqlite_shared[label]} for label, spec in RUNS.items()},
            "stores": {"sqlite": sqlite_own, "postgres": pg_own},
        }
        (work / "manifest.json").write_text(
            json.dumps(manifest, indent=1, sort_keys=False, default=str) + "\n", "utf-8"
        )
        for f in FILES:
            shutil.copyfile(work / f, OUT / f)
    print(f"wrote {', '.join(FILES)} in {OUT}")


if __name__ == "__main__":
    _check_source()
    asyncio.run(main())
