"""Drives a run for one turn: a flow's nodes, or the agent loop of a conversation.

The driver re-enters the run's *active* node from its start; every effect
the node already performed replays from the journal because the node's
callsites count from the base recorded when the node was entered.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from .agents import Agent
from .context import RunContext
from .flows import ActionNode, CollectNode, End, Flow, Goto, Handoff, Node, ReplyNode, to_transition
from .journal import Journal
from .keys import logical_run_id
from .llm import ModelRequest, ModelResponse
from .model_steps import model_turn
from .models import Message, StreamPart
from .tools import encode_json
from .waits import INPUT, suspend

__all__ = ["drive_flow"]

Emit = Callable[[StreamPart], None]


async def drive_flow(
    journal: Journal, flow: Flow, agent: Agent, emit: Emit
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
        try:
            returned = await _run_node(node, state, journal, flow, agent, emit)
        finally:
            # Let every effect of a gather batch finish and journal, even when
            # one of them suspended or failed, before the turn moves on.
            await journal.settle()
        transition = to_transition(returned, flow, node_id)
        if isinstance(transition, Goto) and transition.data:
            state.update(transition.data)
        # The state bag is journaled: refuse what JSON cannot hold before any event.
        encode_json(state, f"the state bag left by node {node_id!r} of flow {flow.name!r}")
        if isinstance(transition, Goto):
            run.enter_node(flow.name, transition.node, state, journal.next_callsite)
            continue
        return transition, state


async def _run_node(
    node: Node, state: dict[str, Any], journal: Journal, flow: Flow, agent: Agent, emit: Emit
) -> Any:
    if isinstance(node, ActionNode):
        return await node.run(state, RunContext(journal, agent.tools, emit))
    if isinstance(node, CollectNode):
        return await _collect(node, state, journal, flow, agent, emit)
    if isinstance(node, ReplyNode):
        return await _reply(node, state, journal, agent, emit)
    msg = f"node {node.id!r} of flow {flow.name!r} is of unknown kind {node.kind!r}"
    raise TypeError(msg)


def _messages(journal: Journal) -> list[Message]:
    return [Message.model_validate(m) for m in journal.run.messages]


def _valid_fields(schema: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """The extracted values that fit their schema fields, as JSON data."""
    fields: dict[str, Any] = {}
    for name, value in data.items():
        info = schema.model_fields.get(name)
        if info is None or value is None:
            continue
        adapter: TypeAdapter[Any] = TypeAdapter(info.annotation if info.annotation else Any)
        try:
            fields[name] = adapter.dump_python(adapter.validate_python(value), mode="json")
        except ValidationError:
            continue  # a value that does not fit is as good as missing: ask again
    return fields


async def _collect(
    node: CollectNode,
    state: dict[str, Any],
    journal: Journal,
    flow: Flow,
    agent: Agent,
    emit: Emit,
) -> Any:
    run = journal.run
    request = ModelRequest(
        purpose="extract",
        messages=_messages(journal),
        instructions=(
            f"Extract the fields of {node.schema.__name__} that the user has given in the "
            "conversation. Leave out anything not stated."
        ),
        schema=node.schema.model_json_schema(),
    )
    response = await model_turn(journal, agent.model, request)
    state.update(_valid_fields(node.schema, response.data or {}))
    missing = [name for name in node.required if state.get(name) is None]
    if missing:
        question = node.ask(missing)
        # Keep what was collected so far, and give the next pass fresh callsites
        # so that it extracts again from the conversation as it will be then.
        run.enter_node(flow.name, node.id, state, journal.next_callsite)
        journal.begin_visit(journal.logical_run, journal.next_callsite)
        run.append_message(Message(role="assistant", content=question))
        emit(StreamPart(type="text", text=question))
        suspend(
            journal,
            callsite=journal.next_callsite,
            name=INPUT,
            kind="input",
            title=question,
            description=f"missing: {', '.join(missing)}",
        )
    data = {name: state[name] for name in node.schema.model_fields if state.get(name) is not None}
    return node.on_complete(data)


async def _reply(
    node: ReplyNode, state: dict[str, Any], journal: Journal, agent: Agent, emit: Emit
) -> Any:
    run = journal.run

    def on_new(response: ModelResponse) -> None:
        run.append_message(Message(role="assistant", content=response.content))
        if response.content:
            emit(StreamPart(type="text", text=response.content))

    request = ModelRequest(
        purpose="reply", messages=_messages(journal), instructions=node.instructions
    )
    await model_turn(journal, agent.model, request, on_new)
    return node.next_transition(state)
