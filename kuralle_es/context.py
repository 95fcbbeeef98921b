"""``RunContext``: what an ``action`` node sees. Thin wrappers over the funnel."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta
from typing import Any
from uuid import uuid4

from pydantic import BaseModel, ValidationError

from .domain import StepData
from .errors import InvalidSignalError, ToolApprovalDeniedError, UnknownToolError
from .journal import Journal, decode, utcnow
from .models import ApprovalDecision, StreamPart, ToolCall
from .tools import Tool
from .waits import (
    APPROVAL,
    APPROVAL_LANE,
    IN_DOUBT,
    approval_decision,
    frozen_operation,
    is_deadline_deny,
    suspend,
)

__all__ = ["RunContext"]


class RunContext:
    """Durable effects for one node execution of one run."""

    def __init__(
        self,
        journal: Journal,
        tools: Mapping[str, Tool],
        emit: Callable[[StreamPart], None],
    ) -> None:
        self._journal = journal
        self._tools = tools
        self._emit = emit

    @property
    def run_id(self) -> str:
        return self._journal.run.run_id

    @property
    def session_id(self) -> str:
        return self._journal.run.session_id

    # ----------------------------------------------------------------- tools
    def tool(
        self,
        name: str,
        args: Any = None,
        *,
        callsite: int | None = None,
        index: int | None = None,
    ) -> Awaitable[Any]:
        """Run a tool durably. The callsite is reserved now, when called, not when awaited.

        Unknown names and invalid args are refused here, before any callsite
        is taken or anything is journaled.
        """
        tool = self._tools.get(name)
        if tool is None:
            raise UnknownToolError(name, list(self._tools))
        validated = tool.validate(args)
        site = _explicit_site(callsite, index)
        if site is None:
            site = self._journal.reserve(1)[0]
        return self._run_tool(tool, validated, site)

    def _call(self, tool: Tool, args: BaseModel, callsite: int) -> ToolCall:
        override = tool.idempotency_key(args) if tool.idempotency_key else None
        payload = {"name": tool.name, "args": args.model_dump(mode="json")}
        return ToolCall(
            idempotency_key=self._journal.key_for(callsite, payload, override),
            run_id=self.run_id,
            session_id=self.session_id,
            tool_name=tool.name,
            callsite=callsite,
        )

    async def _approved_args(self, tool: Tool, args: BaseModel, callsite: int) -> BaseModel:
        """The args to execute with, after the tool's policy and any approval.

        Once an approval is journaled, its frozen operation wins over whatever
        the node computes now: the approver saw those args.
        """
        journal = self._journal
        key = journal.key_for(callsite, APPROVAL)
        step = journal.recorded(callsite, "approval", APPROVAL, key, APPROVAL_LANE)
        if step is not None and step["status"] == "finished":
            decision = approval_decision(decode(step))
            if not decision.approved:
                raise ToolApprovalDeniedError(tool.name, decision.by, decision.reason)
            return tool.validate(step["args"]["operation"]["args"])
        answer = tool.decide(args, self._call(tool, args, callsite))
        if answer == "allow":
            return args
        if answer == "deny":
            raise ToolApprovalDeniedError(tool.name, "policy", "denied by the tool's policy")
        suspend(
            journal,
            callsite=callsite,
            name=APPROVAL,
            kind="approval",
            title=f"Approve {tool.name}",
            description=tool.description,
            operation=frozen_operation(tool.name, args.model_dump(mode="json")),
            lane=APPROVAL_LANE,
        )

    async def _run_tool(self, tool: Tool, args: BaseModel, callsite: int) -> Any:
        journal = self._journal
        if tool.policy is not None or tool.needs_approval:
            args = await self._approved_args(tool, args, callsite)
        args_json = args.model_dump(mode="json")
        call = self._call(tool, args, callsite)
        key = call.idempotency_key

        async def ask_in_doubt(step: StepData) -> None:
            if tool.on_in_doubt == "ask":
                suspend(
                    journal,
                    callsite=callsite,
                    name=IN_DOUBT,
                    kind="signal",
                    title=f"Did {tool.name} run before the crash?",
                    description=(
                        "The process stopped between this call's intent and its result. "
                        "Answer retry, resolve (with the result) or fail."
                    ),
                    operation=frozen_operation(tool.name, step["args"]),
                    step_index=step["index"],
                )

        async def execute() -> Any:
            self._emit(StreamPart(type="tool-call", tool_name=tool.name, args=args_json))
            return await tool.invoke(args, call)

        def executed(result: Any) -> None:
            self._emit(StreamPart(type="tool-result", tool_name=tool.name, result=result))

        return await journal.effect(
            callsite=callsite,
            kind="tool",
            name=tool.name,
            key=key,
            args=args_json,
            execute=execute,
            replay=tool.replay,
            on_running=ask_in_doubt,
            on_executed=executed,
        )

    # ------------------------------------------------------------- waiting
    async def approve(
        self,
        title: str,
        description: str | None = None,
        deadline: datetime | timedelta | float | None = None,
    ) -> ApprovalDecision:
        """Suspend until an ``__approval`` signal arrives; returns the decision."""
        callsite = self._journal.reserve(1)[0]
        payload = await self._wait(
            callsite, APPROVAL, "approval", title=title, description=description, deadline=deadline
        )
        return approval_decision(payload)

    async def signal(
        self,
        name: str,
        deadline: datetime | timedelta | float | None = None,
        schema: type[BaseModel] | None = None,
    ) -> Any:
        """Suspend until signal ``name`` arrives; returns its payload (validated by
        ``schema`` when given, except the deadline sweeper's deny, returned as is)."""
        if not isinstance(name, str) or not name or name.startswith("__"):
            msg = f"signal name must be a non-empty string not starting with '__', got {name!r}"
            raise ValueError(msg)
        callsite = self._journal.reserve(1)[0]
        payload = await self._wait(callsite, name, "signal", deadline=deadline, schema=schema)
        if schema is None or is_deadline_deny(payload):
            return payload
        try:
            return schema.model_validate(payload)
        except ValidationError as e:
            raise InvalidSignalError(name, f"payload of signal {name!r}: {e}") from None

    async def _wait(
        self,
        callsite: int,
        name: str,
        kind: str,
        *,
        title: str | None = None,
        description: str | None = None,
        deadline: datetime | timedelta | float | None = None,
        schema: type[BaseModel] | None = None,
    ) -> Any:
        journal = self._journal
        step = journal.recorded(callsite, kind, name, journal.key_for(callsite, name))
        if step is not None and step["status"] == "finished":
            return decode(step)
        suspend(
            journal,
            callsite=callsite,
            name=name,
            kind=kind,
            title=title,
            description=description,
            deadline=deadline,
            schema=schema,
        )

    # ---------------------------------------------------------- clock, uuid
    async def now(self) -> datetime:
        """The current UTC time, recorded once and replayed identically."""
        value = await self._simple("now", lambda: utcnow().isoformat())
        return datetime.fromisoformat(value)

    async def uuid(self) -> str:
        """A uuid4 string, recorded once and replayed identically."""
        return str(await self._simple("uuid", lambda: str(uuid4())))

    async def _simple(self, kind: str, make: Callable[[], str]) -> Any:
        journal = self._journal
        callsite = journal.reserve(1)[0]

        async def execute() -> str:
            return make()

        return await journal.effect(
            callsite=callsite,
            kind=kind,
            name=kind,
            key=journal.key_for(callsite, kind),
            args=None,
            execute=execute,
        )

    # ---------------------------------------------------------------- misc
    def emit(self, part: Any) -> None:
        """Send a custom part to the turn's stream (not journaled)."""
        self._emit(StreamPart(type="custom", data=part))

    def reserve_callsites(self, n: int) -> list[int]:
        """Reserve ``n`` ordinals now; pass them as ``callsite=`` to later calls."""
        return self._journal.reserve(n)


def _explicit_site(callsite: int | None, index: int | None) -> int | None:
    if callsite is not None and index is not None and callsite != index:
        msg = f"callsite={callsite} and index={index} disagree; pass one of them"
        raise ValueError(msg)
    return callsite if callsite is not None else index
