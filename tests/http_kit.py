"""A real ``kuralle-es serve`` process for the HTTP API tests, and a small client for it.

The server is the installed command in its own process (``--app
http_app:build_agents`` from ``tests/procs``) on a free loopback port, over
the store URL a test gives; the client is ``urllib`` (real HTTP, nothing
in-process). ``StoreHead`` reads the store's notification log from the test
process, to show that a refused request wrote nothing; ``Served`` is a server with
it, and its checks (a 200, a refusal that wrote nothing, a retry that wrote nothing).
``module_store_url`` is a fresh database (SQLite, PostgreSQL) for a module's server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import psycopg
import pytest
from conftest import stripped
from psycopg import sql

from kuralle_es import RunStore

PROCS = Path(__file__).resolve().parent / "procs"
SCRIPT = Path(sys.executable).parent / "kuralle-es"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "kuralle_es.cli"]
APP = "http_app:build_agents"
TOKEN = "test-api-token-0123456789"
ERROR_KEYS = {"error", "message", "fields"}
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without the store, app and token variables of the caller's shell."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not stripped(k, ("PERSISTENCE_", "SQLITE_", "POSTGRES_", "KURALLE_", "HTTP_"))
        and k not in ("OPENAI_API_KEY", "REFUND_LEDGER")
    }
    env["KURALLE_MODEL"] = "scripted"
    return {**env, **extra}


@dataclass
class Reply:
    """One HTTP answer: status, headers, and the body as JSON (None if it is not JSON)."""

    status: int
    headers: dict[str, str]
    body: Any
    raw: bytes

    def is_refusal(self, status: int, error: str | None = None) -> bool:
        """A JSON error of the contract's shape with this status (and error class)."""
        return (
            self.status == status
            and isinstance(self.body, dict)
            and set(self.body) == ERROR_KEYS
            and isinstance(self.body["message"], str)
            and isinstance(self.body["fields"], dict)
            and (error is None or self.body["error"] == error)
            and self.headers.get("content-type", "").startswith("application/json")
        )


def call(
    base: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    token: str | None = TOKEN,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 60,
) -> Reply:
    """``method path`` with ``body`` as JSON (or ``raw`` bytes), the bearer ``token`` if any."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    sent = {"Content-Type": "application/json"} if data is not None else {}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    sent.update(headers or {})
    request = urllib.request.Request(base + path, data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, answer, content = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        status, answer, content = e.code, dict(e.headers), e.read()
    try:
        parsed = json.loads(content) if content else None
    except ValueError:
        parsed = None
    return Reply(status, {k.lower(): v for k, v in answer.items()}, parsed, content)


@dataclass
class Server:
    """A running ``kuralle-es serve``; ``call`` sends it a request."""

    process: subprocess.Popen[bytes]
    base: str
    log: Path
    token: str | None
    stopped: bool = field(default=False)

    def call(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Reply:
        kwargs.setdefault("token", self.token)
        return call(self.base, method, path, body, **kwargs)

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no close; what a crashed host looks like."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        self.stopped = True

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)


def start_server(
    store_url: str,
    workdir: Path,
    *,
    token: str | None = TOKEN,
    name: str = "server",
    args: tuple[str, ...] = (),
    app: str = APP,
    **env: str,
) -> Server:
    """``kuralle-es serve`` over ``store_url``, ready to answer (its output in ``workdir``);
    ``app`` is importable from ``tests/procs``."""
    port = free_port()
    extra = dict(env)
    if token is not None:
        extra["KURALLE_API_TOKEN"] = token
    log = workdir / f"{name}-{port}.log"
    command = [*COMMAND, "serve", "--app", app, "--store", store_url, "--port", str(port), *args]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=PROCS, env=clean_env(**extra), stdout=out, stderr=subprocess.STDOUT
        )
    server = Server(process, f"http://127.0.0.1:{port}", log, token)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve exited {process.returncode}:\n{server.output()}")
        with contextlib.suppress(OSError):
            if server.call("GET", "/openapi.json", timeout=5).status in (200, 401):
                return server
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"serve did not answer within 60 s:\n{server.output()}")


class StoreHead:
    """The store's notification log seen from the test process: its last event's id."""

    def __init__(self, store_url: str) -> None:
        self.store = RunStore.from_url(store_url)

    def head(self) -> int:
        return int(self.store.recorder.max_notification_id() or 0)

    def close(self) -> None:
        self.store.close()


@pytest.fixture(scope="module", params=BACKENDS)
def module_store_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A fresh database for the module's server (``pg_dsn``'s pattern, at module scope)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('http-sqlite') / 'runs.db'}"
        return
    from conftest import dsn_for

    admin = str(request.getfixturevalue("postgres_admin_dsn"))
    name = f"kuralle_test_{uuid4().hex[:16]}"
    with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield dsn_for(admin, name)
    finally:
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@dataclass
class Served:
    server: Server
    log: StoreHead
    store_url: str
    workdir: Path
    env: dict[str, str]

    @property
    def ledger(self) -> Path:
        return Path(self.env["HTTP_LEDGER"])

    @property
    def refund_ledger(self) -> Path:
        return Path(self.env["REFUND_LEDGER"])

    def call(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Reply:
        return self.server.call(method, path, body, **kwargs)

    def ok(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        reply = self.call(method, path, body, **kwargs)
        assert reply.status == 200, (reply.status, reply.body)
        assert reply.headers["content-type"].startswith("application/json")
        return reply.body

    def refused(
        self, status: int, error: str | None, method: str, path: str, body: Any = None, **kw: Any
    ) -> Reply:
        """The request is refused with ``status`` (and ``error``), and the store is unchanged."""
        before = self.log.head()
        reply = self.call(method, path, body, **kw)
        assert reply.is_refusal(status, error), (method, path, reply.status, reply.body)
        assert self.log.head() == before, f"{method} {path} was refused but wrote to the store"
        return reply

    def unchanged(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        """A 200 that wrote nothing (a retry answered from the journal)."""
        before = self.log.head()
        answer = self.ok(method, path, body, **kw)
        assert self.log.head() == before, f"{method} {path} was a retry but wrote to the store"
        return answer

    def start(
        self, flow: str, session: str, input: str | None = None, key: str | None = None
    ) -> Any:
        headers = {"Idempotency-Key": key} if key else {}
        body = {"session_id": session, "flow": flow, "input": input}
        return self.ok("POST", "/api/runs", body, headers=headers)
