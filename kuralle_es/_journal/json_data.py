"""What the journal holds: plain JSON data, within a size bound (internal).

Every tool result, signal payload, state bag and model response is journaled
as JSON text. ``plain_json_problem`` says why a value could not be stored and
read back exactly; ``encode_json`` writes one, refusing what JSON cannot hold
and what is over ``KURALLE_MAX_PAYLOAD_BYTES`` (docs/contract.md, "Bad input").
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from pydantic import BaseModel

from ..errors import InvalidArgumentError, PayloadTooLargeError, UnrecordableValueError

__all__ = [
    "MAX_JSON_DEPTH",
    "check_size",
    "decode_json",
    "encode_json",
    "max_payload_bytes",
    "plain_json_problem",
    "unicode_problem",
]

#: The deepest nesting of JSON data the journal accepts.
MAX_JSON_DEPTH = 100


def decode_json(text: str | bytes) -> Any:
    """``json.loads``, whose every refusal is a ``ValueError`` that says why. A
    document nested deeper than the decoder goes (thousands of brackets in a
    form field or a flag) makes it raise ``RecursionError``, which a caller's
    ``except ValueError`` would miss: a crash instead of a refusal."""
    try:
        return json.loads(text)
    except RecursionError:
        msg = f"it is nested too deeply (JSON here is nested at most {MAX_JSON_DEPTH} deep)"
        raise ValueError(msg) from None


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


_DEFAULT_MAX_PAYLOAD_BYTES = 1_000_000


def max_payload_bytes() -> int:
    """The size bound of a journaled result or payload (``KURALLE_MAX_PAYLOAD_BYTES``)."""
    raw = os.environ.get("KURALLE_MAX_PAYLOAD_BYTES")
    if raw is None:
        return _DEFAULT_MAX_PAYLOAD_BYTES
    try:
        value = int(raw)
    except ValueError:
        msg = f"KURALLE_MAX_PAYLOAD_BYTES must be a whole number of bytes, got {raw!r}"
        raise InvalidArgumentError(msg) from None
    if value <= 0:
        msg = f"KURALLE_MAX_PAYLOAD_BYTES must be positive, got {value}"
        raise InvalidArgumentError(msg)
    return value


def check_size(text: str, what: str) -> None:
    """``PayloadTooLargeError`` naming ``what`` when ``text`` is over the size bound
    (counted in UTF-8 bytes, as it is stored)."""
    size = len(text.encode("utf-8"))
    limit = max_payload_bytes()
    if size > limit:
        raise PayloadTooLargeError(what, size, limit)


def _dump_model(value: object) -> object:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    msg = f"{type(value).__name__} is not JSON-serialisable"
    raise TypeError(msg)


def _dumped(value: Any) -> Any:
    """``value`` with its pydantic models dumped, for ``plain_json_problem`` to walk."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: _dumped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_dumped(v) for v in value]
    return value


def _problem(value: Any) -> str | None:
    """What keeps ``value`` out of the journal, with its path (the slow path, taken
    only once the fast one failed or the value may be nested too deep): the walk
    that needs no recursion first (depth, NaN, lone surrogates), then one over the
    value with its pydantic models dumped (objects with no JSON form)."""
    problem = plain_json_problem(value, other_types_ok=True)
    if problem is not None:
        return problem
    try:
        return plain_json_problem(_dumped(value))
    except RecursionError:  # pragma: no cover - the first walk found the depth
        return f"is nested deeper than {MAX_JSON_DEPTH} levels"


def encode_json(value: Any, what: str) -> str:
    """JSON text of ``value`` for the journal (pydantic models dumped), within the bound.

    The one door every journaled value passes (tool results, model responses,
    state bags, outputs, messages, payloads): ``UnrecordableValueError`` (a
    ``TypeError``) naming ``what`` and the value's path for anything JSON cannot
    hold exactly (NaN, a lone surrogate, nesting deeper than ``MAX_JSON_DEPTH``,
    an object with no JSON form), ``PayloadTooLargeError`` over the bound.
    """
    try:
        text = json.dumps(value, default=_dump_model, ensure_ascii=False, allow_nan=False)
        size = len(text.encode("utf-8"))
    except (TypeError, ValueError, RecursionError) as e:  # UnicodeEncodeError: a ValueError
        raise UnrecordableValueError(what, _problem(value) or f"fails to encode ({e})") from None
    # Nesting is counted only where it may be too deep (brackets inside strings
    # count too: the walk then finds nothing and the value passes).
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        problem = _problem(value)
        if problem is not None:
            raise UnrecordableValueError(what, problem)
    limit = max_payload_bytes()
    if size > limit:
        raise PayloadTooLargeError(what, size, limit)
    return text
