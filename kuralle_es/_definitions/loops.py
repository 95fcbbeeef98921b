"""Agent loops of one's own: what drives a conversation's user turn, and what it is given.

The built-in loop (model, tools, model, ... until a reply; docs/agents.md) is
one way to drive a user turn of a conversation run. An agent defined with
``loop=`` is driven by that loop instead: an integration runs another
framework's agent this way (kuralle_es.integrations.pydantic_ai,
docs/pydantic-ai.md). A loop performs no effect of its own: every model
request, approval and tool call goes through the ``LoopTurn`` it is handed,
which journals it as the built-in loop's would be (a ``model`` step, an
``__approval`` wait, a ``tool`` step with its idempotency key), so a crash, a
retry or a resume in another process replays it instead of doing it again.
A loop must therefore ask for the same effects in the same order on every
pass of a turn, given what the journal returned (docs/concepts.md, "Replay").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ..shapes import ApprovalDecision, Message, StreamPart
from .llm import Model, ModelRequest, ModelResponse
from .tools import Tool

__all__ = ["ConversationLoop", "LoopTurn"]


class LoopTurn(Protocol):
    """One user turn of a conversation run, as a loop drives it.

    Callsites are handed out in call order: ``model`` takes the next one;
    ``reserve`` sets some aside (for the tool calls of a model response, so
    that each call keeps its callsite whatever order the calls then run in).
    """

    @property
    def run_id(self) -> str:
        """The run this turn belongs to."""
        ...

    @property
    def session_id(self) -> str:
        """The run's session."""
        ...

    def messages(self) -> list[Message]:
        """The run's chat so far: earlier turns, this turn's user message, and
        what this turn's journaled steps added."""
        ...

    def append_message(self, message: Message) -> None:
        """Add a message to the run's chat (saved with the turn's next save)."""
        ...

    def emit(self, part: StreamPart) -> None:
        """Send a part to the turn's stream (not journaled)."""
        ...

    async def model(
        self, model: Model, request: ModelRequest, messages: Sequence[Message] = ()
    ) -> ModelResponse:
        """Ask ``model`` at the next callsite as a journaled ``model`` step (the
        run's budget checked first); a replay returns the recorded response.
        A fresh answer appends ``messages`` (what led to this request since the
        last one: tool results) and then the assistant message to the chat."""
        ...

    def reserve(self, n: int) -> list[int]:
        """Set ``n`` consecutive callsites aside, in order."""
        ...

    async def given(self, name: str, value: Any) -> Any:
        """What the caller gave this turn under ``name`` (JSON, such as a message
        history), the same on every pass of the turn in any process: journaled
        at the next callsite as a ``value`` step by the pass that had it first,
        and read back from there by every later pass (which need not have it).
        None, with no callsite taken, when no pass had one, or when the turn
        already went on without it."""
        ...

    async def approval(
        self, callsite: int, tool_name: str, args: Any, description: str | None = None
    ) -> ApprovalDecision:
        """The decision on calling ``tool_name`` with ``args`` at ``callsite``: the
        journaled one, or the turn suspends on ``__approval`` (``SuspendError``)
        with the operation frozen (docs/howto/approvals.md)."""
        ...

    async def tool(
        self, tool: Tool[Any], args: Any, callsite: int, tool_call_id: str | None = None
    ) -> Any:
        """Run ``tool`` with ``args`` at ``callsite`` as a journaled ``tool`` step,
        exactly as a model-requested call of the built-in loop: its policy or
        approval (the frozen args win once approved), retries, in-doubt rule."""
        ...

    async def child(
        self,
        callsite: int,
        ordinal: int,
        agent_id: str,
        prompt: str,
        session_id: str | None = None,
    ) -> tuple[str, Any]:
        """From inside the tool call at ``callsite``, its ``ordinal``-th child run: a
        conversation whose one user turn, ``prompt``, agent ``agent_id`` answers
        (an agent delegating to another, docs/pydantic-ai.md). Started exactly
        once (a step of this run whose key the child's id derives from, so a
        re-execution of the call finds the same child), in ``session_id`` or
        this run's session; returns the child's id and its reply once it
        ended, or raises
        ``ChildRunError`` (it errored or was cancelled). While the child waits
        (an approval of its own), this turn suspends on a ``child`` wait and the
        call is left running: when the child ends, the resumed turn executes
        the call again, where this returns the recorded reply."""
        ...


@runtime_checkable
class ConversationLoop(Protocol):
    """What drives an agent's user turn in place of the built-in loop."""

    async def drive(self, turn: LoopTurn) -> str | None:
        """Drive one user turn to its reply (the turn's output), or raise.

        Re-entered from the start on every pass of the turn (a resume after a
        crash or an approval); a ``SuspendError`` from ``turn`` must propagate.
        """
        ...
