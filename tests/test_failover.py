"""A dead primary: saves in doubt are read back, nothing hangs, and a failover loses nothing.

- A save whose server dies during ``COMMIT`` (the commit waits for a
  synchronous standby that never answers; the server is SIGKILLed there)
  finds out from the server once it is back: its events were committed, so
  the save succeeds, once, within a bounded time; a server that never comes
  back fails the save with ``StoreUnavailableError``, also in bounded time.
- A primary and a synchronous standby under Patroni (``ha_kit``): a worker
  process drives 100 flow runs of three tool steps through a multi-host URL
  (``target_session_attrs=read-write``); the primary's postmaster is
  SIGKILLed mid-way and Patroni promotes the standby. Every run finishes, no
  tool key executes twice except the in-doubt retries of steps in flight at
  the kill, no step acknowledged before the kill is missing, and a follower,
  a ``Consumer``, the views and ``kuralle-es worker`` (whose sweeper then
  recovers an orphan), all started before the kill, go on by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import _pg_binary, _ThrowawayCluster
from runs_kit import stored_run, with_message

from kuralle_es import RunStore, Runtime, StoreUnavailableError
from kuralle_es._journal import pg_async, subject_keys
from kuralle_es.events import Consumer, RunFinished, follow
from kuralle_es.testing import Crash

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.failover,
    pytest.mark.direct_only(
        "fails over servers of its own (a stalled cluster, a Patroni pair), not the "
        "session's server behind PgBouncer"
    ),
]

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ha_kit  # noqa: E402
from procs import three_steps  # noqa: E402

WORKER = HERE / "procs" / "three_steps.py"


def _no_package(message: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


# ------------------------------------------------------- a kill during COMMIT
@pytest.fixture
def stalled_cluster() -> Iterator[_ThrowawayCluster]:
    """A server whose commits wait for a synchronous standby that never comes: a
    save stays in ``COMMIT`` until the test kills the server."""
    initdb, pg_ctl = _pg_binary("initdb"), _pg_binary("pg_ctl")
    if not (initdb and pg_ctl):
        _no_package("initdb/pg_ctl not found")
    assert initdb is not None and pg_ctl is not None
    cluster = _ThrowawayCluster(initdb, pg_ctl, options="-c synchronous_commit=on")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _stall_commits(cluster: _ThrowawayCluster, on: bool) -> None:
    with psycopg.connect(cluster.admin_dsn, autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{'ghost' if on else ''}'")
        conn.execute("SELECT pg_reload_conf()")


def _restart(cluster: _ThrowawayCluster) -> None:
    """Start the killed server again, once its orphaned backends have gone (until
    then it refuses: its shared memory is still in use)."""
    for _ in range(40):
        time.sleep(0.5)
        try:
            cluster.restart()
            return
        except subprocess.CalledProcessError:
            continue
    cluster.restart()


def _waiting_in_commit(cluster: _ThrowawayCluster, dbname: str, timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with psycopg.connect(cluster.admin_dsn, autocommit=True) as conn:
            found = conn.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = %s AND wait_event = 'SyncRep'",
                (dbname,),
            ).fetchone()
        if found and found[0]:
            return
        time.sleep(0.05)
    raise AssertionError("no save waited in COMMIT")


@pytest.mark.parametrize("how", ["async", "sync"])
async def test_a_save_whose_server_dies_during_commit_is_read_back_and_done_once_in_bounded_time(
    stalled_cluster: _ThrowawayCluster, how: str
) -> None:
    dbname = f"kuralle_commit_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(stalled_cluster.admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    url = stalled_cluster.admin_dsn.rsplit("/", 1)[0] + f"/{dbname}"
    with RunStore.from_url(url) as store:
        run = stored_run(store)
        store.keys.key_for(run.data_subject)  # made before commits stall: the save is tested
        head = store.recorder.max_notification_id() or 0
        _stall_commits(stalled_cluster, True)
        changed = with_message(run, "in doubt")
        saving = asyncio.ensure_future(
            store.save_run_async(changed)
            if how == "async"  # from the loop, or from sync code on a thread
            else asyncio.to_thread(store.save_run, changed)
        )
        await asyncio.to_thread(_waiting_in_commit, stalled_cluster, dbname)
        os.kill(stalled_cluster.postmaster_pid(), signal.SIGKILL)  # the server dies in COMMIT
        killed = time.monotonic()
        await asyncio.to_thread(_restart, stalled_cluster)
        await asyncio.wait_for(saving, pg_async.SAVE_DEADLINE)  # no hang: done or failed
        took = time.monotonic() - killed
        saver: Any = store.partitions[0]._saver
        assert saver.in_doubt >= (1 if how == "async" else 0), "the save was not in doubt"
        loaded = store.load(run.run_id)
        assert loaded is not None
        assert [m["content"] for m in loaded.messages] == ["in doubt"]
        events = store.recorder.select_notifications(
            start=head, limit=100, inclusive_of_start=False
        )
        assert len(events) == 1, "the save in doubt was written twice"
    assert took < pg_async.SAVE_DEADLINE


async def test_a_save_whose_server_never_comes_back_fails_as_unavailable_in_bounded_time(
    stalled_cluster: _ThrowawayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg_async, "SAVE_DEADLINE", 3.0)
    url = stalled_cluster.admin_dsn
    with RunStore.from_url(url) as store:
        run = stored_run(store)
        store.keys.key_for(run.data_subject)  # made before commits stall: the save is tested
        _stall_commits(stalled_cluster, True)
        saving = asyncio.ensure_future(store.save_run_async(with_message(run, "lost")))
        await asyncio.to_thread(_waiting_in_commit, stalled_cluster, "postgres")
        os.kill(stalled_cluster.postmaster_pid(), signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="cannot reach"):
            await asyncio.wait_for(saving, 30)
        assert time.monotonic() - started < 10


def _kill_server(cluster: _ThrowawayCluster) -> None:
    """SIGKILL the cluster's postmaster, then wait until its other processes have
    exited too: until a backend notices its postmaster died, a connection a pool
    already holds may still answer a statement (CI saw a key made that way), so
    the server is gone only once they are."""
    with psycopg.connect(cluster.admin_dsn, autocommit=True) as conn:
        pids = [row[0] for row in conn.execute("SELECT pid FROM pg_stat_activity")]
    os.kill(cluster.postmaster_pid(), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids):
        assert time.monotonic() < deadline, "the cluster's backends outlived their postmaster"
        time.sleep(0.01)


def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs (an exited one not yet reaped does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_a_key_table_whose_server_is_gone_fails_as_unavailable_in_bounded_time(
    stalled_cluster: _ThrowawayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subject's first payload needs its key from the key table: with the server
    away that read is tried again, then fails as ``StoreUnavailableError``
    naming the key table, not with a driver's traceback (docs/high-availability.md)."""
    monkeypatch.setattr(subject_keys, "SAVE_DEADLINE", 2.0)
    with RunStore.from_url(stalled_cluster.admin_dsn) as store:
        stored_run(store, "s-known")
        _kill_server(stalled_cluster)
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="cannot reach the subjects' key table"):
            store.keys.key_for("s-new")  # a subject this process has no key of
        assert time.monotonic() - started < 10


# ------------------------------------------------------------- the HA pair
@pytest.fixture(scope="session")
def ha_pair() -> Iterator[ha_kit.HaPair]:
    """A primary and a synchronous standby under Patroni, for the session."""
    why = ha_kit.missing()
    if why is not None:
        _no_package(why)
    pair = ha_kit.HaPair()
    try:
        pair.start()
    except (OSError, RuntimeError) as e:
        pair.stop()
        _no_package(f"could not start the Patroni pair: {e}")
    try:
        yield pair
    finally:
        pair.stop()


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


async def _orphan(url: str, ledger: Path) -> str:
    """A run whose process "dies" in its first tool (lease 1 s): an orphan."""
    with RunStore.from_url(url) as store:
        runtime = Runtime(
            [three_steps.make_agent(ledger, crash_first=True)], store=store, holder="doomed",
            lease_ttl=1.0,
        )  # fmt: skip
        handle = runtime.run("orphan", kind="flow", flow_name="three")
        with contextlib.suppress(Crash):
            await handle.result()
        return await handle.run_id


def _wait_finished(url: str, run_id: str, sweeper: subprocess.Popen[str]) -> None:
    end = time.monotonic() + 60
    with RunStore.from_url(url) as store:
        while True:
            run = store.load(run_id)
            if run is not None and run.status == "finished":
                return
            assert sweeper.poll() is None, "the worker stopped"
            assert time.monotonic() < end, "the sweeper did not recover the orphan"
            time.sleep(0.2)


class Follower:
    """``follow`` and a ``Consumer`` on a thread of their own from the first event,
    across the failover."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.finished: set[str] = set()
        #: The runs a ``Consumer`` (its position kept in the database) saw finish.
        self.consumed: set[str] = set()
        self.positions: list[tuple[int, int]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    async def _stopped(self) -> None:
        while not self.stop.is_set():  # noqa: ASYNC110 - a threading.Event, set by the test
            await asyncio.sleep(0.1)

    def _run(self) -> None:
        async def read(store: RunStore) -> None:
            async for event in follow(store):
                self.positions.append((event.partition, event.position))
                if isinstance(event, RunFinished):
                    self.finished.add(event.run_id)

        def consume(event: Any) -> None:
            if isinstance(event, RunFinished):
                self.consumed.add(event.run_id)

        async def go() -> None:
            with RunStore.from_url(self.url) as store:
                consumer = Consumer(store, "audit", consume)
                reading = asyncio.ensure_future(read(store))
                consuming = asyncio.ensure_future(consumer.run())
                # Polled, not waited for on an executor thread: a test that fails
                # before it sets ``stop`` must not leave a thread that keeps the
                # interpreter from exiting.
                stopped = asyncio.ensure_future(self._stopped())
                await asyncio.wait(
                    {reading, consuming, stopped}, return_when=asyncio.FIRST_COMPLETED
                )
                for task in (reading, consuming):
                    if task.done():
                        task.result()  # what stopped it
                consumer.stop()
                await consuming
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading

        try:
            asyncio.run(go())
        except BaseException as e:
            self.error = e


def test_a_failover_mid_way_through_100_runs_finishes_them_all_and_loses_no_acknowledged_step(
    ha_pair: ha_kit.HaPair, tmp_path: Path
) -> None:
    dbname = f"kuralle_failover_{uuid.uuid4().hex[:8]}"
    ha_pair.create_database(dbname)
    url = ha_pair.url(dbname)
    RunStore.from_url(url).close()  # the tables, before the worker and the follower
    ledger, acks = tmp_path / "ledger.jsonl", tmp_path / "acks.jsonl"
    follower = Follower(url)
    follower.thread.start()
    sweeper_log = tmp_path / "sweeper.log"
    sweeper = subprocess.Popen(  # the worker of the CLI: its sweeper recovers orphans
        [sys.executable, "-m", "kuralle_es.cli", "worker", "--store", url,
         "--app", "three_steps:build_agents", "--interval", "0.5", "--holder", "sweeper"],
        cwd=WORKER.parent, env={**os.environ, "KT_LEDGER": str(tmp_path / "ledger.jsonl")},
        stdout=subprocess.DEVNULL, stderr=sweeper_log.open("w"), text=True,
    )  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), url, str(ledger), str(acks), "100", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        end = time.monotonic() + 60
        while len(_lines(acks)) < 30:
            assert worker.poll() is None, worker.communicate()
            assert time.monotonic() < end, "the worker did not get a third of the way"
            time.sleep(0.05)
        while "worker started" not in sweeper_log.read_text():  # up before the kill
            assert sweeper.poll() is None, sweeper_log.read_text()
            assert time.monotonic() < end, "the worker did not start"
            time.sleep(0.05)
        old = ha_pair.primary()
        assert old is not None
        killed_at = time.time()
        ha_pair.kill_postmaster(old)
        new = ha_pair.wait_primary(60, not_=old)
        promoted_at = time.time()
        out, err = worker.communicate(timeout=150)
        # An orphan made after the failover: the sweeper, up since before it, recovers it.
        orphan = asyncio.run(_orphan(url, ledger))
        _wait_finished(url, orphan, sweeper)
    finally:
        if worker.poll() is None:
            worker.kill()
        sweeper.send_signal(signal.SIGTERM)  # a clean stop
        sweeper.wait(timeout=60)
    log = sweeper_log.read_text()
    assert sweeper.returncode == 0, log[-3000:]
    assert f"run recovered run={orphan} status=finished holder=sweeper" in log
    assert worker.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["finished"] == 100, summary

    acked = _lines(acks)
    executions = _lines(ledger)
    # Every run finished on the new primary, each with its three steps.
    with RunStore.from_url(url) as store:
        runtime = Runtime([], store=store)
        for ack in acked:
            run = store.load(ack["run_id"])
            assert run is not None and run.status == "finished", ack
            steps = asyncio.run(runtime.get_steps(ack["run_id"], run.session_id))
            assert [s.status for s in steps if s.kind == "tool"] == ["finished"] * 3, ack
        views = asyncio.run(runtime.views.list_runs(status="finished", limit=1000))
        assert len(views) == 101  # the orphan too
    assert len({a["run_id"] for a in acked}) == 100
    before_kill = [a for a in acked if a["at"] < killed_at]
    assert len(before_kill) >= 30  # each was checked above: none of their steps is missing

    # No tool key executed twice, except the retries of steps in doubt at the kill.
    by_key: dict[str, list[float]] = {}
    for entry in executions:
        by_key.setdefault(entry["key"], []).append(entry["at"])
    assert len(by_key) == 303  # the orphan's three too
    again = {key: ats for key, ats in by_key.items() if len(ats) > 1}
    for key, ats in again.items():
        assert min(ats) < promoted_at, f"{key} executed twice, its first not in doubt: {ats}"
    assert len(again) <= 8, again  # at most one step in flight a run at once

    # The follower and the consumer, started before the kill, went on by themselves.
    end = time.monotonic() + 30
    while min(len(follower.finished), len(follower.consumed)) < 101 and follower.error is None:
        assert time.monotonic() < end, (len(follower.finished), len(follower.consumed))
        time.sleep(0.1)
    follower.stop.set()
    follower.thread.join(10)
    assert follower.error is None, follower.error
    assert len(follower.finished) == 101
    assert len(follower.consumed) == 101
    assert len(follower.positions) == len(set(follower.positions)), "an event came twice"
    print(
        f"failover {old} -> {new}: promoted {promoted_at - killed_at:.1f} s after the kill; "
        f"turns cut short {summary['failed_turns']} {summary['errors']}; "
        f"in-doubt retries {len(again)}"
    )
