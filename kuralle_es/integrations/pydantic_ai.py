"""Pydantic AI agents made durable on the journal (docs/pydantic-ai.md).

``durable(agent, runtime)`` keeps the ``pydantic_ai.Agent`` a user wrote and runs
each of its turns as a user turn of a kuralle_es conversation run. Nothing of
Pydantic AI's loop is rewritten: a capability added to each run puts the
journal under it, at the three places where a run touches the world:

- every model request goes through the journal as a ``model`` step (a
  ``WrapperModel``), its ``ModelResponse`` recorded in Pydantic AI's own JSON
  form, so a replay hands the agent the very response it had. Requests are
  streamed (docs/streaming.md): the model's text deltas go to the turn's
  stream as they come, and so do its events to an ``event_stream_handler``
  given to ``DurableAgent.run``, inside the step; Pydantic AI then gets the
  journaled response as a completed stream (the way its own durable
  integrations hand a step's response to a workflow), replayed as events
  for a handler that did not see it live;

- every tool call goes through the journal as a ``tool`` step (a
  ``WrapperToolset``), with the idempotency key of docs/concepts.md;
- approval-required tools (``requires_approval=True``) reach Pydantic AI's
  ``handle_deferred_tool_calls`` hook, answered from the journal: the run
  pauses on ``__approval`` with the operation frozen until someone decides,
  from any process (docs/howto/approvals.md), and a denial is a ``ToolDenied``.

A resume re-runs the agent from the turn's start; every step the journal has
is replayed, so the model and the tools are asked only for what is new.

``DurableAgent.iter`` is ``Agent.iter`` on a durable turn: the graph runs in the
turn's task, each node handed to the caller before it runs; the journal calls
of a node the caller streams (in its own task) are made by the turn's task, so
the journal is written by the turn that holds the lease only (``_Handoff``).

Agent delegation (a tool that runs another agent) goes through ``delegate``:
``await delegate(other).run(prompt)`` inside a tool makes the other agent's
turn a child run of the calling run (``LoopTurn.child``), journaled step by
step in its own run instead of inside the calling tool's one step.

``DurableAgent.run`` takes what ``Agent.run`` takes that a durable turn can
keep: ``deps`` (handed to the agent on every pass, never journaled: each
process supplies its own), ``message_history`` (journaled with the turn, so
every pass in any process sees it), ``usage_limits`` (the run's ``Budget``)
and an ``idempotency_key``; its ``output`` is typed (the agent's
``output_type``) whichever process drove the turn, rebuilt from the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union, get_type_hints

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic_core import to_json, to_jsonable_python

from kuralle_es import Agent as KuralleAgent
from kuralle_es import (
    Budget,
    InvalidArgumentError,
    LoopTurn,
    ModelRequest,
    ModelResponse,
    RunNotFoundError,
    Runtime,
    ToolCall,
    ToolCallRequest,
    TurnHandle,
    TurnResult,
    WaitingFor,
    define_agent,
    define_tool,
)
from kuralle_es._lookup import known_entry
from kuralle_es.redaction import Redacted
from kuralle_es.shapes import Message

try:
    from pydantic_ai import Agent, ModelRetry, NativeOutput, PromptedOutput, TextOutput, ToolOutput
    from pydantic_ai.agent import AgentRun, AgentRunResult, EventStreamHandler
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import (
        AgentStreamEvent,
        ModelMessage,
        ModelMessagesTypeAdapter,
        ModelRequestPart,
        PartDeltaEvent,
        PartStartEvent,
        RetryPromptPart,
        SystemPromptPart,
        TextPart,
        TextPartDelta,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
        repair_messages,
    )
    from pydantic_ai.messages import ModelRequest as PaiRequest
    from pydantic_ai.messages import ModelResponse as PaiResponse
    from pydantic_ai.models import (
        CompletedStreamedResponse,
        Model,
        ModelRequestParameters,
        StreamedResponse,
    )
    from pydantic_ai.models.wrapper import WrapperModel
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.tools import DeferredToolRequests, DeferredToolResults, RunContext, ToolDenied
    from pydantic_ai.toolsets import AbstractToolset, WrapperToolset
    from pydantic_ai.toolsets.abstract import ToolsetTool
    from pydantic_ai.usage import UsageLimits
    from pydantic_graph import End
except ImportError as missing:  # pragma: no cover - the extra is installed in CI
    msg = (
        "kuralle_es.integrations.pydantic_ai needs Pydantic AI: "
        "pip install 'kuralle_es[pydantic-ai]'"
    )
    raise ImportError(msg) from missing

__all__ = [
    "Delegate",
    "DurableAgent",
    "DurableAgentRun",
    "DurableRunResult",
    "DurableStreamedRun",
    "definition",
    "delegate",
    "durable",
    "tool_call",
    "typed_output",
]

#: The key of a model step's recorded Pydantic AI response in ``ModelResponse.data``.
RESPONSE_KEY = "pydantic_ai"
#: How a tool's ``ModelRetry`` is journaled: as its result, so a replay retries alike.
MODEL_RETRY_KEY = "__pydantic_ai_model_retry"
#: The journaled call a tool runs as (``tool_call()``), while it runs.
_current_call: contextvars.ContextVar[ToolCall | None] = contextvars.ContextVar(
    "kuralle_pydantic_ai_tool_call", default=None
)
#: What a ``DurableAgent.run`` call gives the turns it drives (this call's only).
_call: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "kuralle_pydantic_ai_call", default=None
)
#: The handoff whose turn this context runs in (``iter``): its graph's own tasks too.
_in_turn: contextvars.ContextVar[_Handoff | None] = contextvars.ContextVar(
    "kuralle_pydantic_ai_in_turn", default=None
)
#: The name of the ``value`` step a turn's given message history is journaled as.
HISTORY = "message_history"


@dataclass
class _InsideCall:
    """The tool call now executing, as the delegations it makes see it: its turn and
    callsite, and how many child runs this execution of it has asked for."""

    turn: LoopTurn
    callsite: int
    started: int = 0


#: The journaled tool call whose body runs now (``Delegate.run`` starts its children).
_inside_call: contextvars.ContextVar[_InsideCall | None] = contextvars.ContextVar(
    "kuralle_pydantic_ai_inside_call", default=None
)


@dataclass
class _Call:
    """One ``DurableAgent.run`` call: what it gives the agent, and the outputs it got."""

    deps: Any = None
    #: The message history in Pydantic AI's JSON form (None: the run's own chat).
    history: list[Any] | None = None
    outputs: dict[str, Any] = field(default_factory=dict)
    #: Pydantic AI's ``event_stream_handler``: with one, model requests stream.
    handler: EventStreamHandler[Any] | None = None
    #: An ``iter`` call's: the turn hands it the graph's nodes one at a time.
    handoff: _Handoff | None = None


_T = TypeVar("_T")


@dataclass
class _Work:
    """A journal call a node makes outside the turn's task, for the turn's task to make."""

    make: Callable[[], Awaitable[Any]]
    done: asyncio.Future[Any]

    async def run(self) -> None:
        """Make the call and hand its outcome back; an error also ends the turn (raised
        here, in the turn's task), as it would have ended a ``run`` of the agent."""
        try:
            self.done.set_result(await self.make())
        except BaseException as error:
            self.done.set_exception(error)
            raise


#: What the turn hands the caller once it ended (no node follows).
_ENDED = object()


class _Handoff:
    """Between the turn that runs an agent's graph and the caller iterating its nodes
    (``DurableAgent.iter``, docs/pydantic-ai.md "Node by node").

    The graph runs in the turn's task, which holds the run's lease. Each node goes
    to the caller before it runs, and the turn waits until the caller asks for the
    next one. A node the caller streams meanwhile (``node.stream(run.ctx)``) runs in
    the caller's task: the journal calls it makes (a model step, a tool step, an
    approval) are handed to the turn's task, which makes them while it waits, so
    the journal is written by the turn that holds the lease and only by it.
    """

    def __init__(self) -> None:
        #: To the caller: the graph's nodes, then ``_ENDED``.
        self.nodes: asyncio.Queue[Any] = asyncio.Queue()
        #: To the turn: journal calls to make, or None (go on to the next node).
        self.orders: asyncio.Queue[_Work | None] = asyncio.Queue()
        self.agent_run: AgentRun[Any, Any] | None = None
        #: Whether the turn runs the graph (it makes the journal calls until it ends).
        self.serving = False
        #: Whether the caller left: the turn goes on without handing nodes.
        self.detached = False
        #: The errors the journal calls made for the caller raised (the turn's too).
        self.delivered: list[BaseException] = []

    async def offer(self, node: Any) -> None:
        """In the turn's task: hand ``node`` to the caller, then make the journal calls
        its stream asks for, until the caller asks for the next node."""
        if self.detached:
            return
        self.nodes.put_nowait(node)
        while (work := await self.orders.get()) is not None:
            await work.run()

    def ended(self) -> None:
        """In the turn's task, as its graph ends (or fails): no node, no call follows."""
        self.serving = False
        self.nodes.put_nowait(_ENDED)
        while not self.orders.empty():
            work = self.orders.get_nowait()
            if work is not None and not work.done.done():
                work.done.set_exception(RuntimeError("the run's turn ended before this call"))

    async def on_turn(self, make: Callable[[], Awaitable[_T]]) -> _T:
        """``make()``'s journal call, made by the turn's task whichever task asks."""
        if not self.serving or _in_turn.get() is self:  # the turn's task, or a task of its graph
            return await make()
        if self.detached:
            msg = (
                "a node of a durable agent's iter is streamed inside the `async with "
                "durable_agent.iter(...)` block that gave it (docs/pydantic-ai.md)"
            )
            raise InvalidArgumentError(msg)
        work = _Work(make, asyncio.get_running_loop().create_future())
        self.orders.put_nowait(work)
        try:
            result: _T = await work.done
        except BaseException as error:
            self.delivered.append(error)
            raise
        return result


async def _on_turn(handoff: _Handoff | None, make: Callable[[], Awaitable[_T]]) -> _T:
    """``make()``, by the turn's task when an ``iter`` call hands its nodes out."""
    if handoff is None:
        return await make()
    return await handoff.on_turn(make)


# --------------------------------------------------------------- the result
@dataclass(frozen=True)
class DurableRunResult:
    """What ``DurableAgent.run`` returns: the turn's ``output``, ``run_id`` and ``status``.

    ``output`` is the agent's output, typed by its ``output_type``: as Pydantic
    AI gave it when the turn ended in this call, rebuilt from the journal when
    another process (or an earlier call with the same key) drove it; None
    while the run is paused. ``waiting_for`` says what a paused run waits for
    (an ``__approval`` with the frozen operation).
    """

    output: Any
    run_id: str
    status: str
    waiting_for: WaitingFor | None = None


class DurableStreamedRun:
    """A durable turn being streamed (``DurableAgent.run_stream``)."""

    def __init__(
        self, handle: TurnHandle, finish: Callable[[TurnResult], DurableRunResult]
    ) -> None:
        self._handle = handle
        self._finish = finish

    async def run_id(self) -> str:
        """The run's id, once the turn opened it."""
        return await self._handle.run_id

    async def stream_text(self, *, delta: bool = False) -> AsyncIterator[str]:
        """The text of each model response as it is written: the text so far
        (``delta=False``), or each new piece. The text of an attempt that failed is
        dropped (a ``retract``: with ``delta=True`` its pieces were given already,
        and the turn's error follows them). The turn's error is raised here."""
        attempts: dict[tuple[int, int], str] = {}
        async for part in self._handle:
            if part.type == "retract":
                attempts.pop((part.step or 0, part.attempt or 0), None)
            if part.type != "text-delta" or not part.delta:
                continue
            key = (part.step or 0, part.attempt or 0)
            attempts[key] = attempts.get(key, "") + part.delta
            yield part.delta if delta else attempts[key]

    async def result(self) -> DurableRunResult:
        """How the turn ended, as ``DurableAgent.run`` says it."""
        return self._finish(await self._handle.result())


class DurableAgentRun:
    """A durable turn driven node by node (``DurableAgent.iter``), as Pydantic AI's
    ``AgentRun`` is: ``async for node in run`` gives each node of the agent's graph
    before it runs (``UserPromptNode``, ``ModelRequestNode``, ``CallToolsNode``,
    ``End``), and ``async with node.stream(run.ctx) as events`` streams a request
    or tool node. ``result`` is the turn's ``DurableRunResult`` once it ended.
    """

    def __init__(
        self,
        handle: TurnHandle,
        handoff: _Handoff,
        finish: Callable[[TurnResult], DurableRunResult],
    ) -> None:
        self._handle = handle
        self._handoff = handoff
        self._finish = finish
        self._holding = False  # whether the turn waits for the caller to go on
        #: How the turn ended (as ``DurableAgent.run`` says it); None until then.
        self.result: DurableRunResult | None = None

    async def run_id(self) -> str:
        """The run's id, once the turn opened it."""
        return await self._handle.run_id

    @property
    def ctx(self) -> Any:
        """The graph's context (``AgentRun.ctx``), for ``node.stream(run.ctx)``."""
        agent_run = self._handoff.agent_run
        if agent_run is None:
            msg = "the run has no graph context before its first node"
            raise InvalidArgumentError(msg)
        return agent_run.ctx

    def __aiter__(self) -> DurableAgentRun:
        return self

    async def __anext__(self) -> Any:
        if self._holding:  # the node given last may run now
            self._holding = False
            self._handoff.orders.put_nowait(None)
        if self.result is None:
            node = await self._next_node()
            if node is not _ENDED:
                self._holding = True
                return node
            await self.finished()
        raise StopAsyncIteration

    async def _next_node(self) -> Any:
        """The node the turn hands over next, or ``_ENDED`` once the turn ended (a
        turn may end before its graph starts: refused, or over its budget)."""
        getting = asyncio.ensure_future(self._handoff.nodes.get())
        ending = asyncio.ensure_future(self._handle.result())
        try:
            await asyncio.wait({getting, ending}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if ending.done() and not ending.cancelled():
                ending.exception()  # raised by ``finished``, not lost
            ending.cancel()
            if not getting.done():
                getting.cancel()
        if getting.done() and not getting.cancelled():
            return getting.result()
        if not self._handoff.nodes.empty():
            return self._handoff.nodes.get_nowait()
        return _ENDED

    def detach(self) -> None:
        """The caller is gone: the turn goes on to its end without handing nodes."""
        self._handoff.detached = True
        self._holding = False
        self._handoff.orders.put_nowait(None)

    async def finished(self) -> DurableRunResult:
        """How the turn ended, once it did (its error raised here), as ``run`` says it."""
        if self.result is None:
            self.result = self._finish(await self._handle.result())
        return self.result


def tool_call() -> ToolCall | None:
    """The journaled call the Pydantic AI tool now running is (None outside one).

    Its ``idempotency_key`` is the same on every execution of the call (a
    re-execution after a crash included): hand it to the system the tool
    changes, so that system can keep one effect per key (docs/guarantees.md).
    """
    return _current_call.get()


# ------------------------------------------------------------ the callsites
@dataclass
class _Callsites:
    """The callsite of each tool call of the turn, by tool call id.

    Reserved in the order of the model response that asked for the calls, on a
    fresh pass and a replay alike, so each call keeps its journal position
    (and its idempotency key) whatever order Pydantic AI then runs them in.
    """

    by_call: dict[str, int] = field(default_factory=dict)

    def assign(self, turn: LoopTurn, response: PaiResponse) -> None:
        calls = response.tool_calls
        for call, callsite in zip(calls, turn.reserve(len(calls)), strict=True):
            self.by_call[call.tool_call_id] = callsite

    def of(self, tool_call_id: str | None) -> int:
        unknown = (
            f"tool call {tool_call_id!r} came from no model response of this turn; "
            "kuralle_es journals the tool calls a model asks for (docs/pydantic-ai.md)"
        )
        return known_entry(self.by_call, tool_call_id, unknown)


# -------------------------------------------------------------------- model
def _usage(response: PaiResponse) -> dict[str, int]:
    usage = response.usage
    return {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }


def _recordable(response: PaiResponse) -> ModelResponse:
    """A Pydantic AI response as a model step records it: its text and tool calls
    (what the dashboard and the chat show), its usage (docs/usage.md), and the
    whole response in Pydantic AI's JSON form, which a replay rebuilds."""
    dumped = ModelMessagesTypeAdapter.dump_python([response], mode="json")[0]
    return ModelResponse(
        content=response.text,
        tool_calls=[
            ToolCallRequest(call.tool_call_id, call.tool_name, call.args_as_dict())
            for call in response.tool_calls
        ],
        data={RESPONSE_KEY: dumped},
        usage=_usage(response),
    )


def _rebuilt(response: ModelResponse) -> PaiResponse:
    data = response.data or {}
    [message] = ModelMessagesTypeAdapter.validate_python([data[RESPONSE_KEY]])
    assert isinstance(message, PaiResponse)
    return message


@dataclass
class _OneRequest:
    """One Pydantic AI model request as a kuralle_es ``Model``: asked only when
    the journal has no response for it."""

    model: Model
    messages: list[ModelMessage]
    settings: ModelSettings | None
    parameters: ModelRequestParameters

    @property
    def id(self) -> str:
        return self.model.model_name

    async def respond(self, request: ModelRequest) -> ModelResponse:
        answer = await self.model.request(self.messages, self.settings, self.parameters)
        return _recordable(answer)


@dataclass
class _OneStream(_OneRequest):
    """One Pydantic AI model request, streamed: its text deltas as they come (to the
    turn's stream), its events to the run's ``event_stream_handler`` inside the
    step, then the response to journal. Asked only when the journal has none."""

    run_context: RunContext[Any] | None = None
    handler: EventStreamHandler[Any] | None = None
    #: Whether the handler saw this response's events live (none to replay then).
    delivered: bool = False

    async def stream(self, request: ModelRequest) -> AsyncIterator[str | ModelResponse]:
        opened = self.model.request_stream(
            self.messages, self.settings, self.parameters, self.run_context
        )
        async with opened as streamed:
            if self.handler is None or self.run_context is None:
                async for event in streamed:
                    text = _text_of(event)
                    if text:
                        yield text
            else:
                async for text in self._handled(streamed, self.handler, self.run_context):
                    yield text
            yield _recordable(streamed.get())

    async def _handled(
        self,
        streamed: StreamedResponse,
        handler: EventStreamHandler[Any],
        run_context: RunContext[Any],
    ) -> AsyncIterator[str]:
        """The stream's text while ``handler`` consumes its events (in a task of its
        own: a handler pulls the events at its pace, the deltas go on as they come)."""
        texts: asyncio.Queue[str | None] = asyncio.Queue()

        async def tapped() -> AsyncIterator[AgentStreamEvent]:
            try:
                async for event in streamed:
                    text = _text_of(event)
                    if text:
                        texts.put_nowait(text)
                    yield event
            finally:
                texts.put_nowait(None)

        async def handle() -> None:
            events = tapped()
            await handler(run_context, events)
            async for _ in events:  # what the handler left unread
                pass

        self.delivered = True
        handling = asyncio.ensure_future(handle())
        try:
            while (text := await texts.get()) is not None:
                yield text
            await handling
        finally:
            if not handling.done():
                handling.cancel()
                with contextlib.suppress(BaseException):
                    await handling


def _text_of(event: Any) -> str | None:
    """The text a streamed event adds to a text part, if any."""
    if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
        return event.part.content
    if isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
        return event.delta.content_delta
    return None


def _tool_messages(parts: Sequence[ModelRequestPart]) -> list[Message]:
    """The chat messages of the tool results among ``parts`` (a request's)."""
    out: list[Message] = []
    for part in parts:
        if isinstance(part, ToolReturnPart):
            content = json.dumps(to_jsonable_python(part.content), ensure_ascii=False)
        elif isinstance(part, RetryPromptPart) and part.tool_name is not None:
            content = json.dumps(part.model_response(), ensure_ascii=False)
        else:
            continue
        out.append(
            Message(
                role="tool", tool_call_id=part.tool_call_id, name=part.tool_name, content=content
            )
        )
    return out


class _JournaledModel(WrapperModel):
    """The agent's model, each request a journaled ``model`` step."""

    def __init__(
        self, wrapped: Model, turn: LoopTurn, callsites: _Callsites, handoff: _Handoff | None
    ) -> None:
        super().__init__(wrapped)
        self._turn = turn
        self._callsites = callsites
        self._handoff = handoff

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> PaiResponse:
        one = _OneRequest(self.wrapped, messages, model_settings, model_request_parameters)
        return await self._journaled(one)

    @contextlib.asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        """The request streamed inside its journaled step; Pydantic AI gets the
        journaled response as a completed stream (its events replayed for a handler
        that did not see them live: a replayed step's, or a run without one)."""
        call = _call.get()
        handler = call.handler if call is not None else None
        one = _OneStream(
            self.wrapped, messages, model_settings, model_request_parameters, run_context, handler
        )
        response = await self._journaled(one)
        yield CompletedStreamedResponse(
            response,
            model_request_parameters=model_request_parameters,
            replay_events=not one.delivered,
        )

    async def _journaled(self, one: _OneRequest) -> PaiResponse:
        """The request as a journaled model step (replayed if the journal has it)."""
        last = one.messages[-1] if one.messages else None
        led_here = _tool_messages(last.parts) if isinstance(last, PaiRequest) else []

        async def step() -> PaiResponse:
            asked = ModelRequest(purpose="agent", messages=[])
            response = _rebuilt(await self._turn.model(one, asked, led_here))
            self._callsites.assign(self._turn, response)
            return response

        return await _on_turn(self._handoff, step)


# -------------------------------------------------------------------- tools
class _Args(BaseModel):
    """A Pydantic AI tool's arguments as the journal keeps them (Pydantic AI validates them)."""

    model_config = ConfigDict(extra="allow")


@dataclass
class _JournaledToolset(WrapperToolset[Any]):
    """The agent's tools, each call a journaled ``tool`` step."""

    turn: LoopTurn | None = None
    callsites: _Callsites | None = None
    handoff: _Handoff | None = None

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        assert self.turn is not None and self.callsites is not None
        turn, shown = self.turn, to_jsonable_python(tool_args)
        callsite = self.callsites.of(ctx.tool_call_id)

        async def execute(args: _Args, call: ToolCall) -> Any:
            given = args.model_dump(mode="json")
            # Approved, the args the approver saw are the ones that run (docs/guarantees.md).
            final = tool_args if given == shown else tool.args_validator.validate_python(given)
            token = _current_call.set(call)
            # Each execution counts its delegations from the first (Delegate.run).
            inside = _inside_call.set(_InsideCall(turn, callsite))
            try:
                result = await self.wrapped.call_tool(name, final, ctx, tool)
            except ModelRetry as retry:  # Pydantic AI's own "try again": journaled as such
                return {MODEL_RETRY_KEY: retry.message}
            finally:
                _inside_call.reset(inside)
                _current_call.reset(token)
            return to_jsonable_python(result)

        journaled = define_tool(
            name,
            tool.tool_def.description or "",
            _Args,
            execute,
            needs_approval=tool.tool_def.kind == "unapproved",
        )
        result = await _on_turn(
            self.handoff, lambda: turn.tool(journaled, shown, callsite, ctx.tool_call_id)
        )
        if isinstance(result, dict) and set(result) == {MODEL_RETRY_KEY}:
            raise ModelRetry(str(result[MODEL_RETRY_KEY]))
        return result


# --------------------------------------------------------------- capability
def _denial(by: str | None, reason: str | None) -> ToolDenied:
    """Pydantic AI's own denial, saying who declined and why."""
    message = "The tool call was denied"
    message += f" by {by}" if by else ""
    message += f": {reason}" if reason else "."
    return ToolDenied(message)


class _OnTheJournal(AbstractCapability[Any]):
    """Puts the journal under one run of the agent: its model, its tools, its approvals."""

    def __init__(self, turn: LoopTurn, handoff: _Handoff | None = None) -> None:
        self.turn = turn
        self.callsites = _Callsites()
        #: An ``iter`` call's: the journal calls of the nodes it streams go through it.
        self.handoff = handoff

    @classmethod
    def get_serialization_name(cls) -> str | None:
        return None  # made per turn, never written in an agent spec

    def get_wrapper_model(self, model: Model) -> Model | None:
        return _JournaledModel(model, self.turn, self.callsites, self.handoff)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return _JournaledToolset(toolset, self.turn, self.callsites, self.handoff)

    async def handle_deferred_tool_calls(
        self, ctx: RunContext[Any], *, requests: DeferredToolRequests
    ) -> DeferredToolResults | None:
        """Approvals from the journal; the first undecided one pauses the run."""
        results = DeferredToolResults()
        for call in requests.approvals:
            callsite = self.callsites.of(call.tool_call_id)
            args = call.args_as_dict()
            decision = await _on_turn(
                self.handoff,
                lambda: self.turn.approval(callsite, call.tool_name, args),  # noqa: B023
            )
            if decision.approved:
                results.approvals[call.tool_call_id] = True
            else:
                results.approvals[call.tool_call_id] = _denial(decision.by, decision.reason)
        return results if results.approvals else None


# ---------------------------------------------------------------- the chat
def _history(messages: list[Message]) -> tuple[list[ModelMessage], str]:
    """The run's chat as Pydantic AI's message history, and the turn's prompt.

    The prompt is the last user message (a turn adds none of its own); what
    came before it is rebuilt as Pydantic AI messages: user and system text,
    assistant text and tool calls, tool results.
    """
    last_user = max(i for i, m in enumerate(messages) if m.role == "user")
    history: list[ModelMessage] = []
    pending: list[ModelRequestPart] = []

    def flush() -> None:
        if pending:
            history.append(PaiRequest(parts=list(pending)))
            pending.clear()

    for message in messages[:last_user]:
        if message.role == "assistant":
            flush()
            history.append(PaiResponse(parts=_response_parts(message)))
        else:
            pending.append(_request_part(message))
    flush()
    # An earlier turn cut short (cancelled while a tool call was pending) left calls
    # with no result: closed out the way Pydantic AI does, so the next turn runs.
    return repair_messages(history), _text(messages[last_user].content)


def _request_part(message: Message) -> ModelRequestPart:
    if message.role == "tool":
        return ToolReturnPart(
            tool_name=message.name or "",
            content=json.loads(_text(message.content) or "null"),
            tool_call_id=message.tool_call_id or "",
        )
    if message.role == "system":
        return SystemPromptPart(content=_text(message.content))
    return UserPromptPart(content=_text(message.content))


def _text(content: str | Redacted | None) -> str:
    """A message's text; an erased one's marker as text (such a run never resumes)."""
    return "" if content is None else str(content)


def _response_parts(message: Message) -> list[Any]:
    parts: list[Any] = [TextPart(content=_text(message.content))] if message.content else []
    calls = message.tool_calls if isinstance(message.tool_calls, list) else []
    for call in calls:
        function = call["function"]
        parts.append(
            ToolCallPart(
                tool_name=function["name"], args=function["arguments"], tool_call_id=call["id"]
            )
        )
    return parts


def _output_text(output: Any) -> str:
    return output if isinstance(output, str) else to_json(output).decode()


# -------------------------------------------------------------------- loop
class PydanticAILoop:
    """Drives a user turn with a Pydantic AI agent, on the journal (``define_agent(loop=)``).

    Equal to another loop over the same agent object, so a runtime given the
    same agent twice (``durable`` called again) keeps the one definition.
    """

    def __init__(self, agent: Agent[Any, Any]) -> None:
        self.agent = agent
        #: The deps of the turns this process drives outside a ``run`` call (an
        #: approval, a recovery): the ones given to ``durable`` last.
        self.deps: Any = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PydanticAILoop) and other.agent is self.agent

    def __hash__(self) -> int:
        return id(self.agent)

    async def drive(self, turn: LoopTurn) -> str | None:
        call = _call.get()
        history, prompt = _history(turn.messages())
        given = await turn.given(HISTORY, call.history if call is not None else None)
        if given is not None:
            history = ModelMessagesTypeAdapter.validate_python(given)
        deps = call.deps if call is not None else self.deps
        if call is not None and call.handoff is not None:
            result = await self._node_by_node(turn, call.handoff, prompt, history, deps)
        else:
            # A handler (a streamed call: run_stream, or run with one) makes Pydantic AI
            # stream its model requests (request_stream): their text reaches the turn's
            # stream as it comes. Without, requests are made whole, as Pydantic AI does.
            result = await self.agent.run(
                prompt,
                message_history=history,
                deps=deps,
                capabilities=[_OnTheJournal(turn)],
                event_stream_handler=call.handler if call is not None else None,
            )
        # Tool results after the last response (an output tool's) ride the turn's close.
        new = result.new_messages()
        if new and isinstance(new[-1], PaiRequest):
            for message in _tool_messages(new[-1].parts):
                turn.append_message(message)
        if call is not None:
            call.outputs[turn.run_id] = result.output
        return _output_text(result.output)

    async def _node_by_node(
        self,
        turn: LoopTurn,
        handoff: _Handoff,
        prompt: str,
        history: list[ModelMessage],
        deps: Any,
    ) -> AgentRunResult[Any]:
        """The agent's graph run in this turn's task (``Agent.iter``), each node handed
        to the ``iter`` caller before it runs, the next one run once the caller asks
        for it (docs/pydantic-ai.md, "Node by node")."""
        handoff.serving = True
        token = _in_turn.set(handoff)  # this task's, and the graph's tasks' (copies of it)
        journal = _OnTheJournal(turn, handoff)
        try:
            async with self.agent.iter(
                prompt, message_history=history, deps=deps, capabilities=[journal]
            ) as agent_run:
                handoff.agent_run = agent_run
                node: Any = agent_run.next_node
                while True:
                    await handoff.offer(node)
                    if isinstance(node, End):
                        break
                    node = await agent_run.next(node)
        finally:
            _in_turn.reset(token)
            handoff.ended()
        result = agent_run.result
        assert result is not None  # the graph reached its End
        return result


async def _drained(run_context: RunContext[Any], events: Any) -> None:
    """The handler of a run that has none of its own: reads the events, ignores them."""
    async for _ in events:
        pass


# ----------------------------------------------------------- durable agent
class DurableAgent:
    """A Pydantic AI agent whose runs are kuralle_es conversation runs (``durable``)."""

    def __init__(self, agent: Agent[Any, Any], runtime: Runtime) -> None:
        self.wrapped = agent
        self.runtime = runtime
        self.name: str = str(agent.name)

    async def run(
        self,
        prompt: str,
        *,
        session_id: str,
        run_id: str | None = None,
        deps: Any = None,
        usage_limits: UsageLimits | None = None,
        message_history: Sequence[ModelMessage] | None = None,
        idempotency_key: str | None = None,
        event_stream_handler: EventStreamHandler[Any] | None = None,
    ) -> DurableRunResult:
        """Run one user turn of the session's conversation with the agent.

        Without ``run_id``: a new user turn of the session's conversation run
        (made on first use). With the ``run_id`` of a run whose last turn did
        not finish (a crash left it running, or it failed), that turn is
        resumed instead, replaying what the journal recorded (``prompt`` is
        then the turn's own, already recorded); with that of a finished run, a
        new user turn of it. A paused run moves on with ``runtime.approve`` or
        ``runtime.deny`` (or the CLI, the dashboard, the HTTP API).

        ``deps`` go to the agent as ``Agent.run``'s do, on every pass of the
        turn this call drives; they are not journaled (a turn driven by
        another call or process gets that one's: ``durable(..., deps=)``).
        ``message_history`` is what the model sees before ``prompt`` in place
        of the run's earlier turns; it is journaled with the turn, so every
        pass of it, in any process, sees the same. ``usage_limits`` become the
        run's ``Budget`` (``request_limit``, ``total_tokens_limit`` and
        ``cost_limit``, on top of what the run spent before this call; a turn
        past them ends ``error`` with ``BudgetExceededError``); its other
        limits have no budget to keep them and are refused
        (``InvalidArgumentError``). ``idempotency_key`` makes a retried call
        (same key, same request) return the first one's result and run
        nothing more. ``output`` is typed by the agent's ``output_type``
        whichever process drove the turn: rebuilt from the journal when this
        call did not. ``event_stream_handler`` is Pydantic AI's: with it, the
        model's requests stream, and it gets each fresh response's events live
        (a replayed one's, replayed) and the tool calls' events; the text also
        reaches the run's stream (``Runtime.stream``, docs/streaming.md).
        """
        call = _Call(deps, _journalable(message_history), handler=event_stream_handler)
        handle = await self._opened(call, prompt, session_id, run_id, usage_limits, idempotency_key)
        return self._result(await handle.result(), call)

    @contextlib.asynccontextmanager
    async def run_stream(
        self,
        prompt: str,
        *,
        session_id: str,
        run_id: str | None = None,
        deps: Any = None,
        usage_limits: UsageLimits | None = None,
        message_history: Sequence[ModelMessage] | None = None,
        idempotency_key: str | None = None,
        event_stream_handler: EventStreamHandler[Any] | None = None,
    ) -> AsyncIterator[DurableStreamedRun]:
        """``run``, streamed: ``async with agent.run_stream(...) as streamed:`` then
        ``async for text in streamed.stream_text(): ...`` and ``await
        streamed.result()``. The model's text comes as it is written; the turn is
        journaled exactly as ``run``'s (docs/streaming.md). Leaving the block
        early lets the turn go on to its end, durably, without a reader."""
        handler = event_stream_handler or _drained
        call = _Call(deps, _journalable(message_history), handler=handler)
        handle = await self._opened(call, prompt, session_id, run_id, usage_limits, idempotency_key)
        yield DurableStreamedRun(handle, lambda result: self._result(result, call))

    @contextlib.asynccontextmanager
    async def iter(
        self,
        prompt: str,
        *,
        session_id: str,
        run_id: str | None = None,
        deps: Any = None,
        usage_limits: UsageLimits | None = None,
        message_history: Sequence[ModelMessage] | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncIterator[DurableAgentRun]:
        """``run``, node by node, as ``Agent.iter``: ``async with agent.iter(...) as
        run:`` then ``async for node in run: ...``; each node of the agent's graph
        comes before it runs, and the turn waits for the caller to ask for the next,
        so ``async with node.stream(run.ctx) as events`` streams a model request or
        a tool node (its model response's events come once its step is journaled).
        The turn is journaled exactly as ``run``'s; ``run.result`` is the
        ``DurableRunResult`` once the iteration ended (docs/pydantic-ai.md).

        Leaving the block early lets the turn go on to its end, durably, without
        handing nodes; the block's end waits for it. A node's stream cut short by the
        run pausing (a tool awaiting approval) ends the block with ``run.result``
        paused; the turn's other errors are raised, as ``run`` raises them.
        """
        handoff = _Handoff()
        call = _Call(deps, _journalable(message_history), handoff=handoff)
        handle = await self._opened(call, prompt, session_id, run_id, usage_limits, idempotency_key)
        run = DurableAgentRun(handle, handoff, lambda result: self._result(result, call))
        try:
            yield run
        except BaseException as error:
            run.detach()
            if not any(error is given for given in handoff.delivered):
                raise  # the caller's own: the turn goes on without it
            # The turn ended with the error the journal gave the node's stream.
            done = await run.finished()
            if done.status != "paused":
                raise
        else:
            run.detach()
            await run.finished()

    async def _opened(
        self,
        call: _Call,
        prompt: str,
        session_id: str,
        run_id: str | None,
        usage_limits: UsageLimits | None,
        idempotency_key: str | None,
    ) -> TurnHandle:
        """The turn's handle; its task (made here) sees ``call``."""
        token = _call.set(call)
        try:
            handle: TurnHandle = await self._turn(
                prompt, session_id, run_id, usage_limits, idempotency_key
            )
            return handle
        finally:
            _call.reset(token)

    def _result(self, result: TurnResult, call: _Call) -> DurableRunResult:
        """A turn's result as this agent's run's: the agent's own output when the
        turn ended in this call, typed from the journal otherwise (None while paused)."""
        if result.status == "paused":
            output = None
        elif result.run_id in call.outputs:
            output = call.outputs[result.run_id]
        else:  # driven elsewhere (another process, a retried key): from the journal
            output = typed_output(self.wrapped, result.output)
        return DurableRunResult(output, result.run_id, result.status, result.waiting_for)

    async def _turn(
        self,
        prompt: str,
        session_id: str,
        run_id: str | None,
        usage_limits: UsageLimits | None,
        idempotency_key: str | None,
    ) -> Any:
        runtime = self.runtime
        budget = await self._budget(usage_limits, session_id, run_id)
        keyed: dict[str, Any] = {"idempotency_key": idempotency_key, "budget": budget}
        if run_id is None:
            return runtime.run(session_id, input=prompt, agent=self.name, **keyed)
        state = await runtime.get_run(run_id, session_id)
        if state is None:
            raise RunNotFoundError(run_id, session_id)
        if state.active_agent != self.name:
            msg = (
                f"run {run_id} is a conversation with agent {state.active_agent!r}, "
                f"not {self.name!r}"
            )
            raise InvalidArgumentError(msg)
        if state.status in ("running", "error") and not await self._seen(run_id, idempotency_key):
            return runtime.run(session_id, run_id=run_id, **keyed)
        # A new user turn of the session's conversation (this run), or the retry of a
        # keyed call: asked the way a call without run_id asks it, so that a retry
        # with or without the run id is the same request (docs/pydantic-ai.md).
        return runtime.run(session_id, input=prompt, agent=self.name, **keyed)

    async def _seen(self, run_id: str, idempotency_key: str | None) -> bool:
        """Whether a call with ``idempotency_key`` already opened a turn of the run."""
        if idempotency_key is None:
            return False
        run = await self.runtime.store.load_async(run_id)
        return run is not None and idempotency_key in run.inbound_keys

    async def _budget(
        self, limits: UsageLimits | None, session_id: str, run_id: str | None
    ) -> Budget | None:
        """``usage_limits`` as the run's ``Budget``: this call's limits on top of what
        the run (the session's conversation, without ``run_id``) spent before it."""
        if limits is None:
            return None
        _refuse_unkept(limits)
        if all(getattr(limits, name) is None for name in _KEPT_LIMITS):
            return None
        if run_id is None:
            runs = await self.runtime.views.list_runs(session_id=session_id)
            run_id = next(
                (r.run_id for r in runs if r.kind == "conversation" and r.parent is None), None
            )
        spent = await self.runtime.views.usage(run_id=run_id) if run_id else None
        calls = spent.model_calls if spent is not None else 0
        tokens = spent.total_tokens if spent is not None else 0
        cost = (spent.cost or 0.0) if spent is not None else 0.0
        return Budget(
            max_model_calls=None if limits.request_limit is None else calls + limits.request_limit,
            max_total_tokens=(
                None if limits.total_tokens_limit is None else tokens + limits.total_tokens_limit
            ),
            max_cost=None if limits.cost_limit is None else cost + float(limits.cost_limit),
            on_exceed="fail",
        )


# --------------------------------------------------------------- delegation
class Delegate:
    """A Pydantic AI agent that a durable agent's tool delegates to (``delegate``).

    ``await delegate(other).run(prompt, deps=ctx.deps)`` inside a tool body is
    Pydantic AI's agent delegation, made durable: the other agent's turn is a
    child run of the calling run (docs/pydantic-ai.md, "Agent delegation").
    """

    def __init__(self, agent: Agent[Any, Any]) -> None:
        definition(agent)  # refused here, not inside a tool: no name, no model
        self.wrapped = agent
        self.name: str = str(agent.name)

    def run(
        self, prompt: str, *, deps: Any = None, session_id: str | None = None
    ) -> Coroutine[Any, Any, DurableRunResult]:
        """Run one turn of the agent, answering ``prompt``, as a child run of the run
        whose tool calls this; returns the child's result once it finished.

        The child (a conversation run of this agent, in ``session_id`` or the
        calling run's session, with ``parent`` set) is started exactly once: its
        id derives from the calling tool call's key and from which delegation of
        that call this is (the first, the second, ...), so a re-execution of the
        tool after a crash finds the same child and never starts a second. Each
        of its model requests and tool calls is a journaled step of its own. A
        child that waits (an approval) pauses the calling run on a ``child``
        wait; when it ends, the calling tool runs again and this returns its
        recorded output. ``ChildRunError`` if it errored or was cancelled.

        ``deps`` go to the child's turn while this call drives it (never
        journaled); a turn of it driven elsewhere (an approval, a recovery) gets
        the deps given to ``durable(agent, runtime, deps=...)`` there. Refused
        with ``InvalidArgumentError``, before anything is journaled, outside a
        tool of a durable agent's run.
        """
        inside = _inside_call.get()
        if inside is None:
            msg = (
                f"delegate({self.name!r}).run is called inside a tool of a durable agent's run "
                f"(its child run belongs to that run); elsewhere, use "
                f"durable(agent, runtime).run (docs/pydantic-ai.md)"
            )
            raise InvalidArgumentError(msg)
        ordinal = inside.started  # taken when called, so concurrent delegations keep theirs
        inside.started += 1
        return self._run(inside, ordinal, prompt, deps, session_id)

    async def _run(
        self, inside: _InsideCall, ordinal: int, prompt: str, deps: Any, session_id: str | None
    ) -> DurableRunResult:
        call = _Call(deps=deps)
        token = _call.set(call)  # the child's turn, driven here, gets this call's deps only
        try:
            child_run_id, reply = await inside.turn.child(
                inside.callsite, ordinal, self.name, prompt, session_id
            )
        finally:
            _call.reset(token)
        if child_run_id in call.outputs:
            output = call.outputs[child_run_id]
        else:  # recorded earlier (a re-execution of the tool), or driven elsewhere
            output = typed_output(self.wrapped, reply)
        return DurableRunResult(output, child_run_id, "finished")


def delegate(agent: Agent[Any, Any]) -> Delegate:
    """The Pydantic AI ``agent`` as a delegate: ``await delegate(agent).run(prompt)``
    inside a tool of a durable agent runs it as a child run (docs/pydantic-ai.md).

    The runtime that drives the calling run must know the agent too
    (``durable(agent, runtime)``, or its ``definition`` in the app's agents), so
    that any process resumes the child. ``InvalidArgumentError`` for an agent
    without a name or a model.
    """
    return Delegate(agent)


# ------------------------------------------------------------ what it takes
#: The limits of ``UsageLimits`` that a run's ``Budget`` keeps.
_KEPT_LIMITS = ("request_limit", "total_tokens_limit", "cost_limit")


def _refuse_unkept(limits: UsageLimits) -> None:
    """Refuse limits that no budget keeps: a durable turn would not honour them."""
    unkept = [
        name
        for name in ("tool_calls_limit", "input_tokens_limit", "output_tokens_limit",
                     "per_request_input_tokens_limit")
        if getattr(limits, name, None) is not None
    ]  # fmt: skip
    if getattr(limits, "count_tokens_before_request", False):
        unkept.append("count_tokens_before_request")
    if unkept:
        msg = (
            f"usage_limits {unkept} have no counterpart in the run's Budget; a durable turn "
            f"keeps {list(_KEPT_LIMITS)} (docs/pydantic-ai.md)"
        )
        raise InvalidArgumentError(msg)


def _journalable(history: Sequence[ModelMessage] | None) -> list[Any] | None:
    """A message history in Pydantic AI's own JSON form, as the journal keeps it."""
    if history is None:
        return None
    if isinstance(history, str | bytes) or not isinstance(history, Sequence):
        msg = f"message_history must be a list of Pydantic AI messages, got {history!r}"
        raise InvalidArgumentError(msg)
    dumped: list[Any] = ModelMessagesTypeAdapter.dump_python(list(history), mode="json")
    return dumped


def _output_types(spec: Any) -> list[Any]:
    """The types an ``output_type`` spec gives its output (a function's: its return type)."""
    if isinstance(spec, ToolOutput):
        return _output_types(spec.output)
    if isinstance(spec, NativeOutput | PromptedOutput):
        return _output_types(spec.outputs)
    if isinstance(spec, TextOutput):
        return _output_types(spec.output_function)
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return [t for one in spec for t in _output_types(one)]
    if inspect.isfunction(spec) or inspect.ismethod(spec):
        return [get_type_hints(spec).get("return", Any)]
    return [spec]


def typed_output(agent: Agent[Any, Any], output: Any) -> Any:
    """The agent's output as its ``output_type`` types it, from the text the journal
    recorded (a turn's output is JSON text unless it was a ``str``); the text itself
    when it does not parse as that type."""
    if not isinstance(output, str):
        return output
    types = _output_types(agent.output_type)
    if types == [str]:
        return output
    union: Any = types[0] if len(types) == 1 else Union[tuple(types)]  # noqa: UP007
    adapter: TypeAdapter[Any] = TypeAdapter(union)
    try:
        return adapter.validate_json(output)
    except ValidationError:
        return output


def definition(agent: Agent[Any, Any], *, deps: Any = None) -> KuralleAgent:
    """The kuralle_es agent that runs the Pydantic AI ``agent`` (``define_agent(loop=)``).

    ``durable`` adds it to a runtime. List it in the app that the command line,
    the dashboard or the HTTP server load (``--app``/``KURALLE_APP``, a list of
    agents), so that they too approve, deny and resume the agent's runs;
    ``deps`` are the agent's deps for the turns they drive (a recovery by
    ``kuralle-es worker``, an approval). Refused with ``InvalidArgumentError``:
    an agent without a ``name`` (the runtime knows it by that name, so that
    another process resumes its runs) or without a model.
    """
    if not isinstance(agent, Agent):
        msg = f"expected a pydantic_ai.Agent, got {agent!r}"
        raise InvalidArgumentError(msg)
    if not agent.name:
        msg = (
            "a durable Pydantic AI agent needs a name: give it one, Agent(..., name='support'); "
            "the runtime knows the agent by it, so that another process resumes its runs"
        )
        raise InvalidArgumentError(msg)
    if agent.model is None:
        msg = f"Pydantic AI agent {agent.name!r} has no model; give it one, Agent(model, ...)"
        raise InvalidArgumentError(msg)
    loop = PydanticAILoop(agent)
    loop.deps = deps
    return define_agent(agent.name, "", None, loop=loop)


def durable(agent: Agent[Any, Any], runtime: Runtime, *, deps: Any = None) -> DurableAgent:
    """Make a Pydantic AI agent durable on ``runtime``'s journal (docs/pydantic-ai.md).

    The agent needs a ``name`` and a model (``definition`` says why). Another
    process that calls ``durable`` on its own runtime with the same agent
    resumes, recovers and approves its runs. Calling ``durable`` again with the
    same agent is harmless; another agent under a taken name is
    ``InvalidArgumentError``. ``deps`` are the agent's deps for the turns this
    runtime drives outside a ``DurableAgent.run`` call (an approval, a
    recovery); a ``run`` call's own ``deps`` win for its turn. Without
    ``deps``, those given before (here or to ``definition``) stay.
    """
    runtime.add_agent(definition(agent))
    loop = runtime.agent(str(agent.name)).loop
    if isinstance(loop, PydanticAILoop) and deps is not None:
        loop.deps = deps
    return DurableAgent(agent, runtime)
