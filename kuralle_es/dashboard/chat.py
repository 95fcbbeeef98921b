"""A run's messages shaped to read like a chat: what was said, the tools the model called
with their arguments and results, and each call's approval where it happened (internal).

The messages are the run's own (``RunState.messages``, the OpenAI shape): a user
or assistant text is a bubble; an assistant message's tool calls are cards, each
with the tool's result from the ``tool`` message that answers it (by
``tool_call_id``), or the denial the model was told of. Approvals come from the
journal: an ``__approval`` step right before a call's tool step (or, denied, before
the model heard of the denial) is that call's decision, shown on its card. A call
the run now waits to have approved says so on its card, where an operator decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._journal.json_data import decode_json
from .._journal.wait import APPROVAL
from ..redaction import Redacted
from ..shapes import Message, RunState, StepRecord

__all__ = ["ChatItem", "ToolCallCard", "chat_items", "message_calls"]


@dataclass
class ToolCallCard:
    """One tool call the model asked for, and what became of it."""

    call_id: str | None
    tool: str
    args: Any
    result: Any = None
    answered: bool = False
    denied_by: str | None = None
    decision: dict[str, Any] | None = None
    waiting: bool = False

    @property
    def state(self) -> str:
        if self.waiting:
            return "waiting for approval"
        if self.denied_by is not None:
            return "denied"
        return "done" if self.answered else "no result yet"


@dataclass
class ChatItem:
    """A bubble (``role`` user, assistant, system, or tool for a result no call claims)
    with its text, and the tool calls an assistant message made."""

    role: str
    text: str | None
    calls: list[ToolCallCard] = field(default_factory=list)


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return decode_json(text)
    except ValueError:
        return text


def message_calls(message: Message) -> list[ToolCallCard]:
    """The tool calls of an assistant message (OpenAI's ``function`` shape, or flat)."""
    cards: list[ToolCallCard] = []
    if isinstance(message.tool_calls, Redacted):
        return cards  # an erased subject's calls (docs/privacy.md)
    for call in message.tool_calls or []:
        nested = call.get("function")
        function: dict[str, Any] = nested if isinstance(nested, dict) else call
        arguments = function.get("arguments", function.get("args"))
        cards.append(
            ToolCallCard(
                call_id=call.get("id"), tool=str(function.get("name", "?")), args=_json(arguments)
            )
        )
    return cards


def chat_items(run: RunState, steps: Sequence[StepRecord]) -> list[ChatItem]:
    """The run's messages as chat items, tool results and approvals in their calls."""
    items: list[ChatItem] = []
    cards: dict[str, ToolCallCard] = {}
    in_order: list[ToolCallCard] = []
    for message in run.messages:
        content = str(message.content) if isinstance(message.content, Redacted) else message.content
        if message.role == "tool":
            card = cards.get(message.tool_call_id or "")
            if card is None:
                items.append(ChatItem("tool", content))
                continue
            _answer(card, _json(message.content))
            continue
        calls = message_calls(message) if message.role == "assistant" else []
        for card in calls:
            if card.call_id:
                cards[card.call_id] = card
            in_order.append(card)
        if content or calls:
            items.append(ChatItem(message.role, content, calls))
    _attach_approvals(in_order, steps)
    _mark_waiting(in_order, run)
    return items


def _answer(card: ToolCallCard, result: Any) -> None:
    card.answered = True
    card.result = result
    if isinstance(result, dict) and result.get("__denied"):
        card.denied_by = str(result.get("deniedBy") or "someone")


def _attach_approvals(calls: list[ToolCallCard], steps: Sequence[StepRecord]) -> None:
    """Each ``__approval`` decision to the call it decided: the next call whose tool step
    follows it, or, denied, the next call the model was told was denied."""
    todo = list(calls)
    decision: StepRecord | None = None
    for step in sorted(steps, key=lambda s: s.index):
        if step.kind == "approval" and step.name == APPROVAL:
            decision = step
        elif step.kind == "tool":
            card = next((c for c in todo if c.tool == step.name), None)
            if card is not None:
                todo.remove(card)
                if decision is not None and decision.index == step.index - 1:
                    card.decision = _decided(decision)
            decision = None
        elif decision is not None and not _approved(decision):
            card = next((c for c in todo if c.denied_by is not None), None)
            if card is not None:
                todo.remove(card)
                card.decision = _decided(decision)
            decision = None


def _approved(step: StepRecord) -> bool:
    return isinstance(step.result, dict) and bool(step.result.get("approved"))


def _decided(step: StepRecord) -> dict[str, Any]:
    result = step.result if isinstance(step.result, dict) else {}
    return {
        "approved": bool(result.get("approved")),
        "by": result.get("by"),
        "reason": result.get("reason"),
        "at": step.finished_at,
    }


def _mark_waiting(calls: list[ToolCallCard], run: RunState) -> None:
    """The call the run waits to have approved: the last unanswered one of that tool."""
    wait = run.waiting_for
    if run.status != "paused" or wait is None or wait.kind != "approval":
        return
    if wait.operation is None:
        return
    for card in reversed(calls):
        if card.tool == wait.operation.tool_name and not card.answered:
            card.waiting = True
            return
