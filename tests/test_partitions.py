"""Partitions and shards (docs/scaling.md), on real PostgreSQL servers.

A store of K logs in one database (``RunStore.postgres(dsn, partitions=K)``)
and a store sharded over databases on two servers (``RunStore.sharded``):
runs spread over the partitions and stay where they landed; the views, the
events, consumers and the recovery of orphans see every partition; the
number of partitions only grows; and a partitioned store's public events
carry their partition, with ``(partition, position)`` unique.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import uvicorn
from conftest import stripped
from events_kit import everything, refund_run
from procs import crashy
from procs.child import Child, wait_lease_expired
from psycopg.conninfo import conninfo_to_dict

from kuralle_es import InvalidArgumentError, RunStore, Runtime, recover_orphaned_runs
from kuralle_es.dashboard import create_app
from kuralle_es.events import RunEvent, RunOpened, RunPaused, follow
from kuralle_es.examples import approval_notifier, refund


def with_query(url: str, query: str) -> str:
    """``url`` with ``query`` added to its own (a URL through PgBouncer has one)."""
    return f"{url}{'&' if '?' in url else '?'}{query}"


@pytest.fixture
def pg_dsn(routed_pg_dsn: str) -> str:
    """A fresh database, straight to the server and through PgBouncer in transaction mode."""
    return routed_pg_dsn


pytestmark = pytest.mark.postgres

PROC = Path(__file__).resolve().parent / "procs" / "approval_consumer.py"


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(refund.LEDGER_ENV, str(path))
    monkeypatch.delenv(refund.MODEL_ENV, raising=False)
    return path


def decisions(n: int) -> list[bool | None]:
    """Approve, deny, or leave waiting, in turn."""
    return [(True, False, None)[i % 3] for i in range(n)]


async def refund_runs(store: RunStore, sessions: list[str]) -> dict[str, str]:
    """One refund run per session (approved, denied or left waiting): run id -> session."""
    runtime = Runtime([refund.build_agent()], store=store)
    pairs = zip(sessions, decisions(len(sessions)), strict=True)
    made = await asyncio.gather(*(refund_run(runtime, s, approve=a) for s, a in pairs))
    return dict(zip(made, sessions, strict=True))


def check_stream(events: list[RunEvent], runs: dict[str, str]) -> None:
    """Every run's events, and only those; each run opens first and stays in one
    partition; ``(partition, position)`` unique and increasing per partition."""
    keys = [(e.partition, e.position) for e in events]
    assert len(set(keys)) == len(keys)
    for partition in {e.partition for e in events}:
        positions = [e.position for e in events if e.partition == partition]
        assert positions == sorted(positions)
    by_run: dict[str, list[RunEvent]] = defaultdict(list)
    for event in events:
        by_run[event.run_id].append(event)
    assert set(by_run) == set(runs)
    for run_id, own in by_run.items():
        assert isinstance(own[0], RunOpened)
        assert {e.partition for e in own} == {own[0].partition}
        assert {e.session_id for e in own} == {runs[run_id]}


# --------------------------------------------------- partitions of one database
async def test_a_partitioned_database_spreads_runs_and_every_reader_sees_them_all(
    pg_dsn: str, ledger: Path
) -> None:
    store = RunStore.postgres(pg_dsn, partitions=4)
    try:
        sessions = [f"customer-{i}" for i in range(12)]
        runs = await refund_runs(store, sessions)
        where = {run_id: store.partition_of(run_id) for run_id in runs}
        assert len(set(where.values())) > 1, where
        views = store_views(store)
        listed = await views.list_runs(limit=100)
        assert {r.run_id for r in listed} == set(runs)
        waiting = await views.waiting_runs()
        assert len(waiting) == decisions(12).count(None)
        stats = {s.name: s.count for s in await views.step_stats()}
        assert stats["processRefund"] == decisions(12).count(True)

        events = await everything(store)
        check_stream(events, runs)
        assert {e.partition for e in events} == set(where.values())
        for event in events:
            assert event.partition == where[event.run_id]
    finally:
        store.close()

    again = RunStore.postgres(pg_dsn)  # the database says how many partitions it has
    try:
        assert len(again.partitions) == 4
        runtime = Runtime([refund.build_agent()], store=again)
        for run_id, session in runs.items():
            state = await runtime.get_run(run_id, session)
            assert state is not None and again.partition_of(run_id) == where[run_id]
        # A run left waiting resumes from a store that had to find its partition.
        waiting_id = waiting[0].run_id
        result = await runtime.approve(waiting_id, runs[waiting_id], by="supervisor")
        assert result.status == "finished"
    finally:
        again.close()


def store_views(store: RunStore) -> Any:
    return Runtime([refund.build_agent()], store=store).views


def hashed_partition(session_id: str, count: int) -> int:
    """Where a new session with this id goes among ``count`` partitions."""
    digest = hashlib.sha256(session_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count


async def test_partitions_only_grow_and_a_run_never_moves(pg_dsn: str, ledger: Path) -> None:
    store = RunStore.postgres(pg_dsn, partitions=2)
    try:
        old = await refund_runs(store, [f"early-{i}" for i in range(6)])
        where = {run_id: store.partition_of(run_id) for run_id in old}
        head = [log.recorder.max_notification_id() for log in store.partitions]
    finally:
        store.close()

    with pytest.raises(InvalidArgumentError, match="partitions=2"):
        RunStore.postgres(pg_dsn, partitions=1)
    check = RunStore.postgres(pg_dsn)
    try:
        assert len(check.partitions) == 2  # the refusal changed nothing
        assert [log.recorder.max_notification_id() for log in check.partitions] == head
    finally:
        check.close()

    grown = RunStore.postgres(pg_dsn, partitions=4)
    try:
        assert len(grown.partitions) == 4
        assert {run_id: grown.partition_of(run_id) for run_id in old} == where
        new = await refund_runs(grown, [f"late-{i}" for i in range(24)])
        assert {grown.partition_of(run_id) for run_id in new} == {0, 1, 2, 3}
        # An old run's session keeps its partition for a new run of the session,
        # even where its id now hashes to another (asked of a store that has not
        # seen the session).
        moved = [
            (run_id, s) for run_id, s in old.items() if hashed_partition(s, 4) != where[run_id]
        ]
        assert moved, "every early session hashes to its partition at 4 as well"
        first, session = moved[0]
        fresh = RunStore.postgres(pg_dsn)
        try:
            runtime = Runtime([refund.build_agent()], store=fresh)
            rerun = await refund_run(runtime, session, approve=True)
            assert fresh.partition_of(rerun) == where[first]
            assert fresh.session_run_ids(session) == [first, rerun]
        finally:
            fresh.close()
        listed = await store_views(grown).list_runs(limit=100)
        assert len(listed) == len(old) + len(new) + 1
    finally:
        grown.close()


async def test_follow_takes_a_position_per_partition(pg_dsn: str, ledger: Path) -> None:
    store = RunStore.postgres(pg_dsn, partitions=3)
    try:
        first = await refund_runs(store, [f"a-{i}" for i in range(6)])
        seen = await everything(store)
        resume_at = {p: max(e.position for e in seen if e.partition == p) for p in range(3)
                     if any(e.partition == p for e in seen)}  # fmt: skip
        later = await refund_runs(store, [f"b-{i}" for i in range(6)])
        expected = [e for e in await everything(store) if e.run_id in later]

        got: list[RunEvent] = []
        stream = follow(store, after=resume_at)
        try:
            while len(got) < len(expected):
                got.append(await asyncio.wait_for(anext(stream), 10))
        finally:
            await stream.aclose()
        assert sorted(got, key=lambda e: (e.partition, e.position)) == sorted(
            expected, key=lambda e: (e.partition, e.position)
        )
        check_stream(got, later)
        assert set(first).isdisjoint(e.run_id for e in got)

        for bad, words in (
            (7, "after={partition: position}"),
            ({5: 0}, "partitions are 0..2"),
            ({0: -1}, "after\\[0\\]"),
            ("3", "mapping"),
        ):
            with pytest.raises(InvalidArgumentError, match=words):
                await anext(follow(store, after=bad))  # type: ignore[arg-type]
    finally:
        store.close()


# ---------------------------------------------------- shards on two servers
@pytest.fixture
def two_servers(pg_dsn: str, second_pg_dsn: str) -> str:
    """The URL of a store sharded over a database on each of two servers."""
    return f"{pg_dsn},{second_pg_dsn}"


async def test_a_store_sharded_over_two_servers_sees_every_run(
    two_servers: str, ledger: Path
) -> None:
    store = RunStore.from_url(two_servers)
    try:
        assert [log.partition for log in store.partitions] == [0, 1]
        runs = await refund_runs(store, [f"shopper-{i}" for i in range(10)])
        where = Counter(store.partition_of(run_id) for run_id in runs)
        assert set(where) == {0, 1}, where
        views = store_views(store)
        assert {r.run_id for r in await views.list_runs(limit=100)} == set(runs)
        usage = await views.usage()
        runtime = Runtime([refund.build_agent()], store=store)
        tools = [
            step
            for run_id, session in runs.items()
            for step in await runtime.get_steps(run_id, session)
            if step.kind == "tool"
        ]
        assert usage.tool_calls == len(tools) == decisions(10).count(True)
        check_stream(await everything(store), runs)
        # Each shard's database holds its own runs only.
        for log in store.partitions:
            mine = {r for r in runs if store.partition_of(r) == log.partition}
            assert {e.run_id for e in await everything(only(log))} == mine
    finally:
        store.close()


def only(log: Any) -> RunStore:
    """A store of one shard, opened on its own."""
    store = RunStore(env=dict(log.env))
    return store


async def test_a_killed_consumer_applies_each_event_once_on_both_servers(
    two_servers: str, ledger: Path
) -> None:
    """The approval notifier, SIGKILLed mid-stream and restarted over a store sharded
    over two servers: each shard's outbox gets exactly one row per approval pause of
    its runs (the row commits with that shard's position of the consumer)."""
    store = RunStore.from_url(two_servers)
    try:
        await asyncio.to_thread(approval_notifier.create_outbox, store)
        runtime = Runtime([refund.build_agent()], store=store)

        async def drive() -> None:
            for i in range(16):
                await refund_run(runtime, f"buyer-{i}", approve=(True, None)[i % 2])

        writer = asyncio.create_task(drive())
        kills = 0
        for _ in range(4):
            proc = await asyncio.to_thread(
                subprocess.Popen, [sys.executable, str(PROC), two_servers],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert proc.stdout is not None
            assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "ready"
            try:
                line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 10)
                kills += line.startswith("inserted")
            except TimeoutError:
                pass
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
            assert proc.returncode == -signal.SIGKILL
        await writer
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "kuralle_es.examples.approval_notifier",
             "--store", two_servers, "--once"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert kills >= 1, "no kill landed inside a handler's transaction"

        pauses = sorted(
            (e.partition, e.position)
            for e in await everything(store)
            if isinstance(e, RunPaused) and e.waiting_for.kind == "approval"
        )
        rows: list[tuple[int, int]] = []
        for log in store.partitions:
            with log.recorder.datastore.transaction(commit=False) as curs:
                curs.execute(f"SELECT partition, position FROM {approval_notifier.OUTBOX_TABLE}")
                rows += [(int(r["partition"]), int(r["position"])) for r in curs.fetchall()]
        assert sorted(rows) == pauses and len(pauses) == 16
        assert {p for p, _ in pauses} == {0, 1}
        position = await approval_notifier.approval_consumer(store).position()
        assert isinstance(position, dict) and set(position) == {0, 1}
    finally:
        store.close()


async def test_orphans_on_both_servers_are_recovered(two_servers: str, tmp_path: Path) -> None:
    """Workers SIGKILLed inside a tool leave running runs on both shards; one sweep
    of ``recover_orphaned_runs`` finishes every one of them, with the same key."""
    ledger = tmp_path / "charges.jsonl"
    store = RunStore.from_url(two_servers)
    try:
        orphans: dict[str, str] = {}
        i = 0
        while {store.partition_of(r) for r in orphans} != {0, 1} or len(orphans) < 4:
            session = f"payer-{i}"
            i += 1
            with Child("crashy", "url", two_servers, ledger, session,
                       "start", crashy.CRASH_FLOW) as child:  # fmt: skip
                run_id = await child.opened()
                code, _ = await asyncio.to_thread(child.wait, 60)
            assert code == -signal.SIGKILL, child.stderr
            orphans[run_id] = session
            assert i < 40, "the sessions never reached both shards"

        runtime = Runtime(
            [crashy.crash_agent(ledger, die_in_tool=False)], store=store, holder="sweeper"
        )
        for run_id, session in orphans.items():
            await wait_lease_expired(runtime, run_id, session)
        recovered = await recover_orphaned_runs(runtime)
        assert sorted(recovered) == sorted(orphans)
        for run_id, session in orphans.items():
            state = await runtime.get_run(run_id, session)
            assert state is not None and state.status == "finished"
        charges = Counter((c["run_id"], c["key"]) for c in crashy.read_ledger(ledger))
        assert sorted(run for run, _ in charges) == sorted(orphans)
        assert set(charges.values()) == {2}  # the killed attempt and the recovery, one key
    finally:
        store.close()


async def test_a_sharded_store_refuses_what_it_cannot_be(pg_dsn: str) -> None:
    for bad, words in (
        ([], "list of store URLs"),
        ([pg_dsn, pg_dsn], "each database once"),
        (pg_dsn, "list of store URLs"),
    ):
        with pytest.raises(InvalidArgumentError, match=words):
            RunStore.sharded(bad)  # type: ignore[arg-type]
    with pytest.raises(Exception, match=r"leave \?partitions= out"):
        RunStore.from_url(f"{pg_dsn},{with_query(pg_dsn, 'partitions=2')}")
    with psycopg.connect(pg_dsn.partition("?")[0]) as conn:  # nothing was written
        tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchone()
    assert tables == (0,)


# ------------------------------------------------------------ the command line
def kuralle(*args: str) -> str:
    """``kuralle-es ARGS`` in a child process; its stdout (it must succeed)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not stripped(k, ("PERSISTENCE_", "POSTGRES_", "KURALLE_"))
    }
    env[refund.MODEL_ENV] = "scripted"
    done = subprocess.run(
        [sys.executable, "-m", "kuralle_es.cli", *args],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("layout", ["partitions", "shards"])
async def test_the_command_line_sees_every_partition(
    layout: str, pg_dsn: str, request: pytest.FixtureRequest, ledger: Path
) -> None:
    url = (
        with_query(pg_dsn, "partitions=3")
        if layout == "partitions"
        else f"{pg_dsn},{request.getfixturevalue('second_pg_dsn')}"
    )
    store = RunStore.from_url(url)
    try:
        runs = await refund_runs(store, [f"caller-{i}" for i in range(9)])
        count = len(store.partitions)
        waiting = [r for r, a in zip(runs, decisions(9), strict=True) if a is None]
        far = next(r for r in waiting if store.partition_of(r) != 0)
    finally:
        store.close()

    listed = json.loads(kuralle("--store", url, "runs", "list", "--json"))
    assert {r["run_id"] for r in listed} == set(runs)
    assert far in kuralle("--store", url, "runs", "show", far)
    approved = json.loads(kuralle("--store", url, "approve", far, "--by", "ops"))
    assert approved["status"] == "finished"
    status = kuralle("--store", url, "views", "status").splitlines()
    assert [line.split(":")[0] for line in status] == [f"partition {i}" for i in range(count)]
    rebuilt = kuralle("--store", url, "views", "rebuild")
    assert rebuilt.startswith("rebuilt the run views from ")
    paused = json.loads(kuralle("--store", url, "runs", "list", "--status", "paused", "--json"))
    assert {r["run_id"] for r in paused} == set(waiting) - {far}


async def test_the_eventsourcing_variables_open_every_partition(pg_dsn: str) -> None:
    RunStore.postgres(pg_dsn, partitions=3).close()
    dsn, _, query = pg_dsn.partition("?")
    params = conninfo_to_dict(dsn)
    store = RunStore(
        env={
            "PERSISTENCE_MODULE": "eventsourcing.postgres",
            "POSTGRES_DBNAME": str(params["dbname"]),
            "POSTGRES_HOST": str(params["host"]),
            "POSTGRES_PORT": str(params["port"]),
            "POSTGRES_USER": str(params["user"]),
            "POSTGRES_PASSWORD": "",
            # Behind PgBouncer in transaction mode (the fixture's ?pooler=transaction).
            "KURALLE_POSTGRES_POOLER": "transaction" if "pooler=transaction" in query else "",
        }
    )
    try:
        assert [log.partition for log in store.partitions] == [0, 1, 2]
    finally:
        store.close()
    with pytest.raises(InvalidArgumentError, match="PostgreSQL"):
        RunStore(env={"PERSISTENCE_MODULE": "eventsourcing.popo"}, partitions=2)


async def test_the_dashboard_sees_every_shard(two_servers: str, ledger: Path) -> None:
    """The dashboard over a sharded store lists the runs of both servers, shows a
    run of the second, and an approval from it resumes that run."""

    store = RunStore.from_url(two_servers)
    try:
        runs = await refund_runs(store, [f"visitor-{i}" for i in range(6)])
        waiting = [r for r, a in zip(runs, decisions(6), strict=True) if a is None]
        far = next((r for r in waiting if store.partition_of(r) == 1), None)
        if far is None:  # the waiting runs all landed on shard 0: make one on shard 1
            more = await refund_runs(store, [f"late-visitor-{i}" for i in range(30)])
            runs.update(more)
            far = next(r for r, a in zip(more, decisions(30), strict=True)
                       if a is None and store.partition_of(r) == 1)  # fmt: skip
        app = create_app(store, lambda s: Runtime([refund.build_agent()], store=s))
        with socket_port() as port:
            server = uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
            )
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            try:
                deadline = time.monotonic() + 20
                while not server.started:
                    assert time.monotonic() < deadline and thread.is_alive()
                    await asyncio.sleep(0.05)
                base = f"http://127.0.0.1:{port}"
                index = await asyncio.to_thread(read, f"{base}/?limit=100")
                assert all(run_id in index for run_id in runs)
                page = await asyncio.to_thread(read, f"{base}/runs/{far}")
                assert "Refund $42.50?" in page
            finally:
                server.should_exit = True
                await asyncio.to_thread(thread.join, 20)
    finally:
        store.close()


def read(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode("utf-8"))


@contextlib.contextmanager
def socket_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    yield port
