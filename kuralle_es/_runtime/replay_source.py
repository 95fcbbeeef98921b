"""Where a step's outcome may come from instead of its execution: a recorded run (internal).

``kuralle_es.testing.replay_with`` re-drives a recorded run through the
ordinary turn and the ordinary writer (``RunWriter.effect`` and
``record_value``), on a scratch store. The writer asks its ``ReplaySource``
before it executes a step it has not journaled: a step the recording holds
under the same key is journaled with the recorded outcome (a result, or the
error it froze), and its effect never runs; anything else executes as usual
(a tool call the recording lacks reaches the replay's stub, which stops the
re-drive; a model call reaches the model being evaluated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .._journal.sites import Effect
from ..shapes import StepError

__all__ = ["RecordedFailure", "ReplaySource", "Served"]


@dataclass(frozen=True)
class Served:
    """A recorded step's outcome: its result, or the error it ended in."""

    result: Any = None
    error: StepError | None = None


class ReplaySource(Protocol):
    """The recorded steps a re-drive may reuse."""

    def serve(self, effect: Effect) -> Served | None:
        """The recorded outcome of ``effect`` (None: execute it)."""


class RecordedFailure(Exception):
    """A served step's recorded error, raised as its execution's: journaled as it was."""

    def __init__(self, error: StepError) -> None:
        super().__init__(error.message)
        self.error = error
