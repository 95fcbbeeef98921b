"""Running one tool call durably: policy, approval, in-doubt, then the writer.

Both ``ctx.tool`` (action nodes) and the agent loop (model-requested calls)
run tools through ``run_tool``, so a tool behaves the same whoever calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from pydantic import BaseModel

from .._definitions.tools import Tool
from .._journal.run import StepData
from .._journal.sites import Effect, Lane, Site
from .._journal.wait import APPROVAL, IN_DOUBT
from ..errors import ToolApprovalDeniedError
from ..shapes import ApprovalDecision, StreamPart, ToolCall
from .children import run_flow_tool
from .step_results import decode
from .suspensions import WaitRequest, approval_decision, frozen_operation, suspend
from .writer import Attempts, RunWriter

__all__ = ["ask_approval", "recorded_approval", "run_tool", "tool_call", "tool_effect"]


def tool_effect(site: Site, tool: Tool[Any], args: BaseModel) -> Effect:
    """A call of ``tool`` with ``args`` at ``site``, as the journal files it (keyed
    by the tool's own ``idempotency_key`` when its definition has one)."""
    override = tool.idempotency_key(args.model_copy(deep=True)) if tool.idempotency_key else None
    return Effect(site, "tool", tool.name, args.model_dump(mode="json"), override)


def tool_call(writer: RunWriter, effect: Effect) -> ToolCall:
    """What the tool (and its policy) learn about the call the journal files as
    ``effect``, its key included."""
    return ToolCall(
        idempotency_key=effect.key,
        run_id=writer.run_id,
        session_id=writer.session_id,
        tool_name=effect.name,
        callsite=effect.site.callsite,
    )


async def _approved_args(
    writer: RunWriter, site: Site, tool: Tool[Any], args: BaseModel
) -> BaseModel:
    """The args to execute with, after the tool's policy and any approval.

    Once an approval is journaled, its frozen operation wins over whatever the
    caller computes now: the approver saw those args.
    """
    recorded = recorded_approval(writer, site)
    if recorded is not None:
        decision, shown = recorded
        if not decision.approved:
            raise ToolApprovalDeniedError(tool.name, decision.by, decision.reason)
        frozen: BaseModel = tool.validate(shown)
        return frozen
    effect = tool_effect(site, tool, args)
    if writer.recorded(effect) is not None:
        return args  # decided on an earlier pass: replay, never ask the policy again
    answer = tool.decide(args, tool_call(writer, effect))
    if answer == "allow":
        return args
    if answer == "deny":
        raise ToolApprovalDeniedError(tool.name, "policy", "denied by the tool's policy")
    ask_approval(writer, site, tool.name, args.model_dump(mode="json"), tool.description)


def recorded_approval(writer: RunWriter, site: Site) -> tuple[ApprovalDecision, Any] | None:
    """The decision journaled on the call at ``site`` and the args the approver
    saw (its frozen operation), or None while none was delivered."""
    step = writer.recorded(Effect(site.in_lane(Lane.APPROVAL), "approval", APPROVAL))
    if step is None or step["status"] != "finished":
        return None
    return approval_decision(decode(step)), step["args"]["operation"]["args"]


def ask_approval(
    writer: RunWriter, site: Site, tool_name: str, args: Any, description: str | None
) -> NoReturn:
    """Suspend the turn on ``__approval`` for the call at ``site``, its operation
    (tool name, args, args hash) frozen for the approver (docs/howto/approvals.md)."""
    request = WaitRequest(
        APPROVAL,
        title=f"Approve {tool_name}",
        description=description,
        operation=frozen_operation(tool_name, args),
    )
    suspend(writer, site.in_lane(Lane.APPROVAL), "approval", request)


async def run_tool(
    writer: RunWriter,
    site: Site,
    tool: Tool[Any],
    args: BaseModel,
    emit: Callable[[StreamPart], None] | None = None,
    tool_call_id: str | None = None,
) -> Any:
    """Run ``tool`` at ``site``; returns its (recorded) result.

    Failed attempts are retried as ``tool.retry`` allows, each with the same key.
    Raises ``ToolExecutionError`` (frozen failure), ``ToolApprovalDeniedError``
    or ``SuspendError`` (approval or in-doubt pending). ``emit`` receives the
    tool-call and tool-result parts of a call that really executes. A
    ``flow_tool`` runs as a child run instead (``ChildRunError`` if it did not
    finish; ``SuspendError`` while it runs).
    """
    if tool.child_flow is not None:
        return await run_flow_tool(writer, site, tool, args)
    if tool.policy is not None or tool.needs_approval:
        args = await _approved_args(writer, site, tool, args)
    args_json = args.model_dump(mode="json")
    effect = tool_effect(site, tool, args)  # made once: its key hashes the args
    call = tool_call(writer, effect)

    async def ask_in_doubt(step: StepData) -> None:
        if tool.on_in_doubt == "ask":
            question = WaitRequest(
                IN_DOUBT,
                title=f"Did {tool.name} run before the crash?",
                description=(
                    "The process stopped between this call's intent and its result. "
                    "Answer retry, resolve (with the result) or fail."
                ),
                operation=frozen_operation(tool.name, step["args"]),
                step_index=step["index"],
            )
            suspend(writer, site, "signal", question)

    announced = False

    async def execute() -> Any:
        nonlocal announced
        if emit is not None and not announced:  # one tool-call part, whatever the attempts
            announced = True
            emit(
                StreamPart(
                    type="tool-call", tool_name=tool.name, tool_call_id=tool_call_id, args=args_json
                )
            )
        # Each attempt gets its own copy of the args the journal holds (and an
        # approver saw): what one attempt changes in them is never retried.
        return await tool.invoke(args.model_copy(deep=True), call)

    def executed(result: Any) -> None:
        if emit is not None:
            emit(
                StreamPart(
                    type="tool-result",
                    tool_name=tool.name,
                    tool_call_id=tool_call_id,
                    result=result,
                )
            )

    attempts = Attempts(
        replay=tool.replay,
        retry=tool.retry,
        heartbeat_for=tool.timeout,
        # A result left unsaved by a crash is re-run under its key: only a tool
        # that may run again in doubt lets its result ride the next save.
        defer_result=tool.on_in_doubt == "retry",
    )
    return await writer.effect(
        effect, execute=execute, attempts=attempts, on_running=ask_in_doubt, on_executed=executed
    )
