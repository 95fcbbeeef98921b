"""Erasing one data subject: its live runs aborted, then its key destroyed (internal).

``Runtime.erase_subject`` (the CLI's ``erase``, HTTP ``DELETE
/api/subjects/{subject}``). The subject's runs are found in the views (each
run row carries its subject). Every run of the subject that could still do
something is aborted first, with outcome ``"erased"``, by the same
compare-and-set change as a cancel (a turn driving it elsewhere loses its
next save and stops): its running, paused and errored runs, and its
conversations, which a new message would otherwise carry on. An aborted run
re-addressed executes nothing, so nothing ever runs on a payload that can no
longer be read. Then the subject's data key is deleted from the key table,
and every payload sealed under it reads ``Redacted`` from then on, in the
database and in its backups (docs/privacy.md).
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, Field

from .._journal.store import RunStore
from ..errors import InvalidArgumentError, RunNotFoundError
from ..views.api import RunViews
from ..views.query import RunQuery
from .run_changes import ERASED, Erase, change_run

__all__ = ["ErasureReport", "erase_subject"]


class ErasureReport(BaseModel):
    """What ``erase_subject`` did: the subject, every run of it (whose payloads now read
    ``Redacted``), and those it aborted (outcome ``"erased"``)."""

    subject: str
    runs: list[str] = Field(default_factory=list)
    aborted: list[str] = Field(default_factory=list)


async def erase_subject(store: RunStore, views: RunViews, subject: str) -> ErasureReport:
    """Abort the subject's live runs, then destroy its key (see the module docstring)."""
    if not isinstance(subject, str) or not subject:
        msg = f"erase_subject needs a subject (a non-empty string), got {subject!r}"
        raise InvalidArgumentError(msg)
    runs: dict[str, None] = {}
    aborted: list[str] = []
    # Twice: a run the subject started while the first pass aborted others is
    # found by the second (the key is destroyed between them and after).
    for _ in range(2):
        rows = await views.run_rows(RunQuery(subject=subject, order="oldest"))
        for row in rows:
            runs.setdefault(row.run_id, None)
            if Erase.applies(row.status, row.kind):
                try:
                    run = await change_run(store, row.run_id, row.session_id, Erase())
                except RunNotFoundError:
                    continue  # pruned meanwhile
                if run.outcome == ERASED and row.run_id not in aborted:
                    aborted.append(row.run_id)
        await asyncio.to_thread(store.erase_keys, subject)
    return ErasureReport(subject=subject, runs=list(runs), aborted=aborted)
