"""``replay_with``: a recorded run re-driven under new code or a new model (API, via ``testing``).

What would the new prompt, model or flow have done on last week's runs,
what would it have called, what would it have cost? ``replay_with`` reads a
recorded run and drives it again from its first turn, through the ordinary
turns and the ordinary writer, on a scratch in-memory store under the code
given, feeding it what the recording was given from outside (its first
message, input, deliveries, later user turns; ``recording``):

- a step whose key the recording holds, settled, is journaled with the
  recorded outcome and not executed (``ReplaySource``): a tool call with the
  same name and args, a clock read, a uuid, a delivered payload, a model
  call to the same model with an unchanged request (a digest of it is kept
  on each model step; a model step recorded before that is matched by its
  key alone);
- a model call the recording does not hold goes to ``model`` (or the
  agent's own): that is what is being evaluated;
- a tool call the recording does not hold reaches a stub (``dry_run``):
  nothing executes, the call is journaled as one that would execute, and the
  re-drive stops there, since what it would have returned is unknown;
- a durable sleep is fired at once by the re-drive's own clock (a
  ``TestClock`` started at the recording's creation).

Nothing is written to the store the run came from, no tool executes, and
the recorded journal is compared with the re-drive's (``counterfactual``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from .._clock import TestClock
from .._definitions.agents import Agent
from .._definitions.budget import Budget
from .._definitions.flows import Flow, version_key
from .._journal.run import Run, StepData
from .._journal.sites import Effect
from .._journal.spending import Prices, validate_prices
from .._journal.store import RunStore
from .._runtime.handle import TurnSink
from .._runtime.mail_calls import Mail
from .._runtime.mailbox import send_message
from .._runtime.registry import Registry
from .._runtime.replay_source import Served
from .._runtime.run_changes import Abandon, change_run
from .._runtime.step_results import decode
from .._runtime.turn import drive_turn
from .._runtime.turn_calls import (
    Command,
    Converse,
    Deliver,
    Input,
    Resume,
    StartFlow,
    TurnEnv,
    Wake,
    load_run,
)
from ..errors import InvalidArgumentError, RunNotFoundError
from ..redaction import Redacted
from ..shapes import StepError, StreamPart
from .counterfactual import Counterfactual, divergence, tool_calls, usage_of
from .dry_run import WouldExecute, stubbed
from .recording import Given, Recording, read_recording

__all__ = ["replay_with"]

#: The worker name of a re-drive's turns (on its scratch store only).
_HOLDER = "kuralle-replay"
#: How many turns a re-drive takes beyond the recording's own (new code that
#: sleeps in a loop, woken at once each time, would never stop).
_SPARE_TURNS = 50
#: The actor of a deadline's deny (``recovery.DEADLINE_ACTOR``, which imports the runtime).
_DEADLINE = "deadline"


class _RecordedSteps:
    """The recording's settled steps, served to the re-drive by key (a ``ReplaySource``).

    ``served`` maps the key of each step served to its index in the recording.
    """

    def __init__(self, history: Run) -> None:
        self._history = history
        self.served: dict[str, int] = {}

    def serve(self, effect: Effect) -> Served | None:
        steps = self._history.steps_at(effect.site)
        if not steps:
            return None
        step = steps[-1]
        if (step["kind"], step["name"], step["key"]) != (effect.kind, effect.name, effect.key):
            return None
        if step["kind"] == "model" and not _same_request(step, effect):
            return None
        if step["status"] == "finished":
            served = Served(result=decode(step))
        elif step["status"] == "error" and step["error"]:
            served = Served(error=StepError.model_validate(step["error"]))
        else:
            return None  # in doubt in the recording: its outcome is unknown
        self.served[effect.key] = step["index"]
        return served


def _same_request(step: StepData, effect: Effect) -> bool:
    """Whether a model call asks what the recorded one asked (a step recorded without
    the request's digest: by its key alone, i.e. the same model and purpose)."""
    recorded = step["args"].get("request") if isinstance(step["args"], dict) else None
    asked = effect.args.get("request") if isinstance(effect.args, dict) else None
    return recorded is None or recorded == asked


def _newest(flows: Sequence[Flow]) -> dict[str, Flow]:
    newest: dict[str, Flow] = {}
    for flow in flows:
        known = newest.get(flow.name)
        if known is None or version_key(flow.version) > version_key(known.version):
            newest[flow.name] = flow
    return newest


def _stand_in(agent: Agent, model: Any, pins: dict[str, tuple[str, str | None]]) -> Agent:
    """``agent`` for a re-drive: its tools stubbed, ``model`` (if given) in place of its
    own, and the newest definition of each flow standing under the digest the recording
    pinned, so that the recording's keys are the re-drive's for the same effects."""
    flows = []
    for flow in _newest(agent.flow_versions or tuple(agent.flows.values())).values():
        pin = pins.get(flow.name)
        flows.append(
            flow if pin is None else dataclasses.replace(flow, digest=pin[0], version=pin[1])
        )
    return dataclasses.replace(
        agent,
        model=model if model is not None else agent.model,
        tools=stubbed(agent.tools),
        flows={flow.name: flow for flow in flows},
        flow_versions=tuple(flows),
    )


class _Quiet(TurnSink):
    def emit(self, part: StreamPart) -> None:
        return None


@dataclass(frozen=True)
class _FirstTurn(StartFlow):
    """A recorded flow run's first turn, under the recorded run's own id (so the
    re-drive's keys are the recording's for the same effects)."""

    run_id: str = ""

    async def address(self, env: TurnEnv) -> tuple[Run, bool]:
        agent, flow = env.registry.flow(str(self.flow_name))
        run_id = UUID(self.run_id)
        return Run(
            run_id, self.session_id, "flow", agent.id, flow.name, flow.digest, flow.version
        ), True


class _Redrive:
    """One re-drive: its turns, each opened with what the recording was given next."""

    def __init__(
        self, env: TurnEnv, recording: Recording, history: Run, session_id: str, clock: TestClock
    ) -> None:
        self.env = env
        self.given = recording.given
        self.recording = recording
        self.run_id = history.run_id
        #: Where the recording stands now: a re-drive that reaches it stops there too.
        self.standing = history.waiting
        self.session_id = session_id
        self.clock = clock

    def first(self) -> tuple[Command, Given]:
        start = self.given.popleft() if self.given else Given("start")
        if self.recording.kind == "flow":
            return _FirstTurn(
                self.session_id, self.recording.flow, start.text, None, run_id=self.run_id
            ), start
        command = Converse(self.session_id, start.text, start.flow, None, self.recording.agent)
        return command, start

    async def run(self) -> str | None:
        """Drive every turn; why the re-drive stopped before the recording's end, if it did."""
        command, given = self.first()
        opened = False
        turns = len(self.given) + self.recording.wakes + _SPARE_TURNS + 1
        for _ in range(turns):
            budget = Budget.model_validate(given.budget) if given.budget else None
            try:
                await drive_turn(self.env, command, _Quiet(), budget)
            except WouldExecute:
                return "stopped at a tool call the recording does not hold (it would execute)"
            except Exception as exc:
                run = await self.env.store.load_async(self.run_id)
                if run is None and not opened:
                    raise  # the code given lacks the run's agent or flow: a refusal
                if run is None or run.status != "error":
                    return f"the re-drive was refused: {type(exc).__name__}: {exc}"
            opened = True
            step, note = await self.next()
            if step is None:
                return note
            command, given = step
        return f"stopped after {turns} turns, {_SPARE_TURNS} more than the recording took"

    async def next(self) -> tuple[tuple[Command, Given] | None, str | None]:
        """The next turn (and what opens it), or why there is none."""
        run = await self.env.store.load_async(self.run_id)
        assert run is not None, "a turn of the re-drive saved the run"
        wait, ahead = run.waiting, self.given[0] if self.given else None
        if run.status == "paused" and wait is not None and wait.kind == "timer":
            standing = self.standing
            if (
                not self.given
                and standing is not None
                and standing.is_at(wait.logical_run, wait.callsite, wait.name, wait.lane)
            ):
                return None, None  # the recording still sleeps here
            if wait.deadline is not None and wait.deadline > self.clock.now():
                self.clock.set(wait.deadline)  # a sleep takes no time in a re-drive
            return (Wake(self.session_id, self.run_id, wait.request_id), Given("resume")), None
        while ahead is not None and ahead.kind == "message" and ahead.mail is not None:
            # A message goes to the mailbox (and wakes a receive waiting for it) as
            # it did in the recording: a send of its own, which drives that turn.
            self.given.popleft()
            await send_message(self.env, self.run_id, self.session_id, Mail(**ahead.mail))
            run = await self.env.store.load_async(self.run_id)
            assert run is not None
            wait, ahead = run.waiting, self.given[0] if self.given else None
        if ahead is None:
            return None, None  # it stands where the recording stands, or ended
        if ahead.kind == "abort":  # stopped from outside (a cancel): stopped here too
            self.given.popleft()
            stop = Abandon(_HOLDER, ahead.outcome or "aborted")
            await change_run(self.env.store, self.run_id, self.session_id, stop)
            return None, None
        command = self._opening(run, ahead)
        if command is None:
            where = f"waits for {wait.name!r}" if wait is not None else f"is {run.status}"
            return None, f"the re-drive {where} where the recording was given {ahead.kind}"
        self.given.popleft()
        return (command, ahead), None

    def _opening(self, run: Run, ahead: Given) -> Command | None:
        wait, session, run_id = run.waiting, self.session_id, self.run_id
        if run.status == "paused" and wait is not None:
            if wait.kind == "input" and ahead.kind == "input":
                return Input(session, run_id, ahead.text or "", None)
            delivery = ahead.delivery
            if delivery is not None and delivery.name == wait.name:
                deny = delivery.actor == _DEADLINE  # a sweeper's deny: delivered as one
                return Deliver(session, run_id, delivery, None, from_sweeper=deny)
            return None
        if ahead.kind == "turn" and run.kind == "conversation":
            return Converse(session, ahead.text, ahead.flow, None)
        if ahead.kind == "resume" and run.status == "error":
            return Resume(session, run_id, None)
        return None


def _agents(agents: object) -> list[Agent]:
    """The code to re-drive under: agents (one, or several); ``InvalidArgumentError`` else."""
    given = [agents] if isinstance(agents, Agent) else agents
    if not isinstance(given, Sequence) or not all(isinstance(a, Agent) for a in given):
        msg = f"agents must be the application's agents (define_agent(...)), got {agents!r}"
        raise InvalidArgumentError(msg)
    return list(given)


async def replay_with(
    store: RunStore,
    run_id: str,
    session_id: str,
    *,
    agents: Sequence[Agent] | Agent,
    model: Any = None,
    prices: Prices | None = None,
) -> Counterfactual:
    """Re-drive a recorded run under ``agents`` (new code) and ``model`` (a new model
    for every agent; None: each agent's own) and compare it with the recording.

    Writes nothing to ``store`` and executes no tool: steps the recording holds
    under the same key are reused, model calls it does not hold go to the
    model, and the first tool call it does not hold is reported in
    ``would_execute`` (name, args) and ends the re-drive. ``prices`` (as
    ``Runtime(prices=...)``) give both sides a cost. ``RunNotFoundError`` for
    an unknown run or one of another session; ``InvalidArgumentError`` for a
    fork (re-drive the run it was forked from); ``FlowNotFoundError`` or
    ``InvalidArgumentError`` when ``agents`` lack the run's flow or agent.
    docs/howto/evaluating-models.md shows it on production runs.
    """
    checked_prices = validate_prices(prices)
    agents = _agents(agents)
    if model is not None and not (
        hasattr(model, "id") and callable(getattr(model, "respond", None))
    ):
        msg = (
            f"model must have an id and async respond(request) (the Model protocol), got {model!r}"
        )
        raise InvalidArgumentError(msg)
    history = await load_run(store, run_id, session_id, history=True)
    if history is None:
        raise RunNotFoundError(run_id, session_id)
    if _erased(history):
        msg = (
            f"cannot replay run {run_id}: its subject was erased, so its recorded inputs and "
            "answers cannot be read (docs/privacy.md)"
        )
        raise InvalidArgumentError(msg)
    events = await asyncio.to_thread(store.run_events, history.run_id)
    recording = read_recording(events)
    if recording.forked:
        msg = (
            f"run {run_id} is a fork; replay_with re-drives a run from its first turn, "
            "which a fork never had: replay the run it was forked from"
        )
        raise InvalidArgumentError(msg)
    clock = TestClock(history.created_on)
    source = _RecordedSteps(history)
    scratch = RunStore.memory()
    env = TurnEnv(
        registry=Registry([_stand_in(a, model, recording.pins) for a in agents]),
        store=scratch,
        holder=_HOLDER,
        lease_ttl=3600.0,
        max_tool_concurrency=8,
        inline_sleep_limit=0.0,
        prices=checked_prices,
        clock=clock,
        source=source,
    )
    try:
        note = await _Redrive(env, recording, history, session_id, clock).run()
        after = await scratch.load_async(history.run_id, history=True)
    finally:
        scratch.close()
    assert after is not None, "the re-drive's first turn saved the run"
    diverged_at, why = divergence(history.steps, after.steps, source.served)
    calls_after = tool_calls(after.steps)
    return Counterfactual(
        run_id=history.run_id,
        session_id=session_id,
        diverged_at=diverged_at,
        divergence=why,
        would_execute=[call for call in calls_after if call.would_execute],
        tool_calls_before=tool_calls(history.steps),
        tool_calls_after=calls_after,
        status_before=history.status,
        status_after=after.status,
        outcome_before=history.outcome,
        outcome_after=after.outcome,
        output_before=history.output,
        output_after=after.output,
        waiting_for_before=history.public_wait(),
        waiting_for_after=after.public_wait(),
        usage_before=usage_of(history, history.steps, checked_prices),
        usage_after=usage_of(after, after.steps, checked_prices),
        note=note,
    )


def _erased(run: Run) -> bool:
    """Whether the run's payloads read ``Redacted`` (its subject was erased): its
    messages, its state or its steps' arguments and results."""
    steps: list[StepData] = run.steps
    return (
        isinstance(run.state, Redacted)
        or any(isinstance(m.get("content"), Redacted) for m in run.messages)
        or any(
            isinstance(s["args"], Redacted) or isinstance(s["result_json"], Redacted) for s in steps
        )
    )
