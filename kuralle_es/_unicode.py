"""Text the journal can always store: a lone surrogate written as its escape (internal).

An error's message is journaled whatever raised it, so its text must never be
refused the way a tool's result with a lone surrogate is (docs/guarantees.md,
"At the edges").
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str) -> str:
    """``text`` with any lone surrogate written as its escape (``\\udcff``)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
