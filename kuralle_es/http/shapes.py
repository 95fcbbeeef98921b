"""The JSON the HTTP API reads and the error it answers with, as pydantic models (internal).

FastAPI validates every request against these and writes ``/openapi.json``
from them. A body is validated with extra fields forbidden, so a typo in a
field name is refused instead of ignored, and must be plain JSON (no NaN,
no lone surrogate, not nested without end: ``plain_json_problem``) before
its fields are looked at, so nothing the journal could not store exactly
gets as far as a turn. The id rules repeat the library's doors (non-empty,
not only spaces, no control character, at most ``MAX_ID_LENGTH``
characters) so that the document says what will be accepted; the doors
check again behind them. Responses are the library's own models
(``TurnResult``, ``RunState``, ``StepRecord``, ``RunSummary``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .._journal.json_data import plain_json_problem
from .._runtime.deliveries import NO_RESULT
from .._runtime.input_checks import MAX_ID_LENGTH
from ..shapes import RunStatus

__all__ = [
    "ID_PATTERN",
    "LIST_LIMIT_MAX",
    "TEXT_PATTERN",
    "Approval",
    "Cancel",
    "ErrorBody",
    "InDoubt",
    "Input",
    "ListQuery",
    "ResolveDrift",
    "Resume",
    "SendMessage",
    "Signal",
    "StartRun",
    "Turn",
]

#: An id as the doors accept it: no control character (C0, DEL, C1) and one
#: character that is not a space (``doors.check_id``).
ID_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f][^\x00-\x1f\x7f-\x9f]*$"
#: Text that must say something: one character that is not a space.
TEXT_PATTERN = r"\S"
#: The most runs one ``GET /api/runs`` returns.
LIST_LIMIT_MAX = 1000

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _plain_json(cls, data: Any) -> Any:
        if isinstance(data, bytes):  # FastAPI passes a body on unparsed when it is not JSON
            raise ValueError("the request body is not sent as Content-Type: application/json")
        problem = plain_json_problem(data)
        if problem is not None:
            raise ValueError(f"the request body {problem}; send plain JSON")
        return data


def _example(example: dict[str, Any]) -> ConfigDict:
    """The body's example in the OpenAPI document (what a reader copies, what a fuzzer starts
    from); the forbidding of extra fields is inherited."""
    return ConfigDict(json_schema_extra={"examples": [example]})


class StartRun(_Body):
    """``POST /api/runs``: start a flow run in a session (driven to its first pause or end)."""

    model_config = _example(
        {"session_id": "customer-42", "flow": "refund", "input": "I want a refund"}
    )

    session_id: Id = Field(description="the session the run belongs to")
    flow: str = Field(description="the name of a flow of the server's agents")
    input: str | dict[str, Any] | None = Field(
        default=None,
        description=(
            "the user's first message, if any; for a flow defined with typed input "
            "(define_flow(..., input=Model)) an object validated against that model"
        ),
    )


class Signal(_Body):
    """``POST /api/runs/{run_id}/signals``: deliver a named signal (``Idempotency-Key`` is its
    ``signal_id``)."""

    model_config = _example({"name": "shipped", "payload": {"tracking": "1Z999"}})

    name: Id = Field(description="the signal the run waits for (ctx.signal's name)")
    payload: Any = Field(default=None, description="any JSON; validated by the wait's schema")
    actor: Id | None = Field(default=None, description="who sends it: journaled as its actor")


class SendMessage(_Body):
    """``POST /api/runs/{run_id}/messages``: put a message in the run's mailbox
    (``Idempotency-Key`` is its ``message_id``)."""

    model_config = _example({"name": "item", "payload": {"sku": "A-1", "qty": 2}})

    name: Id = Field(description="the message's name (what ctx.receive takes)")
    payload: Any = Field(default=None, description="any JSON; validated by a waiting schema")
    actor: Id | None = Field(default=None, description="who sends it: journaled as its actor")


class Approval(_Body):
    """``POST /api/runs/{run_id}/approve`` or ``/deny``: decide what the run waits for."""

    model_config = _example({"by": "ann", "reason": "receipt checked"})

    by: Id = Field(description="who decides: journaled as the delivery's actor")
    reason: str | None = Field(default=None, description="why (the node or model sees it)")
    raise_to: dict[str, int | float] | None = Field(
        default=None,
        description=(
            "approve only, for a run waiting on its budget (__budget): the Budget "
            'limits to raise, e.g. {"max_total_tokens": 20000} (docs/usage.md)'
        ),
    )


class InDoubt(_Body):
    """``POST /api/runs/{run_id}/in-doubt``: answer a step left in doubt (its process died
    between the call's intent and its result; docs/howto/in-doubt.md)."""

    model_config = _example({"action": "resolve", "result": {"ticket": "T-1"}, "by": "oncall"})

    action: Literal["retry", "resolve", "fail"] = Field(
        description="retry: execute the call again under its idempotency key; resolve: record "
        "result as its result and execute nothing; fail: record a failure (the node sees "
        "ToolExecutionError)"
    )
    by: Id = Field(description="who answers: journaled as the delivery's actor")
    result: Any = Field(default=None, description="resolve only (required there): the result")
    message: str | None = Field(default=None, description="fail only: what the failure says")

    def given_result(self) -> Any:
        """The result as given, or ``NO_RESULT`` when the body has none (a resolve may
        record ``null``, which is not the same as no result)."""
        return self.result if "result" in self.model_fields_set else NO_RESULT


class Input(_Body):
    """``POST /api/runs/{run_id}/input``: the user's text for a run waiting for input."""

    model_config = _example({"text": "It was $42.50"})

    text: str = Field(description="what the user said")


class Cancel(_Body):
    """``POST /api/runs/{run_id}/cancel``: stop the run, whoever holds its lease."""

    model_config = _example({"reason": "customer left"})

    reason: Annotated[str, Field(pattern=TEXT_PATTERN)] = Field(
        description="why: the run's outcome becomes 'cancelled: <reason>'"
    )


class Turn(_Body):
    """``POST /api/sessions/{session_id}/turns``: the user's next message in the session's
    conversation (started on first use)."""

    model_config = _example({"text": "Where is my order?", "agent": "support"})

    text: str = Field(description="what the user says")
    agent: Id | None = Field(
        default=None,
        description="the agent the conversation is with (default: the server's first); a "
        "session keeps the agent it started with",
    )


class Resume(_Body):
    """``POST /api/runs/{run_id}/resume``: drive an errored (or orphaned) run again; no
    fields (``{}``)."""

    model_config = _example({})


class ResolveDrift(_Body):
    """``POST /api/runs/{run_id}/resolve-drift``: settle a run whose flow changed."""

    model_config = _example({"action": "restart"})

    action: Literal["restart", "abandon"] = Field(
        description="restart: re-pin the current definition and drive the flow from its "
        "start; abandon: the run becomes aborted with outcome 'abandoned: flow drift'"
    )


class ListQuery(BaseModel):
    """``GET /api/runs``'s query parameters: the run views' ``list_runs`` filters."""

    status: RunStatus | None = None
    session_id: str | None = None
    flow: str | None = Field(default=None, description="runs of this flow, ended ones too")
    limit: int = Field(default=100, ge=1, le=LIST_LIMIT_MAX, description="at most this many")


class ErrorBody(BaseModel):
    """Every refusal: the error's class, what happened and what to do, and its fields."""

    error: str = Field(description="the error's class, e.g. RunNotFoundError")
    message: str = Field(description="what happened and what to do")
    fields: dict[str, Any] = Field(description="the error's attributes (run_id, holder, ...)")
