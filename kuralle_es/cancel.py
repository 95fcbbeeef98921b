"""Cancelling a run from outside its turns (internal; ``Runtime.cancel`` and the CLI).

A cancel is one compare-and-set save that wins over whoever holds the lease:
a turn driving the run elsewhere loses its next save (``StaleWriteError``) and
stops without executing anything further, since every effect saves its
intent before it executes. The cancel itself is retried (reload, apply,
save) until it lands, so a busy turn cannot starve it.
"""

from __future__ import annotations

import asyncio
import random

from .commands import load_run
from .errors import InvalidArgumentError, RunNotFoundError, StaleWriteError
from .models import RunState
from .store import RunStore

__all__ = ["cancel_run"]


async def cancel_run(store: RunStore, run_id: str, session_id: str, reason: str) -> RunState:
    """Cancel the run; returns its state after (see ``Runtime.cancel``)."""
    if not isinstance(reason, str) or not reason.strip():
        msg = f"cancel needs a reason (a non-empty string), got {reason!r}"
        raise InvalidArgumentError(msg)
    attempt = 0
    while True:
        run = await load_run(store, run_id, session_id)
        if run is None:
            raise RunNotFoundError(run_id, session_id)
        if not run.cancel(reason.strip()):
            return run.to_state()  # already cancelled or aborted: a no-op
        try:
            await store.save_run_async(run)
        except StaleWriteError:
            # A turn saved first: read what it wrote and cancel that.
            attempt += 1
            await asyncio.sleep(random.uniform(0, min(0.05, 0.002 * attempt)))
            continue
        return run.to_state()
