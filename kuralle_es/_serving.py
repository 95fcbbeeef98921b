"""Serving an ASGI app from a ``kuralle-es`` command: what the dashboard and the HTTP API share.

Internal module (the ``dashboard`` extra: uvicorn). Two pieces, each with a
reason to live once:

- ``refuse_open_bind(...)``: both servers refuse to bind beyond this machine
  without their token (README, "The dashboard"; docs/http.md, "Security"),
  in the same words.
- ``Server``: uvicorn, but a SIGINT/SIGTERM stop returns to the caller, so
  the command closes its store after the last request instead of being ended
  by the re-raised signal.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import threading
from collections.abc import Iterator

import uvicorn

from .errors import InvalidArgumentError

__all__ = ["STOP_SIGNALS", "Server", "is_loopback", "refuse_open_bind"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def is_loopback(host: str) -> bool:
    """True for hosts only this machine can reach (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def refuse_open_bind(
    host: str, token: str | None, *, server: str, data: str, token_env: str
) -> None:
    """Refuse to serve ``data`` beyond this machine without a token: ``server`` binds a
    ``host`` other machines can reach only with ``token_env`` set."""
    if not token and not is_loopback(host):
        msg = (
            f"refusing to serve {server} on {host!r} without {token_env}: {data} would be "
            f"readable from other machines. Set {token_env} to a long random secret, or bind "
            "to 127.0.0.1"
        )
        raise InvalidArgumentError(msg)


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
