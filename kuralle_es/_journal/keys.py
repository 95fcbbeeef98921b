"""Canonical JSON and the hashes built on it.

Keys must be equal across processes, machines and Python versions, so the
encoding is pinned: keys sorted, no whitespace, UTF-8, no NaN or Infinity.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = [
    "canonical_json",
    "idempotency_key",
    "logical_run_id",
    "sha256_hex",
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
