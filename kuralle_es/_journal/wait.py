"""``Wait``: what a paused run waits for, as one typed value (internal).

The ``Run`` aggregate stores it (``Run.pause(wait)``, ``Run.waiting``), a
suspend raises it (``SuspendError.wait``), and a delivery is checked against
it; nobody reads a wait back by string key.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError

from ..shapes import WaitingFor
from .sites import Lane

__all__ = [
    "APPROVAL",
    "BUDGET",
    "CHILD",
    "INPUT",
    "IN_DOUBT",
    "IN_DOUBT_ACTIONS",
    "TIMER",
    "ApprovalAnswer",
    "DeadlineDeny",
    "InDoubtAction",
    "InDoubtAnswer",
    "Wait",
]


#: The stored names of the waits the runtime makes itself (a signal's own name
#: never starts with ``__``).
APPROVAL = "__approval"
#: The approval a run waits for before a model call past its budget.
BUDGET = "__budget"
IN_DOUBT = "__in_doubt"
INPUT = "__input"
#: The wait of a run paused on a durable sleep (``ctx.sleep``); nothing is delivered to it.
TIMER = "__timer"
#: The wait of a parent run for a child run to end (``ctx.child``, ``ctx.wait_child``,
#: a ``flow_tool`` call); the child's end is its delivery, never an operator's.
CHILD = "__child"


class ApprovalAnswer(BaseModel):
    """An approver's answer to an approval wait (``__approval``; a budget's
    ``__budget`` too, whose ``raise_to`` raises its limits): what the delivered
    payload must hold. Other keys are kept in the journal, and ignored here."""

    model_config = ConfigDict(frozen=True)

    approved: StrictBool
    by: StrictStr | None = None
    reason: StrictStr | None = None
    #: Checked against the budget's limits where a budget is raised (``deliveries``).
    raise_to: Any = None


class DeadlineDeny(BaseModel):
    """What the deadline sweeper delivers to a wait whose deadline passed: a denial
    by ``"deadline"``, stored as the wait's payload. A typed signal's node gets
    ``DeadlineExpiredError`` for it instead (docs/node-code.md)."""

    model_config = ConfigDict(frozen=True)

    approved: Literal[False] = False
    denied: Literal[True] = True
    by: Literal["deadline"] = "deadline"
    reason: Literal["deadline-expired"] = "deadline-expired"

    @classmethod
    def payload(cls) -> dict[str, Any]:
        """The deny as a delivery carries it, and the journal keeps it."""
        return cls().model_dump()

    @classmethod
    def is_one(cls, payload: Any) -> bool:
        """Whether a delivered payload is the sweeper's deny, and nothing more."""
        return isinstance(payload, dict) and payload == cls.payload()


#: How a human answers a step in doubt (docs/howto/in-doubt.md).
InDoubtAction = Literal["retry", "resolve", "fail"]
IN_DOUBT_ACTIONS: tuple[str, ...] = get_args(InDoubtAction)


class InDoubtAnswer(BaseModel):
    """A human's answer to a step left running by a crash (docs/howto/in-doubt.md):
    ``retry`` it under its key, ``resolve`` it with the ``result`` to record, or
    ``fail`` it (``message`` for the node's ``ToolExecutionError``)."""

    model_config = ConfigDict(frozen=True)

    action: InDoubtAction
    result: Any = None
    message: str | None = None

    @classmethod
    def of(cls, payload: Any) -> InDoubtAnswer | None:
        """The answer a delivered payload holds, or None when it holds none (or,
        for ``resolve``, no result to record)."""
        try:
            answer = cls.model_validate(payload)
        except ValidationError:
            return None
        if answer.action == "resolve" and "result" not in answer.model_fields_set:
            return None
        return answer


class Wait(WaitingFor):
    """What a paused run waits for: the public ``WaitingFor`` fields, and what
    resuming needs besides (the logical run and lane of the wait's step, an
    in-doubt step's index, the topic of a signal's payload schema).

    Stored in ``stored.Paused`` as one flat JSON object (the public fields, with
    the private ones beside them), so readers of stored events see a
    ``WaitingFor`` there. Callers see only ``public()``: a ``Wait`` is never
    handed out where a ``WaitingFor`` is shown.
    """

    model_config = ConfigDict(frozen=True)

    logical_run: str
    lane: Lane = Lane.MAIN
    step_index: int | None = None
    schema_topic: str | None = None

    @classmethod
    def of(cls, waiting_for: WaitingFor, *, logical_run: str, **private: Any) -> Wait:
        """The wait behind a public ``WaitingFor``, with its private fields."""
        return cls(**dict(waiting_for), logical_run=logical_run, **private)

    def public(self) -> WaitingFor:
        """The public fields, as the ``WaitingFor`` a caller sees."""
        return WaitingFor(**{name: getattr(self, name) for name in WaitingFor.model_fields})

    def is_at(self, logical_run: str, callsite: int, name: str, lane: Lane) -> bool:
        """Whether this wait is the one a suspend at this place would make."""
        return (self.name, self.callsite, self.logical_run, self.lane) == (
            name,
            callsite,
            logical_run,
            lane,
        )

    def to_json(self) -> dict[str, Any]:
        """The stored JSON: every field, but ``step_index``, ``schema_topic`` and
        ``child_run_id`` only where set (a wait without them is stored as releases
        before them stored it)."""
        optional = ("step_index", "schema_topic", "child_run_id")
        unset = {name for name in optional if getattr(self, name) is None}
        return self.model_dump(mode="json", exclude=unset)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Wait:
        """A stored wait; one stored without ``logical_run`` reads with the empty one."""
        return cls.model_validate({"logical_run": "", **data})
