"""Canonical JSON and the hashes built on it.

Keys must be equal across processes, machines and Python versions, so the
encoding is pinned: keys sorted, no whitespace, UTF-8, no NaN or Infinity.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

__all__ = [
    "MAX_JSON_DEPTH",
    "canonical_json",
    "idempotency_key",
    "logical_run_id",
    "plain_json_problem",
    "sha256_hex",
    "unicode_problem",
]


def canonical_json(value: Any) -> str:
    """The one JSON encoding of ``value`` that every key and digest hashes."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def idempotency_key(logical_run_id: str, callsite: int, payload: Any) -> str:
    """SHA-256 of ``{"run": logical_run_id, "callsite": callsite, "payload": payload}``."""
    return sha256_hex(
        canonical_json({"run": logical_run_id, "callsite": callsite, "payload": payload})
    )


def logical_run_id(
    run_id: str, epoch: int, flow_name: str | None = None, flow_digest: str | None = None
) -> str:
    """``<run_id>#<epoch>``, or ``<run_id>#<epoch>#<flow>@<digest>`` inside a flow."""
    base = f"{run_id}#{epoch}"
    if flow_name is None:
        return base
    return f"{base}#{flow_name}@{flow_digest}"


#: The deepest nesting of JSON data the journal accepts.
MAX_JSON_DEPTH = 64


def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds a lone surrogate {text[e.start]!r} at position {e.start} (not valid Unicode)"
    return None


def plain_json_problem(value: Any, *, other_types_ok: bool = False) -> str | None:
    """What keeps ``value`` from being plain JSON data, or None.

    Plain means what the journal stores exactly and reads back equal: objects
    with string keys, arrays, strings of valid Unicode, finite numbers,
    booleans and null, nested at most ``MAX_JSON_DEPTH`` deep. (``json.dumps``
    alone would turn a key ``1`` into ``"1"``, or fail later on a lone
    surrogate.) With ``other_types_ok``, values of other types and non-string
    keys are let through unexamined (a pydantic model's Python-mode dump, whose
    JSON mode converts them), while NaN, Infinity and lone surrogates are not.
    """
    stack: list[tuple[Any, str, int]] = [(value, "$", 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"is nested deeper than {MAX_JSON_DEPTH} levels (at {path})"
        if item is None or isinstance(item, bool | int):
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                return f"holds {item!r} at {path} (JSON has no NaN or Infinity)"
        elif isinstance(item, str):
            problem = unicode_problem(item)
            if problem is not None:
                return f"has a string at {path} that {problem}"
        elif isinstance(item, dict):
            for key, inner in item.items():
                if isinstance(key, str):
                    problem = unicode_problem(key)
                    if problem is not None:
                        return f"has a key at {path} that {problem}"
                elif not other_types_ok:
                    return f"has a key {key!r} at {path} that is not a string"
                stack.append((inner, f"{path}.{key}", depth + 1))
        elif isinstance(item, list | tuple):
            stack.extend((inner, f"{path}[{i}]", depth + 1) for i, inner in enumerate(item))
        elif not other_types_ok:
            return f"holds a {type(item).__name__} at {path}, which is not JSON"
    return None
