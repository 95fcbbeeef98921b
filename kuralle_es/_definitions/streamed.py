"""A model's streamed answer read as deltas and one response (internal).

A model that streams has ``stream(request)``, an async iterator of its text
as it comes (``str`` deltas) and, last, its whole answer as a
``ModelResponse`` (docs/streaming.md). Without that last item the answer is
the deltas' text. A dict item is taken as a response, unless it is a
delta in the stream-part shape (``{"delta": "..."}``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ModelResponseError
from .llm import ModelRequest, ModelResponse, as_response

__all__ = ["streamed_answer", "streams"]


def streams(model: Any) -> bool:
    """Whether ``model`` streams (has a ``stream(request)`` method)."""
    return callable(getattr(model, "stream", None))


async def streamed_answer(
    model: Any, request: ModelRequest, on_delta: Callable[[str], None]
) -> ModelResponse:
    """Read ``model.stream(request)``: each text delta to ``on_delta`` as it comes,
    then the answer (``ModelResponseError`` for a stream of anything else)."""
    model_id = str(model.id)
    pieces: list[str] = []
    final: ModelResponse | None = None
    async for item in model.stream(request):
        if final is not None:
            raise ModelResponseError(model_id, "the stream went on after its whole response")
        delta = _delta(item)
        if delta is not None:
            if delta:
                pieces.append(delta)
                on_delta(delta)
        elif isinstance(item, ModelResponse | dict):
            final = as_response(model_id, item)
        else:
            msg = f"a stream yields str deltas and then a ModelResponse, got {type(item).__name__}"
            raise ModelResponseError(model_id, msg)
    if final is None:
        return ModelResponse(content="".join(pieces) or None)
    return final


def _delta(item: Any) -> str | None:
    """The text of a delta item (a ``str``, or a dict with a ``delta``), else None."""
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("delta"), str):
        return str(item["delta"])
    return None
