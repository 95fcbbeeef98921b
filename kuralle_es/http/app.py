"""The HTTP API's routes: each one call of the Python API, JSON in and out (internal).

``create_app(runtime)`` builds the ASGI app (docs/http.md) with FastAPI,
which reads and validates each request from the models of ``http/shapes.py``
and writes ``/openapi.json`` from the same models. A route that names only
the run finds its session in the store, as the CLI's operator commands do
(``kuralle-es approve``): the caller holds the API token, so it acts on
behalf of the run's session. Starts and deliveries are turns of
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
from collections.abc import Callable, Coroutine, Iterable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, Header, Path, Query
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response

from .._journal.json_data import encode_json, max_payload_bytes
from .._journal.wait import CHILD, INPUT, TIMER
from .._runtime.deliveries import approval_delivery, in_doubt_delivery
from .._runtime.erasure import ErasureReport
from .._runtime.handle import TurnHandle
from .._runtime.input_checks import MAX_ID_LENGTH
from .._runtime.runtime import Runtime
from .._runtime.turn import drive_turn, result_of
from .._runtime.turn_calls import RestartFlow
from .._serving import HostGate
from ..errors import InvalidSignalError, PayloadTooLargeError
from ..shapes import RunState, SignalDelivery, StepRecord, TurnResult
from ..views import RunSummary
from .auth import TOKEN_ENV, BearerGate, check_bind
from .errors import error_response, refusal_response, unknown_run
from .shapes import (
    ID_PATTERN,
    Approval,
    Cancel,
    ErrorBody,
    InDoubt,
    Input,
    ListQuery,
    ResolveDrift,
    Resume,
    SendMessage,
    Signal,
    StartRun,
    Turn,
)
from .sse import EventStream
from .sse import last_event_id as last_event_id_of

__all__ = ["BODY_SLACK_BYTES", "IDEMPOTENCY_HEADER", "create_app"]

IDEMPOTENCY_HEADER = "Idempotency-Key"
#: Room in a body for what surrounds its payload (a signal's name, an approver, a reason).
BODY_SLACK_BYTES = 64 * 1024

#: Waits the library delivers to itself: a signal of that name would be taken for them.
_NOT_SIGNALS = {
    INPUT: f"{INPUT!r} is a collect node's wait for input: POST the text to /input instead",
    TIMER: f"{TIMER!r} is a durable sleep's wait: the sweeper wakes it (kuralle-es worker)",
    CHILD: (
        f"{CHILD!r} is a parent run's wait for its child run: it resumes when the child "
        "ends; look at the child run (waiting_for.child_run_id)"
    ),
}


class _BoundedRequest(Request):
    """A request whose body is read up to the bound and no further: one payload of
    ``KURALLE_MAX_PAYLOAD_BYTES`` (README, "Configuration") and room for the short
    fields around it. Past it, ``PayloadTooLargeError`` (413). (Starlette's own
    body limit answers in plain text, and the API's every refusal is a JSON error.)"""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            limit = max_payload_bytes() + BODY_SLACK_BYTES
            declared = self.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise PayloadTooLargeError("the request body", int(declared), limit)
            raw = bytearray()
            async for chunk in self.stream():
                raw += chunk
                if len(raw) > limit:
                    raise PayloadTooLargeError("the request body", len(raw), limit)
            self._body = bytes(raw)
        return self._body


class _AnsweredRoute(APIRoute):
    """A route that reads its body within the bound, and whose refusals and failures are
    answered here, as JSON errors: FastAPI's own (the request does not fit its model)
    and the library's alike. (An app-wide handler for ``Exception`` would answer too,
    but Starlette raises the error again after it, to be logged twice.)"""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answered(request: Request) -> Response:
            try:
                return await handler(_BoundedRequest(request.scope, request.receive))
            except Exception as error:
                return refusal_response(request, error)

        return answered


async def _routing_refusal(request: Request, error: Exception) -> Response:
    """A path or method no route serves (404, 405), as the API's JSON error."""
    return refusal_response(request, error)


# ------------------------------------------------------ what the document says
def _key(what: str) -> Any:
    """The ``Idempotency-Key`` header as the doors accept an id (an empty one is refused
    rather than taken for no key)."""
    return Header(
        alias=IDEMPOTENCY_HEADER,
        description=what,
        min_length=1,
        max_length=MAX_ID_LENGTH,
        pattern=ID_PATTERN,
    )


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


Served = Annotated[Runtime, Depends(_runtime)]
RunId = Annotated[str, Path(description="the run's id (TurnResult.run_id)")]
StartKey = Annotated[str | None, _key("a retried start with the same key returns the same run")]
DeliveryKey = Annotated[str | None, _key("the delivery's signal_id: a retry with it is a no-op")]
SignalKey = Annotated[str, _key("the delivery's signal_id (required): a retry is a no-op")]
InputKey = Annotated[str | None, _key("the turn's idempotency key: a retry is a no-op")]
MessageKey = Annotated[str, _key("the message's message_id (required): a retry is a no-op")]

_REFUSALS = {
    401: "no or another bearer token (only when the server has KURALLE_API_TOKEN)",
    403: "a state change on a server without KURALLE_API_TOKEN",
    404: "RunNotFoundError: no run with this id",
    409: "the run's state refuses it: SignalMismatchError, LeaseHeldError, FlowDriftError, "
    "StaleWriteError",
    413: "PayloadTooLargeError: the body or a payload is over the bound",
    422: "InvalidArgumentError, InvalidSignalError, FlowNotFoundError: the request is wrong",
}
#: What a started run's id leads to (OpenAPI links: clients and fuzzers follow them).
_RUN_OPERATIONS = ("get_run", "get_steps", "signal", "approve", "deny", "input", "cancel")
_TURN = "the turn's TurnResult: the run driven to its next pause or its end"


def _responses(*statuses: int, links: bool = False) -> dict[int | str, dict[str, Any]]:
    """The refusals an operation may answer, each an ``ErrorBody``."""
    responses: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorBody, "description": _REFUSALS[status]}
        for status in (401, 403, *statuses, 422)
    }
    responses["default"] = {
        "model": ErrorBody,
        "description": "any other refusal or failure, in the same shape",
    }
    if links:
        responses[200] = {
            "links": {
                name: {"operationId": name, "parameters": {"run_id": "$response.body#/run_id"}}
                for name in _RUN_OPERATIONS
            }
        }
    return responses


_DELIVERY = _responses(404, 409, 413)
_RUN = "/api/runs/{run_id}"
router = APIRouter(route_class=_AnsweredRoute)


# ---------------------------------------------------------------- plumbing
async def _session_of(runtime: Runtime, run_id: str) -> str:
    """The session of the run, read from the store (404 if there is no such run)."""
    run = await runtime.store.load_async(run_id)
    if run is None:
        raise unknown_run(run_id)
    return run.session_id


def _opened(handle: TurnHandle) -> bool:
    """Whether the turn opened its run (saved its first event) before it ended."""
    run_id = handle.run_id
    return run_id.done() and not run_id.cancelled() and run_id.exception() is None


async def _turn(runtime: Runtime, handle: TurnHandle) -> TurnResult:
    """The turn's result; its refusal raised; a failure it journaled as the run's result."""
    try:
        return await handle.result()
    except Exception:
        if not _opened(handle):
            raise  # refused before its first save: nothing was written
        run = await runtime.store.load_async(handle.run_id.result())
        if run is None or run.status == "running":
            raise  # cut off, not closed: the lease expires and recovery drives it
        return result_of(run)


async def _deliver(runtime: Runtime, run_id: str, delivery: SignalDelivery) -> TurnResult:
    # The library refuses an oversized payload as InvalidSignalError (422); here it
    # is the 413 of a body too large, measured as the journal will (``encode_json``).
    encode_json(delivery.payload, f"the payload of signal {delivery.name!r}")
    session = await _session_of(runtime, run_id)
    handle = runtime.run(session_id=session, run_id=run_id, signal_delivery=delivery)
    return await _turn(runtime, handle)


# ------------------------------------------------------------------- reads
@router.get("/api/runs", operation_id="list_runs", responses=_responses(),
            summary="list runs: most recently updated first (the run views)")  # fmt: skip
async def list_runs(runtime: Served, query: Annotated[ListQuery, Query()]) -> list[RunSummary]:
    """The run views' ``list_runs``, most recently updated first."""
    return await runtime.views.list_runs(
        status=query.status, session_id=query.session_id, flow=query.flow, limit=query.limit
    )


@router.get(_RUN, operation_id="get_run", summary="get run: its RunState",
            responses=_responses(404))  # fmt: skip
async def get_run(runtime: Served, run_id: RunId) -> RunState:
    run = await runtime.store.load_async(run_id)
    if run is None:
        raise unknown_run(run_id)
    return run.to_state(await runtime.store.lease_async(run_id))


@router.get(f"{_RUN}/published", operation_id="get_published", responses=_responses(404),
            summary="get published: the latest value the run published under each key")  # fmt: skip
async def get_published(runtime: Served, run_id: RunId) -> dict[str, Any]:
    """``Runtime.published``: what the run's nodes published with ``ctx.publish``."""
    values: dict[str, Any] = await runtime.published(run_id, await _session_of(runtime, run_id))
    return values


@router.get(f"{_RUN}/steps", operation_id="get_steps", responses=_responses(404),
            summary="get steps: the run's journal, every step it recorded")  # fmt: skip
async def get_steps(runtime: Served, run_id: RunId) -> list[StepRecord]:
    run = await runtime.store.load_async(run_id, history=True)
    if run is None:
        raise unknown_run(run_id)
    return run.step_records()


# ------------------------------------------------------------------ writes
@router.post("/api/runs", operation_id="start_run", summary=f"start run: {_TURN}",
             responses=_responses(409, 413, links=True))  # fmt: skip
async def start_run(runtime: Served, body: StartRun, key: StartKey = None) -> TurnResult:
    handle = runtime.run(
        session_id=body.session_id,
        kind="flow",
        flow_name=body.flow,
        input=body.input,
        idempotency_key=key,
    )
    return await _turn(runtime, handle)


@router.post(f"{_RUN}/signals", operation_id="signal", responses=_DELIVERY,
             summary=f"signal: deliver a named signal; {_TURN}")  # fmt: skip
async def signal(runtime: Served, run_id: RunId, body: Signal, key: SignalKey) -> TurnResult:
    if body.name in _NOT_SIGNALS:
        raise InvalidSignalError(body.name, _NOT_SIGNALS[body.name])
    # Exactly ``Runtime.signal``, through ``run`` for the turn's handle.
    delivery = SignalDelivery(signal_id=key, name=body.name, payload=body.payload, actor=body.actor)
    return await _deliver(runtime, run_id, delivery)


@router.post(f"{_RUN}/messages", operation_id="send_message", responses=_DELIVERY,
             summary=f"send message: into the run's mailbox; a run waiting in receive for it "
             f"is driven on: {_TURN}")  # fmt: skip
async def send_message(
    runtime: Served, run_id: RunId, body: SendMessage, key: MessageKey
) -> TurnResult:
    # Exactly ``Runtime.send``; an oversized payload is the 413 of a body too large.
    encode_json(body.payload, f"the payload of message {body.name!r}")
    session = await _session_of(runtime, run_id)
    try:
        return await runtime.send(
            run_id, session, body.name, body.payload, message_id=key, actor=body.actor
        )
    except Exception:
        # The message woke the run and the node then failed: journaled, the
        # run's result is the answer (as for a delivery); else a refusal.
        run = await runtime.store.load_async(run_id)
        if run is None or key not in run.mail_ids or run.status == "running":
            raise
        return result_of(run)


def _decision(approved: bool) -> Callable[..., Coroutine[Any, Any, TurnResult]]:
    async def decide(
        runtime: Served, run_id: RunId, body: Approval, key: DeliveryKey = None
    ) -> TurnResult:
        # Exactly ``Runtime.approve``/``deny``, through ``run`` for the turn's handle.
        delivery = approval_delivery(
            approved=approved, by=body.by, reason=body.reason, signal_id=key,
            raise_to=body.raise_to,
        )  # fmt: skip
        return await _deliver(runtime, run_id, delivery)

    return decide


for _verb, _approved in (("approve", True), ("deny", False)):
    router.add_api_route(
        f"{_RUN}/{_verb}", _decision(_approved), methods=["POST"], operation_id=_verb,
        responses=_DELIVERY, summary=f"{_verb}: what the run waits for; {_TURN}",
    )  # fmt: skip


@router.post(f"{_RUN}/in-doubt", operation_id="answer_in_doubt", responses=_DELIVERY,
             summary="answer in doubt: retry, resolve or fail the step the run's process "
             f"left in doubt; {_TURN}")  # fmt: skip
async def answer_in_doubt(
    runtime: Served, run_id: RunId, body: InDoubt, key: DeliveryKey = None
) -> TurnResult:
    # Exactly the ``__in_doubt`` signal, built where every door builds it.
    delivery = in_doubt_delivery(
        body.action, by=body.by, result=body.given_result(), message=body.message,
        signal_id=key,
    )  # fmt: skip
    return await _deliver(runtime, run_id, delivery)


@router.post(f"{_RUN}/input", operation_id="input", responses=_DELIVERY,
             summary=f"input: the user's text for a run waiting for input; {_TURN}")  # fmt: skip
async def input(runtime: Served, run_id: RunId, body: Input, key: InputKey = None) -> TurnResult:
    session = await _session_of(runtime, run_id)
    handle = runtime.run(session_id=session, run_id=run_id, input=body.text, idempotency_key=key)
    return await _turn(runtime, handle)


@router.post(f"{_RUN}/cancel", operation_id="cancel", responses=_responses(404, 409),
             summary="cancel: stop the run, whoever holds its lease; its RunState after",
             )  # fmt: skip
async def cancel(runtime: Served, run_id: RunId, body: Cancel) -> RunState:
    return await runtime.cancel(run_id, await _session_of(runtime, run_id), body.reason)


# ----------------------------------------------- conversations, resumes, drift
SessionId = Annotated[
    str,
    Path(
        description="the session whose conversation it is",
        max_length=MAX_ID_LENGTH,
        pattern=ID_PATTERN,
    ),
]


@router.post("/api/sessions/{session_id}/turns", operation_id="say",
             responses=_responses(409, 413),
             summary=f"say: the user's next message in the session's conversation; {_TURN}",
             )  # fmt: skip
async def say(
    runtime: Served, session_id: SessionId, body: Turn, key: InputKey = None
) -> TurnResult:
    handle = runtime.run(session_id, input=body.text, agent=body.agent, idempotency_key=key)
    return await _turn(runtime, handle)


@router.post(f"{_RUN}/resume", operation_id="resume", responses=_responses(404, 409),
             summary="resume: drive an errored run again (recorded steps replay, a step in "
             f"doubt runs again, frozen errors stay frozen); {_TURN}")  # fmt: skip
async def resume(
    runtime: Served, run_id: RunId, body: Annotated[Resume | None, Body()] = None
) -> TurnResult:
    session = await _session_of(runtime, run_id)
    return await _turn(runtime, runtime.run(session, run_id=run_id))


@router.post(f"{_RUN}/resolve-drift", operation_id="resolve_drift",
             responses=_responses(404, 409),
             summary="resolve drift: restart the run's flow under its current definition, or "
             "abandon the run; its RunState after")  # fmt: skip
async def resolve_drift(runtime: Served, run_id: RunId, body: ResolveDrift) -> RunState:
    session = await _session_of(runtime, run_id)
    if body.action == "abandon":
        return await runtime.resolve_drift(run_id, session, "abandon")
    # ``Runtime.resolve_drift``'s restart, through a handle: a node that raises has
    # journaled its failure, and the answer is the run as it now stands.
    restart = RestartFlow(session, run_id)
    await _turn(runtime, TurnHandle(lambda sink: drive_turn(runtime.env, restart, sink)))
    state = await runtime.get_run(run_id, session)
    if state is None:  # pragma: no cover - the turn just saved it
        raise unknown_run(run_id)
    return state


@router.delete("/api/subjects/{subject}", operation_id="erase_subject", responses=_responses(),
               summary="erase a data subject: its live runs aborted, its key destroyed; "
               "every payload of its runs reads Redacted (docs/privacy.md)",
               )  # fmt: skip
async def erase_subject(
    runtime: Served,
    subject: Annotated[str, Path(description="the data subject (by default a run's session id)")],
) -> ErasureReport:
    return await runtime.erase_subject(subject)


# HEAD on the reads, as Starlette serves it, left out of the document.
for _read in [r for r in router.routes if isinstance(r, APIRoute) and "GET" in (r.methods or ())]:
    router.add_api_route(_read.path, _read.endpoint, methods=["HEAD"], include_in_schema=False)


# ----------------------------------------------------------------- stream
SessionQuery = Annotated[
    str | None,
    Query(
        description="the run's session; given, a run of another session is 404 (else the "
        "store says which session the run is of)",
        min_length=1,
        max_length=MAX_ID_LENGTH,
    ),
]
AfterQuery = Annotated[
    int, Query(ge=0, description="the offset to start after (Last-Event-ID, if sent, wins)")
]
LastEventId = Annotated[
    str | None,
    Header(
        alias="Last-Event-ID",
        description="the id of the last event a reconnecting client saw: it resumes after it",
        pattern=r"^[0-9]{0,18}$",
    ),
]
#: One event of the stream (each is checked against it): a part (``data``: the part as
#: JSON, ``id``: its offset), the ``end`` event, or the ``retry`` hint.
_SSE_EVENT = {
    "type": "object",
    "properties": {
        "data": {"type": "string", "description": "a StreamPart as JSON ({} for end)"},
        "event": {"type": "string", "description": "end, once the run is at rest"},
        "id": {"type": "string", "description": "the part's offset"},
        "retry": {"type": "integer", "minimum": 0},
    },
}
_ERROR_JSON = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
_STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    # Refusals are JSON, whatever the stream's own media type.
    **{
        status: {"description": answer["description"], "content": _ERROR_JSON}
        for status, answer in _responses(404).items()
    },
    200: {
        "description": "Server-Sent Events: each part of the run's stored stream (id: its "
        "offset; data: the part as JSON), then the live ones, then an `end` event once the "
        "run is at rest",
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
    },
}


@router.get(f"{_RUN}/stream", operation_id="stream", response_class=EventStream,
            status_code=200, responses=_STREAM_RESPONSES,
            summary="stream: the run's stored stream as Server-Sent Events, then live")  # fmt: skip
async def stream(
    runtime: Served,
    run_id: RunId,
    session_id: SessionQuery = None,
    after: AfterQuery = 0,
    last_event_id: LastEventId = None,
) -> EventStream:
    """The parts the run's turns sent after an offset (text deltas, retracts, tool
    calls, each turn's end), as they are stored; docs/streaming.md."""
    start = last_event_id_of(last_event_id, after)
    session = session_id if session_id is not None else await _session_of(runtime, run_id)
    if await runtime.get_run(run_id, session) is None:
        raise unknown_run(run_id)  # fail-closed: no stream of another session's run
    return EventStream(runtime.stream(run_id, session, after=start))


def _describe_server(document: dict[str, Any], flows: list[str], bearer: bool) -> None:
    """What the generated document cannot know: the flows this server's agents define
    (an enum on ``StartRun.flow``) and, with a token, the bearer scheme of every request."""
    start = document["components"]["schemas"][StartRun.__name__]
    if flows:
        start["properties"]["flow"]["enum"] = flows
        start["examples"] = [{**start["examples"][0], "flow": flows[0]}]
    else:
        del start["examples"]  # its flow would be one this server does not have
    if bearer:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]


def create_app(
    runtime: Runtime,
    *,
    token: str | None = None,
    host: str | None = None,
    allowed_hosts: Iterable[str] | None = None,
) -> FastAPI:
    """The HTTP API over ``runtime`` as an ASGI app (docs/http.md).

    ``token`` defaults to ``KURALLE_API_TOKEN``: with one, every request needs
    ``Authorization: Bearer <token>``; without, the app only reads (a state
    change is answered 403), and ``serve`` binds it to loopback only. The app
    answers only requests whose ``Host`` is a loopback name (``host``, where it
    is served, is loopback) or one of ``allowed_hosts`` (default:
    ``KURALLE_ALLOWED_HOSTS``); any other is 400. Without ``host`` it is taken
    as served on loopback, and it answers the names in-process test clients
    send too (``testserver``, ``test``).
    """
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    hosts = check_bind(host, token, allowed_hosts)
    app = FastAPI(
        title="kuralle_es runs",
        version="1",
        description=(
            "Start flow runs and conversation turns, read runs, deliver approvals, signals, "
            "input, messages, answers to steps in doubt and cancels to them, resume errored "
            "runs and settle drifted ones, durably (docs/http.md, docs/operators.md)."
        ),
        docs_url=None,
        redoc_url=None,
        # The routes themselves, not include_router's wrapper of them, so that a 405
        # can list every method of a path (http/errors.py).
        routes=router.routes,
        middleware=[
            Middleware(HostGate, hosts=hosts, refuse=error_response),
            Middleware(BearerGate, token=token),
        ],
        exception_handlers={HTTPException: _routing_refusal},
    )
    app.state.runtime = runtime
    flows = sorted({f for a in runtime.agents.values() for f in a.flows})
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _describe_server(generate(), flows, bearer=token is not None)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
    return app
