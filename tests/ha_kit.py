"""A high-availability PostgreSQL pair for the failover tests: Patroni over etcd.

Debian's ``patroni`` and ``etcd-server`` (installed by ``make ha``) run here
on loopback ports of their own: one etcd member, and two PostgreSQL 15 nodes,
each under its Patroni, a primary and a synchronous standby
(``synchronous_mode``: a commit returns once the standby has it). Patroni's
loop runs every second, and ``primary_start_timeout: 0`` makes a crashed
primary fail over to the standby at once instead of restarting: killing the
primary's postmaster is the failure the tests inject.

``HaPair.url(dbname)`` is a multi-host store URL over both nodes with
``target_session_attrs=read-write``: whichever is primary is the one used.
Both the tests and ``benchmarks/failover.py`` use this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
from conftest import _free_port, _unprivileged_user

PATRONI = "/usr/bin/patroni"
ETCD = "/usr/bin/etcd"
PG_BIN = "/usr/lib/postgresql/15/bin"


def missing() -> str | None:
    """Why the pair cannot be started here (None: it can)."""
    for path in (PATRONI, ETCD, f"{PG_BIN}/initdb"):
        if not os.access(path, os.X_OK):
            return f"no {path}: run `make ha` (Debian's patroni, etcd-server, postgresql-15)"
    return None


class HaPair:
    """etcd and two Patroni-managed PostgreSQL nodes in a temporary folder."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kuralle-ha-"))
        self.etcd_port, self.etcd_peer = _free_port(), _free_port()
        self.nodes = {
            name: {"pg": _free_port(), "api": _free_port()} for name in ("node1", "node2")
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.user = _unprivileged_user() if os.geteuid() == 0 else None

    # ------------------------------------------------------------ addresses
    def url(self, dbname: str, **query: str) -> str:
        """A store URL over both nodes that follows the primary."""
        hosts = ",".join(f"127.0.0.1:{n['pg']}" for n in self.nodes.values())
        params = {"target_session_attrs": "read-write", "connect_timeout": "2", **query}
        return f"postgresql://postgres@{hosts}/{dbname}?" + "&".join(
            f"{k}={v}" for k, v in params.items()
        )

    def dsn(self, name: str, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.nodes[name]['pg']}/{dbname}"

    # ---------------------------------------------------------------- start
    def start(self, timeout: float = 180.0) -> None:
        """etcd, then node1 until it is primary, then node2 until it is its
        synchronous standby. Each wait allows three minutes: on a machine busy
        with the rest of the suite, bootstrapping a node (initdb, a base backup)
        once took longer than one."""
        client, peer = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{self.etcd_peer}"
        etcd = [
            ETCD, "--name", "e1", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"e1={peer}",
        ]  # fmt: skip
        self._spawn("etcd", etcd, as_user=False)
        for name in self.nodes:
            self._write_config(name)
        self._spawn("node1", [PATRONI, str(self.dir / "node1.yml")])
        self.wait_primary(timeout)
        self._spawn("node2", [PATRONI, str(self.dir / "node2.yml")])
        self.wait_sync_standby(timeout)

    def _write_config(self, name: str) -> None:
        node = self.nodes[name]
        data = self.dir / name
        config = {
            "scope": f"kuralle-{self.etcd_port}",
            "name": name,
            "restapi": {
                "listen": f"127.0.0.1:{node['api']}",
                "connect_address": f"127.0.0.1:{node['api']}",
            },
            "etcd3": {"hosts": f"127.0.0.1:{self.etcd_port}"},
            "bootstrap": {
                "dcs": {
                    "ttl": 20,
                    "loop_wait": 1,
                    "retry_timeout": 5,
                    "primary_start_timeout": 0,
                    "synchronous_mode": True,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {
                            "wal_log_hints": "on",
                            "max_connections": 100,
                            "fsync": "off",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}, "no-sync"],
                "pg_hba": [
                    "local all all trust",
                    "host replication all 127.0.0.1/32 trust",
                    "host all all 127.0.0.1/32 trust",
                ],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node['pg']}",
                "connect_address": f"127.0.0.1:{node['pg']}",
                "data_dir": str(data),
                "bin_dir": PG_BIN,
                "pgpass": str(self.dir / f"{name}.pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                    "rewind": {"username": "postgres"},
                },
                "parameters": {"unix_socket_directories": str(self.dir)},
            },
            "log": {"level": "INFO"},
        }
        # JSON is YAML: Patroni reads it as its configuration file.
        (self.dir / f"{name}.yml").write_text(json.dumps(config))

    def _spawn(self, name: str, command: list[str], *, as_user: bool = True) -> None:
        prefix: list[str] = []
        if as_user and self.user is not None:
            entry = pwd.getpwnam(self.user)
            for path in [self.dir, *self.dir.iterdir()]:
                if not path.name.startswith("etcd"):
                    os.chown(path, entry.pw_uid, entry.pw_gid)
            prefix = ["runuser", "-u", self.user, "--"]
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - the process keeps it
        self.processes[name] = subprocess.Popen(
            [*prefix, *command], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    # --------------------------------------------------------------- status
    def status(self, name: str) -> dict[str, Any] | None:
        """Patroni's REST answer for ``name`` (None: no answer)."""
        url = f"http://127.0.0.1:{self.nodes[name]['api']}/patroni"
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                found: dict[str, Any] = json.loads(answer.read())
                return found
        except (OSError, ValueError) as e:
            body = getattr(e, "read", None)
            if body is not None:  # 503 for a replica still carries its status
                with contextlib.suppress(OSError, ValueError):
                    found = json.loads(body())
                    return found
            return None

    def primary(self) -> str | None:
        """The node that is a running primary now, if one is."""
        for name in self.nodes:
            found = self.status(name)
            if (
                found
                and found.get("role") in ("master", "primary")
                and found.get("state") == "running"
            ):
                return name
        return None

    def wait_primary(self, timeout: float = 60.0, *, not_: str | None = None) -> str:
        """The primary, once there is one (other than ``not_``) that takes writes."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            name = self.primary()
            if name is not None and name != not_ and self._writable(name):
                return name
            time.sleep(0.2)
        raise RuntimeError(f"no primary within {timeout} s; see {self.dir}/*.log")

    def wait_sync_standby(self, timeout: float = 60.0) -> None:
        """Until Patroni has a synchronous standby streaming (recorded in etcd: only
        then may it fail over to it)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name in self.nodes:
                url = f"http://127.0.0.1:{self.nodes[name]['api']}/cluster"
                with contextlib.suppress(OSError, ValueError):
                    with urllib.request.urlopen(url, timeout=1) as answer:
                        members = json.loads(answer.read()).get("members", [])
                    states = {m.get("state") for m in members if m.get("role") == "sync_standby"}
                    if states & {"running", "streaming"}:
                        return
            time.sleep(0.2)
        raise RuntimeError(f"no synchronous standby within {timeout} s; see {self.dir}/*.log")

    def _writable(self, name: str) -> bool:
        try:
            with psycopg.connect(self.dsn(name), connect_timeout=2, autocommit=True) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            return row is not None and not row[0]
        except psycopg.Error:
            return False

    # -------------------------------------------------------------- failure
    def kill_postmaster(self, name: str) -> int:
        """SIGKILL the node's PostgreSQL server process (its Patroni lives on)."""
        pid = int((self.dir / name / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        return pid

    def create_database(self, dbname: str) -> None:
        primary = self.wait_primary()
        with psycopg.connect(self.dsn(primary), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')

    # ----------------------------------------------------------------- stop
    def stop(self) -> None:
        for name in ("node2", "node1", "etcd"):
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=5)
        for name in self.nodes:  # a postmaster Patroni left running
            pidfile = self.dir / name / "postmaster.pid"
            with contextlib.suppress(OSError, ValueError, ProcessLookupError):
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
