"""The dashboard's gate: who may change a run, and from which page (internal).

Three rules, each with its reason:

- **Loopback by default.** Run data (messages, tool arguments) is private; a
  dashboard bound to another interface must have ``KURALLE_DASHBOARD_TOKEN``
  set, and then every page asks for it, not only the buttons.
- **The token for every state change.** An operator logs in once with the
  token and a name; the server answers with a session cookie signed by a
  per-process secret (HttpOnly, SameSite=Strict). The name becomes the
  ``actor`` of each decision. Without the token configured, the dashboard is
  read-only.
- **CSRF on every form**: a signed double-submit token. The browser holds a
  random nonce in a cookie; each form carries HMAC(secret, nonce), which a
  page on another site can neither read nor compute. A request whose
  ``Origin`` names another site is refused as well.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass

from .._serving import is_loopback  # shared with the HTTP API; re-exported here

__all__ = [
    "CSRF_COOKIE",
    "SESSION_COOKIE",
    "TOKEN_ENV",
    "Gate",
    "Operator",
    "is_loopback",
    "valid_operator_name",
]

TOKEN_ENV = "KURALLE_DASHBOARD_TOKEN"
SESSION_COOKIE = "kuralle_dashboard_session"
CSRF_COOKIE = "kuralle_dashboard_csrf"
SESSION_SECONDS = 12 * 3600
_OPERATOR_NAME = re.compile(r"^[\w.@+ -]{1,64}$")


def valid_operator_name(name: str) -> bool:
    """A name that reads well as a journaled ``actor``: letters, digits, ``.@+-_``, spaces."""
    return bool(_OPERATOR_NAME.match(name)) and bool(name.strip())


@dataclass(frozen=True)
class Operator:
    """Who is logged in: the name journaled as the actor of their decisions."""

    name: str


class Gate:
    """Checks the token, signs sessions and CSRF tokens with one per-process secret."""

    def __init__(self, token: str | None) -> None:
        self._token = token or None
        # A fresh secret per process: restarting the dashboard logs everyone out,
        # and no signing key is ever stored or derived from anything guessable.
        self._secret = secrets.token_bytes(32)

    @property
    def writable(self) -> bool:
        """Whether state changes are possible at all (a token is configured)."""
        return self._token is not None

    def token_matches(self, offered: str) -> bool:
        if self._token is None:
            return False
        return hmac.compare_digest(offered.encode(), self._token.encode())

    # -------------------------------------------------------------- sessions
    def session_cookie(self, operator: Operator) -> str:
        body = json.dumps({"op": operator.name, "exp": int(time.time()) + SESSION_SECONDS})
        encoded = base64.urlsafe_b64encode(body.encode()).decode()
        return f"{encoded}.{self._sign('session', encoded)}"

    def operator(self, cookie: str | None) -> Operator | None:
        """The logged-in operator of a session cookie, or None if absent, forged or stale."""
        if self._token is None or not cookie or "." not in cookie:
            return None
        encoded, _, signature = cookie.rpartition(".")
        if not hmac.compare_digest(signature, self._sign("session", encoded)):
            return None
        try:
            body = json.loads(base64.urlsafe_b64decode(encoded.encode()))
        except ValueError:
            return None
        if not isinstance(body, dict) or int(body.get("exp", 0)) < time.time():
            return None
        name = body.get("op")
        return Operator(name) if isinstance(name, str) and valid_operator_name(name) else None

    # ------------------------------------------------------------------ csrf
    @staticmethod
    def new_csrf_nonce() -> str:
        return secrets.token_urlsafe(24)

    def csrf_token(self, nonce: str) -> str:
        """The value a form must carry for the browser holding ``nonce`` in its cookie."""
        return self._sign("csrf", nonce)

    def csrf_ok(self, nonce: str | None, offered: str | None) -> bool:
        if not nonce or not offered:
            return False
        return hmac.compare_digest(offered, self.csrf_token(nonce))

    def _sign(self, purpose: str, value: str) -> str:
        message = f"{purpose}:{value}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()
