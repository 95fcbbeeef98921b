"""Model turns as journaled ``model`` steps, and the chat messages they make.

A model call is an effect like a tool call: its intent is journaled before
the call, so a call cut off by a crash is in doubt and its re-run is the
step's next attempt (every attempt is counted in the run's usage). Before a
fresh call the run's budget is checked (docs/usage.md): a call that would
start past it fails the run, or waits for a human's yes on ``__budget``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from .._definitions.budget import Budget
from .._definitions.llm import Model, ModelRequest, ModelResponse, as_response
from .._definitions.streamed import streamed_answer, streams
from .._journal.json_data import plain_json_problem
from .._journal.keys import canonical_json
from .._journal.sites import Effect, Lane, Site
from .._journal.wait import BUDGET
from ..errors import BudgetExceededError, InvalidArgumentError, ModelResponseError
from ..shapes import Message, StreamPart
from .cursor import Cursor
from .step_results import decode
from .streaming import TurnStream
from .suspensions import WaitRequest, approval_decision, frozen_operation, suspend
from .writer import UNJOURNALED, RunWriter

__all__ = ["assistant_message", "model_call", "model_turn", "request_digest", "tool_message"]


def model_call(
    site: Site, model_id: str, purpose: str, request: ModelRequest | None = None
) -> Effect:
    """A model turn at ``site``, as the journal files it. The step keeps a digest of
    the ``request`` (not part of its key), so a replay under new code or a new
    model tells an unchanged request from a changed one (docs/howto/evaluating-models.md)."""
    args: dict[str, Any] = {"purpose": purpose}
    if request is not None:
        args["request"] = request_digest(request)
    return Effect(site, "model", model_id, args)


def request_digest(request: ModelRequest) -> str:
    """What a model was asked, as one hash: purpose, instructions, messages, tools, schema.
    Never refuses: a value canonical JSON has no form for (NaN in a schema) hashes by repr."""
    dumped = request.model_dump(mode="json", by_alias=True)
    try:
        text = canonical_json(dumped)
    except ValueError:
        text = repr(dumped)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


async def model_turn(
    writer: RunWriter,
    cursor: Cursor,
    model: Model | None,
    request: ModelRequest,
    on_new: Callable[[ModelResponse], None] | None = None,
    budget: Budget | None = None,
    stream: TurnStream | None = None,
) -> ModelResponse:
    """Ask ``model`` once, journaled: a replay returns the recorded response.

    The intent is saved before the call and the response (content, tool
    calls, usage) after it; ``on_new`` runs only for a fresh answer, and the
    events it triggers (the assistant message) are saved with the response.
    A call that fails journals nothing more: the next pass asks again.
    ``budget`` is the agent's (the run's own replaces it). With ``stream`` (a
    turn's), a model that streams sends its text deltas there as they come,
    a fresh answer's text follows as a ``text`` part, and a replay sends the
    recorded text (docs/streaming.md).
    """
    if model is None:
        msg = (
            f"run {writer.run_id} needs a model for a {request.purpose!r} turn, but its "
            "agent has none; pass model= to define_agent: openai_model(...), any object with "
            "an id and async respond(request), or kuralle_es.testing.ScriptedModel offline "
            "(docs/agents.md)"
        )
        raise InvalidArgumentError(msg)
    site = cursor.take()
    model_id = model.id
    call = model_call(site, model_id, request.purpose, request)
    step = writer.recorded(call)
    if step is None:
        await _within_budget(writer, site, budget)
    replayed = step is not None and step["status"] == "finished"
    texts = stream if request.purpose != "extract" else None

    async def ask() -> dict[str, Any]:
        if texts is None or not streams(model):
            return _checked(model_id, await model.respond(request))
        current = writer.peek(call)
        assert current is not None, "the intent is journaled before the call"
        index, attempt = current["index"], current["attempts"]
        await texts.before_attempt(index, attempt)
        try:
            return await _streamed(model, request, texts, index, attempt)
        except Exception:
            texts.retract(index, attempt)  # it will not be the journaled response
            raise

    def recorded(value: Any) -> None:
        if on_new is not None:
            on_new(ModelResponse.model_validate(value))

    value = await writer.effect(call, execute=ask, attempts=UNJOURNALED, on_recorded=recorded)
    response = ModelResponse.model_validate(value)
    if texts is not None and response.content:
        done = writer.peek(call)
        assert done is not None
        if replayed:
            await texts.replay(done["index"], done["attempts"], response.content)
        else:
            whole = StreamPart(
                type="text", text=response.content, step=done["index"], attempt=done["attempts"]
            )
            texts(whole)
    return response


async def _streamed(
    model: Model, request: ModelRequest, stream: TurnStream, step: int, attempt: int
) -> dict[str, Any]:
    """One streamed attempt: its deltas sent as they come, its response checked. A
    response whose text is not what its deltas said is retracted and sent whole,
    so the stream's text is the journaled one (a model that sent no delta, such
    as ``openai_model(stream=False)``, answered whole: its text is the ``text``
    part's alone)."""
    sent: list[str] = []

    def delta(text: str) -> None:
        sent.append(text)
        stream.delta(step, attempt, text)

    answer = await streamed_answer(model, request, delta)
    dumped = _checked(model.id, answer)
    content = dumped.get("content") or ""
    if sent and content != "".join(sent):
        stream.retract(step, attempt)
        if content:
            stream.delta(step, attempt, content)
    return dumped


def _checked(model_id: str, raw: Any) -> dict[str, Any]:
    """A model's answer as the journal keeps it; ``ModelResponseError`` (nothing of
    it journaled: the next pass asks again) for one it cannot keep."""
    answer = as_response(model_id, raw)
    # JSON mode would replace a lone surrogate in a key, so look at both dumps.
    problem = plain_json_problem(answer.model_dump(), other_types_ok=True)
    if problem is None:
        try:
            dumped: dict[str, Any] = answer.model_dump(mode="json")
        except (ValueError, UnicodeError) as e:
            raise ModelResponseError(model_id, f"the response is not JSON: {e}") from None
        problem = plain_json_problem(dumped)
    if problem is not None:
        raise ModelResponseError(model_id, f"the response {problem}")
    return dumped


async def _within_budget(writer: RunWriter, site: Site, agent_budget: Budget | None) -> None:
    """Let a fresh model call start, or stop it: past the budget, ``"fail"`` raises
    ``BudgetExceededError`` and ``"ask"`` waits for a human on ``__budget`` (in a
    lane beside the call, so the run's callsites stay as they were). Approved,
    the call goes on (under the raised limits, if the approval raised them);
    denied, the run ends with outcome ``"budget exceeded"``."""
    budget = writer.budget(agent_budget)
    if budget is None:
        return
    usage = await writer.usage()
    reached = budget.exceeded_by(usage)
    if not reached:
        return
    spent = usage.model_dump(mode="json", exclude={"tool_calls"})
    if budget.on_exceed == "fail":
        raise BudgetExceededError(writer.run_id, reached, spent, budget.limits())
    approval = site.in_lane(Lane.BUDGET)
    step = writer.recorded(Effect(approval, "approval", BUDGET))
    if step is not None and step["status"] == "finished":
        if approval_decision(decode(step)).approved:
            return
        writer.admission.stop("budget exceeded")
    request = WaitRequest(
        BUDGET,
        title="Approve spending past the budget",
        description=f"the run reached {', '.join(reached)}; approve (with raise_to) or deny",
        operation=frozen_operation(BUDGET, {"usage": spent, "budget": budget.limits()}),
    )
    suspend(writer, approval, "approval", request)


def assistant_message(response: ModelResponse) -> Message:
    """The OpenAI chat message of an assistant response (with its tool calls)."""
    tool_calls = [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": _arguments_text(call.args)},
        }
        for call in response.tool_calls
    ]
    return Message(role="assistant", content=response.content, tool_calls=tool_calls or None)


def _arguments_text(args: dict[str, Any]) -> str:
    """The arguments as the model sent them (its own text when it was not JSON)."""
    raw = args.get("__malformed_arguments__")
    return str(raw) if raw is not None else json.dumps(args)


def tool_message(tool_call_id: str, name: str, result: Any) -> Message:
    return Message(
        role="tool",
        tool_call_id=tool_call_id,
        name=name,
        content=json.dumps(result, ensure_ascii=False),
    )
