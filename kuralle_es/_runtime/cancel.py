"""Cancelling a run from outside its turns (internal; ``Runtime.cancel`` and the CLI).

A cancel is one compare-and-set save that wins over whoever holds the lease:
a turn driving the run elsewhere loses its next save (``StaleWriteError``) and
stops without executing anything further, since every effect saves its
intent before it executes. The cancel itself is retried (reload, apply,
save) until it lands, so a busy turn cannot starve it.
"""

from __future__ import annotations

from .._journal.store import RunStore
from ..errors import InvalidArgumentError
from ..shapes import RunState
from .writer import Cancel, change_run

__all__ = ["cancel_run"]


async def cancel_run(store: RunStore, run_id: str, session_id: str, reason: str) -> RunState:
    """Cancel the run; returns its state after (see ``Runtime.cancel``)."""
    if not isinstance(reason, str) or not reason.strip():
        msg = f"cancel needs a reason (a non-empty string), got {reason!r}"
        raise InvalidArgumentError(msg)
    run = await change_run(store, run_id, session_id, Cancel(reason.strip()))
    return run.to_state(await store.lease_async(run_id))
