"""Where each consumer's position is kept: ``eventsourcing`` tracking recorders (internal).

One row per consumer name in a tracking table of the store's own database:
PostgreSQL (``PostgresTrackingRecorder``, table ``kuralle_consumer_positions``),
SQLite (the same recorder class on its own table in the store's file), or an
in-process ``POPOTrackingRecorder`` per memory store. A position only ever
moves forward: recording one that is not beyond the stored position is
refused by the recorder (its ``IntegrityError``), which is how a second
instance of the same consumer loses the race instead of applying an event twice.

``begin(name, position)`` opens the transaction a ``handler(event, tx)`` runs
in: the position is recorded first (locking the consumer's row), then the
handler writes through ``tx``, then one commit makes both durable, or neither.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from eventsourcing.persistence import IntegrityError, Tracking, TrackingRecorder
from eventsourcing.popo import POPOApplicationRecorder, POPOTrackingRecorder
from eventsourcing.postgres import PostgresApplicationRecorder, PostgresTrackingRecorder
from eventsourcing.sqlite import SQLiteApplicationRecorder, SQLiteTrackingRecorder

from ..store import RunStore, retry_schema_setup

__all__ = ["TABLE", "AlreadyApplied", "PositionBook"]

TABLE = "kuralle_consumer_positions"


class AlreadyApplied(Exception):
    """Another instance of this consumer recorded this position (or a later one) first."""


class _SQLiteConsumerTracking(SQLiteTrackingRecorder):
    """``SQLiteTrackingRecorder`` on its own table, apart from projections' ``tracking``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.insert_tracking_statement = self.insert_tracking_statement.replace("tracking", TABLE)
        self.select_max_tracking_id_statement = self.select_max_tracking_id_statement.replace(
            "tracking", TABLE
        )

    def construct_create_table_statements(self) -> list[str]:
        statements = super().construct_create_table_statements()
        return [s.replace("EXISTS tracking", f"EXISTS {TABLE}") for s in statements]


_memory_books: weakref.WeakKeyDictionary[RunStore, POPOTrackingRecorder] = (
    weakref.WeakKeyDictionary()
)


class PositionBook:
    """Consumer positions for one store."""

    def __init__(self, store: RunStore) -> None:
        recorder = store.recorder
        self.recorder: TrackingRecorder
        if isinstance(recorder, PostgresApplicationRecorder):
            datastore = recorder.datastore
            self.recorder = retry_schema_setup(
                lambda: _created(PostgresTrackingRecorder(datastore, tracking_table_name=TABLE))
            )
        elif isinstance(recorder, SQLiteApplicationRecorder):
            sqlite_store = recorder.datastore
            self.recorder = _created(_SQLiteConsumerTracking(sqlite_store))
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
        return self.recorder.max_tracking_id(name)

    def record(self, name: str, position: int) -> None:
        """Record a position on its own; raises ``AlreadyApplied`` if it is not new."""
        try:
            self.recorder.insert_tracking(Tracking(name, position))
        except IntegrityError as e:
            raise AlreadyApplied(name, position) from e

    @contextlib.contextmanager
    def begin(self, name: str, position: int) -> Iterator[Any]:
        """A transaction with ``position`` recorded in it; yields the driver connection.

        Raises ``AlreadyApplied`` (and commits nothing) if the position is not new.
        """
        recorder: Any = self.recorder
        with recorder.datastore.transaction(commit=True) as curs:
            try:
                recorder._insert_tracking(curs, Tracking(name, position))
            except IntegrityError as e:
                raise AlreadyApplied(name, position) from e
            if isinstance(recorder, PostgresTrackingRecorder):
                yield curs.connection
            else:
                yield curs.sqlite_cursor.connection


def _created(recorder: Any) -> Any:
    recorder.create_table()
    return recorder
