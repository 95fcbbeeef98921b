"""What stands for the worker process dying at a point: ``Crash`` (API, via ``testing``).

It lives below every layer because the one place a tool is invoked must know
it: tool code's other ``BaseException``s (``SystemExit``, ``KeyboardInterrupt``)
fail the attempt like any exception, so a tool cannot kill its worker, while
a ``Crash`` passes through untouched, so a crash-injection suite can still
kill a turn inside a tool or a model call (docs/guarantees.md, "At the edges").
"""

from __future__ import annotations

__all__ = ["Crash"]


class Crash(BaseException):
    """The worker process dies here: not an ``Exception``, so nothing catches it."""
