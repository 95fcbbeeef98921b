"""Deleting ended runs from a log: events, snapshots, lease records, in small batches (internal).

``runtime.prune`` picks the runs (ended before a date, from the views) and
calls ``delete_runs`` for each log. Each batch of runs is one short
transaction, so a save waits at most for one batch (a save takes the events
table's lock, a delete only row locks): no long lock on the events table.
The notification log gets gaps where the deleted events were; followers
(``follow``, ``Consumer``, the views) read across gaps as they always could
(docs/privacy.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from uuid import UUID

from eventsourcing.persistence import AggregateRecorder
from eventsourcing.popo import POPOAggregateRecorder
from eventsourcing.postgres import PostgresAggregateRecorder
from eventsourcing.sqlite import SQLiteAggregateRecorder
from psycopg.sql import SQL, Identifier

from .recorders import LeasingPOPORecorder, LeasingSQLiteRecorder, OneTripPostgresRecorder

if TYPE_CHECKING:
    from .log import RunLog

__all__ = ["PRUNE_BATCH", "delete_runs"]

#: Runs deleted in one transaction.
PRUNE_BATCH = 50


def delete_runs(log: RunLog, run_ids: Sequence[str]) -> int:
    """Delete the runs' events, snapshots and lease records from ``log``, a batch of
    runs a transaction; how many events were deleted."""
    ids = [UUID(run_id) for run_id in run_ids]
    snapshots = log.snapshots.recorder if log.snapshots is not None else None
    deleted = 0
    for start in range(0, len(ids), PRUNE_BATCH):
        batch = ids[start : start + PRUNE_BATCH]
        deleted += _delete(log.recorder, batch, leases=True)
        if snapshots is not None:
            _delete(snapshots, batch, leases=False)
    return deleted


def _delete(recorder: AggregateRecorder, ids: list[UUID], *, leases: bool) -> int:
    if isinstance(recorder, POPOAggregateRecorder):
        return _delete_popo(recorder, ids, leases=leases)
    if isinstance(recorder, SQLiteAggregateRecorder):
        return _delete_sqlite(recorder, ids, leases=leases)
    if isinstance(recorder, PostgresAggregateRecorder):
        return _delete_postgres(recorder, ids, leases=leases)
    msg = f"cannot prune runs recorded by {type(recorder).__name__}"
    raise TypeError(msg)


def _delete_popo(recorder: POPOAggregateRecorder, ids: list[UUID], *, leases: bool) -> int:
    """In memory: the runs are no longer found (their entries leave the index; the
    process's notification list keeps its positions, so followers are not moved)."""
    index: dict[str, dict[int, int]] = recorder._stored_events_index
    deleted = 0
    with recorder._database_lock:
        for run_id in ids:
            deleted += len(index.pop(str(run_id), {}))
    if leases and isinstance(recorder, LeasingPOPORecorder):
        with recorder._lease_guard:
            for run_id in ids:
                recorder._leases.pop(run_id, None)
    return deleted


def _delete_sqlite(recorder: SQLiteAggregateRecorder, ids: list[UUID], *, leases: bool) -> int:
    marks = ",".join("?" * len(ids))
    values = [i.hex for i in ids]  # how eventsourcing's SQLite recorder keeps a UUID
    with recorder.datastore.transaction(commit=True) as c:
        c.execute(
            f"DELETE FROM {recorder.events_table_name} WHERE originator_id IN ({marks})", values
        )
        c.execute("SELECT changes()")
        deleted = int(c.fetchone()[0])
        if leases and isinstance(recorder, LeasingSQLiteRecorder):
            c.execute(
                f"DELETE FROM {recorder.leases_table} WHERE run_id IN ({marks})",
                [str(i) for i in ids],
            )
    return deleted


def _delete_postgres(recorder: PostgresAggregateRecorder, ids: list[UUID], *, leases: bool) -> int:
    table: Any = Identifier(recorder.datastore.schema, recorder.events_table_name)
    with recorder.datastore.transaction(commit=True) as curs:
        curs.execute(SQL("DELETE FROM {} WHERE originator_id = ANY(%s)").format(table), (ids,))
        deleted = int(curs.rowcount)
        if leases and isinstance(recorder, OneTripPostgresRecorder):
            curs.execute(
                SQL("DELETE FROM {} WHERE run_id = ANY(%s)").format(recorder.leases), (ids,)
            )
    return deleted
