"""Where a turn saves its run: compare-and-set saves, the lease and its heartbeat (internal).

Every save is compare-and-set on the run's aggregate version
(``StaleWriteError`` for a loser) and renews the lease on the way; one
``asyncio.Lock`` orders the saves of a ``gather`` batch. A heartbeat renews
the lease while an effect executes, from a thread of its own, whatever the
effect does to the turn's event loop (``heartbeat``). How old the lease is
is measured on the monotonic clock from the moment its take or renewal was
sent: the expiry is the store's to decide, by the store's clock, and is
never compared with this machine's.

A step's recorded outcome may ride the turn's next save instead of a save of
its own (docs/guarantees.md, "One commit a step"); messages sent to the run
while the turn drives it are taken into the save they clashed with
(``mail.take_in_mail``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import uuid4

from .._clock import back_off
from .._journal.json_data import encode_json
from .._journal.leases import LeaseOp, LeaseRefused
from .._journal.mail import receive_step, take_in_mail
from .._journal.recorders import LeasingRecorder
from .._journal.run import Run
from .._journal.sites import Effect, Site
from .._journal.store import RunStore
from ..errors import StaleWriteError
from ..shapes import TurnResult
from .heartbeat import Heartbeat
from .step_results import result_of

__all__ = ["FLUSH_AFTER", "LeasedSaver", "Outcome"]

#: Seconds a deferred step outcome waits for another save to ride before it is
#: saved alone (docs/guarantees.md, "One commit a step").
FLUSH_AFTER = 0.005
#: How many times one save is made again after messages that arrived meanwhile.
_MAIL_ROUNDS = 50


@dataclass(frozen=True)
class Outcome:
    """A step's outcome on its way to the store: ``record`` triggers it on a run
    (the turn's, or the run as stored after an outside change)."""

    index: int
    record: Callable[[Run], None]
    what: str


class LeasedSaver:
    """One turn's saves of its run, under the run's lease."""

    def __init__(
        self,
        store: RunStore,
        run: Run,
        *,
        holder: str,
        lease_ttl: float,
        turn_task: asyncio.Task[Any] | None,
    ) -> None:
        self._store = store
        self._run = run
        self.run_id = run.run_id
        self._holder = holder
        self.lease_ttl = timedelta(seconds=lease_ttl)
        #: A save renews the lease when its last renewal is older than this.
        self._renew_after = lease_ttl / 2
        #: This turn's token on the run's lease record.
        self._token = uuid4().hex
        #: The lease op the next save carries (a take, or a release), if any.
        self._lease_op: LeaseOp | None = None
        #: Orders the turn's appends and saves (a ``gather`` batch's effects).
        self.lock = asyncio.Lock()
        #: The task that drives the turn: its own effects are awaited one at a time.
        self._turn_task = turn_task
        self._broken: StaleWriteError | None = None
        #: What a save of this turn's own flush raised (a dead store, a simulated
        #: crash): the turn's next save raises it again.
        self._flush_failed: BaseException | None = None
        #: Outcomes recorded on the run and not saved yet: they ride the next save.
        self._unsaved: list[Outcome] = []
        #: The timer that saves those outcomes when no other save comes soon.
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flush_task: asyncio.Task[None] | None = None
        self._closed = False
        self.heartbeat = Heartbeat(self._renew_alone, self._lease_lost, lease_ttl / 3)
        #: Whether the turn's close woke the run again, its lease kept: a message
        #: answered the receive it was pausing in (``_save_taking_in_mail``).
        self.woken_at_close = False

    def take_lease(self) -> None:
        """Take the run's lease with the next save (refused: ``LeaseHeldError``)."""
        self._lease_op = LeaseOp.take(self._run.id, self._holder, self._token, self.lease_ttl)

    async def create(self) -> None:
        """Save a new run (with its session's index, and the lease taken)."""
        op, self._lease_op = self._lease_op, None
        sent_at = time.monotonic()
        await self._store.create_run_async(self._run, op)
        self._hold(op, sent_at)

    async def close_turn(self, idempotency_key: str | None, paused_output: Any) -> TurnResult:
        """Save the turn's end (the run's closing events) with the lease released;
        the turn's result, recorded under ``idempotency_key`` when there is one."""
        run = self._run
        self._lease_op = LeaseOp.release(run.id, self._token)
        result = result_of(run, paused_output if run.status == "paused" else None)
        if idempotency_key:
            run.record_turn(idempotency_key, result.model_dump(mode="json"))
        await self.persist()
        return result

    async def persist(self) -> None:
        """Save every pending event of the run (renewing the lease on the way)."""
        async with self.lock:
            await self.save_locked()

    async def save_locked(self) -> None:
        """``persist``, the lock already held."""
        run = self._run
        if self._flush_failed is not None:
            raise self._flush_failed
        op, self._lease_op = self._lease_op, None
        sent_at = time.monotonic()
        renewed_at = self.heartbeat.renewed_at
        if op is None and renewed_at is not None and sent_at - renewed_at > self._renew_after:
            op = LeaseOp.renew(run.id, self._token, self.lease_ttl)
        if self._broken is None and not run.pending_events and op is None:
            return
        try:
            if self._broken is not None:
                raise self._broken
            op = await self._save_taking_in_mail(op)
        except StaleWriteError as clash:
            # The unsaved events are gone from the aggregate, which is now
            # ahead of the store: no later save of this turn may follow.
            self._broken = clash
            await self._keep_outcomes(clash)
            raise
        except BaseException as exc:
            self._broken = StaleWriteError(
                run.run_id, f"a save of this turn failed with {exc!r}", clash=False
            )
            self._unsaved.clear()  # in doubt: the next turn re-runs them under their keys
            raise
        self._unsaved.clear()
        self._hold(op, sent_at)

    async def save_intent(self) -> None:
        """Save an effect's intent (with whatever else is pending) before it executes.

        On a store whose saves block, the effects of a parallel batch first
        get one turn of the event loop to journal their own intents, so the
        batch's intents share one save; each effect still waits for the save
        that carries its intent (README.md, "Architecture"). An effect awaited
        by the turn's own task is not in a batch (a batch's effects run in
        tasks of their own), and skips that turn: a sequential step's intent
        goes at once.
        """
        if self._store.saves_block and asyncio.current_task() is not self._turn_task:
            await asyncio.sleep(0)
        async with self.lock:
            await self.save_locked()
            # A save may outlast the lease (the store tries it again across a
            # failover): the lease may have lapsed meanwhile, and another worker
            # may take the run over. The effect starts only once the lease is
            # known live, so a second save renews it when it is older than half
            # a TTL (refused if taken over: StaleWriteError, nothing executed).
            await self.save_locked()

    async def save_outcome(self, outcome: Outcome, *, defer: bool = False) -> None:
        """Record the outcome of a step and save it (with ``defer``, with the turn's
        next save). An executed effect is always recorded: a save lost because the
        run was ended from outside meanwhile records it on the run as stored
        (``_keep_outcomes``)."""
        async with self.lock:
            outcome.record(self._run)
            if defer:
                self._defer(outcome)
                return
            self._unsaved.append(outcome)
            await self.save_locked()

    async def _keep_outcomes(self, lost: StaleWriteError) -> None:
        """After a lost save: record the executed steps' outcomes it carried on the
        run as stored, when the run was ended from outside while they ran (a
        cancel, a migration), and say so (docs/guarantees.md, "At the edges"). A
        run another worker took over is left to it (it re-runs a step in doubt
        under the same key)."""
        unsaved, self._unsaved = self._unsaved, []
        if not unsaved or not await self._record_on_stored(unsaved):
            return
        what = " and ".join(outcome.what for outcome in unsaved)
        raise StaleWriteError(
            self.run_id,
            f"the run ended elsewhere while {what} executed; its outcome is recorded "
            "and nothing after it ran",
            clash=lost.clash,
            recorded=True,
        ) from None

    async def _record_on_stored(self, outcomes: list[Outcome]) -> bool:
        """Record steps' outcomes on the run as stored, if it ended there with the
        steps still running; whether they are recorded now."""
        for attempt in range(20):
            latest = await self._store.load_async(self.run_id)
            if latest is None or latest.status not in ("aborted", "finished"):
                return False
            missing = []
            for outcome in outcomes:
                position = outcome.index - latest.step_base
                if not 0 <= position < len(latest.steps):
                    return False
                if latest.steps[position]["status"] == "running":
                    missing.append(outcome)
            if not missing:
                return True
            for outcome in missing:
                outcome.record(latest)
            try:
                await self._store.save_run_async(latest, None)
            except StaleWriteError:
                await back_off(attempt)
                continue
            return True
        return False

    # ------------------------------------------------------------ messages
    async def _save_taking_in_mail(self, op: LeaseOp | None) -> LeaseOp | None:
        """Save the run's pending events (with ``op``); the lease op the save carried.

        A save that clashes only with messages sent to the run meanwhile takes
        them in and is made again after them (``mail.take_in_mail``): a message
        never costs a turn its save. When that save is the turn's close and
        pauses the run in a ``receive`` that one of them answers, the run is
        woken in the same save and the lease kept (``woken_at_close``): the
        turn drives it on, or, should the process die first, a recovery does.
        """
        run = self._run
        for _ in range(_MAIL_ROUNDS):
            unsaved = list(run.pending_events)
            try:
                await self._store.save_run_async(run, op)
                return op
            except StaleWriteError:
                stored_version = run.version - len(unsaved)
                arrived = await self._store.run_events_async(self.run_id, stored_version)
                if not unsaved or not take_in_mail(run, arrived, unsaved):
                    raise
                if op is not None and op.kind == "release" and self.wake_for_mail():
                    op = LeaseOp.renew(run.id, self._token, self.lease_ttl)
                    self.woken_at_close = True
        raise StaleWriteError(self.run_id, "messages kept arriving faster than it could save")

    def wake_for_mail(self) -> bool:
        """Wake the run from the ``receive`` it is paused (or pausing) in, if a message
        for it is in its mailbox: the wake, and the receive's step at the wait's
        site taking the oldest such message, saved with the next save. So the
        node's next pass replays the receive, as it does a delivered signal."""
        run = self._run
        wait = run.waiting
        if run.status != "paused" or wait is None or wait.kind != "message":
            return False
        mail = run.unread(wait.name)
        if mail is None:
            return False
        run.deliver_mail(wait.request_id, mail["message_id"])
        args, taken = receive_step(mail)
        site = Site(wait.logical_run, wait.callsite, wait.lane)
        index = run.start_step(Effect(site, "receive", wait.name, args))
        run.finish_step(index, encode_json(taken, f"the message {wait.name!r}"))
        return True

    async def take_in_mail(self) -> None:
        """Take in the messages sent to the run since this turn last saved (a
        ``receive`` that finds none in the run's state looks once more). Anything
        else stored meanwhile is left for the next save to clash with."""
        async with self.lock:
            run = self._run
            unsaved = list(run.pending_events)
            stored_version = run.version - len(unsaved)
            arrived = await self._store.run_events_async(self.run_id, stored_version)
            take_in_mail(run, arrived, unsaved)

    # --------------------------------------------------------------- lease
    def _hold(self, op: LeaseOp | None, sent_at: float) -> None:
        """What this turn holds after a save, sent at ``sent_at``, that carried ``op``."""
        if op is None:
            return
        if op.kind in ("take", "renew"):
            self.heartbeat.renewed(sent_at)
        else:
            self.heartbeat.released()

    def _renew_alone(self) -> bool:
        """The heartbeat's renewal, on its thread: the lease record alone (nothing is
        appended to the journal), through the store's own blocking connection, never
        the turn's loop. False: the lease was taken over (or cleared by a cancel)."""
        op = LeaseOp.renew(self._run.id, self._token, self.lease_ttl)
        try:
            _lease_record(self._store, self.run_id, op).insert_events([], lease=op)
        except LeaseRefused:
            return False
        return True

    def _lease_lost(self) -> None:
        """A renewal found the lease taken over: the turn's next save raises."""
        if self._broken is None:
            self._broken = StaleWriteError(
                self.run_id, "its lease was taken over by another worker"
            )

    async def hold(self, seconds: float) -> None:
        """Wait inline (a short durable sleep) with the lease kept by the heartbeat."""
        beating = self.heartbeat.enter()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.heartbeat.leave(beating)

    def close(self) -> None:
        """End the turn's saves: no flush is started any more, and the heartbeat stops."""
        self._closed = True
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self.heartbeat.stop()

    # ------------------------------------------------------- deferred outcomes
    def _defer(self, outcome: Outcome) -> None:
        """Leave a recorded outcome to ride the turn's next save (the next intent,
        a pause, the turn's end), or a save of its own when none comes within
        ``FLUSH_AFTER`` seconds: a sequential step costs one commit, and a crash
        before that save leaves the step in doubt, as a crash between execute and
        result always did (docs/guarantees.md, "One commit a step")."""
        self._unsaved.append(outcome)
        if self._flush_timer is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(FLUSH_AFTER, self._start_flush)

    def _start_flush(self) -> None:
        self._flush_timer = None
        if self._unsaved and not self._closed:
            self._flush_task = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        """The timer's save of outcomes no other save carried. What it raises is the
        turn's next save's to raise: nobody awaits this task."""
        async with self.lock:
            if not self._unsaved or self._closed:
                return
            try:
                await self.save_locked()
            except StaleWriteError:
                pass  # ``_broken``: the turn's next save raises it
            except BaseException as exc:  # a dead store or a simulated crash
                self._flush_failed = exc


def _lease_record(store: RunStore, run_id: str, op: LeaseOp) -> LeasingRecorder:
    """The recorder that keeps the run's lease record (its partition's), for a
    renewal made apart from any save of events (``LeaseRefused``: no such run)."""
    partition = store.partition_of(run_id)
    if partition is None:
        raise LeaseRefused(op, None)
    recorder: LeasingRecorder = store.partitions[partition].recorder  # type: ignore[assignment]
    return recorder
