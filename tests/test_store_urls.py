"""Store URLs (docs/scaling.md, docs/cli.md): one address, read the same way everywhere.

``RunStore.from_url`` opens every kind of store; a multi-host PostgreSQL URL
reaches the host that is up from the store, the loop's saver, the follower
and the command line, with its libpq parameters on every connection; a store
whose every host is down is one line naming them all; ``pooler`` parses and
is validated; and a store URL's password is never printed: not by a parse
error, a mistyped ``KURALLE_STORE`` at ``worker`` or ``serve`` start, an
unreachable server, ``--json``, a start line or a store's ``repr``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from conftest import _free_port, stripped
from events_kit import everything, refund_run
from psycopg.conninfo import conninfo_to_dict

from kuralle_es import InvalidArgumentError, RunStore, Runtime, StoreUnavailableError
from kuralle_es.events import RunOpened, follow
from kuralle_es.examples import refund

SCRIPT = Path(sys.executable).parent / "kuralle-es"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "kuralle_es.cli"]
SECRET = "s3cret-Pa55"


@pytest.fixture(autouse=True)
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(refund.LEDGER_ENV, str(path))
    monkeypatch.delenv(refund.MODEL_ENV, raising=False)
    return path


def kuralle(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not stripped(k, ("PERSISTENCE_", "SQLITE_", "POSTGRES_", "KURALLE_"))
    }
    return subprocess.run(
        [*COMMAND, *args], capture_output=True, text=True, timeout=120,
        env={**clean, refund.MODEL_ENV: "scripted", **env},
    )  # fmt: skip


def where(dsn: str) -> tuple[str, str, str]:
    """Host, port and database of a test DSN."""
    params = conninfo_to_dict(dsn)
    return str(params["host"]), str(params["port"]), str(params["dbname"])


def multi_host(dsn: str, *, query: str = "target_session_attrs=read-write") -> str:
    """The DSN's database behind a first host that is down (nothing listens there)."""
    host, port, db = where(dsn)
    return f"postgresql://postgres@127.0.0.1:{_free_port()},{host}:{port}/{db}?{query}"


async def one_refund(store: RunStore) -> str:
    return await refund_run(Runtime([refund.build_agent()], store=store), "s1", approve=True)


# ------------------------------------------------------------------ every kind
async def test_from_url_opens_memory_relative_and_absolute_sqlite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for url, file in (
        ("memory:", None),
        ("sqlite:///relative.db", tmp_path / "relative.db"),
        (f"sqlite:///{tmp_path / 'absolute.db'}", tmp_path / "absolute.db"),
    ):
        with RunStore.from_url(url) as store:
            run_id = await one_refund(store)
            assert store.load(run_id) is not None
        if file is not None:
            assert file.exists()
            with RunStore.from_url(url) as again:
                assert again.load(run_id) is not None


@pytest.mark.postgres
async def test_from_url_opens_partitions_and_shards(pg_dsn: str, tmp_path: Path) -> None:
    shards = f"{pg_dsn},sqlite:///{tmp_path / 'shard.db'}"
    with RunStore.from_url(shards) as store:
        assert [log.partition for log in store.partitions] == [0, 1]
        run_id = await one_refund(store)
        assert store.partition_of(run_id) in (0, 1)
    with RunStore.from_url(f"{pg_dsn}?partitions=3") as store:
        assert [log.partition for log in store.partitions] == [0, 1, 2]


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("postgres://h/db?partitions=0", "whole number"),
        ("postgresql://h/", "database name"),
        ("mysql://h/db", "unknown store URL"),
        ("sqlite://x.db", "sqlite:///relative.db"),
        ("postgresql://h/db?pooler=statement", "'transaction' or 'session'"),
        ("postgresql://h/db?colour=blue", 'invalid URI query parameter: "colour"'),
    ],
)
def test_a_url_that_names_no_store_is_refused_before_anything_connects(
    url: str, words: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=words):
        RunStore.from_url(url)


# ------------------------------------------------------------------ multi-host
@pytest.mark.postgres
async def test_a_multi_host_url_reaches_the_host_that_is_up_from_store_follower_and_cli(
    pg_dsn: str,
) -> None:
    url = multi_host(pg_dsn)
    with RunStore.from_url(url) as store:
        run_id = await one_refund(store)
        stream = follow(store)
        try:
            first = await asyncio.wait_for(anext(stream), 10)
        finally:
            await stream.aclose()
        assert isinstance(first, RunOpened) and first.run_id == run_id
    with RunStore.postgres(url) as store:
        assert store.load(run_id) is not None
    listed = kuralle("--store", url, "runs", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [r["run_id"] for r in json.loads(listed.stdout)] == [run_id]


@pytest.mark.postgres
@pytest.mark.direct_only(
    "reads application_name off the server's connections: PgBouncer's own carry "
    "whichever client's name was last set on them"
)
async def test_every_connection_of_a_store_carries_the_urls_libpq_parameters(
    pg_dsn: str,
) -> None:
    """``application_name`` from the URL is on the pool's connections, the loop's
    saver's and the follower's listener: no connection is made without it."""
    _, _, db = where(pg_dsn)
    url = multi_host(pg_dsn, query="application_name=kuralle-probe")
    with RunStore.from_url(url) as store:
        await one_refund(store)  # saves from the loop: the saver's connection
        assert len(await everything(store)) > 0
        stream = follow(store)
        try:
            await asyncio.wait_for(anext(stream), 10)  # the listener's connection
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                names = [
                    row[0]
                    for row in conn.execute(
                        "SELECT application_name FROM pg_stat_activity "
                        "WHERE datname = %s AND pid <> pg_backend_pid()",
                        (db,),
                    )
                ]
        finally:
            await stream.aclose()
    assert len(names) >= 3, names
    assert set(names) == {"kuralle-probe"}, names


@pytest.mark.postgres
def test_a_libpq_parameter_the_servers_cannot_meet_refuses_the_store_naming_both_hosts(
    pg_dsn: str,
) -> None:
    url = multi_host(pg_dsn, query="target_session_attrs=standby")
    with pytest.raises(StoreUnavailableError, match=r"cannot reach PostgreSQL at 127\.0\.0\.1:"):
        RunStore.from_url(url)


def test_a_store_whose_every_host_is_down_is_one_line_naming_them_within_seconds() -> None:
    ports = [_free_port(), _free_port()]
    url = f"postgresql://postgres@127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}/kuralle_gone"
    started = time.monotonic()
    done = kuralle("--store", url, "runs", "list")
    # Seconds, not a connect timeout's minutes; the bound includes starting Python,
    # which takes seconds of its own on a loaded machine.
    assert time.monotonic() - started < 15
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert line.startswith(
        f"kuralle-es: cannot reach PostgreSQL at 127.0.0.1:{ports[0]}, 127.0.0.1:{ports[1]}, "
        "database 'kuralle_gone': "
    )


# --------------------------------------------------------------------- pooler
@pytest.mark.postgres
def test_a_pooler_is_parsed_validated_and_carried_to_every_log(pg_server_dsn: str) -> None:
    pg_dsn = pg_server_dsn  # a session pooler's store prepares statements: not through PgBouncer
    with RunStore.postgres(pg_dsn, partitions=2, pooler="transaction") as store:
        assert [log.address.pooler for log in store.partitions] == ["transaction"] * 2  # type: ignore[union-attr]
    with RunStore.from_url(f"{pg_dsn}?pooler=session") as store:
        assert store.partitions[0].address.pooler == "session"  # type: ignore[union-attr]
    with pytest.raises(InvalidArgumentError, match="'transaction' or 'session'"):
        RunStore.postgres(pg_dsn, pooler="statement")


POOLER_VAR = "KURALLE_POSTGRES_POOLER"


@pytest.mark.postgres
async def test_the_environment_s_pooler_is_the_default_of_every_postgres_store(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(POOLER_VAR, "transaction")
    with RunStore.postgres(pg_dsn) as store:
        assert store.partitions[0].address.pooler == "transaction"  # type: ignore[union-attr]
        await one_refund(store)  # and the store works
    with RunStore.from_url(pg_dsn) as store:
        assert store.partitions[0].address.pooled  # type: ignore[union-attr]
    sharded = f"{pg_dsn},sqlite:///{tmp_path / 'shard.db'}"
    with RunStore.from_url(sharded) as store:
        assert store.partitions[0].address.pooler == "transaction"  # type: ignore[union-attr]
    # A process the tests start inherits it: the worker's start line shows it.
    line, _ = await asyncio.to_thread(worker_start, pg_dsn)
    assert "worker started" in line and "pooler=transaction" in line, line


@pytest.mark.postgres
def test_a_pooler_the_url_or_the_call_names_wins_over_the_environment_s(
    pg_server_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pg_dsn = pg_server_dsn  # a session pooler's store prepares statements: not through PgBouncer
    monkeypatch.setenv(POOLER_VAR, "transaction")
    with RunStore.from_url(f"{pg_dsn}?pooler=session") as store:
        assert store.partitions[0].address.pooler == "session"  # type: ignore[union-attr]
    with RunStore.postgres(pg_dsn, pooler="session") as store:
        assert store.partitions[0].address.pooler == "session"  # type: ignore[union-attr]
    # A named pooler does not read the variable: a bad value there does not matter.
    monkeypatch.setenv(POOLER_VAR, "statement")
    with RunStore.postgres(f"{pg_dsn}?pooler=transaction") as store:
        assert store.partitions[0].address.pooled  # type: ignore[union-attr]
    with RunStore.postgres(pg_dsn, pooler="session") as store:
        assert not store.partitions[0].address.pooled  # type: ignore[union-attr]


def test_a_pooler_variable_we_do_not_know_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(POOLER_VAR, "statement")
    url = f"postgresql://postgres@127.0.0.1:{_free_port()}/db"  # never reached
    for open_store in (RunStore.from_url, RunStore.postgres):
        with pytest.raises(InvalidArgumentError) as refused:
            open_store(url)
        message = str(refused.value)
        assert "\n" not in message and POOLER_VAR in message and "'statement'" in message
        assert "'transaction' or 'session'" in message
    # SQLite and memory stores have no pooler: the variable is not theirs.
    RunStore.from_url("memory:").close()
    done = kuralle("runs", "list", "--store", url, **{POOLER_VAR: "statement"})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and POOLER_VAR in lines[0] and "'statement'" in lines[0], lines


# ------------------------------------------------------------------ passwords
@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://ann:{SECRET}@127.0.0.1/db?partitions=abc",
        f"postgresql://ann:{SECRET}@127.0.0.1/db?foo=1",
        f"postgresql://ann:{SECRET}@[::1/db",
        f"postgresq://ann:{SECRET}@127.0.0.1/db",
        f"postgresql://ann:{SECRET}@127.0.0.1/db,postgresql://ann:{SECRET}@127.0.0.1/db",
        f"postgresql://ann:{SECRET}@127.0.0.1:{_free_port()}/db",
    ],
    ids=["partitions", "unknown-parameter", "libpq-quotes-the-url", "scheme", "twice", "away"],
)
def test_a_store_url_error_never_prints_its_password(url: str) -> None:
    done = kuralle("--store", url, "runs", "list", "--json")
    assert done.returncode == 2, done.stderr
    assert SECRET not in done.stdout + done.stderr
    with pytest.raises((InvalidArgumentError, StoreUnavailableError)) as refused:
        RunStore.from_url(url)
    assert SECRET not in str(refused.value) and SECRET not in repr(refused.value)


def test_a_password_libpq_quotes_in_a_reason_is_scrubbed() -> None:
    with pytest.raises(InvalidArgumentError, match="percent-encoded") as refused:
        RunStore.from_url("postgresql://ann:s3%ZZcret@127.0.0.1/db")
    assert "ZZcret" not in str(refused.value)


@pytest.mark.parametrize("command", [["worker"], ["serve"]])
def test_a_mistyped_kuralle_store_at_start_never_prints_its_password(
    command: list[str],
) -> None:
    done = kuralle(*command, KURALLE_STORE=f"postgres://ann:{SECRET}@127.0.0.1/db?partition=2")
    assert done.returncode == 2
    assert SECRET not in done.stdout + done.stderr
    assert "postgres://ann:***@127.0.0.1/db?partition=2" in done.stderr


@pytest.mark.postgres
async def test_a_working_store_never_shows_its_password_in_json_start_lines_or_reprs(
    pg_dsn: str,
) -> None:
    host, port, db = where(pg_dsn)
    url = f"postgresql://postgres:{SECRET}@{host}:{port}/{db}"  # trust auth: unused
    with RunStore.from_url(url) as store:
        await one_refund(store)
        shown = [repr(store), *(repr(log) for log in store.partitions)]
        shown += [repr(log.address) for log in store.partitions]
    assert all(SECRET not in text for text in shown), shown
    assert "postgresql://postgres@" in shown[0]
    listed = kuralle("runs", "list", "--json", KURALLE_STORE=url)
    assert listed.returncode == 0, listed.stderr
    assert SECRET not in listed.stdout + listed.stderr
    line, rest = await asyncio.to_thread(worker_start, url)
    assert "worker started" in line and f"store=postgresql://postgres@{host}:{port}/{db}" in line
    assert SECRET not in line + rest


def worker_start(url: str) -> tuple[str, str]:
    """The start line of ``kuralle-es worker`` on ``url``, and what it said after it."""
    worker = subprocess.Popen(
        [*COMMAND, "worker", "--interval", "0.2"], stderr=subprocess.PIPE, text=True,
        env={**os.environ, "KURALLE_STORE": url},
    )  # fmt: skip
    try:
        assert worker.stderr is not None
        deadline, line = time.monotonic() + 60, ""
        while "worker started" not in line and time.monotonic() < deadline:
            line = worker.stderr.readline()
    finally:
        worker.terminate()
        _, rest = worker.communicate(timeout=60)
    return line, rest
