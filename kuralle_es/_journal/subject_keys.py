"""The key table: one data key per data subject, where erasure destroys it (internal).

Every run belongs to a data subject (``runtime.run(..., subject=)``, by
default its session id), and its payloads are sealed under that subject's
data key (``sealing``). The keys live in a table of their own,
``kuralle_subject_keys``, in the store's database by default or in another
one (``key_store=``), so that backups of the events never hold them
(docs/privacy.md). When the store is encrypted, each data key is itself
encrypted with the store's cipher. ``erase`` deletes a subject's row: what
was sealed under it can never be read again, from the database or from any
backup of it.

Keys are cached in the process for a minute: a process that read a key
before another erased it may use it that long (docs/privacy.md says so).
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from eventsourcing.cryptography import AESCipher
from eventsourcing.persistence import Cipher, InterfaceError, OperationalError
from eventsourcing.postgres import PostgresDatastore
from eventsourcing.utils import Environment
from psycopg.sql import SQL, Identifier

from ..errors import StoreUnavailableError
from .recorders import SAVE_DEADLINE
from .store_url import (
    MemoryAddress,
    PostgresAddress,
    SqliteAddress,
    parse_store_url,
    server_reason,
)

__all__ = [
    "KEYS_TABLE",
    "KeyTable",
    "SubjectKey",
    "key_table_at",
]

#: The key table's name, in whichever database holds it.
KEYS_TABLE = "kuralle_subject_keys"
#: Seconds a key read from the table is used before it is read again.
CACHE_SECONDS = 60.0


@dataclass(frozen=True)
class SubjectKey:
    """A subject's data key: its id (what sealed values name) and its cipher."""

    key_id: str
    cipher: Cipher


def _cipher(raw: bytes) -> Cipher:
    from base64 import b64encode

    return AESCipher(Environment(env={"CIPHER_KEY": b64encode(raw).decode("ascii")}))


class KeyTable(ABC):
    """The subjects' data keys, cached; ``wrap`` (the store's cipher) encrypts them
    in the table."""

    def __init__(self, wrap: Cipher | None = None) -> None:
        self._wrap = wrap
        self._lock = threading.Lock()
        self._by_subject: dict[str, tuple[float, SubjectKey]] = {}
        self._by_id: dict[str, tuple[float, SubjectKey | None]] = {}

    # ------------------------------------------------------------- reads
    def key_for(self, subject: str) -> SubjectKey:
        """The subject's key, made (and stored) the first time the subject is seen."""
        now = time.monotonic()
        cached = self._by_subject.get(subject)
        if cached is not None and now - cached[0] < CACHE_SECONDS:
            return cached[1]
        with self._lock:
            raw = AESCipher.random_bytes(32)
            stored = self._wrap.encrypt(raw) if self._wrap is not None else raw
            found = self._get_or_make(subject, uuid.uuid4().hex, stored)
            if found is None:  # erased between two statements: try again
                msg = f"the key of subject {subject!r} was erased while it was made"
                raise RuntimeError(msg)
            key = self._unwrapped(*found)
        self._by_subject[subject] = (now, key)
        self._by_id[key.key_id] = (now, key)
        return key

    def has_cached(self, subject: str) -> bool:
        """Whether ``key_for(subject)`` would answer without reading the table."""
        cached = self._by_subject.get(subject)
        return cached is not None and time.monotonic() - cached[0] < CACHE_SECONDS

    def key_by_id(self, key_id: str) -> SubjectKey | None:
        """The key with this id; None once its subject was erased (for good)."""
        now = time.monotonic()
        cached = self._by_id.get(key_id)
        if cached is not None and (cached[1] is None or now - cached[0] < CACHE_SECONDS):
            return cached[1]
        with self._lock:
            stored = self._select_id(key_id)
        key = self._unwrapped(key_id, stored) if stored is not None else None
        self._by_id[key_id] = (now, key)
        return key

    def _unwrapped(self, key_id: str, stored: bytes) -> SubjectKey:
        raw = self._wrap.decrypt(stored) if self._wrap is not None else stored
        return SubjectKey(key_id, _cipher(raw))

    # ------------------------------------------------------------- erasure
    def erase(self, subject: str) -> bool:
        """Destroy the subject's key; whether there was one."""
        with self._lock:
            found = self._select_subject(subject)
            self._delete(subject)
            self._by_subject.pop(subject, None)
            if found is not None:
                self._by_id[found[0]] = (time.monotonic(), None)
        return found is not None

    def close(self) -> None:  # noqa: B027
        """Let go of the table's connection, if it keeps one (the store is closing)."""

    # ------------------------------------------------------------ backends
    def _get_or_make(self, subject: str, key_id: str, data_key: bytes) -> tuple[str, bytes] | None:
        """The subject's stored key, made of ``key_id`` and ``data_key`` when it has
        none (the first insert wins); None if it was erased meanwhile."""
        found = self._select_subject(subject)
        if found is None:
            self._insert(subject, key_id, data_key)
            found = self._select_subject(subject)
        return found

    @abstractmethod
    def _select_subject(self, subject: str) -> tuple[str, bytes] | None: ...

    @abstractmethod
    def _select_id(self, key_id: str) -> bytes | None: ...

    @abstractmethod
    def _insert(self, subject: str, key_id: str, data_key: bytes) -> None: ...

    @abstractmethod
    def _delete(self, subject: str) -> None: ...


class MemoryKeyTable(KeyTable):
    """The key table of an in-memory store (or ``key_store="memory:"``)."""

    def __init__(self, wrap: Cipher | None = None) -> None:
        super().__init__(wrap)
        self._rows: dict[str, tuple[str, bytes]] = {}

    def _select_subject(self, subject: str) -> tuple[str, bytes] | None:
        return self._rows.get(subject)

    def _select_id(self, key_id: str) -> bytes | None:
        return next((k for i, k in self._rows.values() if i == key_id), None)

    def _insert(self, subject: str, key_id: str, data_key: bytes) -> None:
        self._rows.setdefault(subject, (key_id, data_key))

    def _delete(self, subject: str) -> None:
        self._rows.pop(subject, None)


class SqliteKeyTable(KeyTable):
    """The key table in a SQLite file; a connection a statement (keys are cached)."""

    def __init__(self, path: Path, wrap: Cipher | None = None) -> None:
        super().__init__(wrap)
        self._path = path
        self._ready = False

    def _run(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        conn = sqlite3.connect(self._path, timeout=30)
        try:
            with conn:
                if not self._ready:
                    conn.execute(
                        f"CREATE TABLE IF NOT EXISTS {KEYS_TABLE} (subject TEXT PRIMARY KEY, "
                        "key_id TEXT NOT NULL UNIQUE, data_key BLOB NOT NULL, "
                        "created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)"
                    )
                    self._ready = True
                return conn.execute(sql, args).fetchall()
        finally:
            conn.close()

    def _select_subject(self, subject: str) -> tuple[str, bytes] | None:
        rows = self._run(f"SELECT key_id, data_key FROM {KEYS_TABLE} WHERE subject = ?", (subject,))
        return (str(rows[0][0]), bytes(rows[0][1])) if rows else None

    def _select_id(self, key_id: str) -> bytes | None:
        rows = self._run(f"SELECT data_key FROM {KEYS_TABLE} WHERE key_id = ?", (key_id,))
        return bytes(rows[0][0]) if rows else None

    def _insert(self, subject: str, key_id: str, data_key: bytes) -> None:
        self._run(
            f"INSERT OR IGNORE INTO {KEYS_TABLE} (subject, key_id, data_key) VALUES (?, ?, ?)",
            (subject, key_id, data_key),
        )

    def _delete(self, subject: str) -> None:
        self._run(f"DELETE FROM {KEYS_TABLE} WHERE subject = ?", (subject,))


class PostgresKeyTable(KeyTable):
    """The key table in a PostgreSQL database: in the store's own database, through
    the store's pool (``share``), so the key table adds no connection; elsewhere
    (``key_store=``) over one connection of its own. Its statements are few (keys
    are cached) and one at a time (under the table's lock)."""

    def __init__(self, address: PostgresAddress, wrap: Cipher | None = None) -> None:
        super().__init__(wrap)
        self._address = address
        self._ready = False
        self._table = Identifier(KEYS_TABLE)
        self._connection: psycopg.Connection[Any] | None = None
        self._shared: PostgresDatastore | None = None

    @property
    def address(self) -> PostgresAddress:
        return self._address

    def share(self, datastore: PostgresDatastore) -> None:
        """Send the statements through ``datastore`` (the store's, over the same
        database) instead of a connection of the table's own."""
        with self._lock:
            self._shared = datastore
            self._drop()

    def close(self) -> None:
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _run(self, sql: SQL, args: tuple[Any, ...]) -> list[Any]:
        """One statement in a transaction of its own, sent again on a new connection
        while the server is away (a restart, a failover) for up to a save's
        deadline; then ``StoreUnavailableError``. Every statement here may be sent
        twice: a key is made once (the first insert wins) and read back."""
        deadline = time.monotonic() + SAVE_DEADLINE
        wait = 0.1
        while True:
            try:
                return self._run_once(sql, args)
            except (
                psycopg.OperationalError,
                psycopg.InterfaceError,
                OperationalError,
                InterfaceError,
                StoreUnavailableError,
            ) as lost:
                self._drop()
                if time.monotonic() + wait >= deadline:
                    why = (
                        str(lost)
                        if isinstance(lost, StoreUnavailableError)
                        else (f"{self._address.label()}: {server_reason(lost)}")
                    )
                    msg = f"cannot reach the subjects' key table ({why})"
                    raise StoreUnavailableError(msg) from lost
                time.sleep(wait)
                wait = min(1.0, wait * 2)

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _run_once(self, sql: SQL, args: tuple[Any, ...]) -> list[Any]:
        shared = self._shared
        if shared is not None:
            with shared.transaction(commit=True) as cursor:
                self._set_up(cursor)
                cursor.execute(sql.format(self._table), args)
                found = cursor.fetchall() if cursor.description is not None else []
            self._ready = True
            return [tuple(row.values()) for row in found]  # the store's rows are dicts
        conn = self._connection
        if conn is None or conn.closed:
            conn = self._connection = self._address.connect()
            conn.prepare_threshold = None  # nothing prepared: a transaction pooler may be in front
        with conn.transaction(), conn.cursor() as cursor:
            self._set_up(cursor)
            cursor.execute(sql.format(self._table), args)
            rows = cursor.fetchall() if cursor.description is not None else []
        self._ready = True
        return rows

    def _set_up(self, cursor: Any) -> None:
        """The table, made by the first statement (in its transaction)."""
        if self._ready:
            return
        # Locked: two stores creating the table at once would clash.
        cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (KEYS_TABLE,))
        cursor.execute(
            SQL(
                "CREATE TABLE IF NOT EXISTS {} (subject text PRIMARY KEY, "
                "key_id text NOT NULL UNIQUE, data_key bytea NOT NULL, "
                "created_at timestamptz NOT NULL DEFAULT now())"
            ).format(self._table)
        )

    def _select_subject(self, subject: str) -> tuple[str, bytes] | None:
        rows = self._run(SQL("SELECT key_id, data_key FROM {} WHERE subject = %s"), (subject,))
        return (str(rows[0][0]), bytes(rows[0][1])) if rows else None

    def _select_id(self, key_id: str) -> bytes | None:
        rows = self._run(SQL("SELECT data_key FROM {} WHERE key_id = %s"), (key_id,))
        return bytes(rows[0][0]) if rows else None

    def _insert(self, subject: str, key_id: str, data_key: bytes) -> None:
        self._run(
            SQL(
                "INSERT INTO {} (subject, key_id, data_key) VALUES (%s, %s, %s) "
                "ON CONFLICT (subject) DO NOTHING"
            ),
            (subject, key_id, data_key),
        )

    def _get_or_make(self, subject: str, key_id: str, data_key: bytes) -> tuple[str, bytes] | None:
        """One statement, whether the subject has a key or not (a new run's first save
        waits for it). A key another store inserts meanwhile is not in the
        statement's snapshot: it is read by a second statement."""
        rows = self._run(
            SQL(
                "WITH made AS (INSERT INTO {0} (subject, key_id, data_key) VALUES (%s, %s, %s) "
                "ON CONFLICT (subject) DO NOTHING RETURNING key_id, data_key) "
                "SELECT key_id, data_key FROM made "
                "UNION ALL SELECT key_id, data_key FROM {0} WHERE subject = %s"
            ),
            (subject, key_id, data_key, subject),
        )
        if not rows:
            return self._select_subject(subject)
        return str(rows[0][0]), bytes(rows[0][1])

    def _delete(self, subject: str) -> None:
        self._run(SQL("DELETE FROM {} WHERE subject = %s"), (subject,))


def key_table_at(
    where: str | MemoryAddress | SqliteAddress | PostgresAddress | None, wrap: Cipher | None
) -> KeyTable:
    """The key table in the database ``where`` names (a store URL or an address);
    None or ``memory:``: one in this process's memory."""
    address = parse_store_url(where) if isinstance(where, str) else where
    if isinstance(address, SqliteAddress):
        return SqliteKeyTable(address.path, wrap)
    if isinstance(address, PostgresAddress):
        return PostgresKeyTable(address, wrap)
    if address is None or isinstance(address, MemoryAddress):
        return MemoryKeyTable(wrap)
    msg = "the key table is one database: give key_store= one store URL, not several"
    from ..errors import InvalidArgumentError

    raise InvalidArgumentError(msg)
