"""The HTTP API's gate: a bearer token on every request, or read-only on loopback (internal).

Two rules, each with its reason (docs/http.md, "Security"):

- **With ``KURALLE_API_TOKEN`` set**, every request carries
  ``Authorization: Bearer <token>``, compared in constant time
  (``hmac.compare_digest``) so the answer's timing tells nothing of the
  token; without it the answer is 401. Run data is private, so reads need it too.
- **Without the variable**, the server only binds to loopback (``check_bind``,
  at start) and refuses every state change with 403: anything that can reach
  the port could otherwise approve a payment.

The gate is plain ASGI middleware, in front of routing, so an unknown path
or method is refused the same way as a known one.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from .._serving import refuse_open_bind, served_hosts
from .errors import ReadOnlyServerError, UnauthorizedError, error_response

__all__ = ["READ_METHODS", "TOKEN_ENV", "BearerGate", "check_bind"]

TOKEN_ENV = "KURALLE_API_TOKEN"
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def check_bind(
    host: str | None, token: str | None, allowed_hosts: Iterable[str] | None = None
) -> frozenset[str]:
    """Refuse to serve run data beyond this machine without a token, or on an interface
    with no host name to answer for; the names it answers for (``served_hosts``)."""
    refuse_open_bind(host, token, server="the HTTP API", data="runs", token_env=TOKEN_ENV)
    return served_hosts(host, allowed_hosts)


class BearerGate:
    """ASGI middleware: 401 without the token (when one is set), 403 for a write without one."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self._token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(refusal, UnauthorizedError) else {}
        await error_response(refusal, headers)(scope, receive, send)

    def _refusal(self, scope: Scope) -> Exception | None:
        if self._token is None:
            if scope["method"] in READ_METHODS:
                return None
            return ReadOnlyServerError(
                f"this server was started without {TOKEN_ENV}, so it only reads: restart it "
                f"with {TOKEN_ENV} set to a long random secret and send "
                "'Authorization: Bearer <token>'"
            )
        scheme, _, offered = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            offered.strip().encode("latin-1"), self._token
        ):
            return None
        return UnauthorizedError(
            f"this request needs 'Authorization: Bearer <token>' with the server's {TOKEN_ENV}"
        )
