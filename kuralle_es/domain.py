"""The ``Run`` aggregate: a run's journal as domain events.

The domain is pure. Command methods check their preconditions and trigger
events; an event's ``apply`` is the only way a run's state changes. So the
same ``RunState`` comes out whether a run is rebuilt from its events, from a
snapshot, or read from a projection.

Aggregate attributes are plain JSON-friendly data (dicts, lists, strings,
datetimes) so that ``eventsourcing`` snapshots need no custom transcoding.
Every stored topic is explicit (``TOPIC``) so that moving a class never
orphans a journal.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime, timedelta
from typing import Any, NotRequired, TypedDict, cast
from uuid import UUID, uuid5

from eventsourcing.domain import Aggregate

from .errors import InvalidArgumentError, LeaseHeldError
from .models import (
    Message,
    RunState,
    StepError,
    StepRecord,
    WaitingFor,
    messages_from_json,
)
from .usage import normalise_usage
from .waiting import Wait


class StepData(TypedDict):
    """A step as the aggregate holds it (JSON-friendly; ``result_json`` exact)."""

    index: int
    key: str
    kind: str
    name: str
    callsite: int
    logical_run: str
    args: Any
    status: str
    result_json: str | None
    error: dict[str, Any] | None
    started_at: datetime
    finished_at: datetime | None
    retry_allowed: bool
    attempts: int
    #: Failed attempts so far (a retried tool); absent in steps journaled before retries.
    failures: NotRequired[int]
    #: When the next attempt is due, while the step waits between attempts.
    retry_at: NotRequired[datetime | None]


#: How the outcome of a cancelled run begins.
CANCELLED = "cancelled: "
#: How the outcome of a run migrated to its fork begins (``runtime.migrate``).
MIGRATED = "migrated: "


def _slot(logical_run: str, callsite: int) -> str:
    return f"{logical_run}|{callsite}"


class Run(Aggregate):
    """One run of an agent or a flow, with its journal of steps.

    The run holds the steps a resume can replay, not all of them: a new
    turn of a conversation (``TurnStarted``), a flow's move to a node
    (``NodeEntered``) and a drift restart (``FlowPinned``) each start fresh
    callsites, so the steps before them are never looked up again and are
    archived (``archive_steps``): ``steps`` keeps the live ones, from global
    index ``step_base`` on. A load and a snapshot carry only those; the whole
    journal stays in the events, where ``RunStore.load_history`` folds it
    (docs/concepts.md, "What a run holds").
    """

    TOPIC = "kuralle_es:Run"
    #: 2: snapshots carry ``usage``, ``budget`` and ``budget_raises``.
    class_version = 2
    #: Global index of ``steps[0]`` (a class default for snapshots taken before
    #: steps were archived, which hold every step).
    step_base: int = 0
    #: Set on a run folded for its whole journal (``RunStore.load_history``),
    #: never saved: such a run archives nothing.
    keeps_all_steps: bool = False
    #: The version label of the flow definition the run is pinned to
    #: (``define_flow(..., version=)``; a class default for older snapshots).
    flow_version: str | None = None
    #: The id of the fork this run was migrated to (``runtime.migrate``), if any.
    migrated_to: str | None = None

    class Event(Aggregate.Event):
        pass

    class Created(Event, Aggregate.Created):
        TOPIC = "kuralle_es:Run.Created"
        class_version = 2
        session_id: str
        kind: str
        agent: str | None
        flow: str | None
        flow_digest: str | None
        flow_version: str | None

        @staticmethod
        def upcast_v1_v2(state: dict[str, Any]) -> None:
            """Runs created before flows had versions: pinned to no version."""
            state["flow_version"] = None

    def __init__(
        self,
        session_id: str,
        kind: str,
        agent: str | None,
        flow: str | None,
        flow_digest: str | None,
        flow_version: str | None = None,
    ) -> None:
        self.session_id = session_id
        self.kind = kind
        self.status = "running"
        self.active_agent = agent
        self.active_flow = flow
        self.active_node: str | None = None
        self.flow_digest = flow_digest
        self.flow_version = flow_version
        self.migrated_to = None
        self.state: dict[str, Any] = {}
        self.messages: list[dict[str, Any]] = []
        self.waiting_for: dict[str, Any] | None = None
        self.lease_holder: str | None = None
        self.lease_expires_at: datetime | None = None
        self.error: dict[str, Any] | None = None
        self.outcome: str | None = None
        self.output: Any = None
        self.epoch = 0
        self.callsite_base = 0
        self.step_base = 0
        self.steps: list[StepData] = []
        self.slots: dict[str, list[int]] = {}
        self.signal_ids: list[str] = []
        self.turn_keys: dict[str, dict[str, Any]] = {}
        #: The inbound idempotency key of the turn that started last, if any.
        self.turn_key: str | None = None
        #: ``{"run_id": ..., "at_step": ...}`` when this run is a fork of another.
        self.forked_from: dict[str, Any] | None = None
        #: Model calls and tokens by model name, over the run's whole journal
        #: (None: folded from a snapshot older than this count; see ``usage_unknown``).
        self.usage: dict[str, dict[str, int]] | None = {}
        #: The budget given to this run (``runtime.run(..., budget=)``), if any.
        self.budget: dict[str, Any] | None = None
        #: Limits a human raised when approving past the budget.
        self.budget_raises: dict[str, Any] = {}

    @staticmethod
    def upcast_v1_v2(state: dict[str, Any]) -> None:
        """A snapshot taken before usage was counted: its usage is unknown (a budget
        check folds the whole journal once), and no budget was set or raised."""
        state["usage"] = None
        state["budget"] = None
        state["budget_raises"] = {}

    # ------------------------------------------------------------------ ids
    @property
    def run_id(self) -> str:
        return str(self.id)

    # --------------------------------------------------------------- events
    class Forked(Event):
        """This run is a fork of ``from_run_id`` at step ``at_step`` (README: Forking a run)."""

        TOPIC = "kuralle_es:Run.Forked"
        from_run_id: str
        at_step: int

        def apply(self, run: Run) -> None:
            run.forked_from = {"run_id": self.from_run_id, "at_step": self.at_step}

    class TurnStarted(Event):
        """A turn began: a fresh epoch for a conversation's new user input."""

        TOPIC = "kuralle_es:Run.TurnStarted"
        epoch: int
        message: dict[str, Any] | None
        idempotency_key: str | None

        def apply(self, run: Run) -> None:
            run.epoch = self.epoch
            run.status = "running"
            run.error = None
            run.callsite_base = 0
            run.archive_steps()
            run.turn_key = self.idempotency_key
            if self.message is not None:
                run.messages.append(self.message)

    class NodeEntered(Event):
        """The flow moved to ``node`` with ``state``; its effects count from ``callsite_base``."""

        TOPIC = "kuralle_es:Run.NodeEntered"
        flow: str | None
        node: str | None
        state: dict[str, Any]
        callsite_base: int

        def apply(self, run: Run) -> None:
            run.active_flow = self.flow
            run.active_node = self.node
            run.state = self.state
            run.callsite_base = self.callsite_base
            run.archive_steps()

    class StepStarted(Event):
        """Intent: an effect is about to run at ``callsite`` with ``key``.

        ``batch`` is the callsite of the first effect of the parallel batch
        this one belongs to (one ``gather`` of effects, or one model turn's
        parallel-safe tool calls), or None for an effect requested alone; it is
        recorded when requested, so every backend agrees on it (a fork never
        starts inside a batch).
        """

        TOPIC = "kuralle_es:Run.StepStarted"
        class_version = 2
        index: int
        key: str
        kind: str
        name: str
        callsite: int
        logical_run: str
        args: Any
        batch: int | None

        @staticmethod
        def upcast_v1_v2(state: dict[str, Any]) -> None:
            """Intents stored before batches were recorded: not known to be in one."""
            state["batch"] = None

        def apply(self, run: Run) -> None:
            run.steps.append(
                StepData(
                    index=self.index,
                    key=self.key,
                    kind=self.kind,
                    name=self.name,
                    callsite=self.callsite,
                    logical_run=self.logical_run,
                    args=self.args,
                    status="running",
                    result_json=None,
                    error=None,
                    started_at=self.timestamp,
                    finished_at=None,
                    retry_allowed=False,
                    attempts=1,
                    failures=0,
                    retry_at=None,
                )
            )
            run.slots.setdefault(_slot(self.logical_run, self.callsite), []).append(self.index)
            if self.kind == "model":
                run.count_model_call(self.name)

    class StepFinished(Event):
        TOPIC = "kuralle_es:Run.StepFinished"
        index: int
        result_json: str

        def apply(self, run: Run) -> None:
            step = run.step(self.index)
            step["status"] = "finished"
            step["result_json"] = self.result_json
            step["error"] = None
            step["finished_at"] = self.timestamp
            if step["kind"] == "model":
                run.count_model_tokens(step["name"], self.result_json)

    class StepFailed(Event):
        TOPIC = "kuralle_es:Run.StepFailed"
        index: int
        error: dict[str, Any]

        def apply(self, run: Run) -> None:
            step = run.step(self.index)
            step["status"] = "error"
            step["error"] = self.error
            step["finished_at"] = self.timestamp

    class StepAttemptFailed(Event):
        """An attempt failed and the tool's retry policy allows another (same key).

        The step stays ``running`` with this error until the next attempt,
        due at ``retry_at``; a resume then is not in doubt: it waits until
        ``retry_at`` and starts that attempt.
        """

        TOPIC = "kuralle_es:Run.StepAttemptFailed"
        index: int
        error: dict[str, Any]
        retry_at: datetime

        def apply(self, run: Run) -> None:
            step = run.step(self.index)
            step["error"] = self.error
            step["failures"] = step.get("failures", 0) + 1
            step["retry_at"] = self.retry_at

    class StepRetryAllowed(Event):
        """A human answered an in-doubt step with "retry": execute it again, same key."""

        TOPIC = "kuralle_es:Run.StepRetryAllowed"
        index: int

        def apply(self, run: Run) -> None:
            run.step(self.index)["retry_allowed"] = True

    class StepRetried(Event):
        """A step left running by a crash is executed again (same key).

        Saved before the new attempt, it uses up a human's "retry" answer: if
        this attempt dies too, the next resume asks again.
        """

        TOPIC = "kuralle_es:Run.StepRetried"
        index: int

        def apply(self, run: Run) -> None:
            step = run.step(self.index)
            if step["kind"] == "model":
                run.count_model_call(step["name"])
            step["retry_allowed"] = False
            step["attempts"] += 1
            step["retry_at"] = None
            # A read that is never replayed (``replay=False``) runs again on
            # the same step: it is running once more until this pass records.
            step["status"] = "running"
            step["finished_at"] = None

    class MessageAppended(Event):
        TOPIC = "kuralle_es:Run.MessageAppended"
        message: dict[str, Any]

        def apply(self, run: Run) -> None:
            run.messages.append(self.message)

    class Paused(Event):
        TOPIC = "kuralle_es:Run.Paused"
        waiting_for: dict[str, Any]

        def apply(self, run: Run) -> None:
            run.status = "paused"
            run.waiting_for = self.waiting_for

    class InputAccepted(Event):
        """New user input for a run that waited for it (a ``collect`` node)."""

        TOPIC = "kuralle_es:Run.InputAccepted"
        message: dict[str, Any]

        def apply(self, run: Run) -> None:
            run.messages.append(self.message)
            run.waiting_for = None
            run.status = "running"

    class FlowPinned(Event):
        """The run's flow restarts from ``node`` under a new definition."""

        TOPIC = "kuralle_es:Run.FlowPinned"
        class_version = 2
        flow: str
        flow_digest: str
        node: str
        flow_version: str | None

        @staticmethod
        def upcast_v1_v2(state: dict[str, Any]) -> None:
            """Pins stored before flows had versions: no version."""
            state["flow_version"] = None

        def apply(self, run: Run) -> None:
            run.active_flow = self.flow
            run.flow_digest = self.flow_digest
            run.flow_version = self.flow_version
            run.active_node = self.node
            run.state = {}
            run.callsite_base = 0
            run.archive_steps()
            run.status = "running"
            run.waiting_for = None
            run.error = None

    class SignalAccepted(Event):
        """A delivered signal passed every check; the run may re-execute."""

        TOPIC = "kuralle_es:Run.SignalAccepted"
        signal_id: str
        name: str
        payload: Any
        actor: str | None

        def apply(self, run: Run) -> None:
            run.signal_ids.append(self.signal_id)
            run.waiting_for = None
            run.status = "running"

    class Finished(Event):
        TOPIC = "kuralle_es:Run.Finished"
        outcome: str | None
        output: Any
        agent: str | None
        state: dict[str, Any]

        def apply(self, run: Run) -> None:
            run.status = "finished"
            run.state = self.state
            run.outcome = self.outcome
            run.output = self.output
            run.active_agent = self.agent
            run.active_flow = None
            run.active_node = None
            run.waiting_for = None

    class Errored(Event):
        TOPIC = "kuralle_es:Run.Errored"
        error: dict[str, Any]

        def apply(self, run: Run) -> None:
            run.status = "error"
            run.error = self.error

    class Resumed(Event):
        """A run that had failed is driven again (after a fix or a transient fault)."""

        TOPIC = "kuralle_es:Run.Resumed"

        def apply(self, run: Run) -> None:
            run.status = "running"
            run.error = None

    class TimerFired(Event):
        """A durable sleep's wake time came: a sweeper wakes the run paused on it."""

        TOPIC = "kuralle_es:Run.TimerFired"
        request_id: str

        def apply(self, run: Run) -> None:
            run.status = "running"
            run.waiting_for = None

    class Recovered(Event):
        """A worker takes over a run whose previous worker's lease expired mid-turn."""

        TOPIC = "kuralle_es:Run.Recovered"
        previous_holder: str | None

        def apply(self, run: Run) -> None:
            run.status = "running"

    class Migrated(Event):
        """The run was forked at ``at_step`` onto the flow's newest definition as
        run ``to_run_id`` (``runtime.migrate``); saved with its ``Aborted``."""

        TOPIC = "kuralle_es:Run.Migrated"
        to_run_id: str
        at_step: int

        def apply(self, run: Run) -> None:
            run.migrated_to = self.to_run_id

    class Aborted(Event):
        TOPIC = "kuralle_es:Run.Aborted"
        reason: str

        def apply(self, run: Run) -> None:
            run.status = "aborted"
            run.outcome = self.reason
            run.waiting_for = None

    class TurnRecorded(Event):
        """The result of a turn started with an inbound idempotency key."""

        TOPIC = "kuralle_es:Run.TurnRecorded"
        idempotency_key: str
        result: dict[str, Any]

        def apply(self, run: Run) -> None:
            run.turn_keys[self.idempotency_key] = self.result

    class BudgetSet(Event):
        """The budget a caller gave this run (``runtime.run(..., budget=)``)."""

        TOPIC = "kuralle_es:Run.BudgetSet"
        budget: dict[str, Any] | None

        def apply(self, run: Run) -> None:
            run.budget = self.budget

    class BudgetRaised(Event):
        """A human approved spending past the budget and raised these limits."""

        TOPIC = "kuralle_es:Run.BudgetRaised"
        raise_to: dict[str, Any]

        def apply(self, run: Run) -> None:
            run.budget_raises = {**run.budget_raises, **self.raise_to}

    class LeaseTaken(Event):
        TOPIC = "kuralle_es:Run.LeaseTaken"
        holder: str
        expires_at: datetime

        def apply(self, run: Run) -> None:
            run.lease_holder = self.holder
            run.lease_expires_at = self.expires_at

    class LeaseReleased(Event):
        TOPIC = "kuralle_es:Run.LeaseReleased"

        def apply(self, run: Run) -> None:
            run.lease_holder = None
            run.lease_expires_at = None

    # ------------------------------------------------------------- commands
    def start_turn(self, epoch: int, message: Message | None, idempotency_key: str | None) -> None:
        self.trigger_event(
            self.TurnStarted,
            epoch=epoch,
            message=message.model_dump(exclude_none=True) if message else None,
            idempotency_key=idempotency_key,
        )

    def enter_node(
        self, flow: str | None, node: str | None, state: dict[str, Any], callsite_base: int
    ) -> None:
        self.trigger_event(
            self.NodeEntered,
            flow=flow,
            node=node,
            state=copy.deepcopy(state),
            callsite_base=callsite_base,
        )

    def start_step(
        self,
        *,
        key: str,
        kind: str,
        name: str,
        callsite: int,
        logical_run: str,
        args: Any,
        batch: int | None = None,
    ) -> int:
        """Append an intent; returns the new step's index."""
        self._require_status("running", "start a step")
        index = self.step_count
        self.trigger_event(
            self.StepStarted,
            index=index,
            key=key,
            kind=kind,
            name=name,
            callsite=callsite,
            logical_run=logical_run,
            args=args,
            batch=batch,
        )
        return index

    def finish_step(self, index: int, result_json: str) -> None:
        self._require_step_running(index)
        self.trigger_event(self.StepFinished, index=index, result_json=result_json)

    def fail_step(self, index: int, error: StepError) -> None:
        self._require_step_running(index)
        self.trigger_event(self.StepFailed, index=index, error=error.model_dump())

    def fail_attempt(self, index: int, error: StepError, retry_at: datetime) -> None:
        """Journal a failed attempt that will be retried at ``retry_at``."""
        self._require_step_running(index)
        self.trigger_event(
            self.StepAttemptFailed, index=index, error=error.model_dump(), retry_at=retry_at
        )

    def append_message(self, message: Message) -> None:
        self.trigger_event(self.MessageAppended, message=message.model_dump(exclude_none=True))

    def pause(self, wait: Wait) -> None:
        """Pause on ``wait`` (stored as its JSON, the public fields first-class)."""
        self.trigger_event(self.Paused, waiting_for=wait.to_json())

    def accept_signal(self, signal_id: str, name: str, payload: Any, actor: str | None) -> None:
        self._require_status("paused", "accept a signal")
        self.trigger_event(
            self.SignalAccepted, signal_id=signal_id, name=name, payload=payload, actor=actor
        )

    def accept_input(self, message: Message) -> None:
        self._require_status("paused", "accept input")
        self.trigger_event(self.InputAccepted, message=message.model_dump(exclude_none=True))

    def repin_flow(
        self, flow: str, flow_digest: str, node: str, flow_version: str | None = None
    ) -> None:
        self.trigger_event(
            self.FlowPinned,
            flow=flow,
            flow_digest=flow_digest,
            node=node,
            flow_version=flow_version,
        )

    def retry_step(self, index: int) -> None:
        """Execute a step left running by a crash again, with its key."""
        self._require_step_running(index)
        self.trigger_event(self.StepRetried, index=index)

    def rerun_step(self, index: int) -> None:
        """Start a settled step again on the same record (a ``replay=False`` read)."""
        self._require_status("running", "re-run a step")
        self.trigger_event(self.StepRetried, index=index)

    def allow_retry(self, index: int) -> None:
        self._require_step_running(index)
        self.trigger_event(self.StepRetryAllowed, index=index)

    def finish(
        self, outcome: str | None, output: Any, agent: str | None, state: dict[str, Any]
    ) -> None:
        self.trigger_event(
            self.Finished,
            outcome=outcome,
            output=output,
            agent=agent,
            state=copy.deepcopy(state),
        )

    def fail(self, error: StepError) -> None:
        self.trigger_event(self.Errored, error=error.model_dump())

    def resume(self) -> None:
        if self.status == "error":
            self.trigger_event(self.Resumed)

    def abort(self, reason: str) -> None:
        self.trigger_event(self.Aborted, reason=reason)

    def fire_timer(self, request_id: str) -> None:
        """Wake the run from the durable sleep it is paused on (that wait only)."""
        wait = self.waiting
        if self.status != "paused" or wait is None or wait.kind != "timer":
            msg = f"cannot fire a timer: run {self.run_id} is {self.status} on no timer"
            raise InvalidArgumentError(msg)
        if wait.request_id != request_id:
            msg = f"cannot fire timer {request_id!r}: run {self.run_id} sleeps on another"
            raise InvalidArgumentError(msg)
        self.trigger_event(self.TimerFired, request_id=request_id)

    def recover(self, previous_holder: str | None) -> None:
        """Record that this turn takes the run over from a worker that is gone."""
        self._require_status("running", "recover the run")
        self.trigger_event(self.Recovered, previous_holder=previous_holder)

    def mark_forked(self, from_run_id: str, at_step: int) -> None:
        self.trigger_event(self.Forked, from_run_id=from_run_id, at_step=at_step)

    def migrate(self, to_run_id: str, at_step: int) -> bool:
        """Record that this run moved to its fork ``to_run_id`` and stop it for good
        (``aborted``, outcome ``"migrated: <to_run_id>"``, lease released).
        Returns False (nothing triggered) when it already records that move; an
        aborted run only records it; a finished run is refused.
        """
        if self.migrated_to == to_run_id:
            return False
        if self.migrated_to is not None:
            msg = f"run {self.run_id} was already migrated to run {self.migrated_to}"
            raise InvalidArgumentError(msg)
        if self.status == "finished":
            msg = (
                f"run {self.run_id} finished (outcome {self.outcome!r}) before its "
                f"migration to run {to_run_id} completed; there is nothing to migrate"
            )
            raise InvalidArgumentError(msg)
        self.trigger_event(self.Migrated, to_run_id=to_run_id, at_step=at_step)
        if self.status != "aborted":
            self.abort(f"{MIGRATED}{to_run_id}")
        self.release_lease()
        return True

    def copy_event(self, event_class: type[Run.Event], fields: dict[str, Any]) -> None:
        """Append an event copied from another run's history (a fork's opening)."""
        self.trigger_event(event_class, **fields)

    def cancel(self, reason: str) -> bool:
        """Stop the run for good (a flow: ``aborted``) or end its current turn (a
        conversation: ``finished``), outcome ``"cancelled: <reason>"``, whoever
        holds the lease. Returns False (nothing triggered) when it already is
        cancelled or aborted; a finished run has nothing to cancel
        (``InvalidArgumentError``).
        """
        outcome = f"{CANCELLED}{reason}"
        if self.status == "aborted" or (
            self.status == "finished" and (self.outcome or "").startswith(CANCELLED)
        ):
            return False
        if self.status == "finished":
            msg = (
                f"run {self.run_id} is finished (outcome {self.outcome!r}); "
                "there is nothing to cancel"
            )
            raise InvalidArgumentError(msg)
        if self.kind == "conversation":
            # The conversation stays usable: the next user message opens a new epoch.
            self.finish(outcome, None, self.active_agent, self.state)
        else:
            self.abort(outcome)
        self.release_lease()
        return True

    def record_turn(self, idempotency_key: str, result: dict[str, Any]) -> None:
        self.trigger_event(self.TurnRecorded, idempotency_key=idempotency_key, result=result)

    def set_budget(self, budget: dict[str, Any] | None) -> None:
        """Give the run its own budget (replacing the agent's), from now on."""
        if budget != self.budget:
            self.trigger_event(self.BudgetSet, budget=budget)

    def raise_budget(self, raise_to: dict[str, Any]) -> None:
        self.trigger_event(self.BudgetRaised, raise_to=raise_to)

    def count_model_call(self, model: str) -> None:
        """One more attempt of a call to ``model`` (folded from the step events)."""
        if self.usage is not None:
            self.usage.setdefault(model, _no_usage())["calls"] += 1

    def count_model_tokens(self, model: str, result_json: str) -> None:
        """Add the tokens a finished call to ``model`` reported."""
        if self.usage is None:
            return
        response = json.loads(result_json)
        reported = normalise_usage(response.get("usage") if isinstance(response, dict) else None)
        if reported is None:
            return
        tally = self.usage.setdefault(model, _no_usage())
        for field, count in reported.items():
            tally[field] += count or 0

    def take_lease(self, holder: str, expires_at: datetime) -> None:
        self.trigger_event(self.LeaseTaken, holder=holder, expires_at=expires_at)

    def release_lease(self) -> None:
        if self.lease_holder is not None:
            self.trigger_event(self.LeaseReleased)

    @property
    def snapshot_weight(self) -> int:
        """About how many events replaying would cost as much as loading this
        state: a live step is about an event's worth; messages and recorded
        turns are small and decode in bulk, about sixteen to an event
        (``RunStore`` spaces snapshots by it; benchmarks/long_conversations.py)."""
        return len(self.steps) + (len(self.messages) + len(self.turn_keys)) // 16

    # ----------------------------------------------------------------- steps
    def archive_steps(self) -> None:
        """Drop the live steps from the run's state: what follows starts fresh
        callsites, so none of them is replayed again (their events stay)."""
        if self.keeps_all_steps:
            return
        self.step_base += len(self.steps)
        self.steps = []
        self.slots = {}

    def step(self, index: int) -> StepData:
        """The live step with this global index."""
        return self.steps[index - self.step_base]

    @property
    def step_count(self) -> int:
        """How many steps the run has journaled, archived ones included."""
        return self.step_base + len(self.steps)

    # -------------------------------------------------------------- queries
    def steps_at(self, logical_run: str, callsite: int) -> list[StepData]:
        """Every step journaled at this callsite of this logical run, oldest first."""
        base = self.step_base
        return [self.steps[i - base] for i in self.slots.get(_slot(logical_run, callsite), [])]

    @property
    def waiting(self) -> Wait | None:
        """What the run waits for, typed (None unless paused on something)."""
        return Wait.from_json(self.waiting_for) if self.waiting_for else None

    def lease_is_live(self, now: datetime) -> bool:
        return self.lease_expires_at is not None and self.lease_expires_at > now

    def require_lease_free(self, holder: str, now: datetime) -> None:
        """Refuse a worker other than the holder of a live lease (``LeaseHeldError``)."""
        if (
            self.lease_holder is not None
            and self.lease_expires_at is not None
            and self.lease_holder != holder
            and self.lease_is_live(now)
        ):
            raise LeaseHeldError(self.run_id, self.lease_holder, self.lease_expires_at)

    def lease_needs_renewal(self, now: datetime, ttl: timedelta) -> bool:
        return self.lease_expires_at is None or self.lease_expires_at - now < ttl / 2

    def public_wait(self) -> WaitingFor | None:
        """The run's ``waiting_for``, without building the whole state (its messages)."""
        return WaitingFor.model_validate(self.waiting_for) if self.waiting_for else None

    def to_state(self) -> RunState:
        return RunState(
            run_id=self.run_id,
            session_id=self.session_id,
            kind=cast(Any, self.kind),
            status=cast(Any, self.status),
            active_agent=self.active_agent,
            active_flow=self.active_flow,
            active_node=self.active_node,
            state=copy.deepcopy(self.state),
            messages=messages_from_json(self.messages),
            waiting_for=self.public_wait(),
            flow_digest=self.flow_digest,
            flow_version=self.flow_version,
            lease_holder=self.lease_holder,
            lease_expires_at=self.lease_expires_at,
            version=self.version,
            step_count=self.step_count,
            created_at=self.created_on,
            updated_at=self.modified_on,
            error=StepError.model_validate(self.error) if self.error else None,
            outcome=self.outcome,
            # Snapshots taken before forks existed lack the attribute.
            forked_from=copy.deepcopy(getattr(self, "forked_from", None)),
            migrated_to=self.migrated_to,
        )

    def step_records(self) -> list[StepRecord]:
        """The steps the run holds: every one on a run from ``RunStore.load_history``,
        the live ones (from ``step_base``) on any other."""
        return [step_record(s) for s in self.steps]

    # -------------------------------------------------------------- helpers
    def _require_status(self, status: str, doing: str) -> None:
        if self.status != status:
            msg = f"cannot {doing}: run {self.run_id} is {self.status}, not {status}"
            raise InvalidArgumentError(msg)

    def _require_step_running(self, index: int) -> None:
        status = self.step(index)["status"]
        if status != "running":
            msg = f"step {index} of run {self.run_id} is already {status}"
            raise InvalidArgumentError(msg)


def _no_usage() -> dict[str, int]:
    return {"calls": 0, "input_tokens": 0, "output_tokens": 0, "total_tokens": 0}


def step_record(step: StepData) -> StepRecord:
    result_json = step["result_json"]
    return StepRecord(
        index=step["index"],
        key=step["key"],
        kind=cast(Any, step["kind"]),
        name=step["name"],
        callsite=step["callsite"],
        status=cast(Any, step["status"]),
        result=json.loads(result_json) if result_json is not None else None,
        error=StepError.model_validate(step["error"]) if step["error"] else None,
        started_at=step["started_at"],
        finished_at=step["finished_at"],
        attempts=step["attempts"],
    )


def new_run(
    run_id: UUID,
    session_id: str,
    kind: str,
    agent: str | None,
    flow: str | None,
    flow_digest: str | None,
    flow_version: str | None = None,
) -> Run:
    return Run._create(
        Run.Created,
        id=run_id,
        session_id=session_id,
        kind=kind,
        agent=agent,
        flow=flow,
        flow_digest=flow_digest,
        flow_version=flow_version,
    )


#: Namespace of the deterministic ids of per-session aggregates.
SESSION_NAMESPACE = UUID("0b6f7a52-6c1e-4f0e-9d5e-6b1f0c7d2a41")


class SessionRuns(Aggregate):
    """The runs of one session, so a delivery without ``run_id`` can find its run.

    Its id is derived from the session id, and it is saved in the same
    transaction as each run it lists: a run is never orphaned from its session.
    """

    TOPIC = "kuralle_es:SessionRuns"

    class Event(Aggregate.Event):
        pass

    class Created(Event, Aggregate.Created):
        TOPIC = "kuralle_es:SessionRuns.Created"
        session_id: str

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.run_ids: list[str] = []

    class RunAdded(Event):
        TOPIC = "kuralle_es:SessionRuns.RunAdded"
        run_id: str

        def apply(self, index: SessionRuns) -> None:
            index.run_ids.append(self.run_id)

    @property
    def snapshot_weight(self) -> int:
        """About how many events replaying would cost as much as loading the list."""
        return len(self.run_ids) // 8

    def add_run(self, run_id: str) -> None:
        if run_id not in self.run_ids:
            self.trigger_event(self.RunAdded, run_id=run_id)


def session_runs_id(session_id: str) -> UUID:
    return uuid5(SESSION_NAMESPACE, session_id)


def new_session_runs(session_id: str) -> SessionRuns:
    return SessionRuns._create(
        SessionRuns.Created, id=session_runs_id(session_id), session_id=session_id
    )
