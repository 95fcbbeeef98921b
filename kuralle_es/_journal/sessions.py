"""``SessionRuns``: the runs of one session, so a delivery without ``run_id``
can find its run (internal).

Its id is derived from the session id, and it is saved in the same
transaction as each run it lists: a run is never orphaned from its session.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any
from uuid import UUID, uuid5

from eventsourcing.domain import Aggregate

from . import catalogue as stored

__all__ = ["SavedIndexes", "SessionRuns", "new_session_runs", "session_runs_id"]

#: Namespace of the deterministic ids of per-session aggregates.
SESSION_NAMESPACE = UUID("0b6f7a52-6c1e-4f0e-9d5e-6b1f0c7d2a41")


class SessionRuns(Aggregate):
    """The ids of a session's runs, oldest first."""

    #: Its events are the catalogue's (``eventsourcing`` looks them up here).
    Event = stored.SessionEvent
    Created = stored.SessionIndexCreated
    TOPIC = "kuralle_es:SessionRuns"
    class_version = 1

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.run_ids: list[str] = []

    def fold(self, event: Any) -> None:
        """The one way the index changes (``catalogue.SessionEvent.apply``)."""
        if isinstance(event, stored.RunIndexed):
            self.run_ids.append(event.run_id)

    @property
    def snapshot_weight(self) -> int:
        """About how many events replaying would cost as much as loading the list."""
        return len(self.run_ids) // 8

    def add_run(self, run_id: str) -> None:
        if run_id not in self.run_ids:
            self.trigger_event(stored.RunIndexed, run_id=run_id)


def session_runs_id(session_id: str) -> UUID:
    return uuid5(SESSION_NAMESPACE, session_id)


def new_session_runs(session_id: str) -> SessionRuns:
    return SessionRuns._create(
        stored.SessionIndexCreated, id=session_runs_id(session_id), session_id=session_id
    )


class SavedIndexes:
    """The session indexes this process saved last, as it saved them (at most
    ``limit``, the least recently used dropped first).

    A new run is saved with its session's index in one transaction. Reading
    the index first costs a query (and, from async code, a thread hop); an
    index this process saved itself is usually still current, so the next
    run of the session is added to it straight away. If another process added
    a run meanwhile, that save clashes, writes nothing, and the caller reads
    the index afresh. ``take`` hands an index to one caller at a time, so two
    runs created at once never share one.
    """

    def __init__(self, limit: int = 1024) -> None:
        self._limit = limit
        self._indexes: OrderedDict[str, SessionRuns] = OrderedDict()
        self._guard = threading.Lock()

    def take(self, session_id: str) -> SessionRuns | None:
        """The session's index as last saved here (and forget it), or None."""
        with self._guard:
            return self._indexes.pop(session_id, None)

    def keep(self, index: SessionRuns) -> None:
        """Remember ``index``, just saved with nothing pending."""
        with self._guard:
            self._indexes[index.session_id] = index
            self._indexes.move_to_end(index.session_id)
            while len(self._indexes) > self._limit:
                self._indexes.popitem(last=False)
