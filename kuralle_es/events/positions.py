"""Where each consumer's position is kept: ``eventsourcing`` tracking recorders (internal).

One row per consumer name in a tracking table of the store's own database:
PostgreSQL (``PostgresTrackingRecorder``, table ``kuralle_consumer_positions``),
SQLite (the same recorder class on its own table in the store's file), or an
in-process ``POPOTrackingRecorder`` per memory store. A position only ever
moves forward: recording one that is not beyond the stored position is
refused by the recorder (its ``IntegrityError``), which is how a second
instance of the same consumer loses the race instead of applying an event twice.

``begin(name)`` opens the transaction ``handler(event, tx)`` calls run in: it
first takes the consumer's row (a row lock on PostgreSQL, the write lock on
SQLite) and reads the position stored there, so the events applied in it are
exactly those after that position; the handlers write through ``tx``, the new
position is recorded, and one commit makes all of it durable, or none.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from eventsourcing.persistence import IntegrityError, Tracking, TrackingRecorder
from eventsourcing.popo import POPOApplicationRecorder, POPOTrackingRecorder
from eventsourcing.postgres import PostgresApplicationRecorder, PostgresTrackingRecorder
from eventsourcing.sqlite import SQLiteApplicationRecorder, SQLiteTrackingRecorder
from psycopg import sql

from .._journal.eventsourcing_hooks import insert_tracking, use_tracking_table
from .._journal.log import RunLog, retry_schema_setup
from ..errors import AlreadyApplied

__all__ = ["TABLE", "Batch", "PositionBook"]

TABLE = "kuralle_consumer_positions"


_memory_books: weakref.WeakKeyDictionary[RunLog, POPOTrackingRecorder] = weakref.WeakKeyDictionary()


class PositionBook:
    """Consumer positions for one log (a partition of a store), kept in its database."""

    def __init__(self, store: RunLog) -> None:
        recorder = store.recorder
        self.recorder: TrackingRecorder
        if isinstance(recorder, PostgresApplicationRecorder):
            datastore = recorder.datastore
            self.recorder = retry_schema_setup(
                lambda: _created(PostgresTrackingRecorder(datastore, tracking_table_name=TABLE))
            )
        elif isinstance(recorder, SQLiteApplicationRecorder):
            # The SQLite tracking recorder on its own table, apart from projections'.
            tracking = SQLiteTrackingRecorder(recorder.datastore)
            use_tracking_table(tracking, TABLE)
            self.recorder = _created(tracking)
        elif isinstance(recorder, POPOApplicationRecorder):
            self.recorder = _memory_books.setdefault(store, POPOTrackingRecorder())
        else:  # pragma: no cover - the three persistence modules are all there is
            msg = f"consumers need a memory, SQLite or PostgreSQL store, not {type(recorder)}"
            raise TypeError(msg)

    @property
    def transactional(self) -> bool:
        """Whether a handler can write in the transaction that records the position."""
        return not isinstance(self.recorder, POPOTrackingRecorder)

    def position(self, name: str) -> int | None:
        return self.recorder.max_tracking_id(name) or None  # 0: a row claimed, nothing applied

    def record(self, name: str, position: int) -> None:
        """Record a position on its own; raises ``AlreadyApplied`` if it is not new."""
        try:
            self.recorder.insert_tracking(Tracking(name, position))
        except IntegrityError as e:
            raise AlreadyApplied(name, position) from e

    @contextlib.contextmanager
    def begin(self, name: str) -> Iterator[Batch]:
        """A transaction that holds the consumer's row (so no other instance of it
        moves meanwhile); yields the position stored when it took the row."""
        recorder: Any = self.recorder
        postgres = isinstance(recorder, PostgresTrackingRecorder)
        with recorder.datastore.transaction(commit=True) as curs:
            if postgres:
                table = sql.SQL("{}.{}").format(
                    sql.Identifier(recorder.datastore.schema), sql.Identifier(TABLE)
                )
                curs.execute(_PG_CLAIM.format(table=table), (name,), prepare=True)
                curs.execute(_PG_READ.format(table=table), (name,), prepare=True)
            else:  # a write first: the SQLite write lock is taken before the read
                curs.execute(_SQLITE_CLAIM, (name,))
                curs.execute(_SQLITE_READ, (name,))
            stored = int(curs.fetchone()["notification_id"])
            yield Batch(
                tx=curs.connection if postgres else curs.sqlite_cursor.connection,
                position=stored or None,
                advance=lambda position: insert_tracking(recorder, curs, Tracking(name, position)),
            )


_PG_CLAIM = sql.SQL("INSERT INTO {table} VALUES (%s, 0) ON CONFLICT (application_name) DO NOTHING")
_PG_READ = sql.SQL("SELECT notification_id FROM {table} WHERE application_name = %s FOR UPDATE")
_SQLITE_CLAIM = f"INSERT INTO {TABLE} VALUES (?, 0) ON CONFLICT (application_name) DO NOTHING"
_SQLITE_READ = f"SELECT notification_id FROM {TABLE} WHERE application_name = ?"


@dataclass(frozen=True)
class Batch:
    """An open transaction of one consumer: ``tx`` for the handler's writes, the
    consumer's ``position`` when it began, and ``advance`` to record a new one in it."""

    tx: Any
    position: int | None
    advance: Callable[[int], None]


def _created(recorder: Any) -> Any:
    recorder.create_table()
    return recorder
