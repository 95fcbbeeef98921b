"""Where a step lives in a run's journal, and the one function that keys it (internal).

A ``Site`` is one journal slot: a callsite of a logical run, in a ``Lane``.
A lane keeps a second slot at the same callsite: a tool's approval lives
beside the tool's own step, a budget's approval beside the model call it
lets start. ``step_key`` makes the idempotency key of every effect from its
site, kind, name and args (docs/concepts.md, "Idempotency keys"), so the
effects that journal steps and the fork that re-keys them agree by
construction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from functools import cached_property
from typing import Any

from ..shapes import StepKind
from .keys import idempotency_key

__all__ = ["Effect", "Lane", "Site", "split_lane", "step_key", "step_payload"]


class Lane(StrEnum):
    """A journal slot beside the main one at a callsite (stored as its value)."""

    MAIN = ""
    #: A tool's approval, beside the tool's step.
    APPROVAL = "!approval"
    #: A budget's approval, beside the model call it lets start.
    BUDGET = "!budget"
    #: The wait for a child run, beside the step that started it (``ctx.child``).
    CHILD = "!child"


def split_lane(stored: str) -> tuple[str, str]:
    """A logical run stored with its lane appended (intents and waits stored by
    0.1.0), as the logical run and the lane. Only for reading those shapes."""
    for lane in (Lane.APPROVAL, Lane.BUDGET):
        if stored.endswith(lane.value):
            return stored[: -len(lane.value)], lane.value
    return stored, Lane.MAIN.value


@dataclass(frozen=True)
class Site:
    """One journal slot: a callsite of a logical run (``keys.logical_run_id``), in a lane.

    ``batch`` is the callsite of the first effect of the parallel batch this
    one belongs to (None: requested alone).
    """

    logical_run: str
    callsite: int
    lane: Lane = Lane.MAIN
    batch: int | None = None

    @property
    def slot(self) -> str:
        """The key under which the run finds the steps of this slot."""
        return f"{self.logical_run}{self.lane.value}|{self.callsite}"

    def in_lane(self, lane: Lane) -> Site:
        return replace(self, lane=lane)

    def in_batch(self, batch: int | None) -> Site:
        return replace(self, batch=batch)


def step_payload(kind: str, name: str, args: Any) -> Any:
    """What the key of an effect of ``kind`` hashes besides its site: a tool's
    name and validated args, a model call's model and purpose, the signal name
    of an approval or a signal, the kind of a clock read, a uuid or a timer."""
    if kind == "tool":
        return {"name": name, "args": args}
    if kind == "model":
        purpose = args.get("purpose") if isinstance(args, dict) else None
        return {"model": name, "purpose": purpose}
    if kind in ("now", "uuid", "timer"):
        return kind
    return name


def step_key(site: Site, kind: str, name: str, args: Any, override: str | None = None) -> str:
    """The idempotency key of an effect at ``site``; ``override`` is a tool's own
    (``define_tool(..., idempotency_key=...)``), used as it is."""
    if override is not None:
        return override
    return idempotency_key(site.logical_run, site.callsite, step_payload(kind, name, args))


@dataclass(frozen=True)
class Effect:
    """One effect as the journal files it: where, what, with which args (and a
    tool's own key, when its definition chose one)."""

    site: Site
    kind: StepKind
    name: str
    args: Any = None
    override: str | None = None

    @cached_property
    def key(self) -> str:
        """The effect's idempotency key (computed once: it hashes the args' JSON)."""
        return step_key(self.site, self.kind, self.name, self.args, self.override)
