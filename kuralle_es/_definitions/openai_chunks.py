"""A streamed chat completion put back together (internal).

The chunks of ``chat.completions.create(stream=True)`` carry the first
choice's text, its tool calls (an id and a name first, then the arguments in
pieces, by the call's ``index``) and, with ``stream_options.include_usage``,
one last chunk with the usage and no choice. Assembled, they are what the
whole completion would have said, so ``OpenAIModel`` journals the same
response whether it streamed or not. A stream that ends before its choice
said why it finished (a ``finish_reason``) was cut short: it is never taken
for a whole answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Call", "ChunkAssembly", "Function"]


@dataclass
class Function:
    """A tool call's function: its name and its arguments text."""

    name: str | None
    arguments: str | None


@dataclass
class Call:
    """A tool call of the first choice, as the completion gives it."""

    id: str
    function: Function | Any


@dataclass
class _Partial:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class ChunkAssembly:
    """The first choice's text, tool calls and the usage, chunk by chunk."""

    #: Whether any chunk carried a choice (a completion without one is refused).
    chosen: bool = False
    #: Whether the first choice said why it ended: a stream cut short never does.
    finished: bool = False
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    _calls: dict[int, _Partial] = field(default_factory=dict)

    def add(self, chunk: Any) -> str | None:
        """Take one chunk in; the text it adds, if any."""
        usage = getattr(chunk, "usage", None)
        if usage is not None:
            self.usage = usage.model_dump()
        choices = getattr(chunk, "choices", None) or []
        first = next((c for c in choices if getattr(c, "index", 0) == 0), None)
        if first is None:
            return None
        self.chosen = True
        if getattr(first, "finish_reason", None):
            self.finished = True
        delta = getattr(first, "delta", None)
        if delta is None:
            return None
        for piece in getattr(delta, "tool_calls", None) or []:
            partial = self._calls.setdefault(int(piece.index or 0), _Partial())
            partial.id = piece.id or partial.id
            function = getattr(piece, "function", None)
            if function is not None:
                partial.name = function.name or partial.name
                if function.arguments:
                    partial.arguments.append(function.arguments)
        text = getattr(delta, "content", None)
        if text:
            self.text.append(text)
            return str(text)
        return None

    def calls(self) -> list[Call]:
        """The tool calls, in the order of their indexes."""
        return [
            Call(p.id, Function(p.name or None, "".join(p.arguments) or None))
            for _, p in sorted(self._calls.items())
        ]
