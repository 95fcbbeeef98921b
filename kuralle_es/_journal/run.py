"""The ``Run`` aggregate: a run's journal folded into its state (internal).

The domain is pure. Command methods check their preconditions and trigger
events of the catalogue (``catalogue``); ``Run.fold`` is the only way a
run's state changes, one exhaustive dispatch over the catalogue (``_FOLD``).
So the same ``RunState`` comes out whether a run is rebuilt from its events,
from a snapshot, or read from a projection.

Aggregate attributes are plain JSON-friendly data (dicts, lists, strings,
datetimes) so that ``eventsourcing`` snapshots need no custom transcoding. A
change to what a snapshot holds raises ``Run.class_version`` and adds an
upcaster, so snapshots stored by earlier releases keep loading.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NotRequired, TypedDict
from uuid import UUID

from eventsourcing.domain import Aggregate

from ..errors import InvalidArgumentError
from ..redaction import Redacted
from ..shapes import (
    Message,
    RunKind,
    RunState,
    RunStatus,
    StepError,
    StepKind,
    StepRecord,
    StepStatus,
    WaitingFor,
    messages_from_json,
)
from . import catalogue as stored
from .json_data import encode_json
from .leases import Lease, store_now
from .sites import Effect, Lane, Site
from .spending import result_usage
from .wait import Wait

__all__ = ["MIGRATED", "ParentLink", "Run", "StepData", "step_record"]


class StepData(TypedDict):
    """A step as the aggregate holds it (JSON-friendly; ``result_json`` exact)."""

    index: int
    key: str
    kind: StepKind
    name: str
    callsite: int
    args: Any
    status: StepStatus
    result_json: str | None
    error: dict[str, Any] | None
    started_at: datetime
    finished_at: datetime | None
    retry_allowed: bool
    attempts: int
    #: Failed attempts so far (a retried tool).
    failures: int
    #: When the next attempt is due, while the step waits between attempts.
    retry_at: datetime | None
    #: Held by snapshots of 0.1.0 (the logical run with its lane); never read.
    logical_run: NotRequired[str]


@dataclass(frozen=True)
class ParentLink:
    """Where a child run comes from: the run that started it (and its session), and
    the index of that run's step that did (docs/child-runs.md)."""

    run_id: str
    session_id: str
    step: int


#: How the outcome of a cancelled run begins.
CANCELLED = "cancelled: "
#: How the outcome of a run migrated to its fork begins (``runtime.migrate``).
MIGRATED = "migrated: "


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

    #: Its events are the catalogue's (``eventsourcing`` looks them up here).
    Event = stored.Event
    Created = stored.RunCreated
    TOPIC = "kuralle_es:Run"
    #: 2: usage, budget and budget raises; delivered signal ids as a mapping
    #: (membership in O(1)); the fields older snapshots lacked, set.
    #: 3: every inbound idempotency key seen, with the digest of its request.
    #: 4: the mailbox (unread messages, every message id seen) and published values;
    #: a typed flow's input, a child run's parent, a run's children.
    class_version = 4
    #: Set on a run folded for its whole journal (``RunStore.load_history``),
    #: never saved: such a run archives nothing.
    keeps_all_steps: bool = False
    #: The run's data subject when it is not its session id (``SubjectAssigned``).
    #: A class default, not a snapshot field of its own: a snapshot of an earlier
    #: release lacks it and reads this, as a run without the event does.
    subject: str | None = None
    #: What of a snapshot is payload, sealed under the subject's key like the
    #: events' (``catalogue``'s ``PAYLOAD``; docs/privacy.md).
    PAYLOAD = (
        "state",
        "messages",
        "waiting_for",
        "steps",
        "output",
        "error",
        "turn_keys",
        "mailbox",
        "published",
        "input",
    )

    def __init__(
        self,
        id: UUID,
        session_id: str,
        kind: RunKind,
        agent: str | None,
        flow: str | None,
        flow_digest: str | None,
        flow_version: str | None = None,
    ) -> None:
        """A new run is made by calling ``Run(id, ...)`` with these fields: ``eventsourcing``
        triggers its ``RunCreated`` (with ``id``, which ``Aggregate`` keeps) and calls
        this with the event's fields, as it does when the run is loaded again."""
        self.session_id = session_id
        self.kind: RunKind = kind
        self.status: RunStatus = "running"
        self.active_agent = agent
        self.active_flow = flow
        self.active_node: str | None = None
        self.flow_digest = flow_digest
        #: The version label of the flow definition the run is pinned to.
        self.flow_version = flow_version
        #: The id of the fork this run was migrated to (``runtime.migrate``), if any.
        self.migrated_to: str | None = None
        self.state: dict[str, Any] = {}
        self.messages: list[dict[str, Any]] = []
        self.waiting_for: dict[str, Any] | None = None
        #: The lease a journal of 0.1.0 recorded (``LeaseTaken``); leases are records now.
        self.lease_holder: str | None = None
        self.lease_expires_at: datetime | None = None
        self.error: dict[str, Any] | None = None
        self.outcome: str | None = None
        self.output: Any = None
        self.epoch = 0
        self.callsite_base = 0
        #: Global index of ``steps[0]``.
        self.step_base = 0
        self.steps: list[StepData] = []
        self.slots: dict[str, list[int]] = {}
        #: Every ``signal_id`` delivered to the run (the values mean nothing).
        self.signal_ids: dict[str, None] = {}
        self.turn_keys: dict[str, dict[str, Any]] = {}
        #: The inbound idempotency key of the turn that started last, if any.
        self.turn_key: str | None = None
        #: Every inbound idempotency key a call opened a turn with, and the digest of
        #: its request (None: recorded by a release that kept no digest).
        self.inbound_keys: dict[str, str | None] = {}
        #: ``{"run_id": ..., "at_step": ...}`` when this run is a fork of another.
        self.forked_from: dict[str, Any] | None = None
        #: Model calls and tokens by model name, over the run's whole journal
        #: (None: folded from a snapshot older than this count).
        self.usage: dict[str, dict[str, int]] | None = {}
        #: The budget given to this run (``runtime.run(..., budget=)``), if any.
        self.budget: dict[str, Any] | None = None
        #: Limits a human raised when approving past the budget.
        self.budget_raises: dict[str, Any] = {}
        #: Messages sent to the run and not received yet, oldest first (docs/messages.md).
        self.mailbox: list[dict[str, Any]] = []
        #: Every ``message_id`` that arrived (the values mean nothing): a resend is a no-op.
        self.mail_ids: dict[str, None] = {}
        #: The latest value published under each key (``ctx.publish``), as journaled JSON.
        self.published: dict[str, str] = {}
        #: The validated input of a typed flow's start, as JSON data (``ctx.input``).
        self.input: dict[str, Any] | None = None
        #: ``{"run_id", "session_id", "step"}`` of the run that started this one.
        self.parent: dict[str, Any] | None = None
        #: The ids of the child runs this run started, in order (from their steps).
        self.children: list[str] = []

    @staticmethod
    def upcast_v1_v2(state: dict[str, Any]) -> None:
        """A snapshot of 0.1.0 (or earlier): its usage is unknown (a budget check
        folds the whole journal once), no budget was set or raised, signal ids
        become a mapping, and what snapshots before 0.1.0 lacked is set."""
        state["usage"] = None
        state["budget"] = None
        state["budget_raises"] = {}
        state["signal_ids"] = dict.fromkeys(state.get("signal_ids", ()))
        state.setdefault("step_base", 0)
        state.setdefault("forked_from", None)
        state.setdefault("flow_version", None)
        state.setdefault("migrated_to", None)
        for step in state.get("steps", ()):
            step.setdefault("failures", 0)
            step.setdefault("retry_at", None)

    @staticmethod
    def upcast_v2_v3(state: dict[str, Any]) -> None:
        """A snapshot before inbound keys were kept: the keys it knew (its recorded
        turns and its last turn's key) are seen, with no digest to compare."""
        keys = [*state.get("turn_keys", {}), state.get("turn_key")]
        state["inbound_keys"] = {key: None for key in keys if key}

    @staticmethod
    def upcast_v3_v4(state: dict[str, Any]) -> None:
        """A snapshot before mailboxes, published values, typed input and child
        runs: a run with none of them (no release before them had any)."""
        state["mailbox"] = []
        state["mail_ids"] = {}
        state["published"] = {}
        state["input"] = None
        state["parent"] = None
        state["children"] = []

    # ------------------------------------------------------------------ ids
    @property
    def run_id(self) -> str:
        return str(self.id)

    @property
    def cancelled(self) -> bool:
        """Whether the run was cancelled (``cancel``): a flow aborted, or a
        conversation's turn ended, with the outcome ``"cancelled: <reason>"``."""
        return (self.outcome or "").startswith(CANCELLED)

    @property
    def data_subject(self) -> str:
        """Whose data the run holds: the subject it was given, else its session."""
        return self.subject if self.subject is not None else self.session_id

    @classmethod
    def new(
        cls,
        id: UUID,
        session_id: str,
        kind: RunKind,
        agent: str | None,
        flow: str | None,
        flow_digest: str | None,
        flow_version: str | None = None,
        *,
        subject: str | None = None,
    ) -> Run:
        """A new run (``Run(...)``) whose data subject, when it is not its session, is
        recorded with its creation (``SubjectAssigned``, saved in its first save)."""
        run = cls(id, session_id, kind, agent, flow, flow_digest, flow_version)
        if subject is not None and subject != session_id:
            run.trigger_event(stored.SubjectAssigned, subject=subject)
        return run

    # ----------------------------------------------------------------- fold
    def fold(self, event: stored.Event) -> None:
        """Apply one stored event: the only way a run's state changes (an event
        class this version does not know is kept in the journal, not folded)."""
        handler = _FOLD.get(type(event))
        if handler is not None:
            handler(self, event)

    # ------------------------------------------------------------- commands
    def start_turn(self, epoch: int, message: Message | None, idempotency_key: str | None) -> None:
        self.trigger_event(
            stored.TurnStarted,
            epoch=epoch,
            message=message.model_dump(exclude_none=True) if message else None,
            idempotency_key=idempotency_key,
        )

    def enter_node(
        self, flow: str | None, node: str | None, state: dict[str, Any], callsite_base: int
    ) -> None:
        encode_json(state, f"the state bag at node {node!r}")
        self.trigger_event(
            stored.NodeEntered,
            flow=flow,
            node=node,
            state=copy.deepcopy(state),
            callsite_base=callsite_base,
        )

    def start_step(self, effect: Effect) -> int:
        """Append the intent of ``effect``, at its site; returns the new step's index."""
        self._require_status("running", "start a step")
        index = self.step_count
        site = effect.site
        self.trigger_event(
            stored.StepIntended,
            index=index,
            key=effect.key,
            kind=effect.kind,
            name=effect.name,
            callsite=site.callsite,
            logical_run=site.logical_run,
            lane=site.lane.value,
            args=effect.args,
            batch=site.batch,
        )
        return index

    def finish_step(self, index: int, result_json: str) -> None:
        self._require_step_running(index)
        self.trigger_event(stored.StepSucceeded, index=index, result_json=result_json)

    def fail_step(self, index: int, error: StepError) -> None:
        self._require_step_running(index)
        self.trigger_event(stored.StepErrored, index=index, error=error.model_dump())

    def fail_attempt(self, index: int, error: StepError, retry_at: datetime) -> None:
        """Journal a failed attempt that will be retried at ``retry_at``."""
        self._require_step_running(index)
        self.trigger_event(
            stored.AttemptFailed, index=index, error=error.model_dump(), retry_at=retry_at
        )

    def append_message(self, message: Message) -> None:
        dumped = message.model_dump(exclude_none=True)
        encode_json(dumped, f"a {message.role} message")
        self.trigger_event(stored.MessageAppended, message=dumped)

    def pause(self, wait: Wait) -> None:
        """Pause on ``wait`` (stored as its JSON, the public fields first-class)."""
        waiting_for = wait.to_json()
        encode_json(waiting_for, f"the wait for {wait.name!r}")
        self.trigger_event(stored.Paused, waiting_for=waiting_for)

    def accept_signal(self, signal_id: str, name: str, payload: Any, actor: str | None) -> None:
        self._require_status("paused", "accept a signal")
        self.trigger_event(
            stored.DeliveryAccepted, signal_id=signal_id, name=name, payload=payload, actor=actor
        )

    def accept_input(self, message: Message) -> None:
        self._require_status("paused", "accept input")
        self.trigger_event(stored.InputAccepted, message=message.model_dump(exclude_none=True))

    def repin_flow(self, flow: str, flow_digest: str, node: str, flow_version: str | None) -> None:
        """Restart ``flow`` from ``node`` under the definition ``flow_digest`` names; its
        version label is said every time (None: a definition without one), never left out."""
        self.trigger_event(
            stored.FlowPinned,
            flow=flow,
            flow_digest=flow_digest,
            node=node,
            flow_version=flow_version,
        )

    def retry_step(self, index: int) -> None:
        """Execute a step left running by a crash again, with its key."""
        self._require_step_running(index)
        self.trigger_event(stored.AttemptStarted, index=index)

    def rerun_step(self, index: int) -> None:
        """Start a settled step again on the same record (a ``replay=False`` read)."""
        self._require_status("running", "re-run a step")
        self.trigger_event(stored.AttemptStarted, index=index)

    def allow_retry(self, index: int) -> None:
        self._require_step_running(index)
        self.trigger_event(stored.RetryAllowed, index=index)

    def finish(
        self, outcome: str | None, output: Any, agent: str | None, state: dict[str, Any]
    ) -> None:
        """End the run; refused (``UnrecordableValueError``, nothing triggered) when its
        outcome, output or state bag cannot be journaled."""
        encode_json(outcome, "the run's end reason")
        encode_json(output, "the run's output")
        encode_json(state, "the run's state bag")
        self.trigger_event(
            stored.Finished,
            outcome=outcome,
            output=output,
            agent=agent,
            state=copy.deepcopy(state),
        )

    def fail(self, error: StepError) -> None:
        self.trigger_event(stored.Errored, error=error.model_dump())

    def resume(self) -> None:
        if self.status == "error":
            self.trigger_event(stored.Resumed)

    def abort(self, reason: str) -> None:
        encode_json(reason, "the outcome of an aborted run")
        self.trigger_event(stored.Aborted, reason=reason)

    def fire_timer(self, request_id: str) -> None:
        """Wake the run from the durable sleep it is paused on (that wait only)."""
        wait = self.waiting
        if self.status != "paused" or wait is None or wait.kind != "timer":
            msg = f"cannot fire a timer: run {self.run_id} is {self.status} on no timer"
            raise InvalidArgumentError(msg)
        if wait.request_id != request_id:
            msg = f"cannot fire timer {request_id!r}: run {self.run_id} sleeps on another"
            raise InvalidArgumentError(msg)
        self.trigger_event(stored.TimerFired, request_id=request_id)

    def recover(self, previous_holder: str | None) -> None:
        """Record that this turn takes the run over from a worker that is gone."""
        self._require_status("running", "recover the run")
        self.trigger_event(stored.Recovered, previous_holder=previous_holder)

    def link_parent(self, link: ParentLink) -> None:
        """Record that this run is the child run ``link`` started (with its creation)."""
        self.trigger_event(
            stored.ParentLinked, run_id=link.run_id, session_id=link.session_id, step=link.step
        )

    def give_input(self, data: dict[str, Any]) -> None:
        """Record the validated input a typed flow starts with (with its creation)."""
        encode_json(data, "the run's input")
        self.trigger_event(stored.FlowInputGiven, input=copy.deepcopy(data))

    @property
    def parent_link(self) -> ParentLink | None:
        """The run that started this one, if it is a child run."""
        parent = self.parent
        if parent is None:
            return None
        return ParentLink(parent["run_id"], parent["session_id"], parent["step"])

    def mark_forked(self, from_run_id: str, at_step: int) -> None:
        self.trigger_event(stored.Forked, from_run_id=from_run_id, at_step=at_step)

    def migrate(self, to_run_id: str, at_step: int) -> bool:
        """Record that this run moved to its fork ``to_run_id`` and stop it for good
        (``aborted``, outcome ``"migrated: <to_run_id>"``, lease released).
        Returns False (nothing triggered) when it already records that move; an
        aborted run only records it; a finished run is refused.
        """
        if self.migrated_to == to_run_id:
            return False
        self.refuse_migration_elsewhere(to_run_id)
        if self.status == "finished":
            msg = (
                f"run {self.run_id} finished (outcome {self.outcome!r}) before its "
                f"migration to run {to_run_id} completed; there is nothing to migrate"
            )
            raise InvalidArgumentError(msg)
        self.trigger_event(stored.Migrated, to_run_id=to_run_id, at_step=at_step)
        if self.status != "aborted":
            self.abort(f"{MIGRATED}{to_run_id}")
        return True

    def refuse_migration_elsewhere(self, to_run_id: str) -> None:
        """``InvalidArgumentError`` when this run already moved to a fork other than
        ``to_run_id``: asked before a migration forks (so a refused one writes
        nothing) and again when ``migrate`` records the move (one may have landed
        in between)."""
        if self.migrated_to is not None and self.migrated_to != to_run_id:
            msg = f"run {self.run_id} was already migrated to run {self.migrated_to}"
            raise InvalidArgumentError(msg)

    def copy_event(self, event_class: type[stored.Event], fields: dict[str, Any]) -> None:
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
        if self.status == "aborted" or (self.status == "finished" and self.cancelled):
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
        return True

    def receive_mail(self, message_id: str, name: str, payload: Any, actor: str | None) -> None:
        """Put a message in the mailbox (its payload checked to be journal-able)."""
        if self.status in ("finished", "aborted"):
            msg = f"cannot receive a message: run {self.run_id} is {self.status}"
            raise InvalidArgumentError(msg)
        encode_json(payload, f"the payload of message {name!r}")
        self.trigger_event(
            stored.MailReceived, message_id=message_id, name=name, payload=payload, actor=actor
        )

    def deliver_mail(self, request_id: str, message_id: str) -> None:
        """Wake the run from the ``receive`` it waits in: ``message_id`` is for it."""
        wait = self.waiting
        if self.status != "paused" or wait is None or wait.kind != "message":
            msg = f"cannot deliver a message: run {self.run_id} is {self.status} in no receive"
            raise InvalidArgumentError(msg)
        self.trigger_event(stored.MailDelivered, request_id=request_id, message_id=message_id)

    def unread(self, name: str) -> dict[str, Any] | None:
        """The oldest message named ``name`` no receive took yet, or None."""
        return next((m for m in self.mailbox if m["name"] == name), None)

    def record_inbound_key(self, idempotency_key: str, request: str) -> None:
        """Record that a call with ``idempotency_key`` (asking what ``request`` digests)
        opened a turn of this run."""
        self.trigger_event(
            stored.InboundKeyRecorded, idempotency_key=idempotency_key, request=request
        )

    def record_turn(self, idempotency_key: str, result: dict[str, Any]) -> None:
        encode_json(result, "the turn's result")
        self.trigger_event(stored.TurnRecorded, idempotency_key=idempotency_key, result=result)

    def set_budget(self, budget: dict[str, Any] | None) -> None:
        """Give the run its own budget (replacing the agent's), from now on."""
        if budget != self.budget:
            self.trigger_event(stored.BudgetSet, budget=budget)

    def raise_budget(self, raise_to: dict[str, Any]) -> None:
        self.trigger_event(stored.BudgetRaised, raise_to=raise_to)

    def count_model_call(self, model: str) -> None:
        """One more attempt of a call to ``model`` (folded from the step events)."""
        if self.usage is not None:
            self.usage.setdefault(model, _no_usage())["calls"] += 1

    def count_model_tokens(self, model: str, result_json: str | Redacted) -> None:
        """Add the tokens a finished call to ``model`` reported."""
        if self.usage is None:
            return
        reported = result_usage(result_json)
        if reported is None:
            return
        tally = self.usage.setdefault(model, _no_usage())
        for field, count in reported.items():
            tally[field] += count or 0

    @property
    def snapshot_weight(self) -> int:
        """About how many events replaying would cost as much as loading this
        state: a live step is about an event's worth; messages and recorded
        turns are small and decode in bulk, about sixteen to an event
        (``RunStore`` spaces snapshots by it; benchmarks/long_conversations.py)."""
        small = len(self.messages) + len(self.turn_keys) + len(self.mailbox) + len(self.published)
        return len(self.steps) + small // 16

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
    def steps_at(self, site: Site) -> list[StepData]:
        """Every step journaled at this site, oldest first."""
        base = self.step_base
        return [self.steps[i - base] for i in self.slots.get(site.slot, [])]

    @property
    def waiting(self) -> Wait | None:
        """What the run waits for, typed (None unless paused on something)."""
        return Wait.from_json(self.waiting_for) if self.waiting_for else None

    def lease(self, record: Lease | None) -> Lease | None:
        """The run's lease: its lease ``record`` if it has one; else, while the run is
        running, the lease folded from a journal of 0.1.0 (``LeaseTaken``), if any,
        live by this machine's clock (the time it was written with)."""
        if record is not None:
            return record
        expires_at = self.lease_expires_at
        if self.status == "running" and self.lease_holder and expires_at:
            return Lease(self.lease_holder, expires_at, live=expires_at > store_now())
        return None

    def public_wait(self) -> WaitingFor | None:
        """The run's ``waiting_for``, without building the whole state (its messages)."""
        return WaitingFor.model_validate(self.waiting_for) if self.waiting_for else None

    def to_state(self, lease: Lease | None = None) -> RunState:
        """The run's state, with its lease (``lease``: the run's lease record)."""
        held = self.lease(lease)
        return RunState(
            run_id=self.run_id,
            session_id=self.session_id,
            kind=self.kind,
            status=self.status,
            active_agent=self.active_agent,
            active_flow=self.active_flow,
            active_node=self.active_node,
            state=copy.deepcopy(self.state),
            messages=messages_from_json(self.messages),
            waiting_for=self.public_wait(),
            flow_digest=self.flow_digest,
            flow_version=self.flow_version,
            lease_holder=held.holder if held is not None else None,
            lease_expires_at=held.expires_at if held is not None else None,
            version=self.version,
            step_count=self.step_count,
            created_at=self.created_on,
            updated_at=self.modified_on,
            error=StepError.model_validate(self.error) if self.error else None,
            outcome=self.outcome,
            forked_from=copy.deepcopy(self.forked_from),
            migrated_to=self.migrated_to,
            parent=(
                None
                if self.parent is None
                else {"run_id": self.parent["run_id"], "step": self.parent["step"]}
            ),
            children=list(self.children),
            subject=self.data_subject,
        )

    def step_records(self) -> list[StepRecord]:
        """The steps the run holds: every one on a run from ``RunStore.load_history``,
        the live ones (from ``step_base``) on any other."""
        return [step_record(s) for s in self.steps]

    # -------------------------------------------------------------- helpers
    def _require_status(self, status: RunStatus, doing: str) -> None:
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
        kind=step["kind"],
        name=step["name"],
        callsite=step["callsite"],
        status=step["status"],
        result=_result(result_json),
        error=StepError.model_validate(step["error"]) if step["error"] else None,
        started_at=step["started_at"],
        finished_at=step["finished_at"],
        attempts=step["attempts"],
    )


def _result(result_json: str | Redacted | None) -> Any:
    """A step's recorded result (``Redacted`` once its subject was erased)."""
    if result_json is None or isinstance(result_json, Redacted):
        return result_json
    return json.loads(result_json)


# ------------------------------------------------------------------ the fold
# One handler per stored event (``catalogue.dispatch`` refuses a table that
# misses one). Each changes the run as the event says, and nothing else.
def _subject_assigned(run: Run, e: stored.SubjectAssigned) -> None:
    run.subject = e.subject


def _forked(run: Run, e: stored.Forked) -> None:
    run.forked_from = {"run_id": e.from_run_id, "at_step": e.at_step}


def _parent_linked(run: Run, e: stored.ParentLinked) -> None:
    run.parent = {"run_id": e.run_id, "session_id": e.session_id, "step": e.step}


def _flow_input_given(run: Run, e: stored.FlowInputGiven) -> None:
    run.input = e.input


def _turn_started(run: Run, e: stored.TurnStarted) -> None:
    run.epoch = e.epoch
    run.status = "running"
    run.error = None
    run.callsite_base = 0
    run.archive_steps()
    run.turn_key = e.idempotency_key
    if e.idempotency_key:
        run.inbound_keys.setdefault(e.idempotency_key, None)
    if e.message is not None:
        run.messages.append(e.message)


def _node_entered(run: Run, e: stored.NodeEntered) -> None:
    run.active_flow = e.flow
    run.active_node = e.node
    run.state = e.state
    run.callsite_base = e.callsite_base
    run.archive_steps()


def _flow_pinned(run: Run, e: stored.FlowPinned) -> None:
    run.active_flow = e.flow
    run.flow_digest = e.flow_digest
    run.flow_version = e.flow_version
    run.active_node = e.node
    run.state = {}
    run.callsite_base = 0
    run.archive_steps()
    run.status = "running"
    run.waiting_for = None
    run.error = None


def _message_appended(run: Run, e: stored.MessageAppended) -> None:
    run.messages.append(e.message)


def _step_intended(run: Run, e: stored.StepIntended) -> None:
    kind: Any = e.kind
    run.steps.append(
        StepData(
            index=e.index,
            key=e.key,
            kind=kind,
            name=e.name,
            callsite=e.callsite,
            args=e.args,
            status="running",
            result_json=None,
            error=None,
            started_at=e.timestamp,
            finished_at=None,
            retry_allowed=False,
            attempts=1,
            failures=0,
            retry_at=None,
        )
    )
    site = Site(e.logical_run, e.callsite, Lane(e.lane))
    run.slots.setdefault(site.slot, []).append(e.index)
    if e.kind == "model":
        run.count_model_call(e.name)
    elif e.kind == "receive" and isinstance(e.args, dict) and "message_id" in e.args:
        # The receive took this message: it is read (a replay takes the same one).
        taken = e.args["message_id"]
        run.mailbox = [m for m in run.mailbox if m["message_id"] != taken]
    elif e.kind == "child" and isinstance(e.args, dict) and "run_id" in e.args:
        # A child's id is known at its start's intent (it derives from the step's
        # key), so a cancel that lands while the child is created still finds it.
        run.children.append(str(e.args["run_id"]))


def _step_succeeded(run: Run, e: stored.StepSucceeded) -> None:
    step = run.step(e.index)
    step["status"] = "finished"
    step["result_json"] = e.result_json
    step["error"] = None
    step["finished_at"] = e.timestamp
    if step["kind"] == "model":
        run.count_model_tokens(step["name"], e.result_json)
    elif step["kind"] == "publish":
        run.published[step["name"]] = e.result_json


def _step_errored(run: Run, e: stored.StepErrored) -> None:
    step = run.step(e.index)
    step["status"] = "error"
    step["error"] = e.error
    step["finished_at"] = e.timestamp


def _attempt_failed(run: Run, e: stored.AttemptFailed) -> None:
    step = run.step(e.index)
    step["error"] = e.error
    step["failures"] += 1
    step["retry_at"] = e.retry_at


def _retry_allowed(run: Run, e: stored.RetryAllowed) -> None:
    run.step(e.index)["retry_allowed"] = True


def _attempt_started(run: Run, e: stored.AttemptStarted) -> None:
    step = run.step(e.index)
    if step["kind"] == "model":
        run.count_model_call(step["name"])
    step["retry_allowed"] = False
    step["attempts"] += 1
    step["retry_at"] = None
    # A read that is never replayed (``replay=False``) runs again on the same
    # step: it is running once more until this pass records.
    step["status"] = "running"
    step["finished_at"] = None


def _paused(run: Run, e: stored.Paused) -> None:
    run.status = "paused"
    run.waiting_for = e.waiting_for


def _input_accepted(run: Run, e: stored.InputAccepted) -> None:
    run.messages.append(e.message)
    run.waiting_for = None
    run.status = "running"


def _delivery_accepted(run: Run, e: stored.DeliveryAccepted) -> None:
    run.signal_ids[e.signal_id] = None
    run.waiting_for = None
    run.status = "running"


def _woken(run: Run, e: stored.TimerFired) -> None:
    run.status = "running"
    run.waiting_for = None


def _resumed(run: Run, e: stored.Resumed) -> None:
    run.status = "running"
    run.error = None


def _recovered(run: Run, e: stored.Recovered) -> None:
    run.status = "running"


def _finished(run: Run, e: stored.Finished) -> None:
    run.status = "finished"
    run.state = e.state
    run.outcome = e.outcome
    run.output = e.output
    run.active_agent = e.agent
    run.active_flow = None
    run.active_node = None
    run.waiting_for = None


def _errored(run: Run, e: stored.Errored) -> None:
    run.status = "error"
    run.error = e.error


def _aborted(run: Run, e: stored.Aborted) -> None:
    run.status = "aborted"
    run.outcome = e.reason
    run.waiting_for = None


def _migrated(run: Run, e: stored.Migrated) -> None:
    run.migrated_to = e.to_run_id


def _turn_recorded(run: Run, e: stored.TurnRecorded) -> None:
    run.turn_keys[e.idempotency_key] = e.result
    run.inbound_keys.setdefault(e.idempotency_key, None)


def _inbound_key_recorded(run: Run, e: stored.InboundKeyRecorded) -> None:
    run.inbound_keys[e.idempotency_key] = e.request


def _budget_set(run: Run, e: stored.BudgetSet) -> None:
    run.budget = e.budget


def _budget_raised(run: Run, e: stored.BudgetRaised) -> None:
    run.budget_raises = {**run.budget_raises, **e.raise_to}


def _lease_taken(run: Run, e: stored.LeaseTaken) -> None:
    run.lease_holder = e.holder
    run.lease_expires_at = e.expires_at


def _lease_released(run: Run, e: stored.LeaseReleased) -> None:
    run.lease_holder = None
    run.lease_expires_at = None


def _mail_received(run: Run, e: stored.MailReceived) -> None:
    if e.message_id in run.mail_ids:
        return  # never stored twice (the sender checks), and harmless if it were
    run.mail_ids[e.message_id] = None
    run.mailbox.append(
        {"message_id": e.message_id, "name": e.name, "payload": e.payload, "actor": e.actor}
    )


def _mail_delivered(run: Run, e: stored.MailDelivered) -> None:
    run.status = "running"
    run.waiting_for = None


def _created(run: Run, e: stored.RunCreated) -> None:
    """Nothing more: ``Run.__init__`` took the event's fields."""


_Fold = Callable[[Run, Any], None]
_FOLD: dict[type[stored.Event], _Fold | None] = stored.dispatch(
    "aggregate",
    {
        stored.RunCreated: _created,
        stored.SubjectAssigned: _subject_assigned,
        stored.Forked: _forked,
        stored.ParentLinked: _parent_linked,
        stored.FlowInputGiven: _flow_input_given,
        stored.TurnStarted: _turn_started,
        stored.NodeEntered: _node_entered,
        stored.FlowPinned: _flow_pinned,
        stored.MessageAppended: _message_appended,
        stored.StepIntended: _step_intended,
        stored.StepSucceeded: _step_succeeded,
        stored.StepErrored: _step_errored,
        stored.AttemptFailed: _attempt_failed,
        stored.RetryAllowed: _retry_allowed,
        stored.AttemptStarted: _attempt_started,
        stored.Paused: _paused,
        stored.InputAccepted: _input_accepted,
        stored.DeliveryAccepted: _delivery_accepted,
        stored.TimerFired: _woken,
        stored.Resumed: _resumed,
        stored.Recovered: _recovered,
        stored.Finished: _finished,
        stored.Errored: _errored,
        stored.Aborted: _aborted,
        stored.Migrated: _migrated,
        stored.TurnRecorded: _turn_recorded,
        stored.BudgetSet: _budget_set,
        stored.BudgetRaised: _budget_raised,
        stored.LeaseTaken: _lease_taken,
        stored.LeaseReleased: _lease_released,
        stored.InboundKeyRecorded: _inbound_key_recorded,
        stored.MailReceived: _mail_received,
        stored.MailDelivered: _mail_delivered,
    },
)
