"""A JSON transcoder that stores user JSON exactly as given.

``eventsourcing``'s ``JSONTranscoder`` reads any dict with exactly the keys
``_type_`` and ``_data_`` as one of its own encoded objects. Runs carry user
JSON (state bags, tool args, signal payloads, messages), so such a dict from
a user would come back as something else, or make the run unloadable. This
transcoder escapes those dicts on the way in, for events and snapshots alike.
"""

from __future__ import annotations

from typing import Any

from eventsourcing.persistence import JSONTranscoder, Transcoding

__all__ = ["EscapingJSONTranscoder"]

_ENVELOPE = frozenset(("_type_", "_data_"))


class _EscapedDict:
    """A user dict that looks like a transcoder envelope, held for encoding."""

    __slots__ = ("items",)

    def __init__(self, items: dict[str, Any]) -> None:
        self.items = items


class _EscapedDictAsPairs(Transcoding):
    type = _EscapedDict
    name = "kuralle_es:dict"

    def encode(self, obj: _EscapedDict) -> list[list[Any]]:
        return [[key, value] for key, value in obj.items.items()]

    def decode(self, data: list[list[Any]]) -> dict[str, Any]:
        return {key: value for key, value in data}


def _escape(value: Any) -> Any:
    """``value`` with envelope-shaped dicts wrapped; untouched parts are not copied."""
    kind = type(value)
    if kind is dict:
        out: dict[Any, Any] = {}
        changed = False
        for key, item in value.items():
            escaped = _escape(item)
            changed = changed or escaped is not item
            out[key] = escaped
        if len(value) == 2 and value.keys() == _ENVELOPE:
            return _EscapedDict(out)
        return out if changed else value
    if kind is list or kind is tuple:
        items = [_escape(item) for item in value]
        if any(a is not b for a, b in zip(items, value, strict=True)):
            return items
        return value
    return value


def _has_envelope(value: Any) -> bool:
    """Whether ``value`` holds an envelope-shaped dict anywhere.

    Almost nothing does, so a save first asks this (a walk that allocates
    nothing and only descends into containers) and copies with ``_escape``
    only when the answer is yes.
    """
    kind = type(value)
    if kind is dict:
        if len(value) == 2 and value.keys() == _ENVELOPE:
            return True
        items = value.values()
    elif kind is list or kind is tuple:
        items = value
    else:
        return False
    for item in items:
        item_kind = type(item)
        if (item_kind is dict or item_kind is list or item_kind is tuple) and _has_envelope(item):
            return True
    return False


class EscapingJSONTranscoder(JSONTranscoder):
    """``JSONTranscoder`` that round-trips every JSON value exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.register(_EscapedDictAsPairs())

    def encode(self, obj: Any) -> bytes:
        return super().encode(_escape(obj) if _has_envelope(obj) else obj)
