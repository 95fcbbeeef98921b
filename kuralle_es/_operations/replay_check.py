"""``replay_check``: would today's code resume yesterday's runs? (API, via ``testing``)

The check to run in CI before a deploy (docs/howto/testing.md, docs/deploying.md).
For every live run of a flow (running, paused or errored — the runs a resume
will touch) it reports a ``ReplayFinding`` when the run is pinned to a
definition of the flow that the code no longer has (a resume would raise
``FlowDriftError``; a run pinned to one of several versions given is checked
against that version), or when re-running its active node against its
journal asks for another effect at a recorded callsite
(``NonDeterminismError``). ``check_runs`` does the same for every live run of
a store against a whole application (``kuralle-es check``), with a verdict
per run.

Nothing executes and nothing is written to the store: the run's aggregate is
loaded and driven through a journal that saves to a scratch memory store,
with every tool and the model replaced by stubs that stop the replay, and the
replay stops at the first effect the journal does not hold (where a real
resume would go on live), at a wait, or at the node's own error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

from .._definitions.agents import Agent
from .._definitions.flows import Flow, pinned_version, version_key
from .._journal.run import Run
from .._journal.store import RunStore
from .._runtime.flow_driver import drive
from .._runtime.registry import Registry
from .._runtime.streaming import TurnStream
from .._runtime.suspensions import Schemas
from .._runtime.writer import RunWriter
from ..errors import FlowDriftError, InvalidArgumentError, NonDeterminismError
from ..shapes import StreamPart
from ..views import RunSummary, RunViews
from .dry_run import AnyTools, StubModel, WouldExecute, stubbed

__all__ = ["ReplayFinding", "RunCheck", "check_runs", "replay_check"]

#: The run statuses a resume drives (finished and aborted runs are never re-run).
_LIVE = ("running", "paused", "error")
#: How many runs of the flow one check reads at most.
_MAX_RUNS = 1_000_000


class ReplayFinding(BaseModel):
    """A run that today's code could not resume as recorded."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    kind: Literal["drift", "nondeterminism"]
    message: str


class RunCheck(BaseModel):
    """One live run of a store, checked against an application (``check_runs``).

    ``kind`` is ``"ok"`` (it would resume as recorded), ``"drift"`` (pinned to
    a flow definition the application does not have: a resume raises
    ``FlowDriftError``) or ``"nondeterminism"`` (its active node, re-run on its
    journal, asks for another effect than step ``step`` recorded).
    """

    model_config = ConfigDict(frozen=True)

    run_id: str
    session_id: str
    status: str
    flow: str | None = None
    #: The version of the flow the run is pinned to (as stored with the run).
    flow_version: str | None = None
    kind: Literal["ok", "drift", "nondeterminism"]
    ok: bool
    #: The first step the code would not replay as recorded (nondeterminism).
    step: int | None = None
    message: str | None = None


def _definitions(agent: Agent) -> tuple[Flow, ...]:
    return agent.flow_versions or tuple(agent.flows.values())


def _dry_agent(flow: Flow, agents: Sequence[Agent], model_id: str) -> Agent:
    """The flow's agent with every effect stubbed out (a stand-in without agents)."""
    defining = [a for a in agents if any(f is flow for f in _definitions(a))]
    for agent in defining or agents:
        if flow.name in agent.flows:
            model = StubModel(getattr(agent.model, "id", model_id))
            return Agent(
                agent.id, agent.instructions, model, stubbed(agent.tools), {flow.name: flow}
            )
    return Agent("replay-check", "", StubModel(model_id), AnyTools(), {flow.name: flow})


def _step_of(run: Run, error: NonDeterminismError) -> int | None:
    """The index of the recorded step the code no longer asks for, if it is found."""
    for step in run.steps:
        if error.recorded_key is not None and step["key"] == error.recorded_key:
            return step["index"]
    for step in run.steps:
        if step["callsite"] == error.callsite and error.expected == (
            f"{step['kind']} {step['name']!r}"
        ):
            return step["index"]
    return None


async def _nondeterminism(
    store: RunStore, run_id: str, flow: Flow, agents: Sequence[Agent]
) -> tuple[NonDeterminismError, int | None] | None:
    """Re-run the run's active node against its journal; the mismatch (and the
    index of its recorded step), if any."""
    run = await store.load_async(run_id)
    if run is None:
        return None
    recorded_models = [step["name"] for step in run.steps if step["kind"] == "model"]
    agent = _dry_agent(flow, agents, recorded_models[0] if recorded_models else "replay-check")
    scratch = RunStore.memory()
    writer = RunWriter(scratch, run, holder="kuralle-replay-check", lease_ttl=3600.0)

    def ignore(part: StreamPart) -> None:
        return None

    try:
        await drive(
            writer, agent, flow, TurnStream(ignore), schemas=Schemas(), max_tool_concurrency=1
        )
    except NonDeterminismError as e:
        if e.recorded_key is not None and not agents:
            return None  # other args or defaults: only the tools' input models can tell
        return e, _step_of(run, e)
    except (WouldExecute, Exception):
        return None  # the frontier, a wait, or the node's own error: as recorded
    finally:
        await writer.close()
        scratch.close()
    return None


def _versions_of(given: Sequence[Flow], agents: Sequence[Agent]) -> list[Flow]:
    """The definitions of the flow to check against: those given, then the agents'
    other versions of it (a version label given wins over an agent's)."""
    found = list(given)
    for agent in agents:
        for flow in _definitions(agent):
            if flow.name == given[0].name and all(f.version != flow.version for f in found):
                found.append(flow)
    return found


async def replay_check(
    store: RunStore, flow: Flow | Sequence[Flow], *, agents: Sequence[Agent] = ()
) -> list[ReplayFinding]:
    """The live runs of ``flow`` in ``store`` that today's code could not resume.

    ``flow`` is the flow as the code defines it now, or several versions of it
    (``define_flow(..., version=...)``); the versions of it that ``agents``
    define count too. A run is checked against the version whose digest it
    pinned, and is a ``drift`` finding when none has it. ``agents``
    (optional) are the agents as the code defines them now: with them, tool
    calls are checked with the tools' own input models (defaults filled in, as
    at run time); without, any tool name is accepted with the arguments the
    node passes, so a reordered or renamed call is still found, but a call
    whose arguments differ (or would validate differently) is not judged: pass
    ``agents`` to find args computed from unrecorded values. Executes nothing,
    writes nothing.
    """
    given = [flow] if isinstance(flow, Flow) else list(flow)
    if not given or any(f.name != given[0].name for f in given):
        msg = f"replay_check takes one flow, or versions of one flow, got {flow!r}"
        raise InvalidArgumentError(msg)
    name = given[0].name
    versions = _versions_of(given, agents)
    current = max(given, key=lambda f: version_key(f.version))
    views = RunViews(store)
    findings: list[ReplayFinding] = []
    for summary in await views.list_runs(flow=name, limit=_MAX_RUNS):
        if summary.status not in _LIVE or summary.active_flow != name:
            continue
        run = await store.load_async(summary.run_id)
        if run is None:
            continue
        pinned = pinned_version(versions, run.flow_digest, run.flow_version)
        if pinned is None:
            drift = FlowDriftError(run.run_id, run.flow_digest, current.digest)
            findings.append(ReplayFinding(run_id=run.run_id, kind="drift", message=str(drift)))
            continue
        problem = await _nondeterminism(store, run.run_id, pinned, agents)
        if problem is not None:
            findings.append(
                ReplayFinding(run_id=run.run_id, kind="nondeterminism", message=str(problem[0]))
            )
    return findings


async def _live_runs(store: RunStore) -> list[RunSummary]:
    views = RunViews(store)
    found: list[RunSummary] = []
    for status in _LIVE:
        found += await views.list_runs(status=status, limit=_MAX_RUNS)
    return sorted(found, key=lambda s: (s.updated_at, s.run_id))


async def _check_one(store: RunStore, run: Run, registry: Registry) -> RunCheck:
    base = {
        "run_id": run.run_id,
        "session_id": run.session_id,
        "status": run.status,
        "flow": run.active_flow,
        "flow_version": run.flow_version if run.active_flow is not None else None,
    }
    if run.active_flow is None:
        # A conversation between flows: its agent loop has no pinned definition.
        if run.active_agent in registry.agents:
            return RunCheck(**base, kind="ok", ok=True)
        message = f"agent {run.active_agent!r} of run {run.run_id} is not in the application"
        return RunCheck(**base, kind="drift", ok=False, message=message)
    versions = registry.versions(run.active_flow)
    if not versions:
        message = f"flow {run.active_flow!r} of run {run.run_id} is not in the application"
        return RunCheck(**base, kind="drift", ok=False, message=message)
    pinned = registry.pinned(run.active_flow, run.flow_digest, run.flow_version)
    if pinned is None:
        _, newest = registry.flow(run.active_flow)
        drift = FlowDriftError(run.run_id, run.flow_digest, newest.digest)
        return RunCheck(**base, kind="drift", ok=False, message=str(drift))
    problem = await _nondeterminism(store, run.run_id, pinned[1], list(registry.agents.values()))
    if problem is None:
        return RunCheck(**base, kind="ok", ok=True)
    error, step = problem
    return RunCheck(**base, kind="nondeterminism", ok=False, step=step, message=str(error))


async def check_runs(store: RunStore, agents: Sequence[Agent]) -> list[RunCheck]:
    """Every live run of ``store`` (running, paused or errored), checked against
    the application ``agents``, oldest update first (``kuralle-es check``).

    A run in a flow is checked against the version of the flow whose digest
    it pinned (``"ok"`` when its active node replays as recorded,
    ``"nondeterminism"`` with the first step that differs), and is
    ``"drift"`` when no version of the application has that digest (or the
    flow is gone). A conversation between flows is ``"ok"`` when its agent is
    in the application. Executes nothing, writes nothing to the runs.
    """
    registry = Registry(agents)
    checks: list[RunCheck] = []
    for summary in await _live_runs(store):
        run = await store.load_async(summary.run_id)
        if run is None or run.status not in _LIVE:
            continue  # it moved on since the views saw it
        checks.append(await _check_one(store, run, registry))
    return checks
