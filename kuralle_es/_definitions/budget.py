"""``Budget``: the most a run may spend on model calls before a human says yes (API).

Given to ``define_agent(..., budget=)`` or ``runtime.run(..., budget=)``;
the check before each model call is in the runtime (docs/usage.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..shapes import Usage

__all__ = ["Budget"]


class Budget(BaseModel):
    """The most a run may spend on model calls before a human says yes.

    A limit is reached when the usage so far is at or past it; the next model
    call then does not start: ``on_exceed="ask"`` pauses the run on an
    approval named ``__budget`` (approved with ``raise_to``, the fields to
    raise, it goes on under the raised budget; denied, the run finishes with
    outcome ``"budget exceeded"``); ``"fail"`` ends the run with
    ``BudgetExceededError``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_total_tokens: int | None = Field(default=None, ge=0)
    max_cost: float | None = Field(default=None, ge=0)
    max_model_calls: int | None = Field(default=None, ge=0)
    on_exceed: Literal["ask", "fail"] = "ask"

    def limits(self) -> dict[str, Any]:
        """The limits that are set, by field name."""
        return {
            name: value
            for name, value in self.model_dump(exclude={"on_exceed"}).items()
            if value is not None
        }

    def raised(self, raise_to: Mapping[str, Any]) -> Budget:
        """This budget with the limits of ``raise_to`` (a human's approval) in place."""
        return Budget.model_validate({**self.model_dump(), **raise_to})

    def exceeded_by(self, usage: Usage) -> list[str]:
        """The limits the usage so far is at or past (empty: the next call may start)."""
        reached = []
        if self.max_total_tokens is not None and usage.total_tokens >= self.max_total_tokens:
            reached.append("max_total_tokens")
        if self.max_model_calls is not None and usage.model_calls >= self.max_model_calls:
            reached.append("max_model_calls")
        if self.max_cost is not None and usage.cost is not None and usage.cost >= self.max_cost:
            reached.append("max_cost")
        return reached
