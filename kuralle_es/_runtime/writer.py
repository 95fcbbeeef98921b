"""Where a step is journaled: the one decision every effect goes through (internal).

Every durable effect (``ctx.tool``, ``ctx.now``, ``ctx.uuid``, approvals,
signals, model turns) goes through ``RunWriter.effect`` or
``RunWriter.record_value``, which make one decision per site
(docs/architecture.md, "The one idea"):

    recorded, but another kind/name  -> NonDeterminismError, execute nothing
    recorded finished                -> return the recorded result
    recorded error                   -> raise the recorded error (frozen)
    recorded running (crash window)  -> execute again with the same key
    absent                           -> save intent, execute, record result or error

A writer that re-drives a recording (``replay_with``) asks its
``ReplaySource`` before executing an absent step: the recorded outcome under
the same key stands in for the execution (``replay_source``). Every time a
turn dates (a clock read, a wake time, a deadline, a retry's next attempt)
comes from its clock (``Runtime(clock=)``), never a lease's.

The saves and the lease are the turn's saver's (``leased_saver``); which
effects node code may still request is its admission's (``admission``).
Everything else a turn does to the run goes through a few verbs
(``append_message``, ``enter_node``, ``pause``); nobody outside reaches the
aggregate.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, Never, NoReturn, TypeVar, overload

from .._clock import SYSTEM_CLOCK, Clock, as_utc
from .._definitions.budget import Budget
from .._definitions.retry import NO_RETRY, RetryPolicy
from .._journal.json_data import encode_json
from .._journal.run import ParentLink, Run, StepData
from .._journal.sites import Effect, Site
from .._journal.spending import ModelUsage, Prices, total
from .._journal.store import RunStore
from .._journal.wait import InDoubtAnswer, Wait
from ..errors import (
    KuralleError,
    NonDeterminismError,
    SuspendError,
    ToolExecutionError,
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
from .admission import TurnAdmission
from .leased_saver import LeasedSaver, Outcome
from .observability import traced_step, tracing_on
from .replay_source import RecordedFailure, ReplaySource
from .step_results import UNRECORDABLE, frozen_error, result_of, settled, step_error

if TYPE_CHECKING:
    from .fork import ForkPlan

__all__ = ["TOOL_ATTEMPTS", "UNJOURNALED", "Attempts", "RunWriter"]


_T = TypeVar("_T")


@dataclass(frozen=True)
class Attempts:
    """How a step's attempts go in ``RunWriter.effect``.

    ``replay=False`` (a read re-run on every pass): a recorded step is run
    again on the same record, one step per key, its ``attempts`` counting the
    passes. ``retry``: which failed attempts are journaled and tried again
    (same key) instead of being frozen. ``journal_errors=False``: a failed
    attempt is not journaled; its error propagates and the step stays
    ``running``, so the next pass runs it again as its next attempt (a model
    call: nothing is frozen). ``heartbeat_for``: the heartbeat keeps the lease
    this many seconds at most while an attempt executes (a tool's ``timeout``;
    None: as long as it runs). ``defer_result``: the result rides the turn's
    next save (docs/guarantees.md, "One commit a step").
    """

    replay: bool = True
    retry: RetryPolicy = NO_RETRY
    journal_errors: bool = True
    heartbeat_for: float | None = None
    defer_result: bool = False


#: A tool's attempts by default: replayed, never retried, errors frozen.
TOOL_ATTEMPTS = Attempts()
#: Attempts whose failures are never journaled (a model call, a child's start):
#: the next pass runs the step again.
UNJOURNALED = Attempts(journal_errors=False)


class _RunAttribute(Generic[_T]):
    """A read-only attribute of a ``RunWriter``: its run's attribute of the same
    name, read through (the run changes as the turn goes, so it is never copied)."""

    def __set_name__(self, owner: type[RunWriter], name: str) -> None:
        self._name = name

    @overload
    def __get__(self, writer: None, owner: type[RunWriter]) -> _RunAttribute[_T]: ...

    @overload
    def __get__(self, writer: RunWriter, owner: type[RunWriter]) -> _T: ...

    def __get__(self, writer: RunWriter | None, owner: type[RunWriter]) -> _RunAttribute[_T] | _T:
        if writer is None:
            return self
        value: _T = getattr(writer._run, self._name)
        return value

    def __set__(self, writer: RunWriter, value: Never) -> NoReturn:
        msg = f"{self._name} is the run's: the writer changes it only by its verbs"
        raise AttributeError(msg)


class RunWriter:
    """A run's journal during one turn: the one decision each effect goes through.

    It composes the turn's two other parts: its saver (``saver``: the saves and
    the lease) and its admission (``admission``: which effects node code may
    still request). Every change a turn makes to its run goes through the
    writer's verbs; nobody outside reaches the aggregate.
    """

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
        #: A durable sleep that wakes within this many seconds waits inline.
        self.inline_sleep_limit = inline_sleep_limit
        self.saver = LeasedSaver(
            store, run, holder=holder, lease_ttl=lease_ttl, turn_task=asyncio.current_task()
        )
        self.admission = TurnAdmission(self.run_id)
        #: Whether this turn's steps make spans (a provider set meanwhile counts
        #: from the next turn).
        self.tracing = tracing_on()

    # ---------------------------------------------------------------- reads
    session_id = _RunAttribute[str]()
    epoch = _RunAttribute[int]()
    flow_digest = _RunAttribute[str | None]()
    active_node = _RunAttribute[str | None]()
    #: Where the active node's (or epoch's) callsites start.
    callsite_base = _RunAttribute[int]()
    waiting = _RunAttribute[Wait | None]()
    active_flow = _RunAttribute[str | None]()
    flow_version = _RunAttribute[str | None]()
    status = _RunAttribute[RunStatus]()
    outcome = _RunAttribute[str | None]()
    #: The run's aggregate version (its saved events so far, and those pending).
    version = _RunAttribute[int]()
    #: How many steps the run has journaled: the index its next step gets.
    step_count = _RunAttribute[int]()

    def last_recorded_callsite(self) -> int | None:
        """The highest callsite the active node's (or epoch's) live steps hold: a
        pass of the node replays until it has asked for that one."""
        return max((step["callsite"] for step in self._run.steps), default=None)

    #: A typed flow's validated input as JSON data (``ctx.input``), if it was given one.
    input = _RunAttribute[dict[str, Any] | None]()
    #: The run that started this one (a child run), if any.
    parent_link = _RunAttribute[ParentLink | None]()
    #: The ids of the child runs this run started.
    children = _RunAttribute[list[str]]()

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

    def unread(self, name: str) -> dict[str, Any] | None:
        """The oldest message named ``name`` in the run's mailbox, not received yet."""
        return self._run.unread(name)

    def receive_mail(self, message_id: str, name: str, payload: Any, actor: str | None) -> None:
        self._run.receive_mail(message_id, name, payload, actor)

    def pause(self, wait: Wait) -> None:
        self._run.pause(wait)

    def finish(
        self, outcome: str | None, output: Any, agent: str | None, state: dict[str, Any]
    ) -> None:
        self._run.finish(outcome, output, agent, state)

    def fail(self, error: StepError) -> None:
        self._run.fail(error)

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
            self.admission.refuse_replay(mismatch)
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

    # ---------------------------------------------------------------- the one decision
    @traced_step
    async def effect(
        self,
        effect: Effect,
        *,
        execute: Callable[[], Awaitable[Any]],
        attempts: Attempts = TOOL_ATTEMPTS,
        on_running: Callable[[StepData], Awaitable[None]] | None = None,
        on_recorded: Callable[[Any], None] | None = None,
        on_executed: Callable[[Any], None] | None = None,
    ) -> Any:
        """Run one effect through the journal; returns its (recorded) JSON result.

        ``attempts`` says how its attempts go (``Attempts``). ``on_running`` is
        consulted when a step was left ``running`` by a crash (it may suspend to
        ask a human instead of re-executing). ``on_recorded`` runs with a fresh
        result before the save that carries it (the events it triggers ride on
        that save); ``on_executed`` runs after.
        """
        self.admission.require_open(f"{effect.kind} {effect.name!r}")
        self.admission.enter()
        try:
            retry_at: datetime | None = None
            counted_from = 0
            async with self.saver.lock:
                step = self.recorded(effect)
                if step is None:
                    index = self._run.start_step(effect)
                elif not attempts.replay:
                    index = step["index"]
                    if step["status"] != "running":  # a new pass: its attempts count anew
                        counted_from = step.get("failures", 0)
                    self._run.rerun_step(index)
                else:
                    done, result = settled(step)
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
                execute, attempts = served, replace(attempts, retry=NO_RETRY)
            await self.saver.save_intent()
            if retry_at is not None:
                await self._next_attempt(index, retry_at)
            value = await self._attempts(index, execute, attempts, counted_from)
            try:
                result_json = encode_json(value, f"the result of {effect.kind} {effect.name!r}")
            except (TypeError, KuralleError) as exc:
                if not attempts.journal_errors:
                    raise
                error = StepError(
                    type=type(exc).__name__, message=str(exc), data={"reason": UNRECORDABLE}
                )
                raise await self._record_failure(index, error) from None
            result = json.loads(result_json)

            def succeeded(run: Run) -> None:
                run.finish_step(index, result_json)
                if on_recorded is not None and run is self._run:
                    on_recorded(result)

            await self.saver.save_outcome(
                Outcome(index, succeeded, f"{effect.kind} {effect.name!r}"),
                defer=attempts.defer_result,
            )
            if on_executed is not None:
                on_executed(result)
            return result
        finally:
            self.admission.leave()

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
        self.admission.require_open(f"{effect.kind} {effect.name!r}")
        self.admission.enter()
        try:
            async with self.saver.lock:
                step = self.recorded(effect)
                if step is not None:
                    done, result = settled(step)
                    if done:
                        return result
            served = self._served(effect)
            value = make() if served is None else await served()
            if inspect.isawaitable(value):
                beating = self.saver.heartbeat.enter()
                try:
                    value = await value
                finally:
                    self.saver.heartbeat.leave(beating)
            result_json = encode_json(value, f"the result of {effect.kind} {effect.name!r}")
            result = json.loads(result_json)
            async with self.saver.lock:
                index = self._run.start_step(effect) if step is None else step["index"]
                self._run.finish_step(index, result_json)
                if on_recorded is not None:
                    on_recorded(result)
                if not defer:
                    await self.saver.save_locked()
            return result
        finally:
            self.admission.leave()

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

    def answer_in_doubt(self, index: int, answer: InDoubtAnswer) -> None:
        """Apply a human's answer to a step left running: retry, resolve or fail.

        Only triggers events; they are saved with the delivery that carried them.
        """
        step = self._run.step(index)
        if answer.action == "retry":
            self._run.allow_retry(index)
        elif answer.action == "resolve":
            what = f"the resolved result of {step['kind']} {step['name']!r}"
            self._run.finish_step(index, encode_json(answer.result, what))
        else:
            message = answer.message or "failed by a human after a crash"
            self._run.fail_step(index, StepError(type="InDoubtFailed", message=message, data={}))

    async def _attempts(
        self,
        index: int,
        execute: Callable[[], Awaitable[Any]],
        attempts: Attempts,
        counted_from: int,
    ) -> Any:
        """Execute until an attempt succeeds; a failure the policy retries is
        journaled (the step stays running) and waited out, the last one frozen.

        Failures count from ``counted_from`` (earlier passes of a ``replay=False``
        read do not use up this pass's attempts)."""
        while True:
            beating = self.saver.heartbeat.enter(attempts.heartbeat_for)
            try:
                return await execute()
            except (SuspendError, asyncio.CancelledError):
                raise
            except Exception as exc:
                if not attempts.journal_errors:
                    raise
                error = step_error(exc)
                retry = attempts.retry
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

                await self.saver.save_outcome(Outcome(index, attempt_failed, f"step {index}"))
            finally:
                self.saver.heartbeat.leave(beating)
            await self._next_attempt(index, retry_at)

    async def _next_attempt(self, index: int, retry_at: datetime) -> None:
        """Wait until the next attempt is due (the lease kept by the heartbeat
        meanwhile), then journal its start; a crash before that save resumes
        the wait, never the count."""
        delay = (as_utc(retry_at) - self.now()).total_seconds()
        if delay > 0:
            await self.saver.hold(delay)
        async with self.saver.lock:
            self._run.retry_step(index)
            await self.saver.save_locked()

    async def _record_failure(self, index: int, error: StepError) -> ToolExecutionError:
        await self.saver.save_outcome(
            Outcome(index, lambda run: run.fail_step(index, error), f"step {index}")
        )
        return frozen_error(self._run.step(index))

    async def close(self) -> None:
        """End the turn: no effect is admitted any more, and the saves stop."""
        self.admission.closed = True
        self.saver.close()
