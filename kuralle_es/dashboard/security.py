"""The dashboard's gate: who may read and change runs, and from which page (internal).

Three rules, each with its reason:

- **Loopback by default; with a token, the login for every page.** Run data
  (messages, tool arguments) is private: a dashboard bound to another
  interface must have ``KURALLE_DASHBOARD_TOKEN`` set, and with it set every
  page asks for the login, on loopback too (anything else that runs on this
  machine could read them otherwise).
- **The token for every state change.** An operator logs in once with the
  token and a name; the login is kept in Starlette's session cookie
  (``SessionMiddleware``: signed with itsdangerous by a per-process secret,
  HttpOnly, SameSite=Strict), for 12 hours. The name becomes the ``actor``
  of each decision. Without the token configured, the dashboard is read-only.
- **CSRF on every form**: the session holds a random token and each form
  carries it back. A page on another site can neither read it nor forge the
  signed cookie that holds it. A request whose ``Origin`` names another site
  is refused as well.

A cookie that is not one this process signed (forged, truncated, of another
process, not ASCII) is an empty session, never an error.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware

__all__ = ["SESSION_COOKIE", "TOKEN_ENV", "Gate", "Operator", "valid_operator_name"]

TOKEN_ENV = "KURALLE_DASHBOARD_TOKEN"
SESSION_COOKIE = "kuralle_dashboard_session"
SESSION_SECONDS = 12 * 3600
_OPERATOR_NAME = re.compile(r"^[\w.@+ -]{1,64}$")

Session = dict[str, Any]


def valid_operator_name(name: str) -> bool:
    """A name that reads well as a journaled ``actor``: letters, digits, ``.@+-_``, spaces."""
    return bool(_OPERATOR_NAME.match(name)) and bool(name.strip())


@dataclass(frozen=True)
class Operator:
    """Who is logged in: the name journaled as the actor of their decisions."""

    name: str


def _same(offered: str, expected: str) -> bool:
    """A comparison in constant time that any text may be given to (``compare_digest``
    refuses a ``str`` that is not ASCII)."""
    return secrets.compare_digest(offered.encode(), expected.encode())


class Gate:
    """Checks the token, and keeps the login and the CSRF token in the signed session."""

    def __init__(self, token: str | None) -> None:
        self._token = token or None

    @property
    def writable(self) -> bool:
        """Whether state changes are possible at all (a token is configured); then every
        page needs the login too."""
        return self._token is not None

    def token_matches(self, offered: str) -> bool:
        return self._token is not None and _same(offered, self._token)

    @staticmethod
    def session_middleware() -> Middleware:
        # A fresh secret per process: restarting the dashboard logs everyone out,
        # and no signing key is ever stored or derived from anything guessable.
        return Middleware(
            SessionMiddleware,
            secret_key=secrets.token_urlsafe(32),
            session_cookie=SESSION_COOKIE,
            max_age=SESSION_SECONDS,
            same_site="strict",
        )

    @staticmethod
    def log_in(session: Session, operator: Operator) -> None:
        """A fresh session for ``operator``, valid ``SESSION_SECONDS`` from now (however
        often its pages refresh); its CSRF token is minted anew on the next page."""
        session.clear()
        session.update(operator=operator.name, until=time.time() + SESSION_SECONDS)

    def operator(self, session: Session) -> Operator | None:
        """The logged-in operator of the session, or None (none, or past its time)."""
        name, until = session.get("operator"), session.get("until")
        if self._token is None or not isinstance(name, str) or not valid_operator_name(name):
            return None
        return Operator(name) if isinstance(until, float) and until > time.time() else None

    @staticmethod
    def csrf_token(session: Session) -> str:
        """The value every form of this session carries back."""
        token = session.get("csrf")
        if not isinstance(token, str):
            token = session["csrf"] = secrets.token_urlsafe(32)
        return token

    @staticmethod
    def csrf_ok(session: Session, offered: str | None) -> bool:
        expected = session.get("csrf")
        return isinstance(expected, str) and offered is not None and _same(offered, expected)
