"""A run's journal as a readable timeline, for ``kuralle-es runs show`` and the demo (API).

One line per step (when it started, how long it took, how many attempts,
its outcome) and per delivery (a signal, an approval or input, with the
actor who sent it), in time order, then where the run waits. Deliveries are
read from the run's stored events (a dispatch over the catalogue: ``_READ``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .._clock import as_utc
from .._journal import catalogue as stored
from .._journal.store import RunStore
from .._journal.wait import BUDGET, IN_DOUBT
from ..redaction import Redacted
from ..shapes import RunState, StepRecord, WaitingFor

__all__ = ["Delivery", "answer_hint", "format_timeline", "read_deliveries"]


@dataclass(frozen=True)
class Delivery:
    """Something delivered to a run: a signal (approvals too), input, or a message
    (``signal_id`` is then its ``message_id``)."""

    at: datetime
    kind: str  # "signal" | "input" | "message"
    name: str
    actor: str | None
    payload: Any
    signal_id: str | None


def _signal(e: stored.DeliveryAccepted) -> Delivery:
    return Delivery(
        at=as_utc(e.timestamp),
        kind="signal",
        name=e.name,
        actor=e.actor,
        payload=e.payload,
        signal_id=e.signal_id,
    )


def _mail(e: stored.MailReceived) -> Delivery:
    return Delivery(
        at=as_utc(e.timestamp), kind="message", name=e.name, actor=e.actor, payload=e.payload,
        signal_id=e.message_id,
    )  # fmt: skip


def _input(e: stored.InputAccepted) -> Delivery:
    content = e.message.get("content")
    return Delivery(
        at=as_utc(e.timestamp), kind="input", name="__input", actor=None, payload=content,
        signal_id=None,
    )  # fmt: skip


#: The timeline's reading of the catalogue: deliveries; steps come from the fold.
_READ: Mapping[type[stored.Event], Callable[[Any], Delivery] | None] = stored.dispatch(
    "timeline",
    {stored.DeliveryAccepted: _signal, stored.InputAccepted: _input, stored.MailReceived: _mail},
    skipped=[
        c
        for c in stored.RUN_EVENTS
        if c not in (stored.DeliveryAccepted, stored.InputAccepted, stored.MailReceived)
    ],
)
_TOPICS = frozenset(c.TOPIC for c, read in _READ.items() if read is not None)


def read_deliveries(store: RunStore, run_id: str) -> list[Delivery]:
    """The run's accepted deliveries, oldest first, from its stored events."""
    deliveries = []
    for record in store.stored_events(run_id):
        if record.topic not in _TOPICS:  # decode only what the timeline reads
            continue
        event: Any = store.mapper.to_domain_event(record)
        read = _READ.get(type(event))
        if read is not None:
            deliveries.append(read(event))
    return deliveries


def _short(value: object, width: int = 72) -> str:
    if isinstance(value, Redacted):
        return str(value)
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def _when(at: datetime | None) -> str:
    return "--" if at is None else as_utc(at).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _took(step: StepRecord) -> str:
    if step.started_at is None or step.finished_at is None:
        return "running"
    ms = (step.finished_at - step.started_at).total_seconds() * 1000
    return f"{ms:.1f} ms" if ms < 10_000 else f"{ms / 1000:.1f} s"


def _step_line(step: StepRecord) -> str:
    if step.status == "finished":
        outcome = f"-> {_short(step.result)}"
    elif step.status == "error" and step.error is not None:
        outcome = f"!! {step.error.type}: {step.error.message}"
    elif step.error is not None:  # a retried tool between attempts
        outcome = f"… running, retried after {step.error.type}: {step.error.message}"
    else:
        outcome = "… running (in doubt if its process died)"
    return (
        f"  {_when(step.started_at)}  #{step.index:<3} {step.kind:<8} {step.name:<16} "
        f"{_took(step):>9}  x{step.attempts}  {outcome}"
    )


def _delivery_line(delivery: Delivery) -> str:
    by = f"by {delivery.actor}" if delivery.actor else "by (no actor)"
    label = "message_id" if delivery.kind == "message" else "signal_id"
    sid = f"  {label}={delivery.signal_id}" if delivery.signal_id else ""
    return (
        f"  {_when(delivery.at)}  <-   {delivery.kind:<8} {delivery.name:<16} {by}  "
        f"{_short(delivery.payload)}{sid}"
    )


def answer_hint(run_id: str, wait: WaitingFor) -> str:
    """The command that answers ``wait`` (docs/operators.md has every door of every wait);
    empty for a child run's wait, whose line already names the child."""
    if wait.name == IN_DOUBT:
        return (
            f"kuralle-es in-doubt {run_id} retry|resolve|fail --by NAME "
            "[--result JSON] [--message TEXT]"
        )
    if wait.kind == "approval":
        raised = " [--raise-to JSON]" if wait.name == BUDGET else ""
        return (
            f"kuralle-es approve {run_id} --by NAME{raised}, or "
            f"kuralle-es deny {run_id} --by NAME --reason TEXT"
        )
    hints = {
        "input": f"kuralle-es input {run_id} TEXT",
        "signal": f"kuralle-es signal {run_id} {wait.name} --payload JSON",
        "message": f"kuralle-es send {run_id} {wait.name} --payload JSON --message-id ID",
        "timer": "nothing to answer: a worker (kuralle-es worker) wakes it when it is due",
    }
    return hints.get(wait.kind, "")


_HEADER = f"  {'time (UTC)':<23}  {'step':<4} {'kind':<8} {'name':<16} {'took':>9}  tries"


def format_timeline(
    state: RunState, steps: Sequence[StepRecord], deliveries: Sequence[Delivery] = ()
) -> str:
    """The run as text: a header, its steps and deliveries in time order, its wait."""
    lines = [
        f"run {state.run_id}  session={state.session_id}  kind={state.kind}  "
        f"status={state.status}  version={state.version}",
        f"  created {_when(state.created_at)} UTC, updated {_when(state.updated_at)} UTC, "
        f"{len(steps)} step(s), {len(deliveries)} deliver{'y' if len(deliveries) == 1 else 'ies'}",
    ]
    if state.active_flow:
        version = f" (version {state.flow_version})" if state.flow_version else ""
        lines.append(f"  flow {state.active_flow} at node {state.active_node}{version}")
    if state.forked_from:
        origin = state.forked_from
        lines.append(f"  forked from run {origin['run_id']} at step {origin['at_step']}")
    if state.migrated_to:
        lines.append(f"  migrated to run {state.migrated_to}")
    if state.parent:
        lines.append(
            f"  child of run {state.parent['run_id']} (started by its step {state.parent['step']})"
        )
    if state.children:
        lines.append(f"  children: {', '.join(state.children)}")
    if state.lease_holder:
        lines.append(f"  lease held by {state.lease_holder} until {_when(state.lease_expires_at)}")
    timed: list[tuple[datetime, int, str]] = [
        (as_utc(s.started_at) if s.started_at else state.created_at, 0, _step_line(s))
        for s in steps
    ]
    timed += [(d.at, 1, _delivery_line(d)) for d in deliveries]
    if timed:
        lines.append(
            f"  {'time (UTC)':<23}  {'step':<4} {'kind':<8} {'name':<16} {'took':>9}  tries"
        )
    lines += [line for _, _, line in sorted(timed, key=lambda t: (t[0], t[1]))]
    if state.waiting_for is not None:
        wf = state.waiting_for
        lines.append(f"  waiting for {wf.name} ({wf.kind}) request_id={wf.request_id}")
        if wf.title:
            lines.append(f"    title: {wf.title}")
        if wf.deadline is not None:
            lines.append(f"    deadline: {_when(wf.deadline)} UTC")
        if wf.child_run_id is not None:
            lines.append(f"    until child run {wf.child_run_id} ends (kuralle-es runs show it)")
        if wf.operation is not None:
            lines.append(f"    operation: {wf.operation.tool_name} {_short(wf.operation.args)}")
        if hint := answer_hint(state.run_id, wf):
            lines.append(f"    answer: {hint}")
    if state.outcome is not None:
        lines.append(f"  outcome: {state.outcome}")
    if state.error is not None:
        lines.append(f"  error: {state.error.type}: {state.error.message}")
    return "\n".join(lines)
