"""Where a store is: a store URL, a DSN or the ``eventsourcing`` variables, parsed once (internal).

Every way of naming a store is read here into a typed address:
``RunStore.from_url`` and the CLI's ``--store`` / ``KURALLE_STORE`` (several
URLs separated by commas: a sharded store), ``RunStore.postgres``,
``RunStore.sharded`` and the variables of ``RunStore(env)``. PostgreSQL's
part is read by libpq's own parser (``psycopg.conninfo``): several hosts,
percent-encoding and every libpq parameter (``target_session_attrs``, ...)
work as in ``psql``; ours beside them are ``partitions=K``, ``pool_size=N``,
``pooler`` and ``listen_host``/``listen_port`` (docs/scaling.md,
docs/high-availability.md); a PostgreSQL address that names no pooler takes
``KURALLE_POSTGRES_POOLER`` from the process's environment (``default_pooler``).
An address renders the ``eventsourcing`` variables, and
two of ours for what those cannot say, so that every application built from
a log's environment reaches the database the same way.

A password is never printed: ``redact`` is how a URL is shown, an address's
``repr`` and ``label`` leave it out, and libpq's reasons are scrubbed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeAlias, get_args
from urllib.parse import parse_qsl, quote, unquote, urlencode

import psycopg
from eventsourcing.utils import Environment, EnvType
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

from ..errors import InvalidArgumentError, StoreUnavailableError

__all__ = [
    "CONNECT_TIMEOUT",
    "POOL_SIZE",
    "POOL_SIZE_VAR",
    "STORE_ENV",
    "MemoryAddress",
    "PostgresAddress",
    "ShardedAddress",
    "SqliteAddress",
    "StoreAddress",
    "address_from_env",
    "default_pooler",
    "parse_store_url",
    "postgres_address",
    "redact",
    "server_reason",
    "shards_of",
]

STORE_ENV = "KURALLE_STORE"

#: Seconds one connection attempt may take before the store counts as unreachable.
CONNECT_TIMEOUT = 3

#: The most connections a store holds to one database, whatever its partitions.
POOL_SIZE = 10

Pooler: TypeAlias = Literal["transaction", "session"]

#: Our variables beside ``eventsourcing``'s: libpq's other parameters (a conninfo
#: string), the pooler in front of the server, the store's pool size, and the
#: server(s) to LISTEN on directly when a pooler is in front (a conninfo string).
OPTIONS_VAR = "KURALLE_POSTGRES_OPTIONS"
POOLER_VAR = "KURALLE_POSTGRES_POOLER"
POOL_SIZE_VAR = "KURALLE_POSTGRES_POOL_SIZE"
LISTEN_VAR = "KURALLE_POSTGRES_LISTEN"
#: The store's own URL parameters (the rest are libpq's).
_OURS = ("partitions", "pooler", "pool_size", "listen_host", "listen_port")

#: The libpq parameters ``eventsourcing`` reads from its own variables.
_ES_VARS = {
    "dbname": "POSTGRES_DBNAME",
    "host": "POSTGRES_HOST",
    "port": "POSTGRES_PORT",
    "user": "POSTGRES_USER",
    "password": "POSTGRES_PASSWORD",
}
#: What a PostgreSQL address says when the URL does not.
_DEFAULTS = {"host": "127.0.0.1", "port": "5432", "user": "postgres", "password": ""}

FORMS = (
    "postgresql://user[:password]@host[:port][,host2[:port2]]/dbname (?partitions=K, "
    "?pool_size=N, ?pooler=transaction, ?listen_host=, libpq parameters; several URLs, "
    "comma-separated: a sharded store), sqlite:///relative.db, "
    "sqlite:////absolute.db or memory:"
)

#: A comma before another URL's scheme separates shards; any other comma is the
#: URL's own (a host list ``h1,h2``, or a password).
_SHARD_SEPARATOR = re.compile(r"\s*,\s*(?=(?:postgres(?:ql)?|sqlite|memory):)", re.IGNORECASE)
#: ``scheme://user:password@``: the password runs to the last ``@``, so that a
#: malformed one (an ``@`` or a ``/`` in it, not percent-encoded) is hidden whole.
_USERINFO = re.compile(r"^(?P<head>[A-Za-z][\w+.-]*://[^:@/]*:)(?P<password>.*)(?=@[^@]*$)", re.S)
#: A ``password`` parameter: in a URL's query, or a ``key=value`` conninfo string.
_PASSWORD_PARAM = re.compile(
    r"(?P<head>(?:^|[?&\s])password\s*=\s*)(?P<password>'(?:[^'\\]|\\.)*'|[^&\s]*)"
)


def redact(url: str) -> str:
    """``url`` (one store URL, a comma-separated list of them, or a conninfo string)
    with every password replaced by ``***``: the one way a store URL is shown."""
    parts = _SHARD_SEPARATOR.split(url.strip())
    shown = ",".join(_USERINFO.sub(r"\g<head>***", part) for part in parts)
    return _PASSWORD_PARAM.sub(r"\g<head>***", shown)


def _scrubbed(text: str, url: str) -> str:
    """``text`` (a message of libpq's about ``url``) without ``url``'s password,
    whether it quotes the URL whole or only its password."""
    text = text.replace(url, redact(url))
    parts = _SHARD_SEPARATOR.split(url.strip())
    secrets = [m.group("password") for part in parts for m in _USERINFO.finditer(part)]
    secrets += [m.group("password").strip("'") for m in _PASSWORD_PARAM.finditer(url)]
    for secret in secrets:
        for form in {secret, unquote(secret)}:
            if form:
                text = text.replace(form, "***")
    return text


def server_reason(error: BaseException) -> str:
    """The server's (or driver's) reason, on one line, without the boilerplate."""
    text = " ".join(str(error).split())
    for marker in ("failed: ", "FATAL: "):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
    return text.removesuffix(
        " Is the server running on that host and accepting TCP/IP connections?"
    )


# ------------------------------------------------------------------ addresses
@dataclass(frozen=True)
class MemoryAddress:
    """A store in this process's memory (``memory:``)."""

    def env(self) -> dict[str, str]:
        return {"PERSISTENCE_MODULE": "eventsourcing.popo"}

    def label(self) -> str:
        return "memory:"


@dataclass(frozen=True)
class SqliteAddress:
    """A store in a SQLite file (``sqlite:///relative.db``, ``sqlite:////abs.db``)."""

    path: Path

    def env(self) -> dict[str, str]:
        return {"PERSISTENCE_MODULE": "eventsourcing.sqlite", "SQLITE_DBNAME": str(self.path)}

    def label(self) -> str:
        return f"sqlite:///{self.path}"


@dataclass(frozen=True, repr=False)
class PostgresAddress:
    """A store in one PostgreSQL database: libpq's parameters (``dbname``, ``host``,
    ``port``, ``user`` and ``password`` always there; a host list for a multi-host
    URL), the partitions asked for (None: those the database has), the most
    connections the store holds (``pool_size``), the pooler in front of the server
    (``"transaction"``: nothing may rely on a server session between transactions)
    and, behind such a pooler, the server(s) to LISTEN on directly (``listen``:
    libpq's ``host`` and ``port``; None: followers poll)."""

    params: Mapping[str, str]
    partitions: int | None = None
    pooler: Pooler | None = None
    pool_size: int = POOL_SIZE
    listen: Mapping[str, str] | None = None

    def __repr__(self) -> str:
        return f"PostgresAddress({self.label()!r})"

    @property
    def servers(self) -> list[str]:
        """``host:port`` of each server the address lists, in its order."""
        ports = self.params["port"].split(",")
        return [
            f"{f'[{host}]' if ':' in host else host}:{port}"
            for host, port in zip(self.params["host"].split(","), ports, strict=False)
        ]

    @property
    def options(self) -> dict[str, str]:
        """The libpq parameters beyond those ``eventsourcing``'s variables carry."""
        return {k: v for k, v in self.params.items() if k not in _ES_VARS}

    def label(self) -> str:
        """The address as a URL without its password."""
        query = {**self.options}
        if self.partitions is not None:
            query["partitions"] = str(self.partitions)
        if self.pooler is not None:
            query["pooler"] = self.pooler
        if self.pool_size != POOL_SIZE:
            query["pool_size"] = str(self.pool_size)
        if self.listen is not None:
            query["listen_host"] = self.listen["host"]
            query["listen_port"] = self.listen["port"]
        user = quote(self.params["user"], safe="")
        url = (
            f"postgresql://{user}@{','.join(self.servers)}/{quote(self.params['dbname'], safe='')}"
        )
        return f"{url}?{urlencode(query)}" if query else url

    def env(self) -> dict[str, str]:
        """The variables of ``eventsourcing.postgres`` and ours (every one set, so
        that the process's environment cannot add to what the address says)."""
        env = {"PERSISTENCE_MODULE": "eventsourcing.postgres"}
        env.update({var: self.params[key] for key, var in _ES_VARS.items()})
        env[OPTIONS_VAR] = make_conninfo(**self.options) if self.options else ""
        env[POOLER_VAR] = self.pooler or ""
        env[POOL_SIZE_VAR] = str(self.pool_size)
        env[LISTEN_VAR] = make_conninfo(**self.listen) if self.listen else ""
        return env

    @property
    def pooled(self) -> bool:
        """Whether a pooler in transaction mode is in front: no session state."""
        return self.pooler == "transaction"

    def listen_params(self) -> dict[str, str] | None:
        """libpq's parameters of a connection that may LISTEN (None: none may, poll):
        the server itself without a transaction pooler, else the ``listen`` server."""
        if not self.pooled:
            return dict(self.params)
        if self.listen is None:
            return None
        return {**self.params, **self.listen}

    def configure(self, pool: ConnectionPool[Any]) -> None:
        """Give ``pool`` (built by ``eventsourcing`` from ``env``) libpq's other
        parameters, before it connects: psycopg_pool reads its ``kwargs`` at each
        connect."""
        if self.options and isinstance(pool.kwargs, dict):
            pool.kwargs.update(self.options)

    def connect(self) -> psycopg.Connection[Any]:
        """One connection, within seconds: an unreachable server (every server of a
        multi-host address) is a ``StoreUnavailableError`` naming the servers, the
        database and the server's reason."""
        try:
            return psycopg.connect(make_conninfo(**self.params), connect_timeout=CONNECT_TIMEOUT)
        except psycopg.Error as e:
            reason = server_reason(e)
            if self.params["password"]:
                reason = reason.replace(self.params["password"], "***")
            where = f"{', '.join(self.servers)}, database {self.params['dbname']!r}"
            msg = f"cannot reach PostgreSQL at {where}: {reason}"
            raise StoreUnavailableError(msg) from None


@dataclass(frozen=True)
class ShardedAddress:
    """A store sharded over several databases, partition i being ``shards[i]``."""

    shards: tuple[SqliteAddress | PostgresAddress, ...]

    def label(self) -> str:
        return ",".join(shard.label() for shard in self.shards)


StoreAddress: TypeAlias = MemoryAddress | SqliteAddress | PostgresAddress | ShardedAddress


# -------------------------------------------------------------------- parsing
def parse_store_url(url: str) -> StoreAddress:
    """The store ``url`` names (see the module docstring); ``InvalidArgumentError``,
    quoting the URL redacted, for anything else."""
    if not isinstance(url, str) or not url.strip():
        msg = f"a store URL is a non-empty string, got {url!r}; use {FORMS}"
        raise InvalidArgumentError(msg)
    parts = _SHARD_SEPARATOR.split(url.strip())
    return shards_of(parts) if len(parts) > 1 else _database(parts[0])


def shards_of(urls: Sequence[str]) -> ShardedAddress:
    """The sharded store over the databases ``urls`` name, each once, none partitioned."""
    shards: list[SqliteAddress | PostgresAddress] = []
    for url in urls:
        shard = _database(url.strip())
        if isinstance(shard, MemoryAddress):
            msg = f"a shard is a database: {redact(url)!r} is not one"
            raise InvalidArgumentError(msg)
        if isinstance(shard, PostgresAddress) and shard.partitions is not None:
            msg = f"a shard is one partition: leave ?partitions= out of {redact(url)!r}"
            raise InvalidArgumentError(msg)
        if shard.label() in {other.label() for other in shards}:
            msg = f"a sharded store lists each database once, got {redact(url)!r} twice"
            raise InvalidArgumentError(msg)
        shards.append(shard)
    return ShardedAddress(tuple(shards))


def _database(url: str) -> MemoryAddress | SqliteAddress | PostgresAddress:
    if url in ("memory:", "memory://"):
        return MemoryAddress()
    if url.startswith("sqlite:"):
        return SqliteAddress(_sqlite_path(url))
    if url.startswith(("postgresql://", "postgres://")):
        return _postgres_dsn(url)
    msg = f"unknown store URL {redact(url)!r}: use {FORMS}"
    raise InvalidArgumentError(msg)


def _sqlite_path(url: str) -> Path:
    """``sqlite:///runs.db`` is relative, ``sqlite:////var/runs.db`` absolute."""
    rest = url.removeprefix("sqlite:")
    if not rest.startswith("///") or len(rest) == 3:
        msg = (
            f"a SQLite store URL looks like sqlite:///relative.db or sqlite:////abs.db, "
            f"got {redact(url)!r}"
        )
        raise InvalidArgumentError(msg)
    return Path(rest[3:])


def default_pooler() -> Pooler | None:
    """The pooler of a PostgreSQL address that names none (no ``?pooler=``, no
    ``pooler=`` argument): ``KURALLE_POSTGRES_POOLER`` in the process's environment,
    so that every store of a deployment behind PgBouncer, and every process it
    starts, says so once (docs/high-availability.md)."""
    return _pooler_named_by(POOLER_VAR, os.environ.get(POOLER_VAR))


def _pooler_named_by(var: str, raw: str | None) -> Pooler | None:
    """The pooler the variable ``var`` holds (``raw``; unset or empty: none); a value
    we do not know is refused on one line that names the variable."""
    value = (raw or "").strip()
    if not value:
        return None
    if value not in get_args(Pooler):
        msg = (
            f"{var} must be 'transaction' or 'session' (PgBouncer's pool_mode) or unset, "
            f"got {value!r}"
        )
        raise InvalidArgumentError(msg)
    return value  # type: ignore[return-value]


def _postgres_dsn(dsn: str, *, env_pooler: bool = True) -> PostgresAddress:
    """A ``postgresql://`` URL (our parameters taken out of its query) or a
    ``key=value`` conninfo string, read by libpq; without ``?pooler=``, the
    environment's (``default_pooler``) unless ``env_pooler`` is false."""
    conninfo, ours = dsn, {}
    if dsn.startswith(("postgresql://", "postgres://")):
        base, _, query = dsn.partition("?")
        pairs = parse_qsl(query, keep_blank_values=True)
        ours = {k: v for k, v in pairs if k in _OURS}
        theirs = [(k, v) for k, v in pairs if k not in ours]
        conninfo = f"{base}?{urlencode(theirs)}" if theirs else base
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as e:
        msg = (
            f"not a PostgreSQL store libpq can read, {_quoted(dsn)}: "
            f"{_scrubbed(server_reason(e), dsn)} (the store's own parameters are "
            "partitions=K, pool_size=N, pooler=transaction|session, listen_host, listen_port)"
        )
        raise InvalidArgumentError(msg) from None
    listen = None
    if ours.get("listen_host"):
        listen = {"host": ours["listen_host"], "port": ours.get("listen_port") or ""}
    return _postgres(
        params,
        partitions=_whole(ours.get("partitions")),
        pooler=ours["pooler"] if "pooler" in ours else default_pooler() if env_pooler else None,
        pool_size=_whole(ours.get("pool_size")),
        listen=listen,
        shown=_quoted(dsn),
    )


def _whole(raw: str | None) -> int | str | None:
    """A URL's number as an int where it is one (else as given, refused later)."""
    return int(raw) if raw is not None and raw.isdigit() else raw


def postgres_address(
    dsn_or_params: str | Mapping[str, Any],
    *,
    partitions: int | None = None,
    pooler: str | None = None,
    pool_size: int | None = None,
    env_pooler: bool = True,
) -> PostgresAddress:
    """``RunStore.postgres``'s database: a URL, a ``key=value`` conninfo string or a
    mapping of libpq parameters; ``partitions``, ``pooler`` and ``pool_size`` win
    over the URL's, and a pooler named either way over ``KURALLE_POSTGRES_POOLER``
    (``env_pooler`` false: that variable is not read)."""
    dsn = dsn_or_params
    if isinstance(dsn_or_params, Mapping):
        given = {str(k): str(v) for k, v in dsn_or_params.items() if v is not None}
        try:
            dsn = make_conninfo(**given)
        except psycopg.ProgrammingError as e:
            msg = f"not PostgreSQL parameters libpq knows: {server_reason(e)}"
            raise InvalidArgumentError(msg) from None
    if not isinstance(dsn, str):
        msg = f"a PostgreSQL store takes a URL or a mapping, got {type(dsn).__name__}"
        raise InvalidArgumentError(msg)
    address = _postgres_dsn(dsn, env_pooler=env_pooler and pooler is None)
    return _postgres(
        address.params,
        partitions=address.partitions if partitions is None else partitions,
        pooler=address.pooler if pooler is None else pooler,
        pool_size=address.pool_size if pool_size is None else pool_size,
        listen=address.listen,
        shown=_quoted(dsn),
    )


def _quoted(url: str) -> str:
    return repr(redact(url))


def _postgres(
    params: Mapping[str, Any],
    *,
    partitions: int | str | None,
    pooler: str | None,
    shown: str,
    pool_size: int | str | None = None,
    listen: Mapping[str, str] | None = None,
) -> PostgresAddress:
    """A checked address: a database name, the defaults filled in, ``partitions``
    a whole number, ``pool_size`` 2 or more, ``pooler`` one we know."""
    full = {k: str(v) for k, v in params.items() if v is not None}
    for key, default in _DEFAULTS.items():
        full[key] = full.get(key) or default
    # One port a host, as libpq reads the lists: one port for all, an empty one the default.
    hosts, ports = full["host"].split(","), full["port"].split(",")
    ports = ports * len(hosts) if len(ports) == 1 else ports
    full["port"] = ",".join(port or _DEFAULTS["port"] for port in ports)
    if not full.get("dbname"):
        msg = f"a PostgreSQL store needs a database name (dbname): {shown} has none"
        raise InvalidArgumentError(msg)
    if partitions is not None and not (type(partitions) is int and partitions >= 1):
        msg = f"partitions must be a whole number, 1 or more, got {partitions!r} in {shown}"
        raise InvalidArgumentError(msg)
    if pooler not in (None, *get_args(Pooler)):
        msg = (
            f"pooler must be 'transaction' or 'session' (PgBouncer's pool_mode), got "
            f"{pooler!r} in {shown}"
        )
        raise InvalidArgumentError(msg)
    if pool_size is None:
        pool_size = POOL_SIZE
    if not (type(pool_size) is int and pool_size >= 2):
        msg = (
            f"pool_size must be a whole number, 2 or more (one connection for the saves "
            f"sent from async code, one for the rest), got {pool_size!r} in {shown}"
        )
        raise InvalidArgumentError(msg)
    return PostgresAddress(full, partitions, pooler, pool_size, listen)  # type: ignore[arg-type]


def address_from_env(
    env: EnvType | None, name: str = "RunStore"
) -> MemoryAddress | SqliteAddress | PostgresAddress | None:
    """The database the ``eventsourcing`` variables name, read as the library reads
    them (``env`` over the process's environment, ``NAME_``-prefixed variables
    first); None for a persistence module other than the library's three."""
    environment = Environment(name, {**os.environ, **(env or {})})
    module = environment.get("PERSISTENCE_MODULE") or "eventsourcing.popo"
    if module.startswith("eventsourcing.postgres"):
        # Ours first: in a conninfo string the last of a parameter wins.
        given = {key: environment.get(var) for key, var in _ES_VARS.items()}
        conninfo = make_conninfo(**{k: v for k, v in given.items() if v})
        options = environment.get(OPTIONS_VAR) or ""
        # The variables' pooler, read here (an empty one, rendered by an address
        # without a pooler, is none: not the process's default again).
        address = postgres_address(
            f"{options} {conninfo}",
            pooler=_pooler_named_by(POOLER_VAR, environment.get(POOLER_VAR)),
            env_pooler=False,
            pool_size=_whole(environment.get(POOL_SIZE_VAR) or None),  # type: ignore[arg-type]
        )
        listen = environment.get(LISTEN_VAR)
        if not listen:
            return address
        listen_params = conninfo_to_dict(listen)
        return replace(address, listen={k: str(v) for k, v in listen_params.items()})
    if module.startswith("eventsourcing.sqlite"):
        dbname = environment.get("SQLITE_DBNAME")
        if not dbname:
            msg = "PERSISTENCE_MODULE is eventsourcing.sqlite and SQLITE_DBNAME is not set"
            raise InvalidArgumentError(msg)
        return SqliteAddress(Path(dbname))
    if module.startswith("eventsourcing.popo"):
        return MemoryAddress()
    return None
