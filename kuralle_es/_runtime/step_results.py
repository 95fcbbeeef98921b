"""What a recorded step reads as on a later pass: its result or its frozen error (internal).

The same step reads the same on the first pass and on every replay: a
finished step returns its recorded JSON, a failed one raises the exception
its recorded error describes (docs/guarantees.md).
"""

from __future__ import annotations

import json
from typing import Any

from .._definitions.tools import ToolExited
from .._journal.run import Run, StepData
from ..errors import ToolExecutionError, ToolResultTypeError, ToolTimeoutError, error_fields
from ..shapes import StepError, TurnResult
from .replay_source import RecordedFailure

__all__ = [
    "TIMEOUT",
    "UNRECORDABLE",
    "decode",
    "frozen_error",
    "result_of",
    "settled",
    "step_error",
]

#: ``StepError.data["reason"]`` of a result the journal could not hold.
UNRECORDABLE = "unrecordable_result"
#: ``StepError.data["reason"]`` of an attempt cancelled by the tool's timeout.
TIMEOUT = "timeout"

#: The exception class a recorded error's reason raises as (any other: ``ToolExecutionError``).
_RAISED_AS: dict[str, type[ToolExecutionError]] = {
    UNRECORDABLE: ToolResultTypeError,
    TIMEOUT: ToolTimeoutError,
}


def result_of(run: Run, output: Any = None) -> TurnResult:
    """A turn's result, read off the run (not its whole state: a long
    conversation's messages would be validated at every turn for nothing)."""
    return TurnResult(
        run_id=run.run_id,
        status=run.status,
        output=output if output is not None else run.output,
        waiting_for=run.public_wait(),
    )


def frozen_error(step: StepData) -> ToolExecutionError:
    """The exception a failed step raises, identical on the first pass and on replay."""
    error = step["error"] or {}
    data = error.get("data") or {}
    raised_as = _RAISED_AS.get(str(data.get("reason")), ToolExecutionError)
    error_type = str(error.get("type", "Exception"))
    return raised_as(step["name"], error_type, str(error.get("message", "")), data)


def step_error(exc: Exception) -> StepError:
    """What the journal keeps of an attempt's error (a tool's ``BaseException`` under
    its own name)."""
    if isinstance(exc, ToolTimeoutError):
        return StepError(
            type=exc.error_type, message=exc.message, data={**exc.data, "reason": TIMEOUT}
        )
    if isinstance(exc, ToolExited):
        return StepError(type=type(exc.raised).__name__, message=str(exc), data={})
    if isinstance(exc, RecordedFailure):
        return exc.error
    return StepError(type=type(exc).__name__, message=str(exc), data=error_fields(exc))


def decode(step: StepData) -> Any:
    """A finished step's recorded result."""
    text = step["result_json"]
    return None if text is None else json.loads(text)


def settled(step: StepData) -> tuple[bool, Any]:
    """The replay of a recorded step: (True, its result), its frozen error raised,
    or (False, None) for a step still running."""
    if step["status"] == "finished":
        return True, decode(step)
    if step["status"] == "error":
        raise frozen_error(step)
    return False, None
