"""Models: the ``Model`` protocol, its request/response shapes, and the
``openai`` adapter (any OpenAI-compatible server through ``base_url``).

A model knows nothing of journals: the runtime journals each model turn as a
``model`` step, so a resume never asks the model again for a turn it has.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field, field_validator

from .._journal.spending import normalise_usage
from ..errors import KuralleError, ModelResponseError
from ..shapes import Message

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = [
    "Model",
    "ModelRequest",
    "ModelResponse",
    "OpenAIModel",
    "ToolCallRequest",
    "as_response",
    "openai_model",
]


class ToolCallRequest(BaseModel):
    """A tool call the model asks for: ``ToolCallRequest(id, name, args)``."""

    id: str
    name: str
    args: dict[str, Any] = Field(default_factory=dict)

    def __init__(
        self,
        id: str | None = None,
        name: str | None = None,
        args: dict[str, Any] | None = None,
        **data: Any,
    ) -> None:
        for field, value in (("id", id), ("name", name), ("args", args)):
            if value is not None:
                data[field] = value
        super().__init__(**data)


class ModelResponse(BaseModel):
    """Assistant text, tool calls, extracted ``data`` and token ``usage``.

    ``usage`` is kept as ``{"input_tokens", "output_tokens", "total_tokens"}``
    (OpenAI's ``prompt_tokens``/``completion_tokens`` are mapped, a missing
    total is their sum), or None when the model reported nothing usable.
    """

    content: str | None = None
    tool_calls: list[ToolCallRequest] = Field(default_factory=list)
    data: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None

    @field_validator("usage", mode="before")
    @classmethod
    def _normalise_usage(cls, value: Any) -> dict[str, int | None] | None:
        return normalise_usage(value)


class ModelRequest(BaseModel):
    """What the runtime asks a model; ``schema`` is set for ``extract``."""

    purpose: Literal["agent", "reply", "extract"]
    messages: list[Message]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    model_config = {"populate_by_name": True}

    @property
    def schema(self) -> dict[str, Any] | None:  # type: ignore[override]
        return self.schema_


@runtime_checkable
class Model(Protocol):
    """Anything with an ``id`` that answers a ``ModelRequest``."""

    @property
    def id(self) -> str: ...

    async def respond(self, request: ModelRequest) -> ModelResponse | str: ...


def as_response(model_id: str, value: Any) -> ModelResponse:
    """A model's answer as a ``ModelResponse`` (a ``str`` is assistant text)."""
    if isinstance(value, ModelResponse):
        return value
    if isinstance(value, str):
        return ModelResponse(content=value)
    if isinstance(value, dict):
        try:
            return ModelResponse.model_validate(value)
        except ValueError as e:
            raise ModelResponseError(model_id, str(e)) from None
    raise ModelResponseError(
        model_id, f"expected a str or ModelResponse, got {type(value).__name__}"
    )


class OpenAIModel:
    """Chat completions with tools over ``openai.AsyncOpenAI``."""

    def __init__(
        self,
        model: str,
        client: AsyncOpenAI | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.model = model
        self._client = client
        self._base_url = base_url
        self._api_key = api_key

    @property
    def id(self) -> str:
        return self.model

    def client(self) -> AsyncOpenAI:
        """The client, made on first use so that defining an agent needs no key."""
        if self._client is None:
            from openai import AsyncOpenAI

            api_key = self._api_key or os.environ.get("OPENAI_API_KEY")
            if not api_key:
                msg = (
                    f"model {self.model!r} needs an API key: set OPENAI_API_KEY or pass "
                    "api_key= (any non-empty key for a local OpenAI-compatible server)"
                )
                raise KuralleError(msg)
            self._client = AsyncOpenAI(api_key=api_key, base_url=self._base_url)
        return self._client

    async def respond(self, request: ModelRequest) -> ModelResponse:
        messages: list[dict[str, Any]] = []
        if request.instructions:
            messages.append({"role": "system", "content": request.instructions})
        messages.extend(_chat_message(m) for m in request.messages)
        kwargs: dict[str, Any] = {"model": self.model, "messages": messages}
        if request.tools:
            kwargs["tools"] = request.tools
        if request.purpose == "extract" and request.schema is not None:
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "extraction", "schema": request.schema},
            }
        completion = await self.client().chat.completions.create(**kwargs)
        return self._parse(completion, request)

    def _parse(self, completion: Any, request: ModelRequest) -> ModelResponse:
        choices = getattr(completion, "choices", None)
        if not choices:
            raise ModelResponseError(self.model, "the completion has no choices")
        message = choices[0].message
        if message is None:
            raise ModelResponseError(self.model, "the first choice has no message")
        tool_calls = []
        for call in message.tool_calls or []:
            function = getattr(call, "function", None)
            if function is None or not function.name:
                raise ModelResponseError(self.model, f"tool call {call.id!r} names no function")
            try:
                args = json.loads(function.arguments or "{}")
            except json.JSONDecodeError as e:
                # Kept as a value the agent loop reports back to the model.
                args = {"__malformed_arguments__": function.arguments, "__error__": str(e)}
            if not isinstance(args, dict):
                args = {"__malformed_arguments__": function.arguments}
            tool_calls.append(ToolCallRequest(id=call.id, name=function.name, args=args))
        data = None
        if request.purpose == "extract":
            try:
                parsed = json.loads(message.content or "{}")
            except json.JSONDecodeError as e:
                raise ModelResponseError(self.model, f"extraction is not JSON: {e}") from None
            if not isinstance(parsed, dict):
                raise ModelResponseError(self.model, "extraction is not a JSON object")
            data = parsed
        usage = completion.usage.model_dump() if getattr(completion, "usage", None) else None
        return ModelResponse(
            content=None if data is not None else message.content,
            tool_calls=tool_calls,
            data=data,
            usage=usage,
        )


def _chat_message(message: Message) -> dict[str, Any]:
    """A message in the Chat Completions shape (a tool message has no ``name`` there)."""
    data = message.model_dump(exclude_none=True)
    if message.role == "tool":
        data.pop("name", None)
        data.setdefault("content", "")
    return data


def openai_model(
    model: str = "gpt-4o-mini",
    client: AsyncOpenAI | None = None,
    base_url: str | None = None,
    api_key: str | None = None,
) -> OpenAIModel:
    """A ``Model`` over ``openai.AsyncOpenAI`` (key from ``OPENAI_API_KEY``)."""
    return OpenAIModel(model, client=client, base_url=base_url, api_key=api_key)
