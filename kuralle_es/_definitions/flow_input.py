"""What a flow run starts with: text, or a typed flow's validated input (internal).

A flow defined with ``input=Model`` takes a mapping, a JSON string or a
``Model`` instance, validated here against ``Model`` before anything is
written (docs/child-runs.md, "Typed input"); a flow without one takes text,
as it always did. Every door that starts a flow (``runtime.run``, the CLI,
the HTTP API, a parent's ``ctx.child``, a ``flow_tool`` call) reads its input
through ``flow_input``, so they refuse the same inputs with the same words.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from .._journal.json_data import encode_json
from ..errors import InvalidArgumentError
from .flows import Flow

__all__ = ["FlowInput", "flow_input"]


@dataclass(frozen=True)
class FlowInput:
    """A flow start's input: the run's first user message (``text``) and, for a
    typed flow, the validated input as JSON data (``data``; None for text)."""

    text: str | None
    data: dict[str, Any] | None = None


def _fields_of(error: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in problem['loc']) or '(root)'}: {problem['msg']}"
        for problem in error.errors(include_url=False)
    )


def _validated(flow: Flow, model: type[BaseModel], value: Any) -> BaseModel:
    try:
        if isinstance(value, str):
            return model.model_validate_json(value)
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            msg = (
                f"the input of flow {flow.name!r} is a {type(value).__name__}; pass a mapping, "
                f"a JSON object as a string or a {model.__name__} instance"
            )
            raise InvalidArgumentError(msg)
        return model.model_validate(dict(value))
    except ValidationError as e:
        fields = sorted({str(p["loc"][0]) for p in e.errors() if p["loc"]})
        msg = (
            f"the input of flow {flow.name!r} does not fit {model.__name__} "
            f"(fields {fields}): {_fields_of(e)}; nothing was started. Pass an input "
            f"that {model.__name__} accepts"
        )
        raise InvalidArgumentError(msg) from None


def flow_input(flow: Flow, value: Any) -> FlowInput:
    """``value`` as a start of ``flow``: validated against the flow's ``input`` model
    (the first user message is then its JSON), or text for a flow without one.
    ``InvalidArgumentError`` (naming the fields) for an input the flow refuses."""
    model = flow.input
    if model is None:
        if value is None or isinstance(value, str):
            return FlowInput(value)
        msg = (
            f"flow {flow.name!r} takes text input, not a {type(value).__name__}; give it "
            "text, or define it with define_flow(..., input=Model) to take typed input"
        )
        raise InvalidArgumentError(msg)
    data: dict[str, Any] = _validated(flow, model, value).model_dump(mode="json")
    text = encode_json(data, f"the input of flow {flow.name!r}")
    return FlowInput(text, json.loads(text))
