"""How a user's callable wants to be called (internal).

A tool's ``execute`` may take ``(args)`` or ``(args, call)``, and a
``Consumer`` handler ``(event)`` or ``(event, tx)``: both are told apart once,
by the signature, here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["wants_call"]


def wants_call(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes a second positional argument (a tool's ``ToolCall``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return len(positional) >= 2 or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
