"""Cancelling a run from outside its turns (internal; ``Runtime.cancel`` and the CLI).

A cancel is one compare-and-set save that wins over whoever holds the lease:
a turn driving the run elsewhere loses its next save (``StaleWriteError``) and
stops without executing anything further, since every effect saves its
intent before it executes. The cancel itself is retried (reload, apply,
save) until it lands, so a busy turn cannot starve it. The run's live child
runs are cancelled after it, and theirs after them (docs/child-runs.md); a
child's id is on its parent from the intent of the step that starts it, so a
child being created while its parent is cancelled is found too (and refuses
to start once it sees its parent stopped).
"""

from __future__ import annotations

from .._journal.run import Run
from .._journal.store import RunStore
from ..errors import InvalidArgumentError
from ..shapes import RunState
from .run_changes import Cancel, change_run

__all__ = ["cancel_run"]


async def cancel_run(store: RunStore, run_id: str, session_id: str, reason: str) -> RunState:
    """Cancel the run and its live children; returns its state after (see
    ``Runtime.cancel``)."""
    if not isinstance(reason, str) or not reason.strip():
        msg = f"cancel needs a reason (a non-empty string), got {reason!r}"
        raise InvalidArgumentError(msg)
    run = await change_run(store, run_id, session_id, Cancel(reason.strip()))
    await _cancel_children(store, run, reason.strip())
    return run.to_state(await store.lease_async(run_id))


async def _cancel_children(store: RunStore, parent: Run, reason: str) -> None:
    """Cancel each child of ``parent`` that has not ended, and its children."""
    for child_id in parent.children:
        child = await store.load_async(child_id)
        if child is None or child.status in ("finished", "aborted"):
            continue  # not created (its start never ran), or over already
        why = f"{reason} (its parent run {parent.run_id} was cancelled)"
        try:
            cancelled = await change_run(store, child_id, child.session_id, Cancel(why))
        except InvalidArgumentError:
            continue  # it finished meanwhile: nothing to cancel
        await _cancel_children(store, cancelled, reason)
