"""Drives a run for one turn: a flow's nodes, or the agent loop of a conversation
(the built-in one, or the agent's own ``loop``) (internal).

The driver re-enters the run's *active* node from its start; every effect
the node already performed replays from the journal because the node's
callsites count from the base recorded when the node was entered. The driver
owns the callsite cursor: one per node visit (or per conversation epoch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from .._definitions.agents import Agent
from .._definitions.flows import (
    ActionNode,
    CollectNode,
    End,
    Flow,
    Goto,
    Handoff,
    Node,
    ReplyNode,
    to_transition,
)
from .._definitions.llm import ModelRequest, ModelResponse
from .._journal.keys import logical_run_id
from .._journal.wait import INPUT
from ..errors import FlowDriftError
from ..shapes import Message, StreamPart
from .agent_loop import agent_turn
from .context import RunContext
from .cursor import Cursor
from .loop_turn import JournaledLoopTurn
from .model_calls import model_turn
from .streaming import TurnStream
from .suspensions import Schemas, WaitRequest, suspend
from .writer import RunWriter

__all__ = ["Driven", "drive", "drive_flow"]

#: Where a turn's parts go (to its handle and its stored stream).
Emit = TurnStream


@dataclass(frozen=True)
class Driven:
    """How a turn's driving ended (a suspend or a failure raises instead)."""

    transition: End | Handoff
    state: dict[str, Any]
    #: Whether the agent loop of a conversation was driven (not a flow).
    conversation: bool = False
    #: That loop's final reply (recorded or fresh).
    reply: str | None = None


async def drive(
    writer: RunWriter,
    agent: Agent,
    flow: Flow | None,
    emit: Emit,
    *,
    schemas: Schemas,
    max_tool_concurrency: int,
) -> Driven:
    """Drive the run: its flow's nodes, or else its agent's loop."""
    if flow is not None:
        transition, state = await drive_flow(writer, flow, agent, emit, schemas)
        return Driven(transition, state)
    cursor = Cursor(logical_run_id(writer.run_id, writer.epoch), writer.callsite_base)
    try:
        if agent.loop is not None:  # an agent loop of its own (docs/pydantic-ai.md)
            reply = await agent.loop.drive(JournaledLoopTurn(writer, cursor, agent, emit))
        else:
            reply = await agent_turn(writer, cursor, agent, emit, max_tool_concurrency)
    except Exception:
        writer.admission.raise_if_stopped()
        raise
    finally:
        await writer.admission.settle()
    writer.admission.raise_if_stopped()
    return Driven(End(None), writer.state(), conversation=True, reply=reply)


async def drive_flow(
    writer: RunWriter, flow: Flow, agent: Agent, emit: Emit, schemas: Schemas
) -> tuple[End | Handoff, dict[str, Any]]:
    """Run nodes from the active one; returns the transition that left the flow
    and the state bag as the last node left it.

    ``SuspendError`` and node failures propagate to the turn, which closes
    the run accordingly. Node-entry events are not saved on their own: they
    ride on the next save (a step intent or the turn's close).
    """
    while True:
        node_id = writer.active_node
        if node_id is None or node_id not in flow.nodes:
            # Driven on a definition it was not pinned to (the runtime lacks that
            # one), which lacks the node the run stands at.
            raise FlowDriftError(writer.run_id, writer.flow_digest, flow.digest)
        node = flow.node(node_id)
        cursor = Cursor(
            logical_run_id(writer.run_id, writer.epoch, flow.name, writer.flow_digest),
            writer.callsite_base,
        )
        state = writer.state()
        ctx = RunContext(writer, cursor, agent.tools, emit, schemas, flow.input)
        visit = _Visit(writer, cursor, flow, agent, emit, schemas, ctx)
        try:
            returned = await _run_node(node, state, visit)
        except Exception:
            # A suspension (or a stop) wins over whatever the node raised after catching it.
            writer.admission.raise_if_stopped()
            raise
        finally:
            # The context refuses effects from now on (a task left running);
            # every effect already admitted, such as the rest of a gather batch
            # when one of them suspended or failed, finishes and journals.
            ctx.close()
            await writer.admission.settle()
        # A node that caught a suspension and returned: its return is discarded.
        writer.admission.raise_if_stopped()
        transition = to_transition(returned, flow, node_id)
        if isinstance(transition, Goto) and transition.data:
            state.update(transition.data)
        if isinstance(transition, Goto):
            writer.enter_node(flow.name, transition.node, state, cursor.next)
            continue
        return transition, state


@dataclass(frozen=True)
class _Visit:
    """What one node visit works with."""

    writer: RunWriter
    cursor: Cursor
    flow: Flow
    agent: Agent
    emit: Emit
    schemas: Schemas
    #: The context of an action node (bound to this visit).
    ctx: RunContext


async def _run_node(node: Node, state: dict[str, Any], visit: _Visit) -> Any:
    if isinstance(node, ActionNode):
        return await node.run(state, visit.ctx)
    if isinstance(node, CollectNode):
        return await _collect(node, state, visit)
    assert isinstance(node, ReplyNode), f"define_flow admits no node of kind {node.kind!r}"
    return await _reply(node, state, visit)


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


async def _collect(node: CollectNode, state: dict[str, Any], visit: _Visit) -> Any:
    writer, cursor = visit.writer, visit.cursor
    request = ModelRequest(
        purpose="extract",
        messages=writer.messages(),
        instructions=(
            f"Extract the fields of {node.schema.__name__} that the user has given in the "
            "conversation. Leave out anything not stated."
        ),
        schema=node.schema.model_json_schema(),
    )
    response = await model_turn(
        writer, cursor, visit.agent.model, request, budget=visit.agent.budget, stream=visit.emit
    )
    state.update(_valid_fields(node.schema, response.data or {}))
    missing = [name for name in node.required if state.get(name) is None]
    if missing:
        question = node.ask(missing)
        # Keep what was collected so far, and give the next pass fresh callsites
        # so that it extracts again from the conversation as it will be then.
        writer.enter_node(visit.flow.name, node.id, state, cursor.next)
        writer.append_message(Message(role="assistant", content=question))
        visit.emit(StreamPart(type="text", text=question))
        missing_input = WaitRequest(INPUT, question, f"missing: {', '.join(missing)}")
        suspend(writer, cursor.site(cursor.next), "input", missing_input)
    data = {name: state[name] for name in node.schema.model_fields if state.get(name) is not None}
    return node.on_complete(data)


async def _reply(node: ReplyNode, state: dict[str, Any], visit: _Visit) -> Any:
    writer = visit.writer

    def on_new(response: ModelResponse) -> None:
        writer.append_message(Message(role="assistant", content=response.content))

    request = ModelRequest(
        purpose="reply", messages=writer.messages(), instructions=node.instructions
    )
    await model_turn(
        writer,
        visit.cursor,
        visit.agent.model,
        request,
        on_new,
        budget=visit.agent.budget,
        stream=visit.emit,
    )
    return node.next_transition(state)
