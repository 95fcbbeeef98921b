"""The OpenAPI 3.1 document of the HTTP API, written from the pydantic models (internal).

OpenAPI 3.1 schemas are JSON Schema 2020-12, which is what pydantic's
``model_json_schema`` writes, so every body and response schema here is the
model's own (request bodies in validation mode, responses in serialization
mode), under ``components/schemas``. The document also says what this server
accepts: the flows of its agents (an enum on ``StartRun.flow``) and, when
``KURALLE_API_TOKEN`` is set, the bearer scheme every operation needs.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from .._runtime.input_checks import MAX_ID_LENGTH
from ..shapes import RunState, StepRecord, TurnResult
from ..views import RunSummary
from .reading import IDEMPOTENCY_HEADER
from .shapes import (
    ID_PATTERN,
    LIST_LIMIT_MAX,
    REQUEST_MODELS,
    RUN_STATUSES,
    Approval,
    Cancel,
    ErrorBody,
    Input,
    Signal,
    StartRun,
)

__all__ = ["openapi_document"]

_RESPONSES: tuple[type[BaseModel], ...] = (TurnResult, RunState, StepRecord, RunSummary, ErrorBody)
_JSON = "application/json"
_REFUSALS = {
    "401": "no or another bearer token (only when the server has KURALLE_API_TOKEN)",
    "403": "a state change on a server without KURALLE_API_TOKEN",
    "404": "RunNotFoundError: no run with this id",
    "409": "the run's state refuses it: SignalMismatchError, LeaseHeldError, FlowDriftError, "
    "StaleWriteError",
    "413": "PayloadTooLargeError: the body or a payload is over the bound",
    "422": "InvalidArgumentError, InvalidSignalError, FlowNotFoundError: the request is wrong",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _components() -> dict[str, Any]:
    mode_of: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        *((m, "serialization") for m in _RESPONSES),
        *((m, "validation") for m in REQUEST_MODELS),
    ]
    _, top = models_json_schema(mode_of, ref_template="#/components/schemas/{model}")
    return copy.deepcopy(top["$defs"])


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": _ref(ErrorBody)}}}


def _responses(ok: str, schema: dict[str, Any], *statuses: str) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": ok, "content": {_JSON: {"schema": schema}}}}
    for status in ("401", "403", *statuses, "422"):
        responses[status] = _error(_REFUSALS[status])
    responses["default"] = _error("any other refusal or failure, in the same shape")
    return responses


#: What a started run's id leads to (OpenAPI links: clients and fuzzers follow them).
_RUN_OPERATIONS = ("get_run", "get_steps", "signal", "approve", "deny", "input", "cancel")


def _links() -> dict[str, Any]:
    return {
        name: {"operationId": name, "parameters": {"run_id": "$response.body#/run_id"}}
        for name in _RUN_OPERATIONS
    }


def _run_id() -> dict[str, Any]:
    return {
        "name": "run_id",
        "in": "path",
        "required": True,
        "description": "the run's id (TurnResult.run_id)",
        "schema": {"type": "string"},
    }


def _list_parameters() -> list[dict[str, Any]]:
    limit = {"type": "integer", "minimum": 1, "maximum": LIST_LIMIT_MAX, "default": 100}
    return [
        {"name": "status", "in": "query", "schema": {"enum": list(RUN_STATUSES)}},
        {"name": "session_id", "in": "query", "schema": {"type": "string"}},
        {
            "name": "flow",
            "in": "query",
            "schema": {"type": "string"},
            "description": "runs of this flow, ended ones too",
        },
        {"name": "limit", "in": "query", "schema": limit, "description": "at most this many"},
    ]


def _key(required: bool, what: str) -> dict[str, Any]:
    return {
        "name": IDEMPOTENCY_HEADER,
        "in": "header",
        "required": required,
        "description": what,
        "schema": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_ID_LENGTH,
            "pattern": ID_PATTERN,
        },
    }


def _body(model: type[BaseModel]) -> dict[str, Any]:
    return {"required": True, "content": {_JSON: {"schema": _ref(model)}}}


def _post(
    operation_id: str,
    summary: str,
    model: type[BaseModel],
    result: type[BaseModel],
    parameters: list[dict[str, Any]],
    *statuses: str,
) -> dict[str, Any]:
    return {
        "summary": summary,
        "operationId": operation_id,
        "parameters": parameters,
        "requestBody": _body(model),
        "responses": _responses(result.__name__, _ref(result), *statuses),
    }


def _linked(operation: dict[str, Any]) -> dict[str, Any]:
    operation["responses"]["200"]["links"] = _links()
    return operation


def _paths() -> dict[str, Any]:
    run = [_run_id()]
    turn = "the turn's TurnResult: the run driven to its next pause or its end"
    delivery_key = _key(False, "the delivery's signal_id: a retry with it is a no-op")
    return {
        "/api/runs": {
            "get": {
                "summary": "list runs: most recently updated first (the run views)",
                "operationId": "list_runs",
                "parameters": _list_parameters(),
                "responses": _responses(
                    "RunSummary list", {"type": "array", "items": _ref(RunSummary)}
                ),
            },
            "post": _linked(
                _post(
                    "start_run",
                    f"start run: {turn}",
                    StartRun,
                    TurnResult,
                    [_key(False, "a retried start with the same key returns the same run")],
                    "409",
                    "413",
                )
            ),
        },
        "/api/runs/{run_id}": {
            "get": {
                "summary": "get run: its RunState",
                "operationId": "get_run",
                "parameters": run,
                "responses": _responses("RunState", _ref(RunState), "404"),
            }
        },
        "/api/runs/{run_id}/steps": {
            "get": {
                "summary": "get steps: the run's journal, every step it recorded",
                "operationId": "get_steps",
                "parameters": run,
                "responses": _responses(
                    "StepRecord list", {"type": "array", "items": _ref(StepRecord)}, "404"
                ),
            }
        },
        "/api/runs/{run_id}/signals": {
            "post": _post(
                "signal",
                f"signal: deliver a named signal; {turn}",
                Signal,
                TurnResult,
                [*run, _key(True, "the delivery's signal_id (required): a retry is a no-op")],
                "404",
                "409",
                "413",
            )
        },
        **{
            f"/api/runs/{{run_id}}/{verb}": {
                "post": _post(
                    verb,
                    f"{verb}: what the run waits for; {turn}",
                    Approval,
                    TurnResult,
                    [*run, delivery_key],
                    "404",
                    "409",
                    "413",
                )
            }
            for verb in ("approve", "deny")
        },
        "/api/runs/{run_id}/input": {
            "post": _post(
                "input",
                f"input: the user's text for a run waiting for input; {turn}",
                Input,
                TurnResult,
                [*run, _key(False, "the turn's idempotency key: a retry is a no-op")],
                "404",
                "409",
                "413",
            )
        },
        "/api/runs/{run_id}/cancel": {
            "post": _post(
                "cancel",
                "cancel: stop the run, whoever holds its lease; its RunState after",
                Cancel,
                RunState,
                run,
                "404",
                "409",
            )
        },
    }


def openapi_document(flows: list[str], *, bearer: bool) -> dict[str, Any]:
    """The document for a server whose agents define ``flows``; ``bearer`` when it has a token."""
    components: dict[str, Any] = {"schemas": _components()}
    start = components["schemas"][StartRun.__name__]
    if flows:
        start["properties"]["flow"]["enum"] = sorted(flows)
        start["examples"] = [{**start["examples"][0], "flow": sorted(flows)[0]}]
    else:
        del start["examples"]  # its flow would be one this server does not have
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "kuralle_es runs",
            "version": "1",
            "description": (
                "Start flow runs, read them, and deliver approvals, signals, input and "
                "cancels to them, durably (docs/http.md)."
            ),
        },
        "paths": _paths(),
        "components": components,
    }
    if bearer:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return document
