"""A key looked up among the known ones, or the caller's argument refused (internal).

An agent's id (``Runtime.agent``) and a tool call's id (the Pydantic AI
integration's callsites) are looked up the same way: None, or a key the
mapping lacks, is a bad argument, and the message says what is known.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from .errors import InvalidArgumentError

__all__ = ["known_entry"]

K = TypeVar("K")
V = TypeVar("V")


def known_entry(mapping: Mapping[K, V], key: K | None, refusal: str) -> V:
    """``mapping[key]``, or ``InvalidArgumentError(refusal)`` when ``key`` is None or
    not in ``mapping`` (a caller's mistake, not a missing record: nothing was written)."""
    if key is None or key not in mapping:
        raise InvalidArgumentError(refusal)
    return mapping[key]
