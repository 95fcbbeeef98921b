"""One turn of a run: address -> prepare -> lease -> open -> drive -> close (internal).

The command addresses the run and decides the opening; refusals (unknown
run, drift, signal mismatch, held lease, ...) are raised before the first
save, so a refused turn writes nothing. The first save is compare-and-set
and carries the lease together with whatever opened the turn (a new run, a
new user message, an accepted delivery, a re-pinned flow).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any

from .._definitions.agents import Agent
from .._definitions.budget import Budget
from .._definitions.flows import End, Flow, Handoff
from .._journal.leases import Lease
from .._journal.run import Run
from ..errors import (
    IdempotencyConflictError,
    LeaseHeldError,
    StaleWriteError,
    SuspendError,
    UnrecordableValueError,
    error_fields,
)
from ..shapes import StepError, StreamPart, TurnResult
from .admission import RunStopped
from .children import ChildRuns, driving, follow_up
from .flow_driver import Driven, drive
from .handle import TurnSink
from .observability import log_event, set_status, span
from .step_results import result_of
from .streaming import TurnStream
from .turn_calls import Command, Opening, Recover, Resume, TurnEnv
from .writer import RunWriter

__all__ = ["drive_turn", "result_of"]


async def drive_turn(
    env: TurnEnv, command: Command, sink: TurnSink, budget: Budget | None = None
) -> TurnResult:
    """Run one turn of ``command`` to its end; its refusals and errors are raised.

    ``budget`` (the caller's, for the run) is saved with the turn's opening. A
    turn whose close was answered by a message (the run was pausing in a
    ``receive`` when it came: the close woke the run, its lease kept) drives
    the run on at once, in a turn of its own (docs/messages.md)."""
    turn = _Turn(env, command, sink, budget)
    result = await turn.drive()
    if turn.woken is None:
        return result
    return await drive_turn(env, turn.woken, sink)


class _Turn:
    def __init__(
        self, env: TurnEnv, command: Command, sink: TurnSink, budget: Budget | None
    ) -> None:
        self.env = env
        self.command = command
        self.sink = sink
        self.budget = budget
        self.last_text: str | None = None
        self.span: Any = None
        #: The turn that drives the run on when the close was woken by a message.
        self.woken: Resume | None = None
        #: Every part of the turn goes through it: to the handle, and stored.
        self.stream = TurnStream(self.emit)

    def emit(self, part: StreamPart) -> None:
        if part.type == "text" and part.text:
            self.last_text = part.text
        self.sink.emit(part)

    # ------------------------------------------------------------------ turn
    async def drive(self) -> TurnResult:
        attributes = {
            "kuralle.session_id": self.command.session_id,
            "kuralle.command": type(self.command).__name__,
        }
        try:
            run, fresh = await self.command.address(self.env)
        except Exception:
            with span("kuralle.turn", attributes):  # refused before a run was found
                raise
        # Every turn of the run joins the run's trace (observability.span).
        attributes["kuralle.run_id"] = run.run_id
        with span("kuralle.turn", attributes, run_id=run.run_id) as current:
            self.span = current
            result = await self._drive(run, fresh)
            set_status(current, result.status)
            return result

    def _done_already(self, run: Run, fresh: bool) -> TurnResult | None:
        """The result of a call the run already answered (a retried turn key or
        delivery), which is a no-op whoever holds the run; ``IdempotencyConflictError``
        for a key the run saw with another request."""
        command = self.command
        key = command.idempotency_key
        if key and not fresh and key in run.inbound_keys:
            seen = run.inbound_keys[key]
            if seen is not None and seen != command.request_digest():
                raise IdempotencyConflictError(
                    key, run.run_id, f"the request now differs: {command.request()!r}"
                )
            if key in run.turn_keys:
                return TurnResult.model_validate(run.turn_keys[key])
            return result_of(run)
        if command.already_done(run):
            return result_of(run)
        return None

    async def _drive(self, run: Run, fresh: bool) -> TurnResult:
        command, env = self.command, self.env
        done = self._done_already(run, fresh)
        held = None if fresh else run.lease(await env.store.lease_async(run.run_id))
        live_elsewhere = held is not None and held.holder != env.holder and held.live
        if done is not None and self._still_running(run):
            # A keyed call retried while the run it started still runs: another
            # holder's turn is refused below; this worker's own is in flight here;
            # a turn cut off by a crash that nobody recovered yet is recovered now,
            # and the call answered as the run then stands.
            if held is not None and held.holder == env.holder and held.live:
                return self._noop(run, done)
            if not live_elsewhere:
                self.command = command = Recover(
                    run.session_id, run.run_id, command.idempotency_key
                )
                done = None
        elif done is not None:
            return self._noop(run, done)
        # A run another holder is driving is not this caller's to address yet:
        # refused before anything the call delivers is checked. (The lease is read
        # after the run: a holder that opened its turn in between may have
        # answered this very call, so read the run again before refusing.)
        if held is not None and live_elsewhere:
            latest = await env.store.load_async(run.run_id)
            done = self._done_already(latest, fresh) if latest is not None else None
            if latest is not None and done is not None and not self._still_running(latest):
                return self._noop(latest, done)
            raise LeaseHeldError(run.run_id, held.holder, held.expires_at)
        opening = command.prepare(run, fresh, env, held)
        if opening is None:
            return self._noop(run, result_of(run))
        agent, flow = opening.enters or self._definitions(run)
        writer = RunWriter(
            env.store,
            run,
            holder=env.holder,
            lease_ttl=env.lease_ttl,
            inline_sleep_limit=env.inline_sleep_limit,
            prices=env.prices,
            clock=env.clock,
            source=env.source,
        )
        try:
            return await self._open_and_drive(run, fresh, held, writer, opening, agent, flow)
        finally:
            await writer.close()

    def _still_running(self, run: Run) -> bool:
        """Whether this call is a keyed retry whose run is still running, its turn
        not recorded: in flight somewhere, or cut off by a crash."""
        key = self.command.idempotency_key
        return (
            bool(key)
            and key in run.inbound_keys
            and key not in run.turn_keys
            and run.status == "running"
        )

    async def _open_and_drive(
        self,
        run: Run,
        fresh: bool,
        held: Lease | None,
        writer: RunWriter,
        opening: Opening,
        agent: Agent,
        flow: Flow | None,
    ) -> TurnResult:
        env = self.env
        try:
            await self._opened(run, fresh, held, writer, opening)
        except (StaleWriteError, LeaseHeldError):
            latest = await env.store.load_async(run.run_id)
            if latest is not None:
                lease = latest.lease(await env.store.lease_async(run.run_id))
                if self.command.won_elsewhere(latest, fresh, lease):
                    return self._noop(latest, result_of(latest))
            raise
        self.sink.opened(run.run_id)
        self._log_opened(run)
        if writer.status == "paused":
            # An opening that stands the run on a wait (a fork at a pending input)
            # ends the turn there: driving would re-enter a node that already asked.
            waiting = StreamPart(type="paused", waiting_for=run.public_wait())
            return await self._close(writer, waiting)
        try:
            with driving(ChildRuns(env, drive_turn)):
                driven = await drive(
                    writer,
                    agent,
                    flow,
                    self.stream,
                    schemas=env.registry.schemas,
                    max_tool_concurrency=env.max_tool_concurrency,
                )
        except SuspendError as suspended:
            await self._refused_unless(writer, functools.partial(writer.pause, suspended.wait))
            part = StreamPart(type="paused", waiting_for=suspended.waiting_for)
            return await self._close(writer, part)
        except RunStopped as stopped:
            driven = Driven(End(stopped.outcome), writer.state())
            return await self._close_finished(run, writer, driven)
        except StaleWriteError as lost:
            raise _after_opening(lost) from None
        except Exception as exc:
            await self._close_errored(writer, exc)
            raise
        return await self._close_finished(run, writer, driven)

    def _log_opened(self, run: Run) -> None:
        if self.span is not None:
            self.span.set_attribute("kuralle.run_id", run.run_id)
        log_event(
            "turn opened",
            run.run_id,
            session=run.session_id,
            command=type(self.command).__name__,
            flow=run.active_flow,
            node=run.active_node,
            holder=self.env.holder,
            **self.command.log_fields(),
        )

    def _noop(self, run: Run, result: TurnResult) -> TurnResult:
        self.sink.opened(run.run_id)
        return result

    def _definitions(self, run: Run) -> tuple[Agent, Flow | None]:
        """The agent (and flow, for a run in a flow) that drive this run."""
        registry = self.env.registry
        if run.active_flow is None:
            return registry.agent(run.active_agent), None
        return registry.run_flow(run.active_flow, run.flow_digest, run.flow_version)

    async def _opened(
        self, run: Run, fresh: bool, held: Lease | None, writer: RunWriter, opening: Opening
    ) -> None:
        """``_open``, with the run's stored stream found meanwhile (a run that has one
        reads its last offset while the opening is saved)."""
        store = self.env.store
        if fresh:
            await self._open(run, fresh, held, writer, opening)
            await self.stream.open(store, run.run_id, run.data_subject, fresh=True)
            return
        finding = asyncio.ensure_future(
            self.stream.open(store, run.run_id, run.data_subject, fresh=False)
        )
        try:
            await self._open(run, fresh, held, writer, opening)
        except BaseException:
            finding.cancel()
            with contextlib.suppress(BaseException):
                await finding
            raise
        await finding

    async def _open(
        self, run: Run, fresh: bool, held: Lease | None, writer: RunWriter, opening: Opening
    ) -> None:
        """The turn's first save: the lease taken, with what opens the turn. A turn
        that takes over a running run from another holder (or from none) records
        the takeover, so whoever drove it before loses its next save."""
        writer.saver.take_lease()
        key = self.command.idempotency_key
        if key and key not in run.inbound_keys:
            writer.record_inbound_key(key, self.command.request_digest())
        takeover = held is None or held.holder != self.env.holder
        if not fresh and run.status == "running" and takeover and not opening.takes_over:
            writer.take_over(held.holder if held is not None else None)
        if self.budget is not None:
            writer.set_budget(self.budget)
        await opening.open(writer, self.env)

    # --------------------------------------------------------------- closing
    async def _close_finished(self, run: Run, writer: RunWriter, driven: Driven) -> TurnResult:
        if driven.conversation:
            self.last_text = driven.reply
        transition = driven.transition
        agent = transition.to if isinstance(transition, Handoff) else run.active_agent
        outcome = transition.reason
        output = self.last_text if self.last_text is not None else outcome
        await self._refused_unless(
            writer, lambda: writer.finish(outcome, output, agent, driven.state)
        )
        return await self._close(writer, StreamPart(type="finished"))

    async def _refused_unless(self, writer: RunWriter, close: Callable[[], None]) -> None:
        """Apply the turn's ``close`` (a pause, an end); if the journal refuses what it
        holds (a value with no JSON form, a lone surrogate), the turn ends the run
        ``error`` with that refusal instead, and raises it: no run is left running
        with no turn driving it."""
        try:
            close()
        except UnrecordableValueError as refused:
            await self._close_errored(writer, refused)
            raise

    async def _close_errored(self, writer: RunWriter, exc: Exception) -> None:
        error = StepError(type=type(exc).__name__, message=str(exc), data=error_fields(exc))
        writer.fail(error)
        # The node's error is what the caller needs to see, even if this close loses a race.
        with contextlib.suppress(StaleWriteError):
            await self._close(writer, StreamPart(type="error", error=error))

    async def _close(self, writer: RunWriter, part: StreamPart) -> TurnResult:
        result = await writer.saver.close_turn(self.command.idempotency_key, self.last_text)
        if writer.saver.woken_at_close:
            # Not paused after all: the run runs on under this worker's lease.
            self.woken = Resume(self.command.session_id, result.run_id, None)
            return result
        wait = result.waiting_for
        log_event(
            "turn closed",
            result.run_id,
            status=result.status,
            waiting_for=wait.name if wait is not None else None,
            wait_kind=wait.kind if wait is not None else None,
            outcome=writer.outcome if result.status != "paused" else None,
            error=writer.error_type,
        )
        ended = part.model_copy(update={"data": result.model_dump(mode="json")})
        self.stream(ended, version=writer.version)
        # A child that ended tells its parent; a parent whose child ended meanwhile
        # goes on (docs/child-runs.md): within this call, after this turn's close.
        followed = await follow_up(ChildRuns(self.env, drive_turn), writer, result)
        return followed if followed is not None else result


def _after_opening(lost: StaleWriteError) -> StaleWriteError:
    """A turn that opened its run and then lost a save (a cancel or another writer
    won): what it saved before stands, so it is never told nothing was stored."""
    if lost.recorded:
        return lost
    return StaleWriteError(
        lost.run_id,
        "this turn's earlier saves stand (what opened it and every step it recorded); "
        "its last write was not stored and nothing after it ran",
        clash=lost.clash,
        recorded=True,
    )
