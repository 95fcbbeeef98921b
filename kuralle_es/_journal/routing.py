"""Which log of a store holds a run or a session: asked once, then remembered (internal).

A run lives in one log (partition) for its whole life, and so do all the
runs of its session (the session's index of runs is saved with each of
them). The router finds the log that holds a run by asking each log once;
the log of a session is the one that holds its index, or, for a session
not stored yet, the one its id hashes to among the logs the store has now,
so adding a log never moves a run (docs/scaling.md). In a store of one log
every answer is that log, without a lookup: the per-step path of most
stores.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Sequence
from typing import TypeVar
from uuid import UUID

from .log import RunLog, parse_run_id
from .run import Run
from .sessions import session_runs_id

__all__ = ["Router"]

#: What the router remembers a log of: a run's aggregate id, or a session's id.
_Key = TypeVar("_Key", UUID, str)


class Router:
    """Says which of ``logs`` holds a run or a session (see the module docstring)."""

    def __init__(self, logs: Sequence[RunLog]) -> None:
        self.logs = tuple(logs)
        #: The one log of a store that has one: every answer, without a lookup.
        self._only = self.logs[0] if len(self.logs) == 1 else None
        self._runs: dict[UUID, RunLog] = {}
        self._sessions: dict[str, RunLog] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- runs
    def of_run(self, run_id: str) -> RunLog | None:
        """The log that holds the run (None: no log does, or not a run id)."""
        aggregate_id = parse_run_id(run_id)
        if aggregate_id is None:
            return None
        known = self._known(self._runs, aggregate_id)
        if known is not None:
            return known
        return self._found(self._runs, aggregate_id, self._holder(aggregate_id))

    async def of_run_async(self, run_id: str) -> RunLog | None:
        """``of_run`` for async code: every log asked at once, from the loop."""
        aggregate_id = parse_run_id(run_id)
        return None if aggregate_id is None else await self.of_id_async(aggregate_id)

    async def of_id_async(self, aggregate_id: UUID) -> RunLog | None:
        """The log that holds the run with this aggregate id (``of_run_async``)."""
        known = self._known(self._runs, aggregate_id)
        if known is not None:
            return known
        held = await self._holder_async(aggregate_id)
        return self._found(self._runs, aggregate_id, held)

    def of(self, run: Run) -> RunLog:
        """The log a run is saved in: where it is stored, else its session's."""
        log = self.of_run(run.run_id)
        return log if log is not None else self.of_session(run.session_id)

    async def of_async(self, run: Run) -> RunLog:
        """``of`` for async code."""
        log = await self.of_id_async(run.id)
        return log if log is not None else await self.of_session_async(run.session_id)

    def created(self, run: Run, log: RunLog) -> None:
        """A new run was saved in ``log``: route it, and its session, there from now on."""
        if self._only is None:
            self._found(self._runs, run.id, log)
            self._found(self._sessions, run.session_id, log)

    # ------------------------------------------------------------ sessions
    def of_session(self, session_id: str) -> RunLog:
        """The log of the session's runs: where its index is, else where its id hashes."""
        known = self._known(self._sessions, session_id)
        if known is not None:
            return known
        held = self._holder(session_runs_id(session_id))
        return self._found(self._sessions, session_id, held) or self._hashed(session_id)

    async def of_session_async(self, session_id: str) -> RunLog:
        """``of_session`` for async code: every log asked at once, from the loop."""
        known = self._known(self._sessions, session_id)
        if known is not None:
            return known
        held = await self._holder_async(session_runs_id(session_id))
        return self._found(self._sessions, session_id, held) or self._hashed(session_id)

    def _hashed(self, session_id: str) -> RunLog:
        """Where a new session goes: the log its id hashes to, among those there are."""
        digest = hashlib.sha256(session_id.encode("utf-8")).digest()
        return self.logs[int.from_bytes(digest[:8], "big") % len(self.logs)]

    # -------------------------------------------------------------- lookups
    def _known(self, routes: dict[_Key, RunLog], key: _Key) -> RunLog | None:
        """The log of ``key`` if it is known without asking a database."""
        if self._only is not None:
            return self._only
        with self._lock:
            return routes.get(key)

    def _found(self, routes: dict[_Key, RunLog], key: _Key, log: RunLog | None) -> RunLog | None:
        """``log``, remembered as the log of ``key`` when there is one."""
        if log is not None:
            with self._lock:
                routes[key] = log
        return log

    def _holder(self, aggregate_id: UUID) -> RunLog | None:
        """The first log that holds an event of ``aggregate_id`` (each asked in turn)."""
        return next((log for log in self.logs if log.holds(aggregate_id)), None)

    async def _holder_async(self, aggregate_id: UUID) -> RunLog | None:
        """``_holder`` for async code: every log asked at once, from the loop."""
        held = await asyncio.gather(*(log.holds_async(aggregate_id) for log in self.logs))
        return next((log for log, holds in zip(self.logs, held, strict=True) if holds), None)
