"""Flows: nodes, transitions, and the flow's stable digest.

A node returns a transition; ``to_transition`` turns every accepted form
(a node, ``goto``/``end``/``handoff``, or their dict forms) into one of three
small value types, so the driver handles exactly three cases.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from .._journal.keys import canonical_json, sha256_hex
from ..errors import InvalidArgumentError, InvalidDefinitionError

__all__ = [
    "ActionNode",
    "CollectNode",
    "End",
    "Flow",
    "Goto",
    "Handoff",
    "Node",
    "ReplyNode",
    "Transition",
    "action",
    "collect",
    "define_flow",
    "end",
    "goto",
    "handoff",
    "pinned_version",
    "reply",
    "to_transition",
    "version_key",
]


@dataclass(frozen=True)
class Goto:
    """A transition to another node of the flow (see ``goto``)."""

    node: str
    data: dict[str, Any] | None = None


@dataclass(frozen=True)
class End:
    """A transition that finishes the flow (see ``end``)."""

    reason: str | None = None


@dataclass(frozen=True)
class Handoff:
    """A transition that leaves the flow for another agent (see ``handoff``)."""

    to: str
    reason: str | None = None


Transition = Goto | End | Handoff


def goto(node_id: str | Node, data: dict[str, Any] | None = None) -> Goto:
    """Go to ``node_id`` next; ``data`` is merged into the flow's state bag first."""
    return Goto(node_id.id if isinstance(node_id, Node) else node_id, data)


def end(reason: str | None = None) -> End:
    """Finish the flow; a flow run ends ``finished`` with ``outcome`` set to ``reason``."""
    return End(reason)


def handoff(to: str, reason: str | None = None) -> Handoff:
    """Leave the flow for agent ``to``: a conversation goes on with it next turn."""
    return Handoff(to, reason)


@dataclass(frozen=True)
class Node:
    """Base of every flow node: an id and a kind."""

    id: str

    @property
    def kind(self) -> str:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What of this node enters the flow digest."""
        return {"id": self.id, "kind": self.kind}


#: ``async def run(state, ctx)``, ``ctx`` being the node's ``RunContext``. Typed ``Any``
#: here: definitions sit below the runtime that drives them (a node annotated
#: ``ctx: RunContext`` fits).
ActionRun = Callable[[dict[str, Any], Any], Awaitable[Any]]


@dataclass(frozen=True)
class ActionNode(Node):
    """Durable logic: ``async def run(state, ctx)`` returning a transition."""

    run: ActionRun = field(compare=False)

    @property
    def kind(self) -> str:
        return "action"


def action(id: str, run: ActionRun) -> ActionNode:
    """A node of durable logic: ``async def run(state, ctx)`` returns a transition.

    Every side effect it makes through ``ctx`` is journaled and replayed.
    Raises ``InvalidDefinitionError`` (a ``TypeError``) when ``run`` is not callable.
    """
    if not callable(run):
        msg = f"action {id!r}: run must be an async callable (state, ctx)"
        raise InvalidDefinitionError(msg)
    return ActionNode(id=id, run=run)


@dataclass(frozen=True)
class CollectNode(Node):
    """Gathers ``schema`` fields from the conversation, asking for what is missing."""

    schema: type[BaseModel] = field(compare=False)
    required: tuple[str, ...] = ()
    ask: Callable[[list[str]], str] = field(compare=False, default=lambda missing: "")
    on_complete: Callable[[dict[str, Any]], Any] = field(compare=False, default=lambda d: None)

    @property
    def kind(self) -> str:
        return "collect"

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "schema": self.schema.model_json_schema(),
            "required": list(self.required),
        }


@dataclass(frozen=True)
class ReplyNode(Node):
    """One model turn with ``instructions``, then ``next``."""

    instructions: str = ""
    next: Any = field(compare=False, default=None)

    @property
    def kind(self) -> str:
        return "reply"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "instructions": self.instructions, "next": _edge(self.next)}

    def next_transition(self, state: dict[str, Any]) -> Any:
        if callable(self.next) and not isinstance(self.next, Node):
            return self.next(state) if _arity(self.next) else self.next()
        return self.next


def _arity(fn: Callable[..., Any]) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return 1


def _edge(value: Any) -> Any:
    """A static transition as digest data; a callable edge is only known at run time."""
    if isinstance(value, Node):
        return {"goto": value.id}
    if isinstance(value, str):
        return {"goto": value}
    if isinstance(value, Goto):
        return {"goto": value.node, "data": value.data}
    if isinstance(value, End):
        return {"end": value.reason}
    if isinstance(value, Handoff):
        return {"handoff": value.to, "reason": value.reason}
    if isinstance(value, Mapping):
        return dict(value)
    return "<dynamic>"


def collect(
    id: str,
    schema: type[BaseModel],
    required: Sequence[str],
    ask: Callable[[list[str]], str],
    on_complete: Callable[[dict[str, Any]], Any],
) -> CollectNode:
    """A node that gathers ``schema``'s fields from the conversation.

    The model extracts what the user said; while a field of ``required`` is
    missing the run replies with ``ask(missing)`` and pauses for input. Then
    ``on_complete(data)`` returns the transition (the fields also enter the
    state bag).
    """
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        msg = f"collect {id!r}: schema must be a pydantic model class, got {schema!r}"
        raise InvalidDefinitionError(msg)
    unknown = [f for f in required if f not in schema.model_fields]
    if unknown:
        msg = (
            f"collect {id!r}: required fields {unknown!r} are not fields of "
            f"{schema.__name__} ({sorted(schema.model_fields)!r})"
        )
        raise InvalidArgumentError(msg)
    return CollectNode(
        id=id, schema=schema, required=tuple(required), ask=ask, on_complete=on_complete
    )


def reply(id: str, instructions: str, next: Any) -> ReplyNode:
    """A node that makes one model turn with ``instructions``, then follows ``next``
    (a transition, or a callable of the state bag returning one)."""
    return ReplyNode(id=id, instructions=instructions, next=next)


def to_transition(value: Any, flow: Flow, node_id: str) -> Transition:
    """Normalise what a node returned; anything else is a clear error."""
    if isinstance(value, Goto | End | Handoff):
        transition: Transition = value
    elif isinstance(value, Node):
        transition = Goto(value.id)
    elif isinstance(value, str):
        transition = Goto(value)
    elif isinstance(value, Mapping):
        transition = _transition_from_mapping(value, flow, node_id)
    else:
        msg = (
            f"node {node_id!r} of flow {flow.name!r} returned {value!r}; return a node, "
            "goto(id), end(reason), handoff(to, reason) or their dict forms"
        )
        raise TypeError(msg)
    if isinstance(transition, Goto) and transition.node not in flow.nodes:
        msg = (
            f"node {node_id!r} of flow {flow.name!r} goes to unknown node "
            f"{transition.node!r}; the flow has {sorted(flow.nodes)!r}"
        )
        raise ValueError(msg)  # a bug in the flow, recorded as the run's error: not a refusal
    return transition


def _transition_from_mapping(value: Mapping[str, Any], flow: Flow, node_id: str) -> Transition:
    if "goto" in value:
        data = value.get("data")
        return Goto(str(value["goto"]), dict(data) if data else None)
    if "end" in value:
        reason = value["end"]
        return End(None if reason is None else str(reason))
    if value.get("kind") == "handoff":
        return Handoff(str(value["to"]), value.get("reason"))
    msg = (
        f"node {node_id!r} of flow {flow.name!r} returned {dict(value)!r}; dict transitions "
        "are {'goto': id, 'data': {...}}, {'end': reason} or "
        "{'kind': 'handoff', 'to': ..., 'reason': ...}"
    )
    raise InvalidArgumentError(msg)


@dataclass(frozen=True)
class Flow:
    """A named graph of nodes, entered at ``start``.

    ``version`` is an optional label (``define_flow(..., version="2")``) that
    tells several definitions of one flow apart: a runtime given several
    starts new runs on the newest (``version_key``) and resumes each run on
    the definition whose ``digest`` it pinned. The label is not part of the
    digest.
    """

    name: str
    description: str
    start: str
    nodes: dict[str, Node]
    digest: str
    version: str | None = None
    #: The model a run's input is validated against (``define_flow(..., input=...)``),
    #: which node code reads as ``ctx.input``; None: the flow takes text.
    input: type[BaseModel] | None = None

    def node(self, node_id: str) -> Node:
        return self.nodes[node_id]


_VERSION_PARTS = re.compile(r"([0-9]+)")


def version_key(version: str | None) -> tuple[tuple[int, int, str], ...]:
    """How flow versions compare: naturally, runs of digits as numbers, so
    ``"2" < "10"`` and ``"1.9" < "1.10"``; a flow without a version is older
    than every flow with one."""
    if version is None:
        return ()
    parts = _VERSION_PARTS.split(version)
    return tuple(
        (0, int(part), "") if part[0] in "0123456789" else (1, 0, part) for part in parts if part
    )


def pinned_version(
    versions: Sequence[Flow], digest: str | None, version: str | None
) -> Flow | None:
    """Of ``versions`` (definitions of one flow), the one a run pinned to ``digest``
    and labelled ``version`` resumes on, or None when none has that digest.

    Versions with identical definitions share a digest: the one with the run's
    own label is taken then, else the newest of them.
    """
    same = [flow for flow in versions if flow.digest == digest]
    for flow in same:
        if flow.version == version:
            return flow
    return max(same, key=lambda flow: version_key(flow.version)) if same else None


def _version_label(name: str, version: str | int | None) -> str | None:
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, str | int):
        msg = f"flow {name!r}: version must be a string (or an int), got {version!r}"
        raise InvalidArgumentError(msg)
    label = str(version).strip()
    if not label:
        msg = f"flow {name!r}: version must not be empty; leave it out for no version"
        raise InvalidArgumentError(msg)
    return label


def define_flow(
    name: str,
    description: str,
    start: Node | str,
    nodes: Sequence[Node],
    *,
    version: str | int | None = None,
    input: type[BaseModel] | None = None,
) -> Flow:
    """Define a flow; ids are checked and the digest is computed once, here.

    ``version`` labels this definition (``"2"``; an int is taken as its text)
    so a runtime can hold several definitions of the flow at once: new runs
    start on the newest (compared naturally, ``"10"`` after ``"2"``), and a
    run resumes on the definition whose digest it pinned (docs/deploying.md).
    The label does not enter ``digest``.

    ``input`` (a pydantic model class) makes the flow take typed input: a
    start validates what it is given against the model (a refusal is
    ``InvalidArgumentError`` naming the fields) and node code reads it as
    ``ctx.input`` (docs/child-runs.md). Its JSON schema enters ``digest``; a
    flow without ``input`` keeps the digest it always had.
    """
    label = _version_label(name, version)
    if input is not None and not (isinstance(input, type) and issubclass(input, BaseModel)):
        msg = f"flow {name!r}: input must be a pydantic model class, got {input!r}"
        raise InvalidDefinitionError(msg)
    by_id: dict[str, Node] = {}
    for node in nodes:
        if not isinstance(node, Node):
            msg = f"flow {name!r}: {node!r} is not a node (use action(...), collect(...), ...)"
            raise InvalidDefinitionError(msg)
        if node.id in by_id:
            msg = f"flow {name!r}: two nodes share the id {node.id!r}"
            raise InvalidArgumentError(msg)
        by_id[node.id] = node
    start_id = start.id if isinstance(start, Node) else start
    if start_id not in by_id:
        msg = f"flow {name!r}: start node {start_id!r} is not one of {sorted(by_id)!r}"
        raise InvalidArgumentError(msg)
    description_of_flow: dict[str, Any] = {
        "name": name,
        "start": start_id,
        "nodes": [by_id[k].describe() for k in sorted(by_id)],
    }
    if input is not None:  # only then: the digests of untyped flows never change
        description_of_flow["input"] = input.model_json_schema()
    digest = sha256_hex(canonical_json(description_of_flow))
    return Flow(
        name=name, description=description, start=start_id, nodes=by_id, digest=digest,
        version=label, input=input,
    )  # fmt: skip
