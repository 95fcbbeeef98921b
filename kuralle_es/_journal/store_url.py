"""Opening a ``RunStore`` from a URL, failing fast when its database is away (API).

``open_store_url(url)`` understands ``postgresql://user[:pw]@host[:port]/db``,
``sqlite:///relative/path.db`` / ``sqlite:////absolute/path.db`` and
``memory:``; ``open_store_from_env()`` uses ``KURALLE_STORE``, else the
``eventsourcing`` variables (``PERSISTENCE_MODULE``, ``POSTGRES_*``, …).
Before a PostgreSQL store is built, one short connection attempt checks that
the server answers: an unreachable one is a ``StoreUnavailableError`` within
seconds whose one-line message names host, port, database and the server's
reason, instead of a connection pool retrying for thirty seconds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import StoreUnavailableError
from .store import CONNECT_TIMEOUT, RunStore, check_postgres, postgres_env, server_reason

__all__ = [
    "CONNECT_TIMEOUT",
    "STORE_ENV",
    "StoreUnavailableError",
    "check_postgres",
    "open_store_from_env",
    "open_store_url",
]

STORE_ENV = "KURALLE_STORE"


def open_store_url(url: str, *, must_exist: bool = False) -> RunStore:
    """A store for ``url``; ``must_exist`` refuses a SQLite file that is not there
    (a read-only command must not create an empty database by mistake)."""
    if url in ("memory:", "memory://"):
        return RunStore.memory()
    if url.startswith("sqlite:"):
        return _open_sqlite(_sqlite_path(url), must_exist)
    if url.startswith(("postgresql://", "postgres://")):
        try:
            env = postgres_env(url)
        except ValueError as e:
            raise StoreUnavailableError(str(e)) from None
        return _open_postgres(env)
    msg = (
        f"unknown store URL {url!r}: use postgresql://user[:password]@host[:port]/dbname, "
        "sqlite:///path/to.db or memory:"
    )
    raise StoreUnavailableError(msg)


def open_store_from_env(
    environ: Mapping[str, str] | None = None, *, must_exist: bool = False
) -> RunStore:
    """``KURALLE_STORE`` if set, else the store the ``eventsourcing`` variables describe."""
    env = dict(os.environ if environ is None else environ)
    url = env.get(STORE_ENV)
    if url:
        return open_store_url(url, must_exist=must_exist)
    module = env.get("PERSISTENCE_MODULE", "")
    if module.endswith("postgres"):
        # Trust authentication needs no password; eventsourcing insists on the variable.
        env.setdefault("POSTGRES_PASSWORD", "")
        return _open_postgres(env)
    if module.endswith("sqlite") and env.get("SQLITE_DBNAME"):
        return _open_sqlite(Path(env["SQLITE_DBNAME"]), must_exist)
    return _construct(lambda: RunStore(env=env))


def _open_postgres(env: dict[str, Any]) -> RunStore:
    return _construct(lambda: RunStore(env=env))  # RunStore probes the server first


def _open_sqlite(path: Path, must_exist: bool) -> RunStore:
    if must_exist and not path.exists():
        msg = f"no SQLite database at {path.resolve()}"
        raise StoreUnavailableError(msg)
    return _construct(lambda: RunStore.sqlite(str(path)))


def _construct(build: Any) -> RunStore:
    try:
        store: RunStore = build()
    except StoreUnavailableError:
        raise
    except (OSError, ValueError) as e:  # eventsourcing's configuration errors
        raise StoreUnavailableError(f"cannot open the store: {e}") from None
    except Exception as e:
        raise StoreUnavailableError(f"cannot open the store: {server_reason(e)}") from None
    return store


def _sqlite_path(url: str) -> Path:
    """``sqlite:///runs.db`` is relative, ``sqlite:////var/runs.db`` absolute."""
    rest = url.removeprefix("sqlite:")
    if not rest.startswith("///") or len(rest) == 3:
        msg = (
            f"a SQLite store URL looks like sqlite:///relative.db or sqlite:////abs.db, got {url!r}"
        )
        raise StoreUnavailableError(msg)
    return Path(rest[3:])
