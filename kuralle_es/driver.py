"""Walks a flow's nodes for one turn until it ends, hands off, or suspends.

The driver re-enters the run's *active* node from its start; every effect
the node already performed replays from the journal because the node's
callsites count from the base recorded when the node was entered.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from .agents import Agent
from .context import RunContext
from .flows import ActionNode, End, Flow, Goto, Handoff, to_transition
from .journal import Journal
from .keys import logical_run_id
from .models import StreamPart

__all__ = ["drive_flow"]


async def drive_flow(
    journal: Journal, flow: Flow, agent: Agent, emit: Callable[[StreamPart], None]
) -> tuple[End | Handoff, dict[str, Any]]:
    """Run nodes from the active one; returns the transition that left the flow
    and the state bag as the last node left it.

    ``SuspendError`` and node failures propagate to the turn, which closes
    the run accordingly. Node-entry events are not saved on their own: they
    ride on the next save (a step intent or the turn's close).
    """
    run = journal.run
    while True:
        node_id = run.active_node
        if node_id is None or node_id not in flow.nodes:
            msg = f"run {run.run_id} is at node {node_id!r}, which flow {flow.name!r} lacks"
            raise LookupError(msg)
        node = flow.node(node_id)
        journal.begin_visit(
            logical_run_id(run.run_id, run.epoch, flow.name, run.flow_digest),
            run.callsite_base,
        )
        state = copy.deepcopy(run.state)
        if not isinstance(node, ActionNode):
            msg = f"node {node_id!r} of flow {flow.name!r} is a {node.kind} node; not supported"
            raise TypeError(msg)
        ctx = RunContext(journal, agent.tools, emit)
        try:
            returned = await node.run(state, ctx)
        finally:
            # Let every effect of a gather batch finish and journal, even when
            # one of them suspended or failed, before the turn moves on.
            await journal.settle()
        transition = to_transition(returned, flow, node_id)
        if isinstance(transition, Goto):
            if transition.data:
                state.update(transition.data)
            run.enter_node(flow.name, transition.node, state, journal.next_callsite)
            continue
        return transition, state
