"""``SessionRuns``: the runs of one session, so a delivery without ``run_id``
can find its run (internal).

Its id is derived from the session id, and it is saved in the same
transaction as each run it lists: a run is never orphaned from its session.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID, uuid5

from eventsourcing.domain import Aggregate

from . import catalogue as stored

__all__ = ["SessionRuns", "new_session_runs", "session_runs_id"]

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
