"""Reading a request: a bounded JSON body into its model, query parameters, headers (internal).

The body is read up to a bound and no further (413 past it): one payload of
``KURALLE_MAX_PAYLOAD_BYTES`` (the library's own bound, README
"Configuration") and room for the short fields around it. What is read must
be plain JSON (``keys.plain_json_problem``: no NaN, no lone surrogate, not
nested without end) before its model sees it, so nothing the journal could
not store exactly gets as far as a turn.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from .._journal.json_data import max_payload_bytes, plain_json_problem
from ..errors import PayloadTooLargeError
from .errors import InvalidRequestError, invalid_request

__all__ = ["BODY_SLACK_BYTES", "IDEMPOTENCY_HEADER", "max_body_bytes", "read_body"]

M = TypeVar("M", bound=BaseModel)

#: Room in a body for what surrounds its payload (a signal's name, an approver, a reason).
BODY_SLACK_BYTES = 64 * 1024
IDEMPOTENCY_HEADER = "Idempotency-Key"


def max_body_bytes() -> int:
    """The largest request body read: one payload's bound and the fields around it."""
    return max_payload_bytes() + BODY_SLACK_BYTES


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse(raw: bytes) -> Any:
    if not raw.strip():
        return {}  # no body: the model then names the fields it needs
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        problem = {"field": "body", "problem": f"not JSON: {e}"}
        msg = f"the request body is not JSON ({e}); send a JSON object"
        raise InvalidRequestError(msg, "body", [problem]) from None


async def read_body(request: Request, model: type[M]) -> M:
    """The request's JSON body as ``model``; 413, or 422 (``InvalidArgumentError``), if not."""
    limit = max_body_bytes()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError("the request body", int(declared), limit)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise PayloadTooLargeError("the request body", len(raw), limit)
    data = _parse(bytes(raw))
    problem = plain_json_problem(data)
    if problem is not None:
        msg = f"the request body {problem}; send plain JSON"
        raise InvalidRequestError(msg, "body", [{"field": "body", "problem": problem}])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise invalid_request("body", e) from None
