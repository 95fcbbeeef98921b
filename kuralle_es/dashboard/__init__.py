"""``kuralle-es dashboard``: web pages over the run views, and approve/deny buttons (API).

Install with the ``dashboard`` extra (Starlette, uvicorn, Jinja2). The README
section "Dashboard" says how to run it and what keeps it safe.
"""

from __future__ import annotations

from .app import REFRESH_SECONDS, RuntimeFactory, check_bind, create_app, serve
from .security import TOKEN_ENV

__all__ = ["REFRESH_SECONDS", "TOKEN_ENV", "RuntimeFactory", "check_bind", "create_app", "serve"]
