"""One turn of a run: address -> prepare -> lease -> open -> drive -> close (internal).

The command addresses the run and decides the opening; refusals (unknown
run, drift, signal mismatch, held lease, ...) are raised before the first
save, so a refused turn writes nothing. The first save is compare-and-set
and carries the lease together with whatever opened the turn (a new run, a
new user message, an accepted delivery, a re-pinned flow).
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

from .agents import Agent
from .commands import Command, Opening, TurnEnv
from .domain import Run
from .driver import Driven, drive
from .errors import StaleWriteError, SuspendError, error_fields
from .flows import End, Flow, Handoff
from .handle import TurnSink
from .journal import Journal, RunStopped, utcnow
from .models import StepError, StreamPart, TurnResult
from .observability import log_event, set_status, span
from .usage import Budget

__all__ = ["drive_turn", "result_of"]


def result_of(run: Run, output: Any = None) -> TurnResult:
    """The turn's result, read off the run (not its whole state: a long
    conversation's messages would be validated at every turn for nothing)."""
    return TurnResult(
        run_id=run.run_id,
        status=cast(Any, run.status),
        output=output if output is not None else run.output,
        waiting_for=run.public_wait(),
    )


async def drive_turn(
    env: TurnEnv, command: Command, sink: TurnSink, budget: Budget | None = None
) -> TurnResult:
    """Run one turn of ``command`` to its end; its refusals and errors are raised.

    ``budget`` (the caller's, for the run) is saved with the turn's opening."""
    return await _Turn(env, command, sink, budget).drive()


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

    async def _drive(self, run: Run, fresh: bool) -> TurnResult:
        command, env = self.command, self.env
        key = command.idempotency_key
        if key and key in run.turn_keys:
            return self._noop(run, TurnResult.model_validate(run.turn_keys[key]))
        if key and key == run.turn_key and run.status == "running" and not fresh:
            # The turn this key started is still in flight (or was cut off, for
            # recovery to finish): a retry must not start it a second time.
            return self._noop(run, result_of(run))
        if command.already_done(run):
            return self._noop(run, result_of(run))
        # A run another holder is driving is not this caller's to address yet:
        # refused before anything the call delivers is checked.
        run.require_lease_free(env.holder, utcnow())
        opening = command.prepare(run, fresh, env)
        if opening is None:
            return self._noop(run, result_of(run))
        agent, flow = opening.enters or self._definitions(run)
        journal = Journal(
            env.store,
            run,
            holder=env.holder,
            lease_ttl=env.lease_ttl,
            inline_sleep_limit=env.inline_sleep_limit,
            prices=env.prices,
        )
        try:
            return await self._open_and_drive(run, fresh, journal, opening, agent, flow)
        finally:
            await journal.close()

    async def _open_and_drive(
        self,
        run: Run,
        fresh: bool,
        journal: Journal,
        opening: Opening,
        agent: Agent,
        flow: Flow | None,
    ) -> TurnResult:
        env = self.env
        try:
            await self._open(run, journal, opening)
        except StaleWriteError:
            latest = await env.store.load_async(run.run_id)
            if latest is not None and self.command.won_elsewhere(latest, fresh):
                return self._noop(latest, result_of(latest))
            raise
        self.sink.opened(run.run_id)
        self._log_opened(run)
        if run.status == "paused":
            # An opening that stands the run on a wait (a fork at a pending input)
            # ends the turn there: driving would re-enter a node that already asked.
            waiting = StreamPart(type="paused", waiting_for=run.public_wait())
            return await self._close(run, journal, waiting)
        try:
            driven = await drive(
                journal,
                agent,
                flow,
                self.emit,
                schemas=env.registry.schemas,
                max_tool_concurrency=env.max_tool_concurrency,
            )
        except SuspendError as suspended:
            run.pause(suspended.wait)
            part = StreamPart(type="paused", waiting_for=suspended.waiting_for)
            return await self._close(run, journal, part)
        except RunStopped as stopped:
            driven = Driven(End(stopped.outcome), journal.state())
            return await self._close_finished(run, journal, driven)
        except StaleWriteError:
            raise
        except Exception as exc:
            await self._close_errored(run, journal, exc)
            raise
        return await self._close_finished(run, journal, driven)

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

    async def _open(self, run: Run, journal: Journal, opening: Opening) -> None:
        """The turn's first save: the lease, with what opens the turn."""
        run.take_lease(self.env.holder, utcnow() + journal.lease_ttl)
        if self.budget is not None:
            run.set_budget(self.budget.model_dump(mode="json"))
        await opening.open(run, journal, self.env)

    # --------------------------------------------------------------- closing
    async def _close_finished(self, run: Run, journal: Journal, driven: Driven) -> TurnResult:
        if driven.conversation:
            self.last_text = driven.reply
        transition = driven.transition
        agent = transition.to if isinstance(transition, Handoff) else run.active_agent
        outcome = transition.reason
        output = self.last_text if self.last_text is not None else outcome
        run.finish(outcome, output, agent, driven.state)
        return await self._close(run, journal, StreamPart(type="finished"))

    async def _close_errored(self, run: Run, journal: Journal, exc: Exception) -> None:
        error = StepError(type=type(exc).__name__, message=str(exc), data=error_fields(exc))
        run.fail(error)
        # The node's error is what the caller needs to see, even if this close loses a race.
        with contextlib.suppress(StaleWriteError):
            await self._close(run, journal, StreamPart(type="error", error=error))

    async def _close(self, run: Run, journal: Journal, part: StreamPart) -> TurnResult:
        run.release_lease()
        result = result_of(run, self.last_text if run.status == "paused" else None)
        if self.command.idempotency_key:
            run.record_turn(self.command.idempotency_key, result.model_dump(mode="json"))
        await journal.persist()
        wait = result.waiting_for
        log_event(
            "turn closed",
            run.run_id,
            status=run.status,
            waiting_for=wait.name if wait is not None else None,
            wait_kind=wait.kind if wait is not None else None,
            outcome=run.outcome if run.status != "paused" else None,
            error=run.error["type"] if run.error else None,
        )
        self.sink.emit(part.model_copy(update={"data": result.model_dump(mode="json")}))
        return result
