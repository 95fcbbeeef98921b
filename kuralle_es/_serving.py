"""Serving an ASGI app from a ``kuralle-es`` command: what the dashboard and the HTTP API share.

Internal module (the ``http`` extra: uvicorn). Three pieces, each with a
reason to live once:

- ``refuse_open_bind(...)``: both servers refuse to bind beyond this machine
  without their token (README, "The dashboard"; docs/http.md, "Security"),
  in the same words.
- ``served_hosts(...)`` and ``HostGate``: both servers answer only requests
  whose ``Host`` header names them (the loopback names when bound to
  loopback, else ``--allowed-host`` / ``KURALLE_ALLOWED_HOSTS``). A page on
  any site can point its own name at 127.0.0.1 (DNS rebinding) and then read
  what a loopback server answers; the ``Host`` it sends is its own name,
  which the gate refuses before anything is read. (Starlette's
  ``TrustedHostMiddleware`` makes the same check but answers in plain text,
  and the API's every refusal is a JSON error.)
- ``Server``: uvicorn, but a SIGINT/SIGTERM stop returns to the caller, so
  the command closes its store after the last request instead of being ended
  by the re-raised signal.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import threading
from collections.abc import Callable, Iterable, Iterator

import uvicorn
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import InvalidArgumentError, KuralleError

__all__ = [
    "ALLOWED_HOSTS_ENV",
    "STOP_SIGNALS",
    "HostGate",
    "Server",
    "UnservedHostError",
    "is_loopback",
    "refuse_open_bind",
    "served_hosts",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
ALLOWED_HOSTS_ENV = "KURALLE_ALLOWED_HOSTS"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
#: The names in-process test clients send: Starlette's ``TestClient``
#: (``testserver``) and httpx's ``ASGITransport`` as FastAPI's docs set it up
#: (``test``). An app made without ``host`` (not told where it is served)
#: answers them besides the loopback names, so it can be tested as it is made;
#: neither is a public DNS name ("test" is reserved by RFC 2606), and the
#: servers (``kuralle-es serve``, ``kuralle-es dashboard``) always give ``host``.
TEST_CLIENT_NAMES = frozenset({"testserver", "test"})
#: A ``Host`` header: a name or an IPv6 address in brackets, and perhaps a port.
_HOST = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::\d*)?")


def is_loopback(host: str) -> bool:
    """True for hosts only this machine can reach (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def refuse_open_bind(
    host: str | None, token: str | None, *, server: str, data: str, token_env: str
) -> None:
    """Refuse to serve ``data`` beyond this machine without a token: ``server`` binds a
    ``host`` other machines can reach only with ``token_env`` set (None: an app not
    told where it is served, taken as served on loopback)."""
    if not token and host is not None and not is_loopback(host):
        msg = (
            f"refusing to serve {server} on {host!r} without {token_env}: {data} would be "
            f"readable from other machines. Set {token_env} to a long random secret, or bind "
            "to 127.0.0.1"
        )
        raise InvalidArgumentError(msg)


class UnservedHostError(KuralleError):
    """A request whose ``Host`` header is not a name this server serves (answered 400)."""

    def __init__(self, host: str) -> None:
        self.host = host
        super().__init__(
            f"this server does not answer for the host {host!r}: if its clients reach it by "
            f"that name, restart it with --allowed-host NAME or {ALLOWED_HOSTS_ENV}"
        )


def host_name(header: str) -> str | None:
    """The name in a ``Host`` header (``name``, ``name:port``, ``[v6]:port``), lower case
    and without its port or brackets; None if the header is not of that form."""
    match = _HOST.fullmatch(header)
    return None if match is None else (match["v6"] or match["name"]).lower()


def served_hosts(host: str | None, allowed: Iterable[str] | None = None) -> frozenset[str]:
    """The names a server bound to ``host`` answers for: the loopback names if ``host``
    is loopback (and ``TEST_CLIENT_NAMES`` too when ``host`` is None: an app not told
    where it is served), and ``allowed`` (default: ``KURALLE_ALLOWED_HOSTS``,
    comma-separated). Refuses (``InvalidArgumentError``) a name that is not a host,
    or no name at all."""
    if allowed is None:
        allowed = os.environ.get(ALLOWED_HOSTS_ENV, "").split(",")
    if host is None:
        names = set(LOOPBACK_NAMES | TEST_CLIENT_NAMES)
    else:
        names = set(LOOPBACK_NAMES) if is_loopback(host) else set()
    for given in (a.strip() for a in allowed):
        bare_v6 = given.count(":") > 1 and not given.startswith("[")
        name = host_name(f"[{given}]" if bare_v6 else given)
        if given and name is None:
            msg = f"{given!r} is not a host name; give names like app.example.com or 10.0.0.5"
            raise InvalidArgumentError(msg)
        names |= {name} if name else set()
    if not names:
        msg = (
            f"a server bound to {host!r} answers only for the names its clients use: give "
            f"them with --allowed-host NAME (repeatable) or {ALLOWED_HOSTS_ENV}=name,name"
        )
        raise InvalidArgumentError(msg)
    return frozenset(names)


class HostGate:
    """ASGI middleware: a request whose ``Host`` is not served is refused with ``refuse``'s
    answer, before any route reads anything."""

    def __init__(
        self,
        app: ASGIApp,
        hosts: frozenset[str],
        refuse: Callable[[UnservedHostError], Response],
    ) -> None:
        self.app = app
        self.hosts = hosts
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = Headers(scope=scope).get("host", "")
            if host_name(header) not in self.hosts:
                await self.refuse(UnservedHostError(header))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Server(uvicorn.Server):
    """uvicorn, but a SIGINT/SIGTERM stop returns to the caller.

    uvicorn shuts down gracefully on those signals and then raises the signal
    again, which ends the process before the caller closes its store; here the
    stop is a plain return.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
