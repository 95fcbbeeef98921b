"""Every use of ``eventsourcing``'s protected hooks, in one module (internal).

The library is built of template methods whose hooks start with ``_``. The
run store extends it at a few of them, all of them here and nowhere else;
``HOOKS`` names each, and ``tests/test_eventsourcing_hooks.py`` checks that
each exists, with the parameters used here, on the lowest and on the
installed release of the range ``pyproject.toml`` states. Everything else in
the package uses the library's public API.

- ``SavingApplication``: ``Application.save``'s steps (``_record``,
  ``_take_snapshots``, ``_notify``), with a save's events collected by one
  class check (``AggregatesFirst``) and snapshots taken by the subclass's
  policy (``due_snapshots``) from the aggregate just saved;
- ``SQLiteInsertHook``: the SQLite recorder's ``_insert_events``, so that a
  subclass can write on the insert's own cursor, in its transaction;
- ``SQLiteCreateTableHook``: a SQLite recorder's ``_create_table``, so that a
  subclass can order its statements and upgrade older tables in the creating
  transaction;
- ``insert_tracking``: a tracking record written on a cursor whose
  transaction the caller holds (``_insert_tracking``);
- ``use_tracking_table``: a SQLite tracking recorder moved to a table of its
  own (its statements name the table ``tracking``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

from eventsourcing.application import Application, ProcessingEvent
from eventsourcing.domain import (
    AggregateEvent,
    BaseAggregate,
    DomainEventProtocol,
    MutableOrImmutableAggregate,
)
from eventsourcing.persistence import Recording, StoredEvent, Tracking
from eventsourcing.sqlite import (
    SQLiteApplicationRecorder,
    SQLiteCursor,
    SQLiteRecorder,
    SQLiteTrackingRecorder,
)

__all__ = [
    "HOOKS",
    "AggregatesFirst",
    "SQLiteCreateTableHook",
    "SQLiteInsertHook",
    "SavingApplication",
    "insert_tracking",
    "use_tracking_table",
]

#: (class, protected method, the parameters used here): what the test checks.
HOOKS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("eventsourcing.application:Application", "_record", ("self", "processing_event")),
    ("eventsourcing.application:Application", "_take_snapshots", ("self", "processing_event")),
    ("eventsourcing.application:Application", "_notify", ("self", "recordings")),
    (
        "eventsourcing.sqlite:SQLiteApplicationRecorder",
        "_insert_events",
        ("self", "c", "stored_events"),
    ),
    ("eventsourcing.sqlite:SQLiteRecorder", "_create_table", ("self", "c")),
    ("eventsourcing.sqlite:SQLiteTrackingRecorder", "_insert_tracking", ("self", "c", "tracking")),
    (
        "eventsourcing.postgres:PostgresTrackingRecorder",
        "_insert_tracking",
        ("self", "curs", "tracking"),
    ),
)


class AggregatesFirst(ProcessingEvent[UUID]):
    """A save's events, collected from our aggregates with one class check.

    ``eventsourcing`` tells an aggregate from an event with ``isinstance`` on two
    runtime-checkable protocols, which Python 3.11 answers by walking each
    protocol's attributes on every call: on the in-memory store that was the
    largest single cost of a save. Our aggregates are ``BaseAggregate``s and our
    events ``AggregateEvent``s (a new run's events are saved as events, next to
    its session's index), so plain class checks say the same thing; anything
    else goes the library's way.
    """

    def collect_events(
        self,
        *objs: MutableOrImmutableAggregate[UUID] | DomainEventProtocol[UUID] | None,
        **kwargs: Any,
    ) -> None:
        for obj in objs:
            if isinstance(obj, BaseAggregate):
                self.events.extend(obj.collect_events())
                self.aggregates[obj.id] = obj
            elif isinstance(obj, AggregateEvent):
                self.events.append(obj)
            else:
                super().collect_events(obj)
        self.saved_kwargs.update(kwargs)


class SavingApplication(Application[UUID]):
    """``Application`` whose save collects through ``AggregatesFirst`` and snapshots
    the aggregates its subclass's ``due_snapshots`` names, as they were just saved."""

    def save(
        self,
        *objs: MutableOrImmutableAggregate[UUID] | DomainEventProtocol[UUID] | None,
        **kwargs: Any,
    ) -> list[Recording[UUID]]:
        """``Application.save``, step for step."""
        processing_event = AggregatesFirst()
        processing_event.collect_events(*objs, **kwargs)
        recordings = self._record(processing_event)
        self._take_snapshots(processing_event)
        self._notify(recordings)
        self.notify(processing_event.events)  # the library's deprecated hook, kept
        return recordings

    def _take_snapshots(self, processing_event: ProcessingEvent[UUID]) -> None:
        self.put_snapshots(self.due_snapshots(processing_event))

    def due_snapshots(self, processing_event: ProcessingEvent[UUID]) -> list[Any]:
        """The aggregates of this save to snapshot (none by default)."""
        return []

    def put_snapshots(self, due: list[Any]) -> None:
        """Store a snapshot of each of ``due``."""


class SQLiteInsertHook(SQLiteApplicationRecorder):
    """The SQLite recorder, calling ``before_insert`` on the insert's own cursor."""

    def _insert_events(
        self, c: SQLiteCursor, stored_events: Sequence[StoredEvent], **kwargs: Any
    ) -> Sequence[int] | None:
        self.before_insert(c, kwargs)
        if not stored_events:
            return []
        return super()._insert_events(c, stored_events, **kwargs)

    def before_insert(self, c: SQLiteCursor, kwargs: dict[str, Any]) -> None:
        """Write on ``c`` before the events (``kwargs``: what the save carried; a
        subclass takes its own keys out of it)."""


class SQLiteCreateTableHook(SQLiteRecorder):
    """A SQLite recorder whose tables are created by ``create_tables_on``, on the
    creating transaction's cursor."""

    def _create_table(self, c: SQLiteCursor) -> None:
        self.create_tables_on(c)

    def create_tables_on(self, c: SQLiteCursor) -> None:
        """Run ``create_table_statements`` on ``c`` (a subclass may do more)."""
        for statement in self.create_table_statements:
            c.execute(statement)


def insert_tracking(recorder: Any, cursor: Any, tracking: Tracking) -> None:
    """Record ``tracking`` on ``cursor``, in the transaction the caller holds
    (a tracking recorder's own ``insert_tracking`` opens one of its own)."""
    recorder._insert_tracking(cursor, tracking)


def use_tracking_table(recorder: SQLiteTrackingRecorder, table: str) -> None:
    """Point a SQLite tracking recorder at ``table`` instead of ``tracking``."""
    recorder.insert_tracking_statement = recorder.insert_tracking_statement.replace(
        "tracking", table
    )
    recorder.select_max_tracking_id_statement = recorder.select_max_tracking_id_statement.replace(
        "tracking", table
    )
    recorder.create_table_statements = [
        s.replace("EXISTS tracking", f"EXISTS {table}") for s in recorder.create_table_statements
    ]
