"""Run events for event-driven systems (public API).

The store's notification log, read as a stable, versioned stream of what
happens to runs: ``follow(store, after)`` iterates the events after a
position, and ``Consumer(store, name, handler)`` applies a handler to each
event once, keeping its position under ``name``. See "Run events" in README.md.
"""

from __future__ import annotations

from .consumer import Consumer, Handler
from .follow import follow
from .types import (
    SCHEMA_VERSION,
    EventError,
    EventOperation,
    EventWaitingFor,
    ResumeReason,
    RunAborted,
    RunErrored,
    RunEvent,
    RunFinished,
    RunOpened,
    RunPaused,
    RunResumed,
    SignalAccepted,
    StepFailed,
    StepFinished,
    StepStarted,
    ValuePublished,
    events_json_schema,
    parse_event,
)

__all__ = [
    "SCHEMA_VERSION",
    "Consumer",
    "EventError",
    "EventOperation",
    "EventWaitingFor",
    "Handler",
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
    "follow",
    "parse_event",
]
