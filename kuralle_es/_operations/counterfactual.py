"""``Counterfactual``: a recorded run beside its re-drive under new code or a new model (API).

What ``kuralle_es.testing.replay_with`` returns, and how two journals are
compared: the first step where they differ, the tool calls of each (the
ones the re-drive would execute marked), how each ended, and what each
spent (docs/howto/evaluating-models.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, computed_field

from .._journal.run import Run, StepData
from .._journal.spending import ModelUsage, Prices, total
from .._journal.wait import IN_DOUBT
from ..shapes import StepError, Usage, WaitingFor

__all__ = ["Counterfactual", "ToolCallSummary", "divergence", "tool_calls", "usage_of"]


class ToolCallSummary(BaseModel):
    """One tool call of a run: as recorded, or as the re-drive made it.

    ``would_execute``: the recording does not hold this call (another tool,
    or other args), so the re-drive did not run it, and stopped there; it has
    no result.
    """

    model_config = ConfigDict(frozen=True)

    index: int
    name: str
    args: Any = None
    result: Any = None
    error: StepError | None = None
    would_execute: bool = False

    def __getitem__(self, field: str) -> Any:
        """``call["name"]`` as well as ``call.name``."""
        if field not in type(self).model_fields:
            raise KeyError(field)
        return getattr(self, field)


class Counterfactual(BaseModel):
    """A recorded run (``*_before``) beside its re-drive under new code or a new
    model (``*_after``), which executed nothing and wrote nothing to the store.

    ``diverged_at`` is the index of the first step where the two journals
    differ (another effect, other args, a model that decided otherwise, or a
    step one of them never reaches), None when every step is the same.
    ``decided_differently`` also counts a different end (status, outcome,
    output, or the wait it stands on). ``status_after`` is ``"running"``
    when the re-drive stopped at a call it would execute (``would_execute``).
    Usage and cost count every model call of each journal, the recorded
    answers the re-drive reused included; a cost is None without a price for
    every model that reported tokens.
    """

    model_config = ConfigDict(frozen=True)

    run_id: str
    session_id: str
    diverged_at: int | None = None
    #: What differs at ``diverged_at``, in words.
    divergence: str | None = None
    would_execute: list[ToolCallSummary] = []
    tool_calls_before: list[ToolCallSummary] = []
    tool_calls_after: list[ToolCallSummary] = []
    status_before: str
    status_after: str
    outcome_before: str | None = None
    outcome_after: str | None = None
    output_before: Any = None
    output_after: Any = None
    waiting_for_before: WaitingFor | None = None
    waiting_for_after: WaitingFor | None = None
    usage_before: Usage
    usage_after: Usage
    #: Why the re-drive stopped before the recording's end, if it did.
    note: str | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def cost_before(self) -> float | None:
        return self.usage_before.cost

    @computed_field  # type: ignore[prop-decorator]
    @property
    def cost_after(self) -> float | None:
        return self.usage_after.cost

    @computed_field  # type: ignore[prop-decorator]
    @property
    def cost_change(self) -> float | None:
        """``cost_after - cost_before`` (None unless both are known)."""
        if self.cost_before is None or self.cost_after is None:
            return None
        return self.cost_after - self.cost_before

    @computed_field  # type: ignore[prop-decorator]
    @property
    def decided_differently(self) -> bool:
        """Whether the re-drive took another step or ended otherwise."""
        return self.diverged_at is not None or _end(self, "before") != _end(self, "after")


def _end(c: Counterfactual, side: str) -> tuple[Any, ...]:
    wait: WaitingFor | None = getattr(c, f"waiting_for_{side}")
    if wait is not None and wait.name == IN_DOUBT:
        # A crash's question, not a decision: the re-drive stops at that step instead.
        return ("running", None, None, None)
    where = None if wait is None else (wait.kind, wait.name, wait.callsite)
    return (
        getattr(c, f"status_{side}"),
        getattr(c, f"outcome_{side}"),
        getattr(c, f"output_{side}"),
        where,
    )


def _result(step: StepData) -> Any:
    """A step's result: its stored JSON read, or ``Redacted`` as it is (an erased
    subject's step: docs/privacy.md)."""
    text = step["result_json"]
    return json.loads(text) if isinstance(text, str) else text


def tool_calls(steps: Sequence[StepData]) -> list[ToolCallSummary]:
    """The tool steps of a journal; a step still running is one that would execute."""
    return [
        ToolCallSummary(
            index=step["index"],
            name=step["name"],
            args=step["args"],
            result=_result(step),
            error=StepError.model_validate(step["error"]) if step["error"] else None,
            would_execute=step["status"] == "running",
        )
        for step in steps
        if step["kind"] == "tool"
    ]


def usage_of(run: Run, steps: Sequence[StepData], prices: Prices | None) -> Usage:
    """What a journal's model calls spent (every attempt), and its tool calls."""
    by_model = [ModelUsage(model=model, **tally) for model, tally in (run.usage or {}).items()]
    return total(by_model, sum(1 for s in steps if s["kind"] == "tool"), prices)


def _decision(step: StepData) -> Any:
    """What a model step decided: its text, the tools it asked for and their args,
    and the data it extracted (not its call ids or token counts)."""
    answer = _result(step)
    if not isinstance(answer, Mapping):
        return answer
    calls = [(c.get("name"), c.get("args")) for c in answer.get("tool_calls") or ()]
    return answer.get("content"), calls, answer.get("data")


def _same(step: StepData, recorded: StepData | None, served: Mapping[str, int]) -> bool:
    if recorded is None:
        return False
    if served.get(step["key"]) == recorded["index"]:
        return True  # the recording's own outcome, reused at the same place
    if step["key"] == recorded["key"] and step["status"] == recorded["status"] == "running":
        return True  # in doubt in the recording: a resume would run it again too
    if step["kind"] == "model" == recorded["kind"] and step["status"] == "finished":
        return recorded["status"] == "finished" and _decision(step) == _decision(recorded)
    # A step with no outside effect made again alike (a message received, a value
    # published): the same key, the same outcome.
    return (
        step["key"] == recorded["key"]
        and step["status"] == recorded["status"] == "finished"
        and _result(step) == _result(recorded)
    )


def _told(step: StepData) -> str:
    return f"{step['kind']} {step['name']!r} {json.dumps(step['args'], ensure_ascii=False)}"


def divergence(
    before: Sequence[StepData], after: Sequence[StepData], served: Mapping[str, int]
) -> tuple[int | None, str | None]:
    """The first step where two journals differ, and what differs there, in words;
    ``served`` maps the keys of the re-drive's steps that reused a recorded outcome
    to that step's index in the recording."""
    for position, step in enumerate(after):
        recorded = before[position] if position < len(before) else None
        if _same(step, recorded, served):
            continue
        now = _told(step) + (" (would execute)" if step["status"] == "running" else "")
        if recorded is None:
            return position, f"the recording ends before step {position}; the re-drive: {now}"
        if step["kind"] == "model" == recorded["kind"]:
            return position, (
                f"model step {position} decided otherwise: recorded {_decision(recorded)!r}, "
                f"now {_decision(step)!r}"
            )
        return position, f"step {position}: recorded {_told(recorded)}, now {now}"
    if len(after) < len(before):
        missing = before[len(after)]
        return len(after), f"the re-drive never reaches step {len(after)}: {_told(missing)}"
    return None, None
