"""The public run events (public API, schema version 1).

These are the shapes other systems read; they are not the ``Run``
aggregate's stored events, whose names and fields may change between
releases. Every event has ``schema_version`` (1), ``type`` (its class name,
the discriminator for parsing JSON), ``partition`` (the store's partition
the run lives in, 0 when there is one: docs/scaling.md), ``position`` (the
stored event's notification id in that partition: increasing, with gaps;
``(partition, position)`` is unique), ``run_id``, ``session_id`` and
``occurred_at``. The nested shapes (``EventWaitingFor``, ``EventError``,
``EventOperation``) are the runtime's ``WaitingFor``, ``StepError`` and
``FrozenOperation``, frozen and closed to unknown fields as every event is.
``tests/golden/run_events_v1*.schema.json`` pin each published revision of
the JSON schema, so a change to those runtime shapes that would alter an
event's shape fails the tests until it is published as a new revision or
schema version; a revision of version 1 only adds optional fields
(``partition`` came so), so every event ever published still parses.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ..shapes import FrozenOperation, StepError, WaitingFor

__all__ = [
    "SCHEMA_VERSION",
    "EventError",
    "EventOperation",
    "EventWaitingFor",
    "ResumeReason",
    "RunAborted",
    "RunErrored",
    "RunEvent",
    "RunFinished",
    "RunOpened",
    "RunPaused",
    "RunResumed",
    "SignalAccepted",
    "StepFailed",
    "StepFinished",
    "StepStarted",
    "ValuePublished",
    "events_json_schema",
    "parse_event",
]

SCHEMA_VERSION = 1

#: Why a run that had stopped runs again: new user ``input``, a due ``timer``,
#: a ``recovery`` of an orphaned run, an errored run re-addressed (``error``),
#: a drifted flow ``restart``-ed under its current definition, or a ``message``
#: sent to a run waiting in ``ctx.receive`` for it.
ResumeReason = Literal["input", "timer", "recovery", "error", "restart", "message"]


class _Shape(BaseModel):
    # Last among a shape's bases, so that its config is the one pydantic keeps.
    model_config = ConfigDict(frozen=True, extra="forbid")


class EventError(StepError, _Shape):
    """A failure as recorded: exception class name, message, structured data."""


class EventOperation(FrozenOperation, _Shape):
    """The tool call an approval (or an in-doubt step) is about."""


class EventWaitingFor(WaitingFor, _Shape):
    """What a paused run waits for; the same fields as the runtime's ``WaitingFor``."""

    # The event's own (frozen, closed) shape of the operation.
    operation: EventOperation | None = None


class _Event(_Shape):
    schema_version: Literal[1] = 1
    #: The partition of the store the run lives in (0 in a store of one).
    partition: int = 0
    position: int
    run_id: str
    session_id: str
    occurred_at: datetime


class RunOpened(_Event):
    """A run was created (a conversation, or a flow run pinned to ``flow``)."""

    type: Literal["RunOpened"] = "RunOpened"
    kind: Literal["conversation", "flow"]
    flow: str | None = None


class StepStarted(_Event):
    """An effect is about to execute: its intent is journaled (``attempt`` counts starts)."""

    type: Literal["StepStarted"] = "StepStarted"
    index: int
    key: str
    kind: Literal[
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
    name: str
    attempt: int


class StepFinished(_Event):
    """A step's result is journaled; replays return it without executing."""

    type: Literal["StepFinished"] = "StepFinished"
    index: int
    name: str
    result: Any = None


class StepFailed(_Event):
    """A step's attempt failed; ``final`` when the error is frozen (no retry left)."""

    type: Literal["StepFailed"] = "StepFailed"
    index: int
    name: str
    error: EventError
    final: bool


class RunPaused(_Event):
    """The run stopped cleanly until ``waiting_for`` arrives."""

    type: Literal["RunPaused"] = "RunPaused"
    waiting_for: EventWaitingFor


class SignalAccepted(_Event):
    """A delivered signal (or approval) passed every check; the run goes on."""

    type: Literal["SignalAccepted"] = "SignalAccepted"
    signal_id: str
    name: str
    actor: str | None = None


class ValuePublished(_Event):
    """Node code published ``value`` under ``key`` (``ctx.publish``): step ``index``
    of the run's journal, the one public event of that step (a replay publishes
    nothing again)."""

    type: Literal["ValuePublished"] = "ValuePublished"
    index: int
    key: str
    value: Any = None


class RunResumed(_Event):
    """A run that had stopped runs again, for ``reason``."""

    type: Literal["RunResumed"] = "RunResumed"
    reason: ResumeReason


class RunFinished(_Event):
    """The run ended; ``outcome`` is a flow's end reason (or a handoff's)."""

    type: Literal["RunFinished"] = "RunFinished"
    outcome: str | None = None


class RunErrored(_Event):
    """The run failed with ``error``; re-addressing it resumes it."""

    type: Literal["RunErrored"] = "RunErrored"
    error: EventError


class RunAborted(_Event):
    """The run was abandoned or cancelled; it never runs again."""

    type: Literal["RunAborted"] = "RunAborted"
    outcome: str


RunEvent = Annotated[
    RunOpened
    | StepStarted
    | StepFinished
    | StepFailed
    | RunPaused
    | SignalAccepted
    | RunResumed
    | RunFinished
    | RunErrored
    | RunAborted
    | ValuePublished,
    Field(discriminator="type"),
]

_ADAPTER: TypeAdapter[RunEvent] = TypeAdapter(RunEvent)


def parse_event(data: str | bytes | dict[str, Any]) -> RunEvent:
    """An event back from its JSON (or its ``model_dump``), by its ``type``.

    Raises ``pydantic.ValidationError`` for anything that is not a version-1 event.
    """
    if isinstance(data, dict):
        return _ADAPTER.validate_python(data)
    return _ADAPTER.validate_json(data)


def events_json_schema() -> dict[str, Any]:
    """The JSON schema of every event (a ``oneOf`` keyed by ``type``): the published contract."""
    return {"schema_version": SCHEMA_VERSION, "schema": _ADAPTER.json_schema()}
