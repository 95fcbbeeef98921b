"""Shared fixtures: a real PostgreSQL server, and one store factory per backend.

PostgreSQL comes from ``KURALLE_TEST_POSTGRES_DSN`` (an admin connection,
default ``postgresql://postgres@127.0.0.1:5432/postgres``). If nothing answers
there and ``initdb``/``pg_ctl`` are installed, a throwaway cluster is started
on a free loopback port for the session. With neither, the postgres tests are
skipped, unless ``KURALLE_REQUIRE_POSTGRES=1`` (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import faulthandler
import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote
from uuid import uuid4

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from kuralle_es import RunStore
from kuralle_es.testing import CrashingStore

#: Seconds the interpreter may take to exit once the suite has finished.
EXIT_GRACE = 120


def pytest_unconfigure(config: pytest.Config) -> None:
    """A finished suite must end. Python joins non-daemon threads and the worker
    threads of ``asyncio.to_thread`` at exit, so one left blocked (a test's, or
    the library's) would keep the process, and CI, waiting forever: name the
    threads still alive now, and if the process has not exited ``EXIT_GRACE``
    seconds later, print every thread's stack and exit with a failure."""
    alive = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if alive:
        names = ", ".join(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in alive)
        print(f"\nthreads alive after the suite: {names}", file=sys.stderr)
    faulthandler.dump_traceback_later(EXIT_GRACE, exit=True)


ADMIN_DSN_ENV = "KURALLE_TEST_POSTGRES_DSN"
REQUIRE_ENV = "KURALLE_REQUIRE_POSTGRES"
DEFAULT_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
#: ``1``: every ``pg_dsn`` reaches its database through the session's PgBouncer in
#: transaction mode, and every store (this process's, and those of the processes
#: the tests start) says so by ``KURALLE_POSTGRES_POOLER`` (``make test-pgbouncer``).
PGBOUNCER_ENV = "KURALLE_TEST_PGBOUNCER"
THROUGH_PGBOUNCER = os.environ.get(PGBOUNCER_ENV) == "1"
POOLER_VAR = "KURALLE_POSTGRES_POOLER"


def stripped(name: str, prefixes: tuple[str, ...] | str) -> bool:
    """Whether a test leaves the variable ``name`` (one of ``prefixes``) out of the
    environment of a process it starts: never the session's pooler, which every
    process must inherit under ``KURALLE_TEST_PGBOUNCER=1``."""
    return name.startswith(prefixes) and name != POOLER_VAR


def pytest_configure(config: pytest.Config) -> None:
    """Through PgBouncer, the stores' default pooler is set for the whole session,
    before any test (or process a test starts) opens a store."""
    config.addinivalue_line(
        "markers",
        "direct_only(reason): needs the server itself, not a transaction pooler: "
        f"skipped under {PGBOUNCER_ENV}=1",
    )
    if THROUGH_PGBOUNCER:
        os.environ[POOLER_VAR] = "transaction"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``KURALLE_TEST_PGBOUNCER=1``: skip the tests marked ``direct_only`` (with
    their reason), and the direct variant of a test that also has a PgBouncer one
    (its ``pgbouncer`` variant runs through PgBouncer already; the other would be
    the same test twice)."""
    if not THROUGH_PGBOUNCER:
        return
    twice = pytest.mark.skip(
        reason=f"{PGBOUNCER_ENV}=1: the same test's pgbouncer variant runs through PgBouncer"
    )
    for item in items:
        marker = item.get_closest_marker("direct_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else marker.kwargs.get("reason", "")
            item.add_marker(pytest.mark.skip(reason=f"{PGBOUNCER_ENV}=1: {reason}"))
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("routed_pg_dsn") == "direct":
            item.add_marker(twice)
        elif params.get("backend") == "postgres":
            sibling = item.nodeid.replace("[postgres", "[pgbouncer", 1)
            if sibling != item.nodeid and any(other.nodeid == sibling for other in items):
                item.add_marker(twice)


# --------------------------------------------------------------- postgres
def _answers(dsn: str) -> str | None:
    """None if the server at ``dsn`` answers a query, else why not."""
    try:
        with psycopg.connect(dsn, connect_timeout=3, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as e:
        return f"{type(e).__name__}: {e}".strip()
    return None


def dsn_for(admin_dsn: str, dbname: str) -> str:
    """A ``postgresql://user[:pw]@host:port/dbname`` DSN on the admin DSN's server."""
    params: dict[str, Any] = conninfo_to_dict(admin_dsn)
    user = quote(str(params.get("user") or "postgres"), safe="")
    password = params.get("password")
    auth = f"{user}:{quote(str(password), safe='')}" if password else user
    host = str(params.get("host") or "127.0.0.1")
    port = str(params.get("port") or 5432)
    return f"postgresql://{auth}@{host}:{port}/{dbname}"


def _pg_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    return candidates[0] if candidates else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _ThrowawayCluster:
    """A private PostgreSQL cluster in a temp dir, trust auth, loopback only."""

    def __init__(self, initdb: str, pg_ctl: str, options: str = "") -> None:
        self.initdb = initdb
        self.pg_ctl = pg_ctl
        #: More ``postgres -c`` options for the server.
        self.options = options
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kuralle-pg-"))
        self.data = self.dir / "data"
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            # PostgreSQL refuses to run as root: run it as an unprivileged user.
            user = _unprivileged_user()
            entry = pwd.getpwnam(user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
            self.prefix = ["runuser", "-u", user, "--"]

    @property
    def admin_dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        subprocess.run(
            [*self.prefix, *args], check=True, capture_output=True, text=True, timeout=120
        )

    def start(self) -> None:
        self._run(
            self.initdb, "-D", str(self.data), "--auth=trust", "--username=postgres",
            "--encoding=UTF8", "--no-sync",
        )  # fmt: skip
        self.restart()

    def restart(self) -> None:
        """Start the server on its data (again, after it was killed)."""
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir} "
            f"-c fsync=off -c synchronous_commit=off -c max_connections=200 {self.options}"
        )
        self._run(
            self.pg_ctl, "-D", str(self.data), "-l", str(self.dir / "server.log"),
            "-w", "-t", "60", "-o", options, "start",
        )  # fmt: skip

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run(self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


def _unprivileged_user() -> str:
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    msg = "running as root and no 'postgres' or 'nobody' user to run PostgreSQL as"
    raise RuntimeError(msg)


@contextlib.contextmanager
def _throwaway_cluster(reasons: list[str]) -> Iterator[str | None]:
    """A throwaway cluster's admin DSN while the block runs, or None (and why not,
    appended to ``reasons``)."""
    initdb, pg_ctl = _pg_binary("initdb"), _pg_binary("pg_ctl")
    if not (initdb and pg_ctl):
        reasons.append("initdb/pg_ctl not found on PATH or in /usr/lib/postgresql/*/bin")
        yield None
        return
    cluster = _ThrowawayCluster(initdb, pg_ctl)
    try:
        cluster.start()
        why = _answers(cluster.admin_dsn)
        if why is not None:
            reasons.append(f"throwaway cluster did not answer ({why})")
    except (subprocess.SubprocessError, OSError, RuntimeError) as e:
        why = "no start"
        reasons.append(f"could not start a throwaway cluster: {getattr(e, 'stderr', None) or e}")
    try:
        yield cluster.admin_dsn if why is None else None
    finally:
        cluster.stop()


def _no_server(message: str) -> None:
    """Skip, or fail under ``KURALLE_REQUIRE_POSTGRES=1`` (CI)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 and {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def postgres_admin_dsn() -> Iterator[str]:
    """An admin DSN of a live PostgreSQL server (skip, or fail in CI, without one)."""
    admin = os.environ.get(ADMIN_DSN_ENV) or DEFAULT_ADMIN_DSN
    why = _answers(admin)
    if why is None:
        yield admin
        return
    reasons = [f"{admin} did not answer ({why})"]
    with _throwaway_cluster(reasons) as started:
        if started is not None:
            yield started
            return
    _no_server(
        "no PostgreSQL server for the postgres tests: " + "; ".join(reasons) + ". "
        f"Set {ADMIN_DSN_ENV} to an admin DSN of a running server, or install PostgreSQL."
    )


@pytest.fixture(scope="session")
def second_postgres_admin_dsn(postgres_admin_dsn: str) -> Iterator[str]:
    """An admin DSN of a second PostgreSQL server, a throwaway cluster of this
    session's (for stores sharded over two servers); fails in CI without one."""
    reasons: list[str] = []
    with _throwaway_cluster(reasons) as started:
        if started is not None:
            yield started
            return
    _no_server("no second PostgreSQL server for the sharding tests: " + "; ".join(reasons))


def _fresh_database(admin_dsn: str) -> Iterator[str]:
    """A fresh, uniquely named database on the admin DSN's server; dropped
    (connections and all) afterwards."""
    name = f"kuralle_test_{uuid4().hex[:16]}"
    with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield dsn_for(admin_dsn, name)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def second_pg_dsn(second_postgres_admin_dsn: str) -> Iterator[str]:
    """A fresh database on the second server."""
    yield from _fresh_database(second_postgres_admin_dsn)


@pytest.fixture
def pg_dsn(postgres_admin_dsn: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, uniquely named database; dropped (connections and all) afterwards.
    Under ``KURALLE_TEST_PGBOUNCER=1``, a plain libpq URL of it through the
    session's PgBouncer (made and dropped on the server directly)."""
    for dsn in _fresh_database(postgres_admin_dsn):
        if THROUGH_PGBOUNCER:
            yield request.getfixturevalue("pgbouncer").dsn(dsn)
        else:
            yield dsn


@pytest.fixture
def pg_server_dsn(pg_dsn: str, postgres_admin_dsn: str) -> str:
    """``pg_dsn``'s database on the server itself, whatever route ``pg_dsn`` takes: for
    what only a server session can do (a LISTEN of the test's own, a session pooler)."""
    return dsn_for(postgres_admin_dsn, str(conninfo_to_dict(pg_dsn)["dbname"]))


# -------------------------------------------------------------- pgbouncer
PGBOUNCER = "/usr/sbin/pgbouncer"


class PgBouncer:
    """Debian's PgBouncer in transaction mode on a free loopback port, in front of
    the server of ``admin_dsn`` (every database, trust auth): at most
    ``pool_size`` server connections per database, whatever its clients hold."""

    def __init__(self, admin_dsn: str, pool_size: int = 10) -> None:
        params = conninfo_to_dict(admin_dsn)
        self.server = (str(params.get("host") or "127.0.0.1"), str(params.get("port") or 5432))
        self.user = str(params.get("user") or "postgres")
        self.pool_size = pool_size
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kuralle-pgbouncer-"))
        self.process: subprocess.Popen[bytes] | None = None

    def dsn(self, dsn: str) -> str:
        """``dsn``'s database through PgBouncer, as a plain libpq URL."""
        dbname = conninfo_to_dict(dsn)["dbname"]
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{dbname}"

    def url(self, dsn: str) -> str:
        """``dsn``'s database through PgBouncer, as a store URL (``?pooler=transaction``)."""
        return f"{self.dsn(dsn)}?pooler=transaction"

    def start(self) -> None:
        host, port = self.server
        (self.dir / "users.txt").write_text(f'"{self.user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={host} port={port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.dir / 'users.txt'}\n"
            "pool_mode = transaction\nserver_reset_query =\n"
            f"default_pool_size = {self.pool_size}\nmax_db_connections = {self.pool_size}\n"
            "min_pool_size = 0\nreserve_pool_size = 0\nmax_client_conn = 2000\n"
            "ignore_startup_parameters = extra_float_digits\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        prefix: list[str] = []
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            user = _unprivileged_user()
            entry = pwd.getpwnam(user)
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
            prefix = ["runuser", "-u", user, "--"]
        self.process = subprocess.Popen(
            [*prefix, PGBOUNCER, str(self.dir / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        probe = f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres"
        for _ in range(100):
            if _answers(probe) is None:
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"PgBouncer did not answer on port {self.port}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
            if self.process.poll() is None:
                self.process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _no_package(message: str) -> None:
    """Skip, or fail under CI=true, where ``make test`` installed the package (and
    under ``KURALLE_TEST_PGBOUNCER=1``, whose every PostgreSQL test needs it)."""
    if os.environ.get("CI") == "true" or THROUGH_PGBOUNCER:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def pgbouncer(postgres_admin_dsn: str) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode in front of the test server, for the session
    (``make pgbouncer`` installs it; skipped without it, failed under CI=true)."""
    if not os.access(PGBOUNCER, os.X_OK):
        _no_package(f"no {PGBOUNCER}: run `make pgbouncer` (Debian's package pgbouncer)")
    bouncer = PgBouncer(postgres_admin_dsn)
    try:
        bouncer.start()
    except (OSError, RuntimeError) as e:
        _no_package(f"could not start PgBouncer: {e}")
    try:
        yield bouncer
    finally:
        bouncer.stop()


#: A ``pg_dsn`` route: straight to the server, or through PgBouncer.
ROUTES = ["direct", pytest.param("pgbouncer", marks=pytest.mark.pgbouncer)]


@pytest.fixture(params=ROUTES)
def routed_pg_dsn(request: pytest.FixtureRequest, postgres_admin_dsn: str) -> Iterator[str]:
    """A fresh database, as a store URL straight to the server or through PgBouncer in
    transaction mode: a module whose tests run both ways defines
    ``pg_dsn`` as this."""
    for dsn in _fresh_database(postgres_admin_dsn):
        if request.param == "direct":
            yield dsn
        else:
            yield request.getfixturevalue("pgbouncer").url(dsn)


# ----------------------------------------------------------------- stores
class StoreFactory:
    """Zero-arg callable: a NEW ``RunStore`` over the same database on each call.

    ``memory`` is the exception: a POPO store cannot be shared, so every call
    returns the one store instance. ``target`` is the SQLite path or the
    PostgreSQL DSN (None for memory), for handing the database to another process.
    """

    def __init__(self, backend: str, target: str | None) -> None:
        self.backend = backend
        self.target = target
        self.stores: list[RunStore] = []

    def __call__(self) -> RunStore:
        if self.backend == "memory":
            if not self.stores:
                self.stores.append(RunStore.memory())
            return self.stores[0]
        assert self.target is not None
        if self.backend == "sqlite":
            store = RunStore.sqlite(self.target)
        else:
            store = RunStore.postgres(self.target)
        self.stores.append(store)
        return store

    def crashing(self) -> CrashingStore:
        """A store over the same database whose saves die where its plan says (the
        testing kit's ``CrashingStore``). Memory has one store: call this first."""
        if self.backend == "memory":
            assert not self.stores, "call crashing() before the first open_store()"
            crashing = CrashingStore.memory()
        else:
            assert self.target is not None
            sqlite = self.backend == "sqlite"
            crashing = (
                CrashingStore.sqlite(self.target) if sqlite else CrashingStore.postgres(self.target)
            )
        self.stores.append(crashing)
        return crashing

    def close_all(self) -> None:
        for store in self.stores:
            with contextlib.suppress(Exception):
                store.close()
        self.stores.clear()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store URL another process can open: a SQLite file, or a fresh PostgreSQL
    database (the tests that run ``kuralle-es`` or a server in a subprocess)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'runs.db'}"
    return str(request.getfixturevalue("pg_dsn"))


BACKENDS = ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
#: ``BACKENDS`` and PostgreSQL through PgBouncer in transaction mode: a module whose
#: tests run that way too defines its ``backend`` fixture over these.
BACKENDS_AND_PGBOUNCER = [
    *BACKENDS,
    pytest.param("pgbouncer", marks=[pytest.mark.postgres, pytest.mark.pgbouncer]),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_store(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[StoreFactory]:
    if backend == "memory":
        target = None
    elif backend == "sqlite":
        target = str(tmp_path / "runs.db")
    elif backend == "pgbouncer":
        target = request.getfixturevalue("pgbouncer").url(request.getfixturevalue("pg_dsn"))
    else:
        target = request.getfixturevalue("pg_dsn")
    factory = StoreFactory("postgres" if backend == "pgbouncer" else backend, target)
    try:
        yield factory
    finally:
        factory.close_all()
