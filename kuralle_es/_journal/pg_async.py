"""The one-round-trip PostgreSQL save, sent from the event loop, and its group commit (internal).

A turn's saves are awaited on its event loop. Through ``eventsourcing``'s
recorder a save is a blocking call, so it runs on a worker thread, and on
this kind of machine the hop to that thread and back costs more than the
save's own round trip (benchmarks/RESULTS.md). This module sends the very
statement of ``OneTripPostgresRecorder`` (the lease op, the table lock and
the insert in one PL/pgSQL call, on an autocommit connection) over
psycopg's asynchronous connections, taken from the store's pool for the
running loop (``pg_pool``): the loop waits on the socket, no thread is
involved, and the other turns on the loop run meanwhile.

The batcher: a save made while no other of its partition is in flight on
the loop is sent at once, alone, so one run's latency is one round trip.
The saves that runs make while one is in flight queue up, and go together
in the next statement (group commit): the batch function of the recorder
writes them in one transaction, under one lock, with one flush, each in a
subtransaction of its own, so one run's version clash or refused lease
fails that save alone and writes none of its events. A version clash is
``IntegrityError``.

A lost connection (a restart, a failover) is retried on another, within
``SAVE_DEADLINE`` seconds; past it the save fails with ``OperationalError``.
If the statement had been sent, its outcome is unknown: it may have
committed before the connection died. So the saver reads the save's events
back (from the new primary, after a failover) before it decides: there,
exactly as sent, the save is done; absent, it is sent again (nothing of it
was written, so this is not a second write); written by another, a clash.

The followers are woken at most once every ``WAKE_SPACING`` seconds. A save
made when a wake-up is due carries it in its own transaction (the
recorder's ``*_waking_statement``: delivered at its commit), so the first
commit after a quiet spell wakes them at once and a busy writer's wake-ups
cost no transaction of their own (one commit a step, docs/guarantees.md);
the server's notification lock is then taken by one save a spacing, not by
every save. A commit no such save announced within the spacing gets a
wake-up of its own (``wake_statement``, from a task of its own). A wake-up
still due when the store is closed is sent then.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from eventsourcing.persistence import (
    IntegrityError,
    InterfaceError,
    OperationalError,
    StoredEvent,
)

from .leases import Lease, LeaseOp, LeaseRefused
from .pg_pool import PgConnections, SaverConnection
from .recorders import SAVE_DEADLINE as RECORDER_DEADLINE
from .recorders import InDoubt, OneTripPostgresRecorder, lease_refusal, stored_outcome

__all__ = ["AsyncOneTripSaver"]

#: Seconds a save (or a read) keeps trying on new connections before it fails.
SAVE_DEADLINE = RECORDER_DEADLINE
#: Seconds between two tries, at first (doubling up to a second).
RETRY_WAIT = 0.1
#: The most saves one group commit carries.
MAX_BATCH = 256
#: Seconds the commits after a wake-up wait to share the next one: a follower
#: hears of a busy writer at most this late, and reads all it committed
#: meanwhile at once (4 worker processes: 1.53x one at 5 ms, 1.64x at 50 ms;
#: each wake-up is a transaction of its own on the server).
WAKE_SPACING = 0.05
#: Seconds a wake-up may wait for a connection before it is dropped (a follower
#: also looks again every second).
WAKE_WAIT = 2.0


@dataclass
class _Save:
    """One save: its events (as sent, to read them back if in doubt), their rows and
    its lease op."""

    events: Sequence[StoredEvent]
    rows: list[Any]
    lease: LeaseOp | None


@dataclass
class _Queued:
    """A save waiting for the next group commit of its loop."""

    save: _Save
    done: asyncio.Future[list[int]]


@dataclass
class _Lane:
    """One loop's saves of one partition: whether a statement is in flight, and the
    saves queued for the next."""

    busy: bool = False
    queued: list[_Queued] = field(default_factory=list)
    flusher: asyncio.Task[None] | None = None


@dataclass
class _Waker:
    """One loop's wake-ups of the followers: when the last went, whether a commit
    since is still unannounced (``again``), and the task that announces it alone
    if no save carries it first."""

    woken_at: float = float("-inf")
    again: bool = False
    sending: asyncio.Task[None] | None = None


#: What a save came to: its events' notification ids, or the error it raises.
_Outcome = list[int] | Exception


class AsyncOneTripSaver:
    """Inserts stored events with the one-trip statement, from any event loop."""

    def __init__(self, recorder: OneTripPostgresRecorder, connections: PgConnections) -> None:
        self._recorder = recorder
        self._connections = connections
        self._lanes: dict[asyncio.AbstractEventLoop, _Lane] = {}
        self._wakers: dict[asyncio.AbstractEventLoop, _Waker] = {}
        #: Statements sent, and the saves they carried (a group commit carries several).
        self.statements = 0
        self.saves = 0
        #: Saves whose connection died after they were sent, settled by reading back.
        self.in_doubt = 0
        self._closed = False

    async def insert(
        self, stored_events: Sequence[StoredEvent], lease: LeaseOp | None = None
    ) -> list[int]:
        """The events' notification ids, once their transaction (with the lease op)
        has committed; ``LeaseRefused`` if the lease op was refused,
        ``IntegrityError`` on a version clash (nothing of the save written)."""
        save = _Save(stored_events, self._recorder.rows(stored_events), lease)
        loop = asyncio.get_running_loop()
        lane = self._lanes.get(loop)
        if lane is None:  # not ``setdefault``: that makes a lane on every save
            lane = self._lanes[loop] = _Lane()
        if not lane.busy:
            lane.busy = True
            try:
                [outcome] = await self._send([save])
            finally:
                self._after_statement(lane)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        queued = _Queued(save, loop.create_future())
        lane.queued.append(queued)
        try:
            return await queued.done
        except asyncio.CancelledError:
            if queued in lane.queued:  # not sent yet: it never will be
                lane.queued.remove(queued)
            raise

    def _after_statement(self, lane: _Lane) -> None:
        """A statement returned: send what queued meanwhile, or let the lane idle."""
        if lane.queued:
            lane.flusher = asyncio.get_running_loop().create_task(self._flush(lane))
        else:
            lane.busy = False

    async def _flush(self, lane: _Lane) -> None:
        """Send the queued saves, a group commit at a time, until none is left."""
        try:
            while lane.queued:
                # One pass of the loop first: the runs that the last statement's
                # return just woke queue their next saves, and go in this group
                # instead of the next (at 32 runs, 18 saves a statement, not 13).
                await asyncio.sleep(0)
                batch, lane.queued = lane.queued[:MAX_BATCH], lane.queued[MAX_BATCH:]
                await self._commit_group(batch)
        finally:
            lane.busy = False
            lane.flusher = None

    async def _commit_group(self, batch: list[_Queued]) -> None:
        try:
            outcomes = await self._send([queued.save for queued in batch])
        except BaseException as error:
            for queued in batch:
                if not queued.done.done():
                    queued.done.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        for queued, outcome in zip(batch, outcomes, strict=True):
            if queued.done.done():
                continue
            if isinstance(outcome, Exception):
                queued.done.set_exception(outcome)
            else:
                queued.done.set_result(outcome)

    # ------------------------------------------------------------- sending
    async def _send(self, saves: list[_Save], deadline: float | None = None) -> list[_Outcome]:
        """Each save's outcome, sent in one statement (one save: the one-trip
        statement, whose lease refusal or clash raises; several: the batch); a
        statement in doubt is settled by reading back, and what it had not written
        is sent again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SAVE_DEADLINE if deadline is None else deadline
        recorder = self._recorder
        self.statements += 1
        self.saves += len(saves)
        # A save carries the followers' wake-up when one is due (none went for
        # WAKE_SPACING): a busy writer's wake-ups then cost no transaction.
        waking = self._wake_due(loop) and any(s.rows for s in saves)
        try:
            if len(saves) == 1:
                [save] = saves
                parameters = recorder.parameters_of(save.rows, save.lease)
                statement = (
                    recorder.one_trip_waking_statement if waking else recorder.one_trip_statement
                )
                try:
                    found = await self._execute(
                        statement, parameters, save.lease, deadline, sent_matters=True
                    )
                except (IntegrityError, LeaseRefused) as refused:
                    return [refused]
                outcomes: list[_Outcome] = [[int(row[0]) for row in found]]
            else:
                parameters = recorder.batch_parameters([(s.rows, s.lease) for s in saves])
                statement = recorder.batch_waking_statement if waking else recorder.batch_statement
                found = await self._execute(
                    statement, parameters, None, deadline, sent_matters=True
                )
                outcomes = [_outcome(s, row) for s, row in zip(saves, found, strict=True)]
        except InDoubt:
            waking = False  # whatever it carried, announce what was settled
            outcomes = await self._settle(saves, deadline)
        if any(
            s.rows for s, o in zip(saves, outcomes, strict=True) if not isinstance(o, Exception)
        ):
            self._committed(loop, woke=waking)
        return outcomes

    async def _settle(self, saves: list[_Save], deadline: float) -> list[_Outcome]:
        """The outcomes of saves whose statement's connection died after it was sent:
        read back; those not written are sent again."""
        self.in_doubt += len(saves)
        stored = await self._stored(saves, deadline)
        again = [save for save, found in zip(saves, stored, strict=True) if found is None]
        resent = iter(await self._send(again, deadline) if again else [])
        return [next(resent) if found is None else found for found in stored]

    async def _stored(self, saves: list[_Save], deadline: float) -> list[_Outcome | None]:
        """For each save: what it came to, read back (``stored_outcome``)."""
        events = [e for save in saves for e in save.events]
        rows: list[Any] = []
        if events:
            recorder = self._recorder
            parameters = recorder.read_back_parameters(events)
            rows = await self._execute(recorder.read_back_statement, parameters, None, deadline)
        return [stored_outcome(save.events, rows) for save in saves]

    async def _execute(
        self,
        statement: Any,
        parameters: Sequence[Any],
        lease: LeaseOp | None,
        deadline: float | None = None,
        *,
        sent_matters: bool = False,
    ) -> list[Any]:
        """Run one statement on a connection of the loop's pool, trying again on
        another while the deadline allows. A lost connection after the statement
        was sent raises ``InDoubt`` when ``sent_matters`` (a save)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SAVE_DEADLINE if deadline is None else deadline
        wait = RETRY_WAIT
        while True:
            if loop.time() >= deadline:
                raise OperationalError("the store's database did not answer in time")
            conn: SaverConnection | None = None
            try:
                pool = await self._connections.loop_pool()
                conn = await pool.getconn(max(0.1, deadline - loop.time()))
                try:
                    cursor = conn.reused_cursor()
                    await cursor.execute(statement, parameters, prepare=True)
                    return await cursor.fetchall()
                finally:
                    await pool.putconn(conn)
            except psycopg.IntegrityError as clash:
                raise IntegrityError(str(clash)) from clash
            except (psycopg.OperationalError, psycopg.InterfaceError) as lost:
                if self._closed:
                    raise InterfaceError("the run store is closed") from lost
                # Sent on a connection that died: it may have committed. A statement
                # the server refused (a lock or statement timeout) on a live one did not.
                if sent_matters and conn is not None and (conn.broken or conn.closed):
                    raise InDoubt from lost
                if loop.time() + wait >= deadline:
                    interface = isinstance(lost, psycopg.InterfaceError)
                    raise (InterfaceError if interface else OperationalError)(str(lost)) from lost
                await asyncio.sleep(wait)
                wait = min(1.0, wait * 2)
            except psycopg.Error as error:
                refusal = lease_refusal(error, lease)
                if refusal is not None:
                    raise refusal from None
                raise

    # ------------------------------------------------------------ wake-ups
    def _waker(self, loop: asyncio.AbstractEventLoop) -> _Waker:
        waker = self._wakers.get(loop)
        if waker is None:
            waker = self._wakers[loop] = _Waker()
        return waker

    def _wake_due(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether the next save should carry a wake-up: none went for ``WAKE_SPACING``."""
        return loop.time() - self._waker(loop).woken_at >= WAKE_SPACING

    def _committed(self, loop: asyncio.AbstractEventLoop, *, woke: bool) -> None:
        """A save that wrote events committed: it woke the followers itself (``woke``),
        or its commit is announced by the next save that carries a wake-up, or, if
        none comes within ``WAKE_SPACING`` of the last, by a wake-up of its own."""
        waker = self._waker(loop)
        if woke:
            waker.woken_at = loop.time()
            waker.again = False
            return
        waker.again = True
        if waker.sending is None:
            waker.sending = loop.create_task(self._send_wake_ups(waker))

    async def _send_wake_ups(self, waker: _Waker) -> None:
        """Announce the commits no save carried a wake-up for, at most one wake-up
        every ``WAKE_SPACING``. A failed one is dropped: the events are committed,
        and a follower also looks again when it is next woken (``follow`` every
        second besides)."""
        loop = asyncio.get_running_loop()
        try:
            while waker.again and not self._closed:
                await asyncio.sleep(max(0.0, waker.woken_at + WAKE_SPACING - loop.time()))
                if not waker.again or self._closed:
                    return  # a save carried it meanwhile
                waker.again = False
                waker.woken_at = loop.time()
                try:
                    await self._execute(
                        self._recorder.wake_statement, (), None, loop.time() + WAKE_WAIT
                    )
                except (psycopg.Error, OperationalError, InterfaceError):
                    return
                except BaseException:
                    waker.again = True  # cancelled: still due, ``close`` sends it
                    raise
        finally:
            waker.sending = None

    # --------------------------------------------------------------- reads
    async def holds(self, originator_id: Any) -> bool:
        """Whether the events table holds any event of ``originator_id``."""
        return bool(await self._execute(self._recorder.holds_statement, (originator_id,), None))

    async def select_lease(self, run_id: Any) -> Lease | None:
        """The run's lease record (live or not by the server's clock)."""
        rows = await self._execute(self._recorder.select_lease_statement, (run_id,), None)
        if not rows:
            return None
        holder, token, expires_at, live = rows[0]
        return Lease(holder, expires_at, token, live)

    def close(self) -> None:
        """Stop taking statements; a wake-up still due is sent now, on a blocking
        connection (its loop may never run again)."""
        self._closed = True
        if any(w.again for w in self._wakers.values()):
            with contextlib.suppress(Exception), self._recorder.datastore.get_connection() as conn:
                self._recorder.wake_followers(conn.cursor())


def _outcome(save: _Save, row: Any) -> _Outcome:
    """One save's outcome in a group commit's answer ``(save, outcome, ids, detail)``."""
    _, outcome, ids, detail = row
    if outcome == "ok":
        return [int(i) for i in ids]
    if outcome == "clash":
        return IntegrityError("another writer appended first")
    return _refused(save.lease, outcome, detail)


def _refused(op: LeaseOp | None, outcome: str, detail: str | None) -> LeaseRefused:
    """A save of a group commit whose lease op was refused."""
    assert op is not None, "only a save with a lease op can have it refused"
    if outcome == "lost" or not detail:
        return LeaseRefused(op, None)
    holder, _, epoch = detail.rpartition(" ")
    return LeaseRefused(op, Lease(holder, datetime.fromtimestamp(float(epoch), UTC)))
