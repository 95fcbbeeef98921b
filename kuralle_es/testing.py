"""Testing kit for users' own suites: a scripted model (more to come)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .errors import KuralleError
from .llm import ModelRequest, ModelResponse, as_response

__all__ = ["ScriptedModel"]

Script = Sequence[ModelResponse | str] | Callable[[ModelRequest], ModelResponse | str]


class ScriptedModel:
    """A model that answers from a script: responses in order, or a function.

    ``requests`` keeps every request it was asked, so a test can check that a
    resume did not ask the model again.
    """

    def __init__(self, script: Script, id: str = "scripted") -> None:
        self._script = script
        self._id = id
        self._next = 0
        self.requests: list[ModelRequest] = []

    @property
    def id(self) -> str:
        return self._id

    async def respond(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        if callable(self._script):
            answer: Any = self._script(request)
        else:
            if self._next >= len(self._script):
                msg = (
                    f"ScriptedModel {self._id!r} ran out of responses after "
                    f"{len(self._script)}; add a response for this {request.purpose!r} request"
                )
                raise KuralleError(msg)
            answer = self._script[self._next]
            self._next += 1
        return as_response(self._id, answer)
