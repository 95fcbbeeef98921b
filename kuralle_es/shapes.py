"""The public data shapes (docs/concepts.md, docs/reference.md), as pydantic v2 models.

These are read models: the ``Run`` aggregate folds its events into plain data
and ``Run.to_state()`` / ``Run.step_records()`` build these from it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from ._unicode import printable
from .redaction import Redacted

#: ``"child"``: a child run started (the step's name is its flow) or waited for
#: (name ``"__child"``, result: how the child ended), docs/child-runs.md.
StepKind = Literal[
    "tool",
    "approval",
    "signal",
    "now",
    "uuid",
    "model",
    "timer",
    "publish",
    "receive",
    "value",
    "child",
]
StepStatus = Literal["running", "finished", "error"]
RunKind = Literal["conversation", "flow"]
RunStatus = Literal["running", "paused", "finished", "error", "aborted"]
WaitKind = Literal["approval", "signal", "input", "timer", "message", "child"]
PartType = Literal[
    "text",
    "text-delta",
    "retract",
    "tool-call",
    "tool-result",
    "paused",
    "finished",
    "error",
    "custom",
]


class StepError(BaseModel):
    """A failed step's error as journaled: the exception class name, its message and fields.

    Whatever raised it, its text can be stored: a lone surrogate in a message is
    written as its escape (the failure must be journaled, never refused)."""

    type: str
    #: ``Redacted`` once the run's subject was erased (docs/privacy.md).
    message: str | Redacted
    data: Redacted | dict[str, Any] = Field(default_factory=dict, union_mode="left_to_right")

    @field_validator("type", "message")
    @classmethod
    def _storable(cls, text: str | Redacted) -> str | Redacted:
        return text if isinstance(text, Redacted) else printable(text)


class StepRecord(BaseModel):
    """One step of a run's journal: a side effect, its idempotency key, status and outcome.

    ``attempts`` counts how many times the effect was started (more than 1 after
    a re-execution of an in-doubt step or a retry).
    """

    index: int
    key: str
    kind: StepKind
    name: str
    callsite: int
    status: StepStatus
    result: Any | None = None
    error: StepError | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = 1


class FrozenOperation(BaseModel):
    """The tool call an approver sees and approves: it executes with exactly these args."""

    tool_name: str
    args: Any
    args_hash: str


class WaitingFor(BaseModel):
    """What a paused run waits for: a signal (or approval, input, timer) at a callsite.

    ``request_id`` stays the same while the run waits on the same wait; pass it
    in a ``SignalDelivery`` to pin the delivery to this very request.
    """

    name: str
    callsite: int
    #: ``title``, ``description`` and the operation's ``args`` read ``Redacted`` once
    #: the run's subject was erased (docs/privacy.md).
    title: str | Redacted | None = None
    description: str | Redacted | None = None
    deadline: datetime | None = None
    request_id: str
    kind: WaitKind
    operation: FrozenOperation | None = None
    #: The child run a parent waits for (``kind == "child"``): it resumes when that
    #: run ends; nothing is delivered to it by hand (docs/child-runs.md).
    child_run_id: str | None = None


class Message(BaseModel):
    """A chat message in the OpenAI shape (role, content, tool calls, tool call id, name)."""

    role: Literal["system", "user", "assistant", "tool"]
    #: ``content`` and ``tool_calls`` read ``Redacted`` once the run's subject was
    #: erased (docs/privacy.md).
    content: str | Redacted | None = None
    tool_calls: Redacted | list[dict[str, Any]] | None = Field(
        default=None, union_mode="left_to_right"
    )
    tool_call_id: str | None = None
    name: str | None = None


_MESSAGE_LIST: TypeAdapter[list[Message]] = TypeAdapter(list[Message])


def messages_from_json(messages: list[dict[str, Any]]) -> list[Message]:
    """Messages from their stored JSON, validated as one list: twice as fast as
    one ``model_validate`` each, which a long conversation's every turn paid
    for all of its history."""
    return _MESSAGE_LIST.validate_python(messages)


class RunHeader(BaseModel):
    """Which run (of which session and kind) and its status: the fields every shape
    of a run starts with (its ``RunState``, the views' ``RunSummary``)."""

    run_id: str
    session_id: str
    kind: RunKind
    status: RunStatus


class RunState(RunHeader):
    """A run as a fold of its events: status, where it is, what it waits for, its lease."""

    active_agent: str | None = None
    active_flow: str | None = None
    active_node: str | None = None
    #: The state bag; ``Redacted`` once the run's subject was erased (docs/privacy.md).
    state: Redacted | dict[str, Any] = Field(default_factory=dict, union_mode="left_to_right")
    messages: list[Message] = Field(default_factory=list)
    waiting_for: WaitingFor | None = None
    flow_digest: str | None = None
    #: The version label of the flow definition the run is pinned to, if it has one.
    flow_version: str | None = None
    lease_holder: str | None = None
    lease_expires_at: datetime | None = None
    version: int
    step_count: int
    created_at: datetime
    updated_at: datetime
    error: StepError | None = None
    outcome: str | None = None
    #: ``{"run_id": ..., "at_step": ...}`` for a run forked from another.
    forked_from: dict[str, Any] | None = None
    #: The id of the fork this run was migrated to (``runtime.migrate``), if any.
    migrated_to: str | None = None
    #: ``{"run_id": ..., "step": ...}`` for a child run: the run that started it and
    #: the index of that run's step that did (docs/child-runs.md); None otherwise.
    parent: dict[str, Any] | None = None
    #: The ids of the child runs this run started, in the order it started them.
    children: list[str] = Field(default_factory=list)
    #: Whose data the run holds (``runtime.run(..., subject=)``; by default its
    #: session id): what ``runtime.erase_subject`` names (docs/privacy.md).
    subject: str | None = None


class SignalDelivery(BaseModel):
    """A signal sent to a paused run; ``signal_id`` makes a retried delivery a no-op."""

    signal_id: str
    name: str
    payload: Any = None
    request_id: str | None = None
    actor: str | None = None


class ApprovalDecision(BaseModel):
    """What ``ctx.approve()`` returns, built from the delivered approval payload."""

    approved: bool
    by: str | None = None
    reason: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class ToolCall(BaseModel):
    """What a tool's ``execute(args, call)`` learns about its call."""

    model_config = ConfigDict(frozen=True)

    idempotency_key: str
    run_id: str
    session_id: str
    tool_name: str
    callsite: int


class StreamPart(BaseModel):
    """One part of a turn's stream; ``type`` says which fields are set.

    ``text-delta`` carries ``delta``, a piece of a model step's text as it
    arrives, with ``step`` (the model step's index) and ``attempt`` (from 1);
    ``retract`` carries the ``step`` and ``attempt`` whose deltas a consumer
    drops (that attempt failed); ``text`` is a model step's whole text (with
    its ``step`` and ``attempt``) once it is journaled. ``offset`` is the part's position in
    the run's stored stream (``Runtime.stream(after=)``, the SSE event id);
    docs/streaming.md.
    """

    type: PartType
    text: str | None = None
    delta: str | None = None
    step: int | None = None
    attempt: int | None = None
    offset: int | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    args: Any = None
    result: Any = None
    waiting_for: WaitingFor | None = None
    error: StepError | None = None
    data: Any = None


class TurnResult(BaseModel):
    """How a turn ended: the run's status, its output and, when paused, what it waits for."""

    run_id: str
    status: RunStatus
    output: Any = None
    waiting_for: WaitingFor | None = None


class Usage(BaseModel):
    """What model and tool calls spent: ``model_calls`` counts attempts, tokens add
    up over the attempts that reported them, ``cost`` is None without a price for
    every model that reported tokens."""

    model_config = ConfigDict(frozen=True)

    model_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    tool_calls: int = 0
    cost: float | None = None
