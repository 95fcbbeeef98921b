"""Suspending a turn on a wait (internal).

Suspending raises ``SuspendError`` carrying a typed ``Wait``; the turn
catches it, pauses the run and ends cleanly. The writer keeps the turn's
first suspension: node code that catches it and goes on gets it again at its
next effect (docs/node-code.md). Re-suspending on the same wait keeps its
``request_id`` and deadline, so a supervisor's pending link stays valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NoReturn
from uuid import uuid4

from eventsourcing.utils import resolve_topic
from pydantic import BaseModel

from .._durations import deadline_at
from .._journal.keys import canonical_json, sha256_hex
from .._journal.sites import Site
from .._journal.wait import Wait
from ..shapes import ApprovalDecision, FrozenOperation, WaitKind
from .writer import RunWriter

__all__ = [
    "Schemas",
    "WaitRequest",
    "approval_decision",
    "frozen_operation",
    "suspend",
]


class Schemas:
    """Payload schemas of ``ctx.signal`` seen by one runtime, by topic.

    A delivery validates against the class the run suspended with, even one
    defined where ``resolve_topic`` can't reach (inside a function).
    """

    def __init__(self) -> None:
        self._by_topic: dict[str, type[BaseModel]] = {}

    def remember(self, schema: type[BaseModel]) -> str:
        # The topic as ``eventsourcing`` writes one, without its registry: a class
        # defined in a function is a new class each time the function runs (a
        # test's, a factory's), and the registry refuses a second class under one
        # topic (``TopicError``).
        topic = f"{schema.__module__}:{schema.__qualname__}"
        self._by_topic[topic] = schema
        return topic

    def find(self, topic: str | None) -> type[BaseModel] | None:
        """The schema of ``topic``, or None when it can be found neither here nor by import."""
        if not topic:
            return None
        schema = self._by_topic.get(topic)
        if schema is not None:
            return schema
        try:
            resolved = resolve_topic(topic)
        except Exception:
            # Not importable here: ctx.signal validates on re-execution instead.
            return None
        if isinstance(resolved, type) and issubclass(resolved, BaseModel):
            return resolved
        return None


def frozen_operation(tool_name: str, args: Any) -> FrozenOperation:
    return FrozenOperation(
        tool_name=tool_name, args=args, args_hash=sha256_hex(canonical_json(args))
    )


def _absolute(deadline: datetime | timedelta | float | None, writer: RunWriter) -> datetime | None:
    return deadline_at(deadline, writer.now())


@dataclass(frozen=True)
class WaitRequest:
    """What a run is asked to wait for, by node code or by the runtime for it.

    The kind of wait is ``suspend``'s own argument: ``RunContext`` journals an
    answered wait as a step of that kind and names it once for both. The
    ``Wait`` that ``suspend`` makes adds where (the site), which request (its id,
    kept while the run waits on it) and when it expires (an absolute deadline).
    """

    name: str
    title: str | None = None
    description: str | None = None
    #: When the wait expires: a moment, a delay or seconds from now (None: never).
    deadline: datetime | timedelta | float | None = None
    #: The frozen tool call an approval (or an in-doubt question) is about.
    operation: FrozenOperation | None = None
    #: The step an in-doubt question is about.
    step_index: int | None = None
    #: The model a signal's payload is validated against.
    schema: type[BaseModel] | None = None
    #: The child run a parent waits for (``kind == "child"``).
    child_run_id: str | None = None


def suspend(
    writer: RunWriter,
    site: Site,
    kind: WaitKind,
    request: WaitRequest,
    schemas: Schemas | None = None,
) -> NoReturn:
    """Stop the turn on a wait of ``kind`` until ``request.name`` is delivered for
    this site (``schemas`` remembers the request's payload schema, for the delivery).

    The journal keeps the turn's first suspension: node code that catches
    this ``SuspendError`` and goes on gets it again at its next effect.
    """
    current = writer.waiting
    if current is not None and current.is_at(
        site.logical_run, site.callsite, request.name, site.lane
    ):
        request_id = current.request_id
        absolute = current.deadline or _absolute(request.deadline, writer)
    else:
        request_id = uuid4().hex
        absolute = _absolute(request.deadline, writer)
    topic = None
    if request.schema is not None:
        topic = (schemas or Schemas()).remember(request.schema)
    wait = Wait(
        name=request.name,
        callsite=site.callsite,
        title=request.title,
        description=request.description,
        deadline=absolute,
        request_id=request_id,
        kind=kind,
        operation=request.operation,
        logical_run=site.logical_run,
        lane=site.lane,
        step_index=request.step_index,
        schema_topic=topic,
        child_run_id=request.child_run_id,
    )
    writer.admission.suspend(wait)


def approval_decision(payload: Any) -> ApprovalDecision:
    """``ctx.approve()``'s answer, built from a validated approval payload."""
    data = dict(payload)
    return ApprovalDecision(
        approved=bool(data.pop("approved")),
        by=data.pop("by", None),
        reason=data.pop("reason", None),
        data=data,
    )
