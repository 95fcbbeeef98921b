"""A store's connections do not grow with its partitions: counted on the server.

``benchmarks/connections.py`` drives 32 runs at once on a store of four
partitions, then runs ``kuralle-es runs list`` on it, while it samples
``pg_stat_activity``; the store may hold at most its ``pool_size`` (10)
connections at once, the read-only command at most two. Through PgBouncer in transaction mode, 64
worker coroutines in four processes (each process a store of its own, 10
connections to PgBouncer) share at most 10 server connections.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from events_kit import everything, refund_run, take

from kuralle_es import InvalidArgumentError, RunStore, Runtime
from kuralle_es._journal.stream_log import StoredPart
from kuralle_es.events import follow
from kuralle_es.examples import refund

pytestmark = pytest.mark.postgres

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "connections.py"
WORKER = Path(__file__).resolve().parent / "procs" / "three_steps.py"


@pytest.mark.direct_only(
    "counts the store's connections on the server: behind PgBouncer those are PgBouncer's"
)
def test_a_four_partition_store_under_32_runs_holds_at_most_10_connections(pg_dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--dsn", pg_dsn, "--seconds", "2", "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["runs_finished"] >= 32, counts
    assert 1 <= counts["store"] <= 10, counts
    assert 1 <= counts["runs_list"] <= 2, counts


def test_pool_size_is_a_whole_number_of_two_or_more(pg_dsn: str) -> None:
    with RunStore.from_url(f"{pg_dsn}?pool_size=3") as store:
        connections = store.partitions[0].connections
        assert connections is not None
        assert (connections.blocking_size, connections.loop_size) == (2, 1)
    for bad in (1, 0, "ten"):
        with pytest.raises(InvalidArgumentError, match="pool_size"):
            RunStore.postgres(pg_dsn, pool_size=bad)  # type: ignore[arg-type]


@pytest.mark.pgbouncer
def test_64_worker_coroutines_in_4_processes_share_at_most_10_server_connections_through_pgbouncer(
    pg_dsn: str, pg_server_dsn: str, pgbouncer: Any, tmp_path: Path
) -> None:
    url = pgbouncer.url(pg_dsn)
    RunStore.from_url(url).close()  # the tables, before the workers race to make them
    dbname = pg_dsn.rsplit("/", 1)[1]
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        with psycopg.connect(pg_server_dsn, autocommit=True) as conn:  # the server's view
            while not stop.is_set():
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (dbname,),
                ).fetchone()
                peak = max(peak, int(row[0]) if row else 0)
                time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ledger, acks = tmp_path / "ledger.jsonl", tmp_path / "acks.jsonl"
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), url, str(ledger), str(acks), "32", "16", f"p{n}-"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(4)
    ]
    try:
        outcomes = [worker.communicate(timeout=180) for worker in workers]
    finally:
        stop.set()
        sampler.join()
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    for worker, (out, err) in zip(workers, outcomes, strict=True):
        assert worker.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["finished"] == 32
    assert len(acks.read_text().splitlines()) == 128
    assert 1 <= peak <= 10, peak


def _listeners(pg_dsn: str) -> int:
    """Connections of ``pg_dsn``'s database that sent a LISTEN (the server's view)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'LISTEN%%'"
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.pgbouncer
@pytest.mark.parametrize("direct", [False, True])
async def test_behind_pgbouncer_a_follower_listens_only_on_a_direct_server(
    pg_dsn: str, pg_server_dsn: str, pgbouncer: Any, direct: bool
) -> None:
    """No LISTEN through PgBouncer (it would be lost with its server session): a
    follower polls, or listens on the direct server ``listen_host`` names."""
    url = pgbouncer.url(pg_dsn)
    if direct:
        params = psycopg.conninfo.conninfo_to_dict(pg_server_dsn)
        url += f"&listen_host={params['host']}&listen_port={params['port']}"
    with RunStore.from_url(url) as store:
        runtime = Runtime([refund.build_agent()], store=store)
        stream = follow(store)
        first = await refund_run(runtime, "before", approve=True)
        got = await take(stream, len(await everything(store)))
        assert {e.run_id for e in got} == {first}
        assert _listeners(pg_dsn) == (1 if direct else 0)
        second = await refund_run(runtime, "after", approve=True)  # woken, or by polling
        more = await take(stream, len(await everything(store)) - len(got))
        assert {e.run_id for e in more} == {second}
        await stream.aclose()


@pytest.mark.pgbouncer
@pytest.mark.parametrize("direct", [False, True])
async def test_behind_pgbouncer_a_stream_follower_listens_only_on_a_direct_server(
    pg_dsn: str, pg_server_dsn: str, pgbouncer: Any, direct: bool
) -> None:
    """A stored stream's follower (docs/streaming.md) of another store: no LISTEN
    through PgBouncer (it would hear nothing once its server connection served
    another client); it reads every ``POOLED_POLL``, or is woken from the direct server."""
    url = pgbouncer.url(pg_dsn)
    if direct:
        params = psycopg.conninfo.conninfo_to_dict(pg_server_dsn)
        url += f"&listen_host={params['host']}&listen_port={params['port']}"
    with RunStore.from_url(url) as writer, RunStore.from_url(url) as reader:
        ours, theirs = writer.stream_log(0), reader.stream_log(0)
        async with theirs.following("run-1") as follower:
            assert _listeners(pg_dsn) == (1 if direct else 0)
            for offset in (1, 2):
                ours.add(StoredPart("run-1", offset, "text-delta", 1, 1, '{"delta": "hi"}'))
                started, parts = time.monotonic(), []
                while len(parts) < offset and time.monotonic() - started < 5:
                    await theirs.wait(follower)
                    parts = await theirs.read("run-1", 0, 10)
                assert [p.offset for p in parts] == list(range(1, offset + 1))
                assert time.monotonic() - started < 0.8  # not the lost-wake-up poll (1 s)
