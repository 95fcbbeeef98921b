"""Models: the ``Model`` protocol, its request/response shapes, and the
``openai`` adapter (any OpenAI-compatible server through ``base_url``).

A model knows nothing of journals: the runtime journals each model turn as a
``model`` step, so a resume never asks the model again for a turn it has.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, Field, field_validator

from .._journal.spending import normalise_usage
from ..errors import KuralleError, ModelResponseError
from ..shapes import Message
from .openai_chunks import Call, ChunkAssembly

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = [
    "Model",
    "ModelRequest",
    "ModelResponse",
    "OpenAIModel",
    "StreamingModel",
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
    """Anything with an ``id`` that answers a ``ModelRequest``.

    A model may also stream (``StreamingModel``): the runtime then calls
    ``stream`` instead of ``respond`` for agent and reply turns."""

    @property
    def id(self) -> str: ...

    async def respond(self, request: ModelRequest) -> ModelResponse | str: ...


@runtime_checkable
class StreamingModel(Model, Protocol):
    """A ``Model`` that streams: ``stream(request)`` yields its text as it comes
    (``str`` deltas) and, last, its whole answer as a ``ModelResponse`` (without
    it, the answer is the deltas' text). docs/streaming.md."""

    def stream(self, request: ModelRequest) -> AsyncIterator[str | ModelResponse]: ...


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
    """Chat completions with tools over ``openai.AsyncOpenAI``; streamed unless
    ``streaming`` is off (a server that cannot stream)."""

    def __init__(
        self,
        model: str,
        client: AsyncOpenAI | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        stream: bool = True,
    ) -> None:
        self.model = model
        self._client = client
        self._base_url = base_url
        self._api_key = api_key
        #: Whether ``stream`` asks the server for a streamed completion.
        self.streaming = stream

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

    def _arguments(self, request: ModelRequest) -> dict[str, Any]:
        """The chat-completion request for ``request``."""
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
        return kwargs

    async def respond(self, request: ModelRequest) -> ModelResponse:
        completion = await self.client().chat.completions.create(**self._arguments(request))
        choices = getattr(completion, "choices", None)
        if not choices:
            raise ModelResponseError(self.model, "the completion has no choices")
        message = choices[0].message
        if message is None:
            raise ModelResponseError(self.model, "the first choice has no message")
        calls = [
            Call(call.id, getattr(call, "function", None)) for call in message.tool_calls or []
        ]
        usage = completion.usage.model_dump() if getattr(completion, "usage", None) else None
        return self._response(message.content, calls, usage, request)

    async def stream(self, request: ModelRequest) -> AsyncIterator[str | ModelResponse]:
        """The completion streamed (``stream_options.include_usage``): its text as it
        comes, then the response assembled as ``respond`` makes it. An extraction,
        or a model made with ``stream=False``, is answered whole."""
        if not self.streaming or request.purpose == "extract":
            yield await self.respond(request)
            return
        chunks = await self.client().chat.completions.create(
            **self._arguments(request), stream=True, stream_options={"include_usage": True}
        )
        assembly = ChunkAssembly()
        async with chunks:
            async for chunk in chunks:
                text = assembly.add(chunk)
                if text:
                    yield text
        if not assembly.chosen:
            raise ModelResponseError(self.model, "the completion has no choices")
        if not assembly.finished:
            detail = "the stream ended before the completion did (no finish_reason)"
            raise ModelResponseError(self.model, detail)
        content = "".join(assembly.text) if assembly.text else None
        yield self._response(content, assembly.calls(), assembly.usage, request)

    def _response(
        self,
        content: str | None,
        calls: list[Call],
        usage: dict[str, Any] | None,
        request: ModelRequest,
    ) -> ModelResponse:
        """The response of a completion's first choice (its text, tool calls and usage)."""
        tool_calls = []
        for call in calls:
            function = call.function
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
                parsed = json.loads(content or "{}")
            except json.JSONDecodeError as e:
                raise ModelResponseError(self.model, f"extraction is not JSON: {e}") from None
            if not isinstance(parsed, dict):
                raise ModelResponseError(self.model, "extraction is not a JSON object")
            data = parsed
        return ModelResponse(
            content=None if data is not None else content,
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
    *,
    stream: bool = True,
) -> OpenAIModel:
    """A ``Model`` over ``openai.AsyncOpenAI`` (key from ``OPENAI_API_KEY``) that
    streams its text as it comes (``stream=False``: whole completions, for a server
    that cannot stream; docs/streaming.md)."""
    return OpenAIModel(model, client=client, base_url=base_url, api_key=api_key, stream=stream)
