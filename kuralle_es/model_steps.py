"""Model turns as journaled ``model`` steps, and the chat messages they make."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .cursor import Cursor, Site
from .errors import InvalidArgumentError
from .journal import Journal
from .keys import plain_json_problem
from .llm import Model, ModelRequest, ModelResponse, ModelResponseError, as_response
from .models import Message

__all__ = ["assistant_message", "model_turn", "tool_message", "turn_key"]


def turn_key(site: Site, model_id: str, purpose: str) -> str:
    """The idempotency key of a model turn at ``site``."""
    return site.key({"model": model_id, "purpose": purpose})


async def model_turn(
    journal: Journal,
    cursor: Cursor,
    model: Model | None,
    request: ModelRequest,
    on_new: Callable[[ModelResponse], None] | None = None,
) -> ModelResponse:
    """Ask ``model`` once, journaled: a replay returns the recorded response.

    The response (content, tool calls, usage) is saved in one step after the
    model answers; ``on_new`` runs only for a fresh answer, and the events it
    triggers (the assistant message) are saved with it.
    """
    if model is None:
        msg = (
            f"run {journal.run_id} needs a model for a {request.purpose!r} turn, but its "
            "agent has none; pass model= to define_agent (openai_model(...) or ScriptedModel)"
        )
        raise InvalidArgumentError(msg)
    site = cursor.take()
    model_id = model.id

    async def ask() -> dict[str, Any]:
        answer = as_response(model_id, await model.respond(request))
        # Nothing of a refused response is journaled: the next pass asks again.
        # JSON mode would replace a lone surrogate in a key, so look at both dumps.
        problem = plain_json_problem(answer.model_dump(), other_types_ok=True)
        if problem is None:
            try:
                dumped = answer.model_dump(mode="json")
            except (ValueError, UnicodeError) as e:
                raise ModelResponseError(model_id, f"the response is not JSON: {e}") from None
            problem = plain_json_problem(dumped)
        if problem is not None:
            raise ModelResponseError(model_id, f"the response {problem}")
        return dumped

    def recorded(value: Any) -> None:
        if on_new is not None:
            on_new(ModelResponse.model_validate(value))

    value = await journal.record_value(
        site,
        kind="model",
        name=model_id,
        key=turn_key(site, model_id, request.purpose),
        args={"purpose": request.purpose},
        make=ask,
        on_recorded=recorded,
    )
    return ModelResponse.model_validate(value)


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
