"""``Wait``: what a paused run waits for, as one typed value (internal).

The ``Run`` aggregate stores it (``Run.pause(wait)``, ``Run.waiting``), a
suspend raises it (``SuspendError.wait``), and a delivery is checked against
it; nobody reads a wait back by string key.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..shapes import FrozenOperation, WaitingFor, WaitKind
from .sites import Lane

__all__ = ["APPROVAL", "BUDGET", "INPUT", "IN_DOUBT", "TIMER", "Wait"]


#: The stored names of the waits the runtime makes itself (a signal's own name
#: never starts with ``__``).
APPROVAL = "__approval"
#: The approval a run waits for before a model call past its budget.
BUDGET = "__budget"
IN_DOUBT = "__in_doubt"
INPUT = "__input"
#: The wait of a run paused on a durable sleep (``ctx.sleep``); nothing is delivered to it.
TIMER = "__timer"


@dataclass(frozen=True)
class Wait:
    """What a paused run waits for: the public ``WaitingFor`` fields, and what
    resuming needs besides (the logical run and lane of the wait's step, an
    in-doubt step's index, the topic of a signal's payload schema).

    Stored in ``stored.Paused`` as one flat JSON object (the public fields, with
    the private ones beside them), so readers of stored events see a
    ``WaitingFor`` there.
    """

    name: str
    callsite: int
    kind: WaitKind
    request_id: str
    logical_run: str
    title: str | None = None
    description: str | None = None
    deadline: datetime | None = None
    operation: FrozenOperation | None = None
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
        data: dict[str, Any] = {
            **self.public().model_dump(mode="json"),
            "logical_run": self.logical_run,
            "lane": self.lane.value,
        }
        if self.step_index is not None:
            data["step_index"] = self.step_index
        if self.schema_topic is not None:
            data["schema_topic"] = self.schema_topic
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Wait:
        step_index = data.get("step_index")
        schema_topic = data.get("schema_topic")
        return cls.of(
            WaitingFor.model_validate(data),
            logical_run=str(data.get("logical_run", "")),
            lane=Lane(str(data.get("lane", ""))),
            step_index=None if step_index is None else int(step_index),
            schema_topic=None if schema_topic is None else str(schema_topic),
        )
