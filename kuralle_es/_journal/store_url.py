"""Opening a ``RunStore`` from a URL, failing fast when its database is away (API).

``open_store_url(url)`` understands ``postgresql://user[:pw]@host[:port]/db``
(``?partitions=K`` for K event logs in the database), several such URLs
separated by commas (a store sharded over those databases, partition i
being the i-th), ``sqlite:///relative/path.db`` / ``sqlite:////absolute/path.db``
and ``memory:``; ``open_store_from_env()`` uses ``KURALLE_STORE``, else the
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
from .log import CONNECT_TIMEOUT, check_postgres, server_reason
from .store import RunStore
from .urls import locate

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
    urls = [u.strip() for u in url.split(",")]
    if len(urls) > 1:
        return _construct(lambda: RunStore.sharded(urls))
    place = locate(url)
    if place.sqlite is not None:
        return _open_sqlite(place.sqlite, must_exist)
    return _construct(lambda: RunStore(env=place.env, partitions=place.partitions))


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
