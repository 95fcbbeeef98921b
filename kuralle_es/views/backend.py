"""What every view backend provides, and the one way a batch of events is applied.

``apply`` is a template method: the backend opens one transaction that
serialises projectors (a lock) and reads the tracking position; events at or
before that position were applied already (by this or another process) and
are skipped; the rest are folded and written with the new position in that
same transaction. So each event is applied exactly once, whoever applies it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from .._journal import catalogue as stored
from .fold import RunRow, StepRow, fold
from .query import RunQuery, UsageQuery, UsageShare
from .source import Logged, UnknownEvent
from .summaries import ToolStats

__all__ = ["ViewBackend", "ViewTransaction"]

StepKey = tuple[str, int]


class ViewTransaction(Protocol):
    """One open transaction of a view backend, holding the projectors' lock."""

    def position(self) -> int | None: ...

    def load_runs(self, run_ids: Collection[str]) -> dict[str, RunRow]: ...

    def load_steps(self, keys: Collection[StepKey]) -> dict[StepKey, StepRow]: ...

    def write(self, runs: Sequence[RunRow], steps: Sequence[StepRow], position: int) -> None: ...


class ViewBackend(ABC):
    """View tables of one store, with their tracking position."""

    #: The upstream application's name, the key of the tracking position.
    application_name = "RunStore"

    @abstractmethod
    def view_transaction(self) -> AbstractContextManager[ViewTransaction]:
        """A transaction holding the projectors' lock; commits on a clean exit."""

    @abstractmethod
    def view_position(self) -> int | None:
        """The notification id of the last event applied (None: none yet)."""

    @abstractmethod
    def select_runs(self, query: RunQuery) -> list[RunRow]: ...

    @abstractmethod
    def select_tool_stats(self) -> list[ToolStats]: ...

    @abstractmethod
    def select_usage(self, query: UsageQuery) -> list[UsageShare]:
        """What the model and tool steps ``query`` covers spent, by group, kind and model."""

    @abstractmethod
    def select_steps(self) -> list[StepRow]:
        """Every step row (for checks and rebuild comparisons; not indexed)."""

    @abstractmethod
    def delete_runs(self, run_ids: Sequence[str], *, keep_steps: bool) -> None:
        """Delete these runs' rows (``prune``); their step rows too unless
        ``keep_steps`` (what ``usage`` sums: a pruned run's spending is kept)."""

    @abstractmethod
    def reset_views(self) -> None:
        """Delete every row and the tracking position, in one transaction."""

    def apply(self, entries: Sequence[Logged], last_id: int) -> int:
        """Apply the entries of the log up to ``last_id``; returns how many were new.

        ``entries`` are every entry of the log after some earlier position up
        to ``last_id``, in order (non-run events included or not: only run
        events change rows, but the position moves to ``last_id`` either way).
        """
        with self.view_transaction() as tx:
            position = tx.position()
            if position is not None and last_id <= position:
                return 0
            todo = [e for e in entries if position is None or e.position > position]
            run_events = [event for e in todo if (event := e.run_event) is not None]
            runs = tx.load_runs({str(e.originator_id) for e in run_events})
            steps = tx.load_steps(set(_step_keys(run_events)))
            changed_runs: dict[str, RunRow] = {}
            changed_steps: dict[StepKey, StepRow] = {}
            for event in run_events:
                run_id = str(event.originator_id)

                def lookup(index: int, run_id: str = run_id) -> StepRow | None:
                    return steps.get((run_id, index))

                row, step = fold(runs.get(run_id), event, lookup)
                runs[run_id] = changed_runs[run_id] = row
                if step is not None:
                    steps[(run_id, step.index)] = changed_steps[(run_id, step.index)] = step
            tx.write(list(changed_runs.values()), list(changed_steps.values()), last_id)
            return len(todo)


def _step_keys(events: Sequence[stored.Event | UnknownEvent]) -> Iterator[StepKey]:
    for event in events:
        if isinstance(event, stored.STEP_EVENTS):
            yield str(event.originator_id), event.index
