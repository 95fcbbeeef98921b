"""``kuralle-es serve``: the HTTP API under uvicorn until SIGINT/SIGTERM (internal).

One process, one ``Runtime``: each request that starts or delivers is a turn
driven within the request (docs/http.md). Nothing here needs to survive the
process: a run's every step is in the store, so a server killed mid-way is
replaced by starting another on the same store (the kill-and-resume test,
tests/test_http_api.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

import uvicorn

from .._runtime.runtime import Runtime
from .._serving import Server
from .app import create_app
from .auth import TOKEN_ENV

__all__ = ["serve"]


async def serve(
    runtime: Runtime,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    *,
    allowed_hosts: Iterable[str] | None = None,
    store_label: str | None = None,
) -> None:
    """Serve the API over ``runtime`` until SIGINT/SIGTERM; ``token`` defaults to the
    environment's ``KURALLE_API_TOKEN``; a non-loopback ``host`` needs one, and the
    names clients reach it by (``allowed_hosts``, default ``KURALLE_ALLOWED_HOSTS``).
    ``store_label`` (no password in it) names the store on the start line."""
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    app = create_app(runtime, token=token, host=host, allowed_hosts=allowed_hosts)
    mode = "bearer token required" if token else f"read-only: {TOKEN_ENV} is unset"
    over = f", store {store_label}" if store_label else ""
    line = f"kuralle-es: HTTP API on http://{host}:{port}/ ({mode}{over})"
    print(line, file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", server_header=False)
    await Server(config).serve()
