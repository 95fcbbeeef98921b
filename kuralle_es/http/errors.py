"""How the HTTP API says no: an error class to a status, and the error as JSON (internal).

Every refusal is ``{"error": <class>, "message": ..., "fields": {...}}`` with
a 4xx status (docs/http.md, "Errors"). A refusal is raised before a turn
opens its run, so it wrote nothing (docs/contract.md, "Bad input"). The
statuses:

- 404 ``RunNotFoundError`` (and a path no route serves);
- 409 the run's state refuses the request: ``SignalMismatchError``,
  ``LeaseHeldError``, ``FlowDriftError``, ``StaleWriteError``, any other
  refusal of the library;
- 413 ``PayloadTooLargeError`` (a request body or a payload over the bound);
- 422 bad input: ``InvalidArgumentError`` (a body that is not JSON or does not
  fit its model, a bad query parameter or header, a bad id), ``InvalidSignalError``,
  and ``FlowNotFoundError`` (the flow is named in the body, not the path: the
  request is what is wrong, not the URL);
- 401 ``UnauthorizedError``, 403 ``ReadOnlyServerError``, 405 ``MethodNotAllowedError``;
- 503 ``StoreUnavailableError``; 500 anything else, which the library leaves
  whole: a turn cut off mid-way keeps its lease until it expires, and
  recovery drives it again (README, "Recovery, sweeps and durable sleep").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from .._journal.json_data import plain_json_problem
from .._runtime.observability import LOGGER_NAME
from ..errors import (
    FlowDriftError,
    FlowNotFoundError,
    InvalidArgumentError,
    InvalidSignalError,
    KuralleError,
    LeaseHeldError,
    PayloadTooLargeError,
    RunNotFoundError,
    SignalMismatchError,
    StaleWriteError,
    StoreUnavailableError,
)

__all__ = [
    "InvalidRequestError",
    "MethodNotAllowedError",
    "ReadOnlyServerError",
    "UnauthorizedError",
    "UnknownRouteError",
    "error_response",
    "invalid_request",
    "status_of",
    "unknown_run",
]

_log = logging.getLogger(f"{LOGGER_NAME}.http")


class UnauthorizedError(KuralleError):
    """No ``Authorization: Bearer <KURALLE_API_TOKEN>`` header, or another token."""


class ReadOnlyServerError(KuralleError):
    """A state change asked of a server started without ``KURALLE_API_TOKEN``."""


class UnknownRouteError(KuralleError, LookupError):
    """A path the API does not serve."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"no route {path!r}; the routes are listed in /openapi.json")


class MethodNotAllowedError(KuralleError):
    """A method the path does not take (the ``Allow`` header says which it does)."""

    def __init__(self, method: str, path: str) -> None:
        self.method = method
        self.path = path
        super().__init__(f"{path} does not take {method}; see the Allow header")


class InvalidRequestError(InvalidArgumentError):
    """A request the API cannot read: its body is not JSON or does not fit its model, or a
    query parameter or header is bad. Answered as its base, ``InvalidArgumentError``: to a
    caller it is the same refusal as a bad argument to the Python API."""

    def __init__(self, message: str, where: str, problems: list[dict[str, str]]) -> None:
        self.where = where
        self.problems = problems
        super().__init__(message)


#: The status of each refusal; the first class an error is an instance of wins.
_STATUSES: tuple[tuple[type[BaseException], int], ...] = (
    (UnauthorizedError, 401),
    (ReadOnlyServerError, 403),
    (RunNotFoundError, 404),
    (UnknownRouteError, 404),
    (MethodNotAllowedError, 405),
    (SignalMismatchError, 409),
    (LeaseHeldError, 409),
    (FlowDriftError, 409),
    (StaleWriteError, 409),
    (PayloadTooLargeError, 413),
    (FlowNotFoundError, 422),
    (InvalidSignalError, 422),
    (InvalidArgumentError, 422),
    (StoreUnavailableError, 503),
)


def status_of(error: BaseException) -> int:
    """The HTTP status that says what kind of refusal (or failure) ``error`` is."""
    for kind, status in _STATUSES:
        if isinstance(error, kind):
            return status
    return 409 if isinstance(error, KuralleError) else 500


def _name(error: BaseException) -> str:
    if isinstance(error, InvalidRequestError):
        return "InvalidArgumentError"
    return type(error).__name__


def _fields(error: BaseException) -> dict[str, Any]:
    """The error's public attributes that are JSON (a datetime as ISO 8601, a tuple as a list)."""
    out: dict[str, Any] = {}
    for name, value in vars(error).items():
        if name.startswith("_"):
            continue
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, tuple):
            value = list(value)
        if plain_json_problem(value) is None:
            out[name] = value
    return out


def error_response(error: BaseException, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The JSON error for ``error``; a 5xx is logged with its traceback (the body says little)."""
    status = status_of(error)
    if status >= 500 and not isinstance(error, StoreUnavailableError):
        _log.error("request failed", exc_info=error)
        body = {
            "error": "InternalServerError",
            "message": (
                f"the server failed ({type(error).__name__}); nothing of this request is half "
                "written: a turn cut off mid-way is finished by recovery. See the server's log"
            ),
            "fields": {},
        }
    else:
        body = {"error": _name(error), "message": str(error), "fields": _fields(error)}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def unknown_run(run_id: str) -> RunNotFoundError:
    """The 404 of a route that names only the run (its session is the store's to say)."""
    error = RunNotFoundError(run_id, "")
    error.args = (f"no run {run_id!r} in this store; check the run id",)
    return error


def invalid_request(where: str, error: ValidationError) -> InvalidRequestError:
    """A pydantic ``ValidationError`` of ``where`` (body, query) as the API's 422."""
    problems = [
        {"field": ".".join(str(p) for p in e["loc"]) or where, "problem": e["msg"]}
        for e in error.errors(include_url=False, include_input=False)
    ]
    said = "; ".join(f"{p['field']}: {p['problem']}" for p in problems)
    return InvalidRequestError(f"invalid request {where}: {said}", where, problems)
