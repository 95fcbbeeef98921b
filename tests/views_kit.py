"""Runs in every status, for the view tests (and the processes they spawn).

``populate(runtime)`` drives real turns (flows that finish, fail, pause on an
approval, a signal or input, a drifted flow abandoned) and adds the states a
single process cannot reach through turns alone — a worker that died holding
its lease, a live lease, a due durable-sleep timer — through the ``Run``
aggregate's own commands, as a crashed worker or the runtime would leave them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import uuid4

from pydantic import BaseModel

from kuralle_es import (
    ModelRequest,
    ModelResponse,
    RunState,
    RunStore,
    Runtime,
    ToolExecutionError,
    WaitingFor,
    action,
    collect,
    define_agent,
    define_flow,
    define_tool,
    end,
)
from kuralle_es._definitions.agents import Agent
from kuralle_es._journal import catalogue as stored
from kuralle_es._journal.leases import LeaseOp
from kuralle_es._journal.run import Run
from kuralle_es.examples.refund import refund_flow
from kuralle_es.testing import ScriptedModel

SESSION = "views-session"
PAST = datetime(2001, 1, 1, tzinfo=UTC)
FUTURE = datetime(2999, 1, 1, tzinfo=UTC)


class Empty(BaseModel):
    pass


class Count(BaseModel):
    i: int


#: Tool calls of one run of the "many" flow (about twice as many events).
MANY = 40


class Details(BaseModel):
    amount: float | None = None


def _ping(args: Empty) -> dict[str, Any]:
    return {"pong": True}


def _boom(args: Empty) -> dict[str, Any]:
    raise RuntimeError("the payment API said no")


def _count(args: Count) -> dict[str, Any]:
    return {"i": args.i}


async def _many(state: dict[str, Any], ctx: Any) -> Any:
    for i in range(MANY):
        await ctx.tool("count", {"i": i})
    return end("counted")


async def _quick(state: dict[str, Any], ctx: Any) -> Any:
    await ctx.tool("ping", {})
    await ctx.tool("ping", {})
    return end("done")


async def _flaky(state: dict[str, Any], ctx: Any) -> Any:
    with contextlib.suppress(ToolExecutionError):
        await ctx.tool("boom", {})
    return end("handled")


async def _crash(state: dict[str, Any], ctx: Any) -> Any:
    await ctx.tool("ping", {})
    raise RuntimeError("a bug in the node")


async def _approve(state: dict[str, Any], ctx: Any) -> Any:
    await ctx.approve("refund?", deadline=PAST)
    return end("approved")


async def _signal(state: dict[str, Any], ctx: Any) -> Any:
    await ctx.signal("shipment", deadline=FUTURE)
    return end("shipped")


async def _drift_v1(state: dict[str, Any], ctx: Any) -> Any:
    await ctx.signal("never")
    return end("v1")


async def _drift_v2(state: dict[str, Any], ctx: Any) -> Any:
    return end("v2")


def _model(request: ModelRequest) -> ModelResponse | str:
    if request.purpose == "extract":
        return ModelResponse(data={})
    return "hello"


def agent(drift_version: int = 1) -> Agent:
    """The views' test agent; ``drift_version=2`` changes the ``drifty`` flow."""
    drifty = (
        define_flow("drifty", "v1", "wait", [action("wait", _drift_v1)])
        if drift_version == 1
        else define_flow("drifty", "v2", "other", [action("other", _drift_v2)])
    )
    flows = [
        define_flow("quick", "pings twice", "go", [action("go", _quick)]),
        define_flow("many", "many tool calls", "go", [action("go", _many)]),
        define_flow("flaky", "a tool fails", "go", [action("go", _flaky)]),
        define_flow("crash", "the node raises", "go", [action("go", _crash)]),
        define_flow("approve", "asks a human", "ask", [action("ask", _approve)]),
        define_flow("signal", "waits for a shipment", "wait", [action("wait", _signal)]),
        define_flow(
            "intake",
            "collects an amount",
            "amount",
            [collect("amount", Details, ["amount"], lambda m: f"need {m}", lambda d: end("ok"))],
        ),
        drifty,
    ]
    tools = [
        define_tool("ping", "answers", Empty, _ping),
        define_tool("boom", "fails", Empty, _boom),
        define_tool("count", "echoes its number", Count, _count),
    ]
    return define_agent("views", "test agent", ScriptedModel(_model), tools, flows)


@dataclass
class Populated:
    """Run ids by what they were left as."""

    by_case: dict[str, str] = field(default_factory=dict)

    @property
    def run_ids(self) -> list[str]:
        return list(self.by_case.values())


async def start(runtime: Runtime, flow: str, session: str = SESSION) -> str:
    handle = runtime.run(session, input="go", kind="flow", flow_name=flow)
    run_id = await handle.run_id
    with contextlib.suppress(Exception):  # "crash" ends in error, as it should
        await handle.result()
    return run_id


async def populate(runtime: Runtime, drifted: Runtime | None = None) -> Populated:
    """Leave runs of ``runtime``'s store in every status the views tell apart."""
    out = Populated()
    for case in ("quick", "flaky", "crash", "approve", "signal", "intake"):
        out.by_case[case] = await start(runtime, case)
    convo = await runtime.run("conversation-session", input="hi").result()
    out.by_case["conversation"] = convo.run_id
    out.by_case["drifty"] = await start(runtime, "drifty")
    if drifted is not None:
        await drifted.resolve_drift(out.by_case["drifty"], SESSION, "abandon")
    now = datetime.now(UTC)
    out.by_case["orphan"] = leave_run(runtime.store, lease_until=now - timedelta(minutes=5))
    out.by_case["leased"] = leave_run(runtime.store, lease_until=now + timedelta(minutes=5))
    out.by_case["timer"] = leave_run(runtime.store, timer_due=now - timedelta(seconds=1))
    out.by_case["sleeping"] = leave_run(runtime.store, timer_due=FUTURE)
    return out


def leave_run(
    store: RunStore,
    *,
    lease_until: datetime | None = None,
    timer_due: datetime | None = None,
    session: str = SESSION,
) -> str:
    """A flow run left by a worker: holding a lease, or asleep on a durable timer."""
    run = Run(uuid4(), session, "flow", "views", "quick", "digest")
    lease = None
    if lease_until is not None:
        # The lease record a worker took before it died (a TTL that ends at
        # ``lease_until``: a negative one for a lease that lapsed already).
        ttl = lease_until - datetime.now(UTC)
        lease = LeaseOp.take(run.id, "a-worker-that-died", "its-token", ttl)
    if timer_due is not None:
        wait = WaitingFor(
            name="__timer", callsite=0, request_id=uuid4().hex, kind="timer", deadline=timer_due
        )
        # The stored shape of a pause: the public wait plus what the runtime reads back.
        shape = {**wait.model_dump(mode="json"), "logical_run": f"{run.run_id}#0"}
        run.trigger_event(stored.Paused, waiting_for=shape)
    store.create_run(run, lease)
    return run.run_id


def expected_summary(state: RunState) -> dict[str, Any]:
    """What a ``RunSummary`` of this run must say: the fold of its events."""
    keys = (
        "run_id", "session_id", "kind", "status", "active_flow", "active_node",
        "waiting_for", "lease_holder", "lease_expires_at", "step_count", "updated_at",
        "flow_version", "parent", "subject",
    )  # fmt: skip
    dumped = state.model_dump(mode="json")
    # The last flow the run was in: an ended run keeps its flow's digest.
    flows = {f.digest: f.name for a in (agent(), agent(2)) for f in a.flows.values()}
    flows[refund_flow.digest] = refund_flow.name
    return {
        **{k: dumped[k] for k in keys},
        "flow": state.active_flow or flows.get(state.flow_digest or ""),
        "node": state.active_node or last_node(state),
        "outcome": state.outcome,
        "error_type": state.error.type if state.error is not None else None,
    }


#: The node each test flow ends in (its only one): an ended run's last node.
_END_NODES = {"quick": "go", "many": "go", "flaky": "go", "crash": "go", "approve": "ask",
              "signal": "wait", "intake": "amount"}  # fmt: skip


def last_node(state: RunState) -> str | None:
    """The last node of an ended run of this kit's flows (None outside a flow)."""
    if state.flow_digest == refund_flow.digest:
        return state.outcome  # its last nodes are named after how it ends
    flows = {f.digest: f for a in (agent(), agent(2)) for f in a.flows.values()}
    flow = flows.get(state.flow_digest or "")
    if flow is None:
        return None
    return _END_NODES.get(flow.name, flow.start)
