"""``replay_check``: would today's code resume yesterday's runs? (API, via ``testing``)

The check to run in CI before a deploy (docs/howto/testing.md). For every live
run of a flow (running, paused or errored — the runs a resume will touch) it
reports a ``ReplayFinding`` when the run is pinned to another definition of
the flow (a resume would raise ``FlowDriftError``), or when re-running its
active node against its journal asks for another effect at a recorded
callsite (``NonDeterminismError``).

Nothing executes and nothing is written to the store: the run's aggregate is
loaded and driven through a journal that saves to a scratch memory store,
with every tool and the model replaced by stubs that stop the replay, and the
replay stops at the first effect the journal does not hold (where a real
resume would go on live), at a wait, or at the node's own error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from .agents import Agent
from .driver import drive
from .errors import FlowDriftError, NonDeterminismError
from .flows import Flow
from .journal import Journal
from .llm import ModelRequest, ModelResponse
from .models import StreamPart
from .store import RunStore
from .tools import Tool, define_tool
from .views import RunViews
from .waits import Schemas

__all__ = ["ReplayFinding", "replay_check"]

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


class _WouldExecute(BaseException):
    """The replay reached an effect the journal does not hold: stop, nothing ran.

    A ``BaseException``, so that no node's ``except Exception`` can swallow it
    and go on executing.
    """


class _AnyArgs(BaseModel):
    """Arguments of a tool the check was not given: whatever the node passes."""

    model_config = ConfigDict(extra="allow")


async def _forbidden(args: BaseModel) -> Any:
    raise _WouldExecute


class _StubModel:
    """A model that answers nothing: a recorded turn replays, a new one stops the check."""

    def __init__(self, model_id: str) -> None:
        self._id = model_id

    @property
    def id(self) -> str:
        return self._id

    async def respond(self, request: ModelRequest) -> ModelResponse:
        raise _WouldExecute


class _AnyTools(dict[str, Tool[Any]]):
    """Every tool name a node asks for, as a stub (when the check has no agents)."""

    def get(self, name: str, default: Any = None) -> Tool[Any]:
        if name not in self:
            self[name] = define_tool(name, "", _AnyArgs, _forbidden)
        return self[name]


def _dry_agent(flow: Flow, agents: Sequence[Agent], model_id: str) -> Agent:
    """The flow's agent with every effect stubbed out (a stand-in without agents)."""
    for agent in agents:
        if flow.name in agent.flows:
            tools = {
                name: dataclasses.replace(tool, execute=_forbidden, wants_call=False)
                for name, tool in agent.tools.items()
            }
            model = _StubModel(getattr(agent.model, "id", model_id))
            return Agent(agent.id, agent.instructions, model, tools, {flow.name: flow})
    return Agent("replay-check", "", _StubModel(model_id), _AnyTools(), {flow.name: flow})


async def _nondeterminism(
    store: RunStore, run_id: str, flow: Flow, agents: Sequence[Agent]
) -> str | None:
    """Re-run the run's active node against its journal; the mismatch, if any."""
    run = await store.load_async(run_id)
    if run is None:
        return None
    recorded_models = [step["name"] for step in run.steps if step["kind"] == "model"]
    agent = _dry_agent(flow, agents, recorded_models[0] if recorded_models else "replay-check")
    scratch = RunStore.memory()
    journal = Journal(scratch, run, holder="kuralle-replay-check", lease_ttl=3600.0)

    def ignore(part: StreamPart) -> None:
        return None

    try:
        await drive(journal, agent, flow, ignore, schemas=Schemas(), max_tool_concurrency=1)
    except NonDeterminismError as e:
        if e.recorded_key is not None and not agents:
            return None  # other args or defaults: only the tools' input models can tell
        return str(e)
    except (_WouldExecute, Exception):
        return None  # the frontier, a wait, or the node's own error: as recorded
    finally:
        await journal.close()
        scratch.close()
    return None


async def replay_check(
    store: RunStore, flow: Flow, *, agents: Sequence[Agent] = ()
) -> list[ReplayFinding]:
    """The live runs of ``flow`` in ``store`` that today's code could not resume.

    ``flow`` is the flow as the code defines it now. ``agents`` (optional) are
    the agents as the code defines them now: with them, tool calls are checked
    with the tools' own input models (defaults filled in, as at run time);
    without, any tool name is accepted with the arguments the node passes, so
    a reordered or renamed call is still found, but a call whose arguments
    differ (or would validate differently) is not judged: pass ``agents`` to
    find args computed from unrecorded values. Executes nothing, writes nothing.
    """
    views = RunViews(store)
    findings: list[ReplayFinding] = []
    for summary in await views.list_runs(flow=flow.name, limit=_MAX_RUNS):
        if summary.status not in _LIVE or summary.active_flow != flow.name:
            continue
        run = await store.load_async(summary.run_id)
        if run is None:
            continue
        if run.flow_digest != flow.digest:
            drift = FlowDriftError(run.run_id, run.flow_digest, flow.digest)
            findings.append(ReplayFinding(run_id=run.run_id, kind="drift", message=str(drift)))
            continue
        problem = await _nondeterminism(store, run.run_id, flow, agents)
        if problem is not None:
            findings.append(
                ReplayFinding(run_id=run.run_id, kind="nondeterminism", message=problem)
            )
    return findings
