"""The funnel: the one place where steps are written (internal).

Every durable effect (``ctx.tool``, ``ctx.now``, ``ctx.uuid``, approvals,
signals, model turns) goes through ``Journal.effect`` or
``Journal.record_value``, which make one decision per site:

    recorded, but another kind/name  -> NonDeterminismError, execute nothing
    recorded finished                -> return the recorded result
    recorded error                   -> raise the recorded error (frozen)
    recorded running (crash window)  -> execute again with the same key
    absent                           -> persist intent, execute, persist result or error

A writer that re-drives a recording (``replay_with``) asks its
``ReplaySource`` before executing an absent step: the recorded outcome under
the same key stands in for the execution (``replay_source``). Every time a
turn dates (a clock read, a wake time, a deadline, a retry's next attempt)
comes from its clock (``Runtime(clock=)``), never a lease's.

Once an effect has suspended the turn, the journal refuses every effect
node code requests afterwards (``SuspendError`` again, on the first wait),
and once the turn has ended it refuses every effect (``TurnClosedError``):
node code that catches a suspension, or a task it left running, cannot
execute anything the journal did not admit (docs/node-code.md).

The journal also owns the run's single writer: one ``asyncio.Lock`` orders
the appends of a ``gather`` batch, every save is compare-and-set on the
aggregate version (``StaleWriteError`` for a loser) and renews the lease, and
a heartbeat renews it while an effect executes, from a thread of its own,
whatever the effect does to the turn's event loop (``heartbeat``). The
writer measures how old its lease is on the monotonic clock, from the moment
it sent the take or renewal: the expiry is the store's to decide, by the
store's clock, and is never compared with this machine's. Everything else a
turn does to the run goes through a few verbs (``append_message``,
``enter_node``, ``pause``); nobody outside reaches the aggregate through the
journal.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Never, NoReturn, TypeVar, overload
from uuid import uuid4

from .._clock import SYSTEM_CLOCK, Clock
from .._definitions.budget import Budget
from .._definitions.retry import NO_RETRY, RetryPolicy
from .._definitions.tools import ToolExited
from .._journal.json_data import encode_json
from .._journal.leases import Lease, LeaseOp, LeaseRefused
from .._journal.mail import receive_step, take_in_mail
from .._journal.recorders import LeasingRecorder
from .._journal.run import ParentLink, Run, StepData
from .._journal.sites import Effect, Site
from .._journal.spending import ModelUsage, Prices, total
from .._journal.store import RunStore
from .._journal.wait import Wait
from ..errors import (
    KuralleError,
    LeaseHeldError,
    NonDeterminismError,
    RunNotFoundError,
    StaleWriteError,
    SuspendError,
    ToolExecutionError,
    ToolResultTypeError,
    ToolTimeoutError,
    TurnClosedError,
    error_fields,
)
from ..shapes import (
    Message,
    RunStatus,
    SignalDelivery,
    StepError,
    TurnResult,
    Usage,
    messages_from_json,
)
from .heartbeat import Heartbeat
from .observability import traced_step, tracing_on
from .replay_source import RecordedFailure, ReplaySource

if TYPE_CHECKING:
    from .fork import ForkPlan

__all__ = [
    "ERASED",
    "Abandon",
    "Cancel",
    "Erase",
    "MigrateTo",
    "Post",
    "RunChange",
    "RunStopped",
    "RunWriter",
    "change_run",
    "decode",
    "frozen_error",
    "result_of",
]


class RunStopped(Exception):
    """The turn ends the run here with ``outcome`` (internal: a budget a human
    refused to raise). Like a suspension, it cannot be swallowed: the journal
    refuses every later effect of the turn and the turn finishes the run."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        super().__init__(f"the run ends here: {outcome}")


#: ``StepError.data`` marker of a result the journal could not hold.
_UNRECORDABLE = "unrecordable_result"
#: ``StepError.data`` marker of an attempt cancelled by the tool's timeout.
_TIMEOUT = "timeout"
#: How many times one save is made again after messages that arrived meanwhile.
_MAIL_ROUNDS = 50

_T = TypeVar("_T")


def result_of(run: Run, output: Any = None) -> TurnResult:
    """A turn's result, read off the run (not its whole state: a long
    conversation's messages would be validated at every turn for nothing)."""
    return TurnResult(
        run_id=run.run_id,
        status=run.status,
        output=output if output is not None else run.output,
        waiting_for=run.public_wait(),
    )


def frozen_error(step: StepData) -> ToolExecutionError:
    """The exception a failed step raises, identical on the first pass and on replay."""
    error = step["error"] or {}
    error_type = str(error.get("type", "Exception"))
    message = str(error.get("message", ""))
    data = error.get("data") or {}
    if data.get("reason") == _UNRECORDABLE:
        return ToolResultTypeError(step["name"], error_type, message, data)
    if data.get("reason") == _TIMEOUT:
        return ToolTimeoutError(step["name"], error_type, message, data)
    return ToolExecutionError(step["name"], error_type, message, data)


def _step_error(exc: Exception) -> StepError:
    """What the journal keeps of an attempt's error (a tool's ``BaseException`` under
    its own name)."""
    if isinstance(exc, ToolTimeoutError):
        return StepError(
            type=exc.error_type, message=exc.message, data={**exc.data, "reason": _TIMEOUT}
        )
    if isinstance(exc, ToolExited):
        return StepError(type=type(exc.raised).__name__, message=str(exc), data={})
    if isinstance(exc, RecordedFailure):
        return exc.error
    return StepError(type=type(exc).__name__, message=str(exc), data=error_fields(exc))


def _as_utc(at: datetime) -> datetime:
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at


def decode(step: StepData) -> Any:
    """A finished step's recorded result."""
    text = step["result_json"]
    return None if text is None else json.loads(text)


def _settled(step: StepData) -> tuple[bool, Any]:
    """The replay of a recorded step: (True, its result), its frozen error raised,
    or (False, None) for a step still running."""
    if step["status"] == "finished":
        return True, decode(step)
    if step["status"] == "error":
        raise frozen_error(step)
    return False, None


class _OfRun(Generic[_T]):
    """A read-only attribute of a ``RunWriter``: its run's attribute of the same
    name, read through (the run changes as the turn goes, so it is never copied)."""

    def __set_name__(self, owner: type[RunWriter], name: str) -> None:
        self._name = name

    @overload
    def __get__(self, writer: None, owner: type[RunWriter]) -> _OfRun[_T]: ...

    @overload
    def __get__(self, writer: RunWriter, owner: type[RunWriter]) -> _T: ...

    def __get__(self, writer: RunWriter | None, owner: type[RunWriter]) -> _OfRun[_T] | _T:
        if writer is None:
            return self
        value: _T = getattr(writer._run, self._name)
        return value

    def __set__(self, writer: RunWriter, value: Never) -> NoReturn:
        msg = f"{self._name} is the run's: the writer changes it only by its verbs"
        raise AttributeError(msg)


class RunWriter:
    """A run's journal during one turn: lookups, appends, saves, the lease."""

    def __init__(
        self,
        store: RunStore,
        run: Run,
        *,
        holder: str,
        lease_ttl: float,
        inline_sleep_limit: float = 1.0,
        prices: Prices | None = None,
        clock: Clock = SYSTEM_CLOCK,
        source: ReplaySource | None = None,
    ) -> None:
        self._store = store
        #: Recorded outcomes a re-drive reuses instead of executing (``replay_with``).
        self._source = source
        self._prices = prices
        #: What this turn dates by (``Runtime(clock=)``); never a lease (the store's clock).
        self.clock = clock
        self._run = run
        #: The run's id, made once: a run never changes its id, and the text of a
        #: UUID is made afresh on every read of ``Run.run_id``.
        self.run_id = run.run_id
        self._holder = holder
        self.lease_ttl = timedelta(seconds=lease_ttl)
        #: A save renews the lease when its last renewal is older than this.
        self._renew_after = lease_ttl / 2
        #: This turn's token on the run's lease record.
        self._token = uuid4().hex
        #: The lease op the next save carries (a take, or a release), if any.
        self._lease_op: LeaseOp | None = None
        #: A durable sleep that wakes within this many seconds waits inline.
        self.inline_sleep_limit = inline_sleep_limit
        self._lock = asyncio.Lock()
        #: The task that drives the turn: its own effects are awaited one at a time.
        self._turn_task = asyncio.current_task()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._broken: StaleWriteError | None = None
        #: What a save of this turn's own flush raised (a dead store, a simulated
        #: crash): the turn's next save raises it again.
        self._flush_failed: BaseException | None = None
        #: Outcomes recorded on the run and not saved yet (each step's index, how
        #: it is recorded, what it was): they ride the turn's next save.
        self._unsaved: list[_Outcome] = []
        #: The timer that saves those outcomes when no other save comes soon.
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flush_task: asyncio.Task[None] | None = None
        #: What stopped the turn first: the wait it suspended on, the outcome it
        #: ended the run with, or the replay mismatch that refused an effect.
        self._stopped: Wait | str | NonDeterminismError | None = None
        self._closed = False
        self._heartbeat = Heartbeat(self._renew_alone, self._lease_lost, lease_ttl / 3)
        #: Whether this turn's steps make spans (a provider set meanwhile counts
        #: from the next turn).
        self.tracing = tracing_on()
        #: Whether the turn's close woke the run again, its lease kept: a message
        #: answered the receive it was pausing in (``_save_taking_in_mail``).
        self.woken_at_close = False

    # ---------------------------------------------------------------- reads
    session_id = _OfRun[str]()
    epoch = _OfRun[int]()
    flow_digest = _OfRun[str | None]()
    active_node = _OfRun[str | None]()
    #: Where the active node's (or epoch's) callsites start.
    callsite_base = _OfRun[int]()
    waiting = _OfRun[Wait | None]()
    active_flow = _OfRun[str | None]()
    flow_version = _OfRun[str | None]()
    status = _OfRun[RunStatus]()
    outcome = _OfRun[str | None]()
    #: The run's aggregate version (its saved events so far, and those pending).
    version = _OfRun[int]()
    #: How many steps the run has journaled: the index its next step gets.
    step_count = _OfRun[int]()

    def last_recorded_callsite(self) -> int | None:
        """The highest callsite the active node's (or epoch's) live steps hold: a
        pass of the node replays until it has asked for that one."""
        return max((step["callsite"] for step in self._run.steps), default=None)

    #: A typed flow's validated input as JSON data (``ctx.input``), if it was given one.
    input = _OfRun[dict[str, Any] | None]()
    #: The run that started this one (a child run), if any.
    parent_link = _OfRun[ParentLink | None]()
    #: The ids of the child runs this run started.
    children = _OfRun[list[str]]()

    def now(self) -> datetime:
        """The time by the runtime's clock (a ``TestClock`` in tests)."""
        return self.clock.now()

    def state(self) -> dict[str, Any]:
        """A copy of the flow state bag, for a node to change."""
        return copy.deepcopy(self._run.state)

    def messages(self) -> list[Message]:
        return messages_from_json(self._run.messages)

    @property
    def error_type(self) -> str | None:
        """The type of the error the run ended in, if it did."""
        error = self._run.error
        return None if error is None else str(error.get("type"))

    def result(self, output: Any = None) -> TurnResult:
        """The turn's result as the run stands (``output`` unless the run has its own)."""
        return result_of(self._run, output)

    # ---------------------------------------------------------------- verbs
    # Every change a turn makes to its run is one of these: each triggers the
    # run's events, saved with the next save (``persist``, or the save of the
    # next effect's intent). Nobody else calls the run's commands.
    def append_message(self, message: Message) -> None:
        """Append a chat message; it is saved with the next save."""
        self._run.append_message(message)

    def enter_node(
        self, flow: str | None, node: str | None, state: dict[str, Any], callsite_base: int
    ) -> None:
        """Move to ``node``; its effects count from ``callsite_base`` (saved with the next save)."""
        self._run.enter_node(flow, node, state, callsite_base)

    def link_parent(self, link: ParentLink) -> None:
        """Record the run that started this one (saved with the run's creation)."""
        self._run.link_parent(link)

    def give_input(self, data: dict[str, Any]) -> None:
        """Record a typed flow's validated input (saved with the run's creation)."""
        self._run.give_input(data)

    def take_lease(self) -> None:
        """Take the run's lease with the next save (refused: ``LeaseHeldError``)."""
        self._lease_op = LeaseOp.take(self._run.id, self._holder, self._token, self.lease_ttl)

    def take_over(self, previous_holder: str | None) -> None:
        """Record that this turn takes the running run over from ``previous_holder``:
        a stale writer's next save then loses on the run's version."""
        self._run.recover(previous_holder)

    def record_inbound_key(self, idempotency_key: str, request: str) -> None:
        """Record the inbound key of the call that opens this turn (with its opening)."""
        self._run.record_inbound_key(idempotency_key, request)

    def start_turn(self, epoch: int, message: Message | None, idempotency_key: str | None) -> None:
        self._run.start_turn(epoch, message, idempotency_key)

    def repin(self, flow: str, digest: str, start: str, version: str | None) -> None:
        """Restart the run's ``flow`` from its ``start`` node under the definition
        whose digest is ``digest`` (labelled ``version``)."""
        self._run.repin_flow(flow, digest, start, version)

    def resume(self) -> None:
        """Drive an errored run again (nothing to record for a running one)."""
        self._run.resume()

    def accept_input(self, message: Message) -> None:
        self._run.accept_input(message)

    def accept_signal(self, delivery: SignalDelivery, payload: Any) -> None:
        self._run.accept_signal(delivery.signal_id, delivery.name, payload, delivery.actor)

    def raise_budget(self, raise_to: dict[str, Any]) -> None:
        self._run.raise_budget(raise_to)

    def set_budget(self, budget: Budget) -> None:
        self._run.set_budget(budget.model_dump(mode="json"))

    def fire_timer(self, request_id: str) -> None:
        self._run.fire_timer(request_id)

    def fork_from(self, plan: ForkPlan) -> None:
        """The fork's opening: where it came from, and its copies of the history."""
        run = self._run
        run.mark_forked(plan.from_run_id, plan.at_step)
        for copy_ in plan.copies:
            run.copy_event(copy_.event_class, copy_.fields)
        if plan.wait is not None:
            run.pause(plan.wait)

    def pause(self, wait: Wait) -> None:
        self._run.pause(wait)

    def finish(
        self, outcome: str | None, output: Any, agent: str | None, state: dict[str, Any]
    ) -> None:
        self._run.finish(outcome, output, agent, state)

    def fail(self, error: StepError) -> None:
        self._run.fail(error)

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

    # ---------------------------------------------------------------- saves
    async def persist(self) -> None:
        """Save every pending event of the run (renewing the lease on the way)."""
        async with self._lock:
            await self._persist_locked()

    async def _persist_locked(self) -> None:
        run = self._run
        if self._flush_failed is not None:
            raise self._flush_failed
        op, self._lease_op = self._lease_op, None
        sent_at = time.monotonic()
        renewed_at = self._heartbeat.renewed_at
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
        async with self._lock:
            run = self._run
            unsaved = list(run.pending_events)
            stored_version = run.version - len(unsaved)
            arrived = await self._store.run_events_async(self.run_id, stored_version)
            take_in_mail(run, arrived, unsaved)

    def unread(self, name: str) -> dict[str, Any] | None:
        """The oldest message named ``name`` in the run's mailbox, not received yet."""
        return self._run.unread(name)

    def receive_mail(self, message_id: str, name: str, payload: Any, actor: str | None) -> None:
        self._run.receive_mail(message_id, name, payload, actor)

    def _hold(self, op: LeaseOp | None, sent_at: float) -> None:
        """What this turn holds after a save, sent at ``sent_at``, that carried ``op``."""
        if op is None:
            return
        if op.kind in ("take", "renew"):
            self._heartbeat.renewed(sent_at)
        else:
            self._heartbeat.released()

    async def _save_intent(self) -> None:
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
        async with self._lock:
            await self._persist_locked()

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
        beating = self._heartbeat.enter()
        try:
            await asyncio.sleep(seconds)
        finally:
            self._heartbeat.leave(beating)

    async def close(self) -> None:
        """End the turn: no effect is admitted any more, and the heartbeat stops."""
        self._closed = True
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self._heartbeat.stop()

    # ------------------------------------------------------- deferred outcomes
    def _defer(self, outcome: _Outcome) -> None:
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
        async with self._lock:
            if not self._unsaved or self._closed:
                return
            try:
                await self._persist_locked()
            except StaleWriteError:
                pass  # ``_broken``: the turn's next save raises it
            except BaseException as exc:  # a dead store or a simulated crash
                self._flush_failed = exc

    # ------------------------------------------------------------ admission
    def suspend(self, wait: Wait) -> NoReturn:
        """Suspend the turn on ``wait``, or on its first wait if it already suspended.

        The first suspension is the one the run pauses on, whatever the node
        does with the exception afterwards.
        """
        if self._stopped is None:
            self._stopped = wait
        raise self._stop_error()

    def stop(self, outcome: str) -> NoReturn:
        """End the run with ``outcome`` at the end of this turn (``RunStopped``)."""
        if self._stopped is None:
            self._stopped = outcome
        raise self._stop_error()

    def refuse_replay(self, mismatch: NonDeterminismError) -> NoReturn:
        """Refuse an effect that does not match the journal, and every effect of
        the turn after it: node code that catches the ``NonDeterminismError`` and
        goes on would otherwise take the next recorded callsite for another effect
        (an approval given for one question read as the answer to another)."""
        if self._stopped is None:
            self._stopped = mismatch
        raise self._stop_error()

    def _stop_error(self) -> Exception:
        stopped = self._stopped
        assert stopped is not None
        if isinstance(stopped, Wait):
            return SuspendError(stopped)
        if isinstance(stopped, NonDeterminismError):
            return stopped
        return RunStopped(stopped)

    def require_open(self, what: str) -> None:
        """Refuse every effect once the turn ended (``TurnClosedError``)."""
        if self._closed:
            raise TurnClosedError(self._run.run_id, what)

    def admit(self, what: str) -> None:
        """Let node code request an effect, or refuse it: ``TurnClosedError``
        once the turn ended, ``SuspendError`` (its first wait) once it
        suspended, ``RunStopped`` once it ended the run, the
        ``NonDeterminismError`` once a replay did not match.

        Checked when the effect is requested: the rest of a ``gather`` batch,
        requested before one of its effects suspended, still runs and settles.
        """
        self.require_open(what)
        if self._stopped is not None:
            raise self._stop_error()

    def raise_if_stopped(self) -> None:
        """After node code returned or raised: a turn that suspended (or ended
        the run) stops there, and what the node returned or raised is discarded."""
        if self._stopped is not None:
            raise self._stop_error()

    # ---------------------------------------------------------------- spending
    def budget(self, agent_budget: Budget | None) -> Budget | None:
        """The budget the run's next model call is checked against: the run's own
        (``runtime.run(..., budget=)``) or its agent's, with what a human raised."""
        run = self._run
        base = Budget.model_validate(run.budget) if run.budget is not None else agent_budget
        if base is None or not run.budget_raises:
            return base
        return base.raised(run.budget_raises)

    async def usage(self) -> Usage:
        """What the run's model calls spent so far, over its whole journal."""
        run = self._run
        if run.usage is None:
            # Folded from a snapshot older than the count: count the whole journal
            # once; the run's next snapshot carries the count.
            history = await self._store.load_async(run.run_id, history=True)
            run.usage = {} if history is None or history.usage is None else history.usage
        by_model = [ModelUsage(model=model, **tally) for model, tally in run.usage.items()]
        return total(by_model, 0, self._prices)

    # ------------------------------------------------------------ in flight
    async def settle(self) -> None:
        """Wait until no effect of this turn is still executing or journaling."""
        await self._idle.wait()

    def _enter(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    # ---------------------------------------------------------------- lookup
    def holds(self, site: Site) -> bool:
        """Whether the run holds a step at ``site``, of whatever kind."""
        return bool(self._run.steps_at(site))

    def peek(self, effect: Effect) -> StepData | None:
        """The step recorded for this effect if it matches, else None; refuses nothing."""
        step, mismatch = self._find(effect)
        return None if mismatch is not None else step

    def recorded(self, effect: Effect) -> StepData | None:
        """The step recorded for this effect, or None.

        Raises ``NonDeterminismError`` when the callsite holds another kind or
        name, or the same one under another key (args computed from a value
        the journal did not record): re-keying would execute it again. The
        mismatch stops the turn (``refuse_replay``): it ends in that error
        whatever the node does with it.
        """
        step, mismatch = self._find(effect)
        if mismatch is not None:
            self.refuse_replay(mismatch)
        return step

    def _find(self, effect: Effect) -> tuple[StepData | None, NonDeterminismError | None]:
        steps = self._run.steps_at(effect.site)
        if not steps:
            return None, None
        latest = steps[-1]
        callsite = effect.site.callsite
        recorded = f"{latest['kind']} {latest['name']!r}"
        requested = f"{effect.kind} {effect.name!r}"
        if (latest["kind"], latest["name"]) != (effect.kind, effect.name):
            return latest, NonDeterminismError(callsite, recorded, requested)
        key = effect.key
        if latest["key"] != key:
            mismatch = NonDeterminismError(
                callsite, recorded, requested, recorded_key=latest["key"], requested_key=key
            )
            return latest, mismatch
        return latest, None

    # ---------------------------------------------------------------- funnel
    @traced_step
    async def effect(
        self,
        effect: Effect,
        *,
        execute: Callable[[], Awaitable[Any]],
        replay: bool = True,
        on_running: Callable[[StepData], Awaitable[None]] | None = None,
        on_recorded: Callable[[Any], None] | None = None,
        on_executed: Callable[[Any], None] | None = None,
        retry: RetryPolicy = NO_RETRY,
        journal_errors: bool = True,
        heartbeat_for: float | None = None,
        defer_result: bool = False,
    ) -> Any:
        """Run one effect through the journal; returns its (recorded) JSON result.

        ``on_running`` is consulted when a step was left ``running`` by a crash
        (it may suspend to ask a human instead of re-executing). With
        ``replay=False`` (a read re-run on every pass) a recorded step is run
        again on the same record: one step per key, its ``attempts`` counting
        the passes. ``retry`` says which failed attempts are journaled and
        tried again (same key) instead of being frozen. ``on_recorded`` runs
        with a fresh result before the save that carries it (the events it
        triggers ride on that save); ``on_executed`` runs after. With
        ``journal_errors=False`` a failed attempt is not journaled: its error
        propagates and the step stays ``running``, so the next pass runs it
        again as its next attempt (a model call: nothing is frozen). While an
        attempt executes, the heartbeat keeps the lease ``heartbeat_for``
        seconds at most (a tool's ``timeout``; None: as long as it runs). With
        ``defer_result`` the result rides the turn's next save (``_defer``).
        """
        self.require_open(f"{effect.kind} {effect.name!r}")
        self._enter()
        try:
            retry_at: datetime | None = None
            counted_from = 0
            async with self._lock:
                step = self.recorded(effect)
                if step is None:
                    index = self._run.start_step(effect)
                elif not replay:
                    index = step["index"]
                    if step["status"] != "running":  # a new pass: its attempts count anew
                        counted_from = step.get("failures", 0)
                    self._run.rerun_step(index)
                else:
                    done, result = _settled(step)
                    if done:
                        return result
                    index = step["index"]
                    retry_at = step.get("retry_at")
                    if retry_at is None:
                        # Running: the process died between intent and result.
                        if on_running is not None and not step["retry_allowed"]:
                            await on_running(step)
                        self._run.retry_step(index)
                    # else between attempts of a retried tool: not in doubt.
                served = self._served(effect)
            if served is not None:
                execute, retry = served, NO_RETRY
            await self._save_intent()
            if retry_at is not None:
                await self._next_attempt(index, retry_at)
            value = await self._attempts(
                index, execute, retry, counted_from, journal_errors, heartbeat_for
            )
            try:
                result_json = encode_json(value, f"the result of {effect.kind} {effect.name!r}")
            except (TypeError, KuralleError) as exc:
                if not journal_errors:
                    raise
                error = StepError(
                    type=type(exc).__name__, message=str(exc), data={"reason": _UNRECORDABLE}
                )
                raise await self._record_failure(index, error) from None
            result = json.loads(result_json)

            def succeeded(run: Run) -> None:
                run.finish_step(index, result_json)
                if on_recorded is not None and run is self._run:
                    on_recorded(result)

            await self._save_outcome(
                _Outcome(index, succeeded, f"{effect.kind} {effect.name!r}"), defer=defer_result
            )
            if on_executed is not None:
                on_executed(result)
            return result
        finally:
            self._leave()

    @traced_step
    async def record_value(
        self,
        effect: Effect,
        *,
        make: Callable[[], Any],
        on_recorded: Callable[[Any], None] | None = None,
        defer: bool = False,
    ) -> Any:
        """Journal an effect with no outside side effect (a clock read, a uuid, a
        delivered payload, a model turn) as intent and result in one save.

        Nobody outside can have seen a value that was never saved, so the
        intent-before-execute window buys nothing here and costs a save. If
        ``make`` fails, nothing is journaled and the error propagates: the next
        pass asks again. ``on_recorded`` runs only when the value is new, and
        whatever events it triggers are saved in the same transaction. With
        ``defer`` (a clock read, a uuid) the value rides the turn's next save,
        whenever that comes: a crash before it only means the value is made
        again, and nothing outside can have used a value no save carried.
        """
        self.require_open(f"{effect.kind} {effect.name!r}")
        self._enter()
        try:
            async with self._lock:
                step = self.recorded(effect)
                if step is not None:
                    done, result = _settled(step)
                    if done:
                        return result
            served = self._served(effect)
            value = make() if served is None else await served()
            if inspect.isawaitable(value):
                beating = self._heartbeat.enter()
                try:
                    value = await value
                finally:
                    self._heartbeat.leave(beating)
            result_json = encode_json(value, f"the result of {effect.kind} {effect.name!r}")
            result = json.loads(result_json)
            async with self._lock:
                index = self._run.start_step(effect) if step is None else step["index"]
                self._run.finish_step(index, result_json)
                if on_recorded is not None:
                    on_recorded(result)
                if not defer:
                    await self._persist_locked()
            return result
        finally:
            self._leave()

    def _served(self, effect: Effect) -> Callable[[], Awaitable[Any]] | None:
        """The recorded outcome of ``effect`` as its execution, when this writer
        re-drives a recorded run and the recording holds it (docs/howto/evaluating-models.md)."""
        served = self._source.serve(effect) if self._source is not None else None
        if served is None:
            return None

        async def recorded() -> Any:
            if served.error is not None:
                raise RecordedFailure(served.error)
            return served.result

        return recorded

    def answer_in_doubt(self, index: int, answer: dict[str, Any]) -> None:
        """Apply a human's answer to a step left running: retry, resolve or fail.

        Only triggers events; they are saved with the delivery that carried them.
        """
        action = answer["action"]
        step = self._run.step(index)
        if action == "retry":
            self._run.allow_retry(index)
        elif action == "resolve":
            what = f"the resolved result of {step['kind']} {step['name']!r}"
            self._run.finish_step(index, encode_json(answer.get("result"), what))
        else:
            message = str(answer.get("message") or "failed by a human after a crash")
            self._run.fail_step(index, StepError(type="InDoubtFailed", message=message, data={}))

    async def _attempts(
        self,
        index: int,
        execute: Callable[[], Awaitable[Any]],
        retry: RetryPolicy,
        counted_from: int,
        journal_errors: bool = True,
        heartbeat_for: float | None = None,
    ) -> Any:
        """Execute until an attempt succeeds; a failure the policy retries is
        journaled (the step stays running) and waited out, the last one frozen.

        Failures count from ``counted_from`` (earlier passes of a ``replay=False``
        read do not use up this pass's attempts)."""
        while True:
            beating = self._heartbeat.enter(heartbeat_for)
            try:
                return await execute()
            except (SuspendError, asyncio.CancelledError):
                raise
            except Exception as exc:
                if not journal_errors:
                    raise
                error = _step_error(exc)
                failures = self._run.step(index).get("failures", 0) + 1 - counted_from
                if not retry.retries(exc, failures):
                    raise await self._record_failure(index, error) from exc
                retry_at = self.now() + timedelta(seconds=retry.delay(failures))

                def attempt_failed(
                    run: Run, at: datetime = retry_at, failure: StepError = error
                ) -> None:
                    if run is self._run:
                        run.fail_attempt(index, failure, at)
                    else:  # the run ended meanwhile: no attempt follows, the error stands
                        run.fail_step(index, failure)

                await self._save_outcome(_Outcome(index, attempt_failed, f"step {index}"))
            finally:
                self._heartbeat.leave(beating)
            await self._next_attempt(index, retry_at)

    async def _next_attempt(self, index: int, retry_at: datetime) -> None:
        """Wait until the next attempt is due (the lease kept by the heartbeat
        meanwhile), then journal its start; a crash before that save resumes
        the wait, never the count."""
        delay = (_as_utc(retry_at) - self.now()).total_seconds()
        if delay > 0:
            await self.hold(delay)
        async with self._lock:
            self._run.retry_step(index)
            await self._persist_locked()

    async def _record_failure(self, index: int, error: StepError) -> ToolExecutionError:
        await self._save_outcome(
            _Outcome(index, lambda run: run.fail_step(index, error), f"step {index}")
        )
        return frozen_error(self._run.step(index))

    async def _save_outcome(self, outcome: _Outcome, *, defer: bool = False) -> None:
        """Record the outcome of a step and save it (with ``defer``, with the turn's
        next save). An executed effect is always recorded: a save lost because the
        run was ended from outside meanwhile records it on the run as stored
        (``_keep_outcomes``)."""
        async with self._lock:
            outcome.record(self._run)
            if defer:
                self._defer(outcome)
                return
            self._unsaved.append(outcome)
            await self._persist_locked()

    async def _record_on_stored(self, outcomes: list[_Outcome]) -> bool:
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
                await asyncio.sleep(random.uniform(0, min(0.05, 0.002 * (attempt + 1))))
                continue
            return True
        return False


@dataclass(frozen=True)
class _Outcome:
    """A step's outcome on its way to the store: ``record`` triggers it on a run
    (the turn's, or the run as stored after an outside change)."""

    index: int
    record: Callable[[Run], None]
    what: str


#: Seconds a deferred step outcome waits for another save to ride before it is
#: saved alone (docs/guarantees.md, "One commit a step").
FLUSH_AFTER = 0.005


def _lease_record(store: RunStore, run_id: str, op: LeaseOp) -> LeasingRecorder:
    """The recorder that keeps the run's lease record (its partition's), for a
    renewal made apart from any save of events (``LeaseRefused``: no such run)."""
    partition = store.partition_of(run_id)
    if partition is None:
        raise LeaseRefused(op, None)
    recorder: LeasingRecorder = store.partitions[partition].recorder  # type: ignore[assignment]
    return recorder


# ------------------------------------------------------- outside a turn
class RunChange(ABC):
    """A change made to a run from outside its turns (cancel, migrate, abandon, a message)."""

    #: Whether the change takes the run away from whoever holds its lease (a
    #: stop does; a message waits in the mailbox and leaves the holder be).
    clears_lease: ClassVar[bool] = True

    @abstractmethod
    def apply(self, run: Run, lease: Lease | None) -> bool:
        """Trigger the change on ``run`` (whose lease is ``lease``); False when it
        already holds it (nothing to save), or a refusal."""


@dataclass(frozen=True)
class Cancel(RunChange):
    """Stop the run for good (a conversation: end its turn), whoever holds the lease."""

    reason: str

    def apply(self, run: Run, lease: Lease | None) -> bool:
        return run.cancel(self.reason)


#: The outcome of a run aborted because its subject was erased (docs/privacy.md).
ERASED = "erased"


@dataclass(frozen=True)
class Erase(RunChange):
    """Abort, with outcome ``"erased"``, a run of an erased subject that could still
    execute something (running, paused, errored; a conversation, which a new
    message would carry on), whoever holds its lease."""

    @staticmethod
    def applies(status: str, kind: str) -> bool:
        return status in ("running", "paused", "error") or (
            kind == "conversation" and status != "aborted"
        )

    def apply(self, run: Run, lease: Lease | None) -> bool:
        if not self.applies(run.status, run.kind):
            return False
        run.abort(ERASED)
        return True


@dataclass(frozen=True)
class MigrateTo(RunChange):
    """Stop the run for good: it moved to its fork ``fork_id`` (``runtime.migrate``)."""

    fork_id: str
    at_step: int

    def apply(self, run: Run, lease: Lease | None) -> bool:
        return run.migrate(self.fork_id, self.at_step)


@dataclass(frozen=True)
class Abandon(RunChange):
    """End a live run with ``outcome``, unless another holder's live lease has it."""

    holder: str
    outcome: str

    def apply(self, run: Run, lease: Lease | None) -> bool:
        if run.status in ("finished", "aborted"):
            return False
        if lease is not None and lease.holder != self.holder and lease.live:
            raise LeaseHeldError(run.run_id, lease.holder, lease.expires_at)
        run.abort(self.outcome)
        return True


@dataclass(frozen=True)
class Post(RunChange):
    """Put a message in the run's mailbox (``runtime.send``), whatever the run is
    doing, its lease left alone: a turn driving the run takes the message into
    its next save (``mail.take_in_mail``). ``screen`` may refuse the run as
    stored, raising before anything is triggered; a ``message_id`` the run
    already has is a no-op."""

    message_id: str
    name: str
    payload: Any
    actor: str | None
    screen: Callable[[Run], None]
    clears_lease: ClassVar[bool] = False

    def apply(self, run: Run, lease: Lease | None) -> bool:
        if self.message_id in run.mail_ids:
            return False
        self.screen(run)
        run.receive_mail(self.message_id, self.name, self.payload, self.actor)
        return True


async def change_run(store: RunStore, run_id: str, session_id: str, change: RunChange) -> Run:
    """Apply ``change`` to the run as stored and save it with the run's lease record
    cleared (unless the change leaves the holder be: ``clears_lease``): one
    compare-and-set that wins over whoever holds the lease (a turn driving the
    run elsewhere loses its next save, and its heartbeat finds the record gone).
    A save that loses to a turn's reloads what the turn wrote and tries again,
    until it lands, so a busy turn cannot starve it. Returns the run as it
    stands after; ``RunNotFoundError`` for an unknown or foreign run.
    """
    attempt = 0
    while True:
        run = await store.load_async(run_id)
        if run is None or run.session_id != session_id:
            raise RunNotFoundError(run_id, session_id)
        lease = run.lease(await store.lease_async(run_id))
        if not change.apply(run, lease):
            return run
        try:
            await store.save_run_async(run, LeaseOp.clear(run.id) if change.clears_lease else None)
        except StaleWriteError:
            attempt += 1
            await asyncio.sleep(random.uniform(0, min(0.05, 0.002 * attempt)))
            continue
        return run
