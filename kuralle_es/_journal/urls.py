"""What a store URL names: the ``eventsourcing`` environment of one log (internal).

``postgresql://user[:pw]@host[:port]/db`` (with ``?partitions=K``, the one
parameter known), ``sqlite:///relative/path.db`` / ``sqlite:////absolute/path.db``
and ``memory:``. Opening the store is ``store_url``'s; a sharded store
(``store``) reads each of its URLs here. Every refusal is a
``StoreUnavailableError`` that names the URL and its expected form.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from ..errors import InvalidArgumentError, StoreUnavailableError
from .log import postgres_env

__all__ = ["StoreLocation", "locate", "sqlite_path"]

MEMORY_URLS = ("memory:", "memory://")


@dataclass(frozen=True)
class StoreLocation:
    """One database a URL names: its environment, and the partitions it asks for
    (None: not said); ``sqlite`` holds the path of a SQLite file."""

    env: dict[str, str]
    partitions: int | None = None
    sqlite: Path | None = None


def locate(url: str) -> StoreLocation:
    """The database ``url`` names (``memory:``, SQLite or PostgreSQL)."""
    if url in MEMORY_URLS:
        return StoreLocation({"PERSISTENCE_MODULE": "eventsourcing.popo"})
    if url.startswith("sqlite:"):
        path = sqlite_path(url)
        env = {"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": str(path)}
        return StoreLocation(env, sqlite=path)
    if url.startswith(("postgresql://", "postgres://")):
        bare, partitions = _partitions_of(url)
        try:
            env = postgres_env(bare)
        except (InvalidArgumentError, ValueError) as e:
            raise StoreUnavailableError(str(e)) from None
        return StoreLocation(env, partitions)
    msg = (
        f"unknown store URL {url!r}: use postgresql://user[:password]@host[:port]/dbname "
        "(?partitions=K; several, comma-separated, for a sharded store), sqlite:///path/to.db "
        "or memory:"
    )
    raise StoreUnavailableError(msg)


def _partitions_of(url: str) -> tuple[str, int | None]:
    """The URL without its query, and the ``partitions`` it asks for (None: not said)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(query) - {"partitions"})
    if unknown:
        msg = f"unknown parameters {unknown} in store URL {url!r}; the one known is partitions=K"
        raise StoreUnavailableError(msg)
    bare = urlunsplit(parts._replace(query=""))
    raw = query.get("partitions")
    if raw is None:
        return bare, None
    if not raw.isdigit() or int(raw) < 1:
        msg = f"partitions in store URL {url!r} must be a whole number, 1 or more; got {raw!r}"
        raise StoreUnavailableError(msg)
    return bare, int(raw)


def sqlite_path(url: str) -> Path:
    """``sqlite:///runs.db`` is relative, ``sqlite:////var/runs.db`` absolute."""
    rest = url.removeprefix("sqlite:")
    if not rest.startswith("///") or len(rest) == 3:
        msg = (
            f"a SQLite store URL looks like sqlite:///relative.db or sqlite:////abs.db, got {url!r}"
        )
        raise StoreUnavailableError(msg)
    return Path(rest[3:])
