"""``Redacted``: what a reader finds where an erased subject's payload was (API).

After ``runtime.erase_subject`` the key that sealed a subject's payloads is
gone, so a run of that subject still loads with its shape (steps, kinds,
names, keys, timings, statuses, usage) and every payload reads as this
marker (docs/privacy.md). It is a ``dict`` holding ``{"__redacted__": true}``,
so it is JSON as it is: a tool result, an output or a state bag that was
erased serialises to that object over HTTP, in ``--json`` output and in the
public events, and ``isinstance(value, Redacted)`` tells it apart in Python.
Pydantic fields that hold text (a message's content, an error's message, a
wait's title) accept it too, and read the JSON object back as ``Redacted``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

__all__ = ["REDACTED_KEY", "Redacted", "is_redacted"]

#: The one key of a redacted value's JSON form.
REDACTED_KEY = "__redacted__"


class Redacted(dict[str, Any]):
    """An erased payload: ``{"__redacted__": true}``, whatever the value was.

    Every ``Redacted`` equals every other (and its JSON form); ``str()`` of it
    is ``[redacted]``, which is how the CLI and the dashboard show it.
    """

    #: What stayed readable beside the erased value (a model result's usage), or None.
    kept: dict[str, Any] | None = None

    def __init__(self) -> None:
        super().__init__({REDACTED_KEY: True})

    def __str__(self) -> str:
        return "[redacted]"

    def __repr__(self) -> str:
        return "Redacted()"

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(REDACTED_KEY)

    def __deepcopy__(self, memo: dict[int, Any]) -> Redacted:
        return self

    def __copy__(self) -> Redacted:
        return self

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        """A field typed ``... | Redacted`` takes a ``Redacted`` or its JSON form, and
        writes the JSON form."""
        # Written as what it is, a dict: a union member's own serializer would be
        # used for the other members' values too.
        return core_schema.no_info_plain_validator_function(_validate)

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """Its JSON form in an OpenAPI document, so a client that validates
        responses accepts an erased payload where the field's own type is."""
        return {
            "title": "Redacted",
            "type": "object",
            "properties": {REDACTED_KEY: {"const": True}},
            "required": [REDACTED_KEY],
            "additionalProperties": False,
        }


def is_redacted(value: object) -> bool:
    """Whether ``value`` is an erased payload: a ``Redacted`` or its JSON form."""
    return isinstance(value, dict) and len(value) == 1 and value.get(REDACTED_KEY) is True


def _validate(value: object) -> Redacted:
    if isinstance(value, Redacted):
        return value
    if is_redacted(value):
        return Redacted()
    msg = "not a redacted value"
    raise ValueError(msg)


def loads(text: Any) -> Any:
    """A journaled JSON text's value; an erased one stays ``Redacted``."""
    if isinstance(text, Redacted):
        return text
    return json.loads(text)
