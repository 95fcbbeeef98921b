"""How the HTTP API says no: an error class to a status, and the error as JSON (internal).

Every refusal is ``{"error": <class>, "message": ..., "fields": {...}}`` with
a 4xx status (docs/http.md, "Errors"). A refusal is raised before a turn
opens its run, so it wrote nothing (docs/contract.md, "Bad input"). FastAPI's
and Starlette's own refusals (a request that does not fit its model, a body
over the bound or not JSON, a path or method no route serves) are answered
as the library's errors, in the same shape. The statuses:

- 404 ``RunNotFoundError`` (and a path no route serves);
- 409 the run's state refuses the request: ``SignalMismatchError``,
  ``LeaseHeldError``, ``FlowDriftError``, ``StaleWriteError``, any other
  refusal of the library;
- 413 ``PayloadTooLargeError`` (a request body or a payload over the bound);
- 422 bad input: ``InvalidArgumentError`` (a body that is not JSON or does not
  fit its model, a bad query parameter or header, a bad id), ``InvalidSignalError``,
  and ``FlowNotFoundError`` (the flow is named in the body, not the path: the
  request is what is wrong, not the URL);
- 400 ``UnservedHostError`` (a ``Host`` this server does not serve), 401
  ``UnauthorizedError``, 403 ``ReadOnlyServerError``, 405 ``MethodNotAllowedError``;
- 503 ``StoreUnavailableError``; 500 anything else, which the library leaves
  whole: a turn cut off mid-way keeps its lease until it expires, and
  recovery drives it again (README, "Recovery, sweeps and durable sleep").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Match, Route

from .._journal.json_data import plain_json_problem
from .._runtime.observability import LOGGER_NAME
from .._serving import UnservedHostError
from ..errors import (
    EncryptionKeyError,
    FlowDriftError,
    FlowNotFoundError,
    IdempotencyConflictError,
    InvalidArgumentError,
    InvalidSignalError,
    KuralleError,
    LeaseHeldError,
    PayloadTooLargeError,
    RunNotFoundError,
    SignalMismatchError,
    StaleWriteError,
    StoreUnavailableError,
    UnrecordableValueError,
)

__all__ = [
    "InvalidRequestError",
    "MethodNotAllowedError",
    "ReadOnlyServerError",
    "UnauthorizedError",
    "UnknownRouteError",
    "error_response",
    "refusal_response",
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
    (UnservedHostError, 400),
    (UnauthorizedError, 401),
    (ReadOnlyServerError, 403),
    (RunNotFoundError, 404),
    (UnknownRouteError, 404),
    (MethodNotAllowedError, 405),
    (IdempotencyConflictError, 409),
    (SignalMismatchError, 409),
    (LeaseHeldError, 409),
    (FlowDriftError, 409),
    (StaleWriteError, 409),
    (PayloadTooLargeError, 413),
    (FlowNotFoundError, 422),
    (InvalidSignalError, 422),
    (InvalidArgumentError, 422),
    (UnrecordableValueError, 422),
    (StoreUnavailableError, 503),
    (EncryptionKeyError, 503),
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


def refusal_response(request: Request, error: BaseException) -> JSONResponse:
    """``error_response`` for any error of a request, FastAPI's and Starlette's own
    refusals (``HTTPException``, ``RequestValidationError``) as the library's errors."""
    if isinstance(error, RequestValidationError):
        return error_response(_invalid_request(error.errors()))
    if not isinstance(error, HTTPException):
        return error_response(error)
    path = request.url.path
    if error.status_code == 404:
        return error_response(UnknownRouteError(path))
    if error.status_code == 405:
        allow = ", ".join(sorted(_methods_of(request)))
        return error_response(MethodNotAllowedError(request.method, path), {"Allow": allow})
    # FastAPI's 400 is a body it could not read: over the bound (its cause, a
    # PayloadTooLargeError), or not UTF-8, or nested past Python's limit.
    if isinstance(error.__cause__, KuralleError):
        return error_response(error.__cause__)
    reason = error.__cause__ or error.detail
    problem = {"field": "body", "problem": f"not JSON: {reason}"}
    msg = f"the request body is not JSON ({reason}); send a JSON object"
    return error_response(InvalidRequestError(msg, "body", [problem]))


def _methods_of(request: Request) -> set[str]:
    """Every method some route takes on this path (each route of FastAPI takes its own)."""
    return {
        method
        for route in request.app.router.routes
        if isinstance(route, Route) and route.matches(request.scope)[0] is not Match.NONE
        for method in route.methods or ()
    }


def _invalid_request(errors: Sequence[Any]) -> InvalidRequestError:
    """FastAPI's validation errors as the API's 422: where (body, query, header) and what."""
    where = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else "request"
    problems = []
    for e in errors:
        place, *inside = e["loc"] or (where,)
        if e["type"] == "json_invalid":
            problem = {"field": "body", "problem": f"not JSON: {e['ctx']['error']}"}
        else:
            problem = {"field": ".".join(str(p) for p in inside) or str(place), "problem": e["msg"]}
        problems.append(problem)
    said = "; ".join(f"{p['field']}: {p['problem']}" for p in problems)
    return InvalidRequestError(f"invalid request {where}: {said}", where, problems)


def unknown_run(run_id: str) -> RunNotFoundError:
    """The 404 of a route that names only the run (its session is the store's to say)."""
    error = RunNotFoundError(run_id, "")
    error.args = (f"no run {run_id!r} in this store; check the run id",)
    return error
