"""The public data shapes (SPEC §2), as pydantic v2 models.

These are read models: the ``Run`` aggregate folds its events into plain data
and ``Run.to_state()`` / ``Run.step_records()`` build these from it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

StepKind = Literal["tool", "approval", "signal", "now", "uuid", "model", "timer"]
StepStatus = Literal["running", "finished", "error"]
RunKind = Literal["conversation", "flow"]
RunStatus = Literal["running", "paused", "finished", "error", "aborted"]
PartType = Literal["text", "tool-call", "tool-result", "paused", "finished", "error", "custom"]


class StepError(BaseModel):
    type: str
    message: str
    data: dict[str, Any] = Field(default_factory=dict)


class StepRecord(BaseModel):
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
    tool_name: str
    args: Any
    args_hash: str


class WaitingFor(BaseModel):
    name: str
    callsite: int
    title: str | None = None
    description: str | None = None
    deadline: datetime | None = None
    request_id: str
    kind: Literal["approval", "signal", "input", "timer"]
    operation: FrozenOperation | None = None


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class RunState(BaseModel):
    run_id: str
    session_id: str
    kind: RunKind
    status: RunStatus
    active_agent: str | None = None
    active_flow: str | None = None
    active_node: str | None = None
    state: dict[str, Any] = Field(default_factory=dict)
    messages: list[Message] = Field(default_factory=list)
    waiting_for: WaitingFor | None = None
    flow_digest: str | None = None
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


class SignalDelivery(BaseModel):
    signal_id: str
    name: str
    payload: Any = None
    request_id: str | None = None
    actor: str | None = None


class ApprovalDecision(BaseModel):
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
    """One part of a turn's stream; ``type`` says which fields are set."""

    type: PartType
    text: str | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    args: Any = None
    result: Any = None
    waiting_for: WaitingFor | None = None
    error: StepError | None = None
    data: Any = None


class TurnResult(BaseModel):
    run_id: str
    status: RunStatus
    output: Any = None
    waiting_for: WaitingFor | None = None
