"""The HTTP API over runs and webhooks: ``create_app(runtime)`` and ``kuralle-es serve`` (API).

Install with the ``http`` extra (FastAPI, uvicorn). docs/http.md says
what each route does, how refusals look, and how the token keeps it safe;
``/openapi.json`` describes it for machines.
"""

from __future__ import annotations

from .app import create_app
from .auth import TOKEN_ENV, check_bind
from .server import serve

__all__ = ["TOKEN_ENV", "check_bind", "create_app", "serve"]
