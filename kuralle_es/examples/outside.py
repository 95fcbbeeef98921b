"""The outside world the examples change: a ledger that keeps one effect per key.

A bank, a payment provider, an airline: the examples' tools call one of these
systems, which writes what it did to a ledger table in a SQLite file or a
PostgreSQL database (``EXAMPLES_LEDGER``: a path or a ``postgresql://`` URL;
default ``examples-ledger.db``). Like a real payment API, the ledger keeps one
effect per idempotency key: a call made again with the same key (a tool
executed again after a crash) changes nothing and is answered with what the
first call did. It also counts every call, so a re-execution shows.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg

__all__ = ["LEDGER_ENV", "Effect", "Ledger"]

LEDGER_ENV = "EXAMPLES_LEDGER"

_TABLES = (
    "CREATE TABLE IF NOT EXISTS example_effects "
    "(key TEXT PRIMARY KEY, system TEXT, action TEXT, data TEXT)",
    "CREATE TABLE IF NOT EXISTS example_calls (key TEXT, system TEXT, action TEXT)",
)


@dataclass(frozen=True)
class Effect:
    """One effect an outside system kept: under which key, what, with which data."""

    key: str
    system: str
    action: str
    data: dict[str, Any]


class Ledger:
    """The outside systems' ledger, at ``target`` (else ``EXAMPLES_LEDGER``, read
    at each call, so a module-level ``Ledger()`` follows the environment)."""

    def __init__(self, target: str | None = None) -> None:
        self._target = target

    @property
    def target(self) -> str:
        return self._target or os.environ.get(LEDGER_ENV, "examples-ledger.db")

    @contextmanager
    def _connect(self) -> Iterator[Any]:
        if self.target.startswith("postgresql://"):
            with psycopg.connect(self.target, autocommit=True) as pg:
                for table in _TABLES:
                    pg.execute(table)
                yield pg
            return
        lite = sqlite3.connect(self.target, timeout=30, isolation_level=None)
        try:
            for table in _TABLES:
                lite.execute(table)
            yield lite
        finally:
            lite.close()

    def _sql(self, conn: Any, sql: str) -> str:
        return sql.replace("?", "%s") if isinstance(conn, psycopg.Connection) else sql

    def record(self, key: str, system: str, action: str, data: dict[str, Any]) -> dict[str, Any]:
        """Do ``action`` once per ``key``: returns the data kept under ``key`` (this
        call's the first time; the first call's when the key was seen before)."""
        with self._connect() as conn:
            conn.execute(
                self._sql(conn, "INSERT INTO example_calls VALUES (?, ?, ?)"), (key, system, action)
            )
            once = "INSERT INTO example_effects VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING"
            conn.execute(self._sql(conn, once), (key, system, action, json.dumps(data)))
            row = conn.execute(
                self._sql(conn, "SELECT data FROM example_effects WHERE key = ?"), (key,)
            ).fetchone()
        kept: dict[str, Any] = json.loads(row[0])
        return kept

    def effects(self, system: str | None = None) -> list[Effect]:
        """The effects kept (of one system, or all), in key order."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT key, system, action, data FROM example_effects ORDER BY key"
            )
            kept = [Effect(k, s, a, json.loads(d)) for k, s, a, d in rows]
        return [e for e in kept if system is None or e.system == system]

    def calls(self, action: str) -> list[str]:
        """The key of every call of ``action``, each call made again included."""
        with self._connect() as conn:
            query = self._sql(conn, "SELECT key FROM example_calls WHERE action = ?")
            return [key for (key,) in conn.execute(query, (action,))]
