"""The HTTP API's routes: each one call of the Python API, JSON in and out (internal).

``create_app(runtime)`` builds the ASGI app (docs/http.md). A route that
names only the run finds its session in the store, as the CLI's operator
commands do (``kuralle-es approve``): the caller holds the API token, so it
acts on behalf of the run's session. Starts and deliveries are turns of
``Runtime.run``, driven within the request to the run's next pause or end.

A turn refused before it opened its run (unknown run, mismatch, held lease,
bad input, ...) wrote nothing and is answered with its error
(``http/errors.py``). A turn that opened its run and then failed (a node
raised) has journaled that failure: the run is ``error`` (or, if a cancel
won meanwhile, ``aborted``) and the answer is its ``TurnResult``, as a
repeated ``GET`` would show it; the node's error is the run's ``RunState.error``.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._journal.json_data import encode_json
from .._journal.wait import INPUT, TIMER
from .._runtime.deliveries import approval_delivery
from .._runtime.handle import TurnHandle
from .._runtime.input_checks import check_id
from .._runtime.runtime import Runtime
from .._runtime.turn import result_of
from ..errors import InvalidSignalError
from ..shapes import SignalDelivery
from .auth import TOKEN_ENV, BearerGate
from .errors import (
    InvalidRequestError,
    MethodNotAllowedError,
    UnknownRouteError,
    error_response,
    invalid_request,
    unknown_run,
)
from .openapi import openapi_document
from .reading import IDEMPOTENCY_HEADER, read_body
from .shapes import Approval, Cancel, Input, ListQuery, Signal, StartRun

__all__ = ["create_app"]

Handler = Callable[[Request], Awaitable[Response]]


#: Waits the library delivers to itself: a signal of that name would be taken for them.
_NOT_SIGNALS = {
    INPUT: f"{INPUT!r} is a collect node's wait for input: POST the text to /input instead",
    TIMER: f"{TIMER!r} is a durable sleep's wait: the sweeper wakes it (kuralle-es worker)",
}


def _json(value: BaseModel | list[Any]) -> JSONResponse:
    if isinstance(value, BaseModel):
        return JSONResponse(value.model_dump(mode="json"))
    return JSONResponse([item.model_dump(mode="json") for item in value])


def _opened(handle: TurnHandle) -> bool:
    """Whether the turn opened its run (saved its first event) before it ended."""
    run_id = handle.run_id
    return run_id.done() and not run_id.cancelled() and run_id.exception() is None


class _Api:
    def __init__(self, runtime: Runtime, bearer: bool) -> None:
        self.runtime = runtime
        self.store = runtime.store
        self.bearer = bearer
        self._document: dict[str, Any] | None = None

    # ------------------------------------------------------------- plumbing
    async def session_of(self, run_id: str) -> str:
        """The session of the run, read from the store (404 if there is no such run)."""
        run = await self.store.load_async(run_id)
        if run is None:
            raise unknown_run(run_id)
        return run.session_id

    async def turn(self, handle: TurnHandle) -> Response:
        """The turn's result; its refusal raised; a failure it journaled as the run's result."""
        try:
            return _json(await handle.result())
        except Exception:
            if not _opened(handle):
                raise  # refused before its first save: nothing was written
            run = await self.store.load_async(handle.run_id.result())
            if run is None or run.status == "running":
                raise  # cut off, not closed: the lease expires and recovery drives it
            return _json(result_of(run))

    @staticmethod
    def key(request: Request) -> str | None:
        """The ``Idempotency-Key`` header, if sent; an empty or malformed one is refused
        (422) rather than taken for no key."""
        value = request.headers.get(IDEMPOTENCY_HEADER)
        return None if value is None else check_id(value, f"the {IDEMPOTENCY_HEADER} header")

    # ---------------------------------------------------------------- reads
    async def runs(self, request: Request) -> Response:
        """``/api/runs``: one route for both methods, so a 405 lists both in ``Allow``."""
        return await (self.start(request) if request.method == "POST" else self.list_runs(request))

    async def openapi(self, request: Request) -> Response:
        if self._document is None:
            flows = {f for a in self.runtime.agents.values() for f in a.flows}
            self._document = openapi_document(sorted(flows), bearer=self.bearer)
        return JSONResponse(self._document)

    async def list_runs(self, request: Request) -> Response:
        params = request.query_params
        try:
            query = ListQuery.model_validate(
                {k: params[k] for k in ListQuery.model_fields if k in params}
            )
        except ValidationError as e:
            raise invalid_request("query", e) from None
        summaries = await self.runtime.views.list_runs(
            status=query.status, session_id=query.session_id, flow=query.flow, limit=query.limit
        )
        return _json(summaries)

    async def get_run(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        run = await self.store.load_async(run_id)
        if run is None:
            raise unknown_run(run_id)
        return _json(run.to_state(await self.store.lease_async(run_id)))

    async def get_steps(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        run = await self.store.load_async(run_id, history=True)
        if run is None:
            raise unknown_run(run_id)
        return _json(run.step_records())

    # --------------------------------------------------------------- writes
    async def start(self, request: Request) -> Response:
        body = await read_body(request, StartRun)
        handle = self.runtime.run(
            session_id=body.session_id,
            kind="flow",
            flow_name=body.flow,
            input=body.input,
            idempotency_key=self.key(request),
        )
        return await self.turn(handle)

    async def signal(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        body = await read_body(request, Signal)
        signal_id = self.key(request)
        if signal_id is None:
            problem = {"field": IDEMPOTENCY_HEADER, "problem": "is required"}
            msg = (
                f"a signal needs the {IDEMPOTENCY_HEADER} header: it is the delivery's "
                "signal_id, which makes a retried delivery a no-op"
            )
            raise InvalidRequestError(msg, "header", [problem])
        if body.name in _NOT_SIGNALS:
            raise InvalidSignalError(body.name, _NOT_SIGNALS[body.name])
        # Exactly ``Runtime.signal``, through ``run`` for the turn's handle.
        delivery = SignalDelivery(signal_id=signal_id, name=body.name, payload=body.payload)
        return await self.deliver(run_id, delivery)

    def decide(self, approved: bool) -> Handler:
        async def handler(request: Request) -> Response:
            body = await read_body(request, Approval)
            # Exactly ``Runtime.approve``/``deny``, through ``run`` for the turn's handle.
            delivery = approval_delivery(
                approved=approved,
                by=body.by,
                reason=body.reason,
                signal_id=self.key(request),
                raise_to=body.raise_to,
            )
            return await self.deliver(request.path_params["run_id"], delivery)

        return handler

    async def deliver(self, run_id: str, delivery: SignalDelivery) -> Response:
        # The library refuses an oversized payload as InvalidSignalError (422); here it
        # is the 413 of a body too large, measured as the journal will (``encode_json``).
        encode_json(delivery.payload, f"the payload of signal {delivery.name!r}")
        session = await self.session_of(run_id)
        return await self.turn(
            self.runtime.run(session_id=session, run_id=run_id, signal_delivery=delivery)
        )

    async def input(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        body = await read_body(request, Input)
        session = await self.session_of(run_id)
        handle = self.runtime.run(
            session_id=session, run_id=run_id, input=body.text, idempotency_key=self.key(request)
        )
        return await self.turn(handle)

    async def cancel(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        body = await read_body(request, Cancel)
        return _json(await self.runtime.cancel(run_id, await self.session_of(run_id), body.reason))


async def _not_found(request: Request, exc: Exception) -> Response:
    if isinstance(exc, HTTPException) and exc.status_code == 405:
        error: Exception = MethodNotAllowedError(request.method, request.url.path)
        return error_response(error, exc.headers)
    return error_response(UnknownRouteError(request.url.path))


def _answered(handler: Handler) -> Handler:
    """The route, its refusals and failures answered as JSON errors here (Starlette's own
    handler for ``Exception`` would raise the error again after answering)."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as error:
            return error_response(error)

    return route


def create_app(runtime: Runtime, *, token: str | None = None) -> Starlette:
    """The HTTP API over ``runtime`` as an ASGI app (docs/http.md).

    ``token`` defaults to ``KURALLE_API_TOKEN``: with one, every request needs
    ``Authorization: Bearer <token>``; without, the app only reads (a state
    change is answered 403), and ``serve`` binds it to loopback only.
    """
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    api = _Api(runtime, bearer=token is not None)
    served: list[tuple[str, Handler, list[str]]] = [
        ("/openapi.json", api.openapi, ["GET"]),
        ("/api/runs", api.runs, ["GET", "POST"]),
        ("/api/runs/{run_id}", api.get_run, ["GET"]),
        ("/api/runs/{run_id}/steps", api.get_steps, ["GET"]),
        ("/api/runs/{run_id}/signals", api.signal, ["POST"]),
        ("/api/runs/{run_id}/approve", api.decide(True), ["POST"]),
        ("/api/runs/{run_id}/deny", api.decide(False), ["POST"]),
        ("/api/runs/{run_id}/input", api.input, ["POST"]),
        ("/api/runs/{run_id}/cancel", api.cancel, ["POST"]),
    ]
    routes = [Route(path, _answered(handler), methods=methods) for path, handler, methods in served]
    return Starlette(
        routes=routes,
        middleware=[Middleware(BearerGate, token=token)],
        exception_handlers={HTTPException: _not_found},
    )
