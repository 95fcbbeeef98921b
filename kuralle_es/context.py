"""``RunContext``: what an ``action`` node sees (API). Thin wrappers over the funnel."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta
from typing import Any
from uuid import uuid4

from pydantic import BaseModel, ValidationError

from .cursor import Cursor
from .errors import InvalidArgumentError, InvalidSignalError, UnknownToolError
from .journal import Journal, decode, utcnow
from .models import ApprovalDecision, StreamPart
from .tool_steps import run_tool
from .tools import Tool
from .waits import APPROVAL, TIMER, Schemas, approval_decision, is_deadline_deny, suspend

__all__ = ["RunContext"]


class RunContext:
    """Durable effects for one node execution of one run."""

    def __init__(
        self,
        journal: Journal,
        cursor: Cursor,
        tools: Mapping[str, Tool[Any]],
        emit: Callable[[StreamPart], None],
        schemas: Schemas,
    ) -> None:
        self._journal = journal
        self._cursor = cursor
        self._tools = tools
        self._emit = emit
        self._schemas = schemas

    @property
    def run_id(self) -> str:
        return self._journal.run_id

    @property
    def session_id(self) -> str:
        return self._journal.session_id

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
        explicit = _explicit_site(callsite, index)
        site = self._cursor.take() if explicit is None else self._cursor.site(explicit)
        return run_tool(self._journal, site, tool, validated, self._emit)

    # ------------------------------------------------------------- waiting
    async def approve(
        self,
        title: str,
        description: str | None = None,
        deadline: datetime | timedelta | float | None = None,
    ) -> ApprovalDecision:
        """Suspend until an ``__approval`` signal arrives; returns the decision."""
        callsite = self._cursor.reserve(1)[0]
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
            raise InvalidArgumentError(msg)
        callsite = self._cursor.reserve(1)[0]
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
        site = self._cursor.site(callsite)
        step = self._journal.recorded(site, kind, name, site.key(name))
        if step is not None and step["status"] == "finished":
            return decode(step)
        suspend(
            self._journal,
            site,
            name=name,
            kind=kind,
            title=title,
            description=description,
            deadline=deadline,
            schema=schema,
            schemas=self._schemas,
        )

    # ----------------------------------------------------------------- sleep
    async def sleep(self, duration: float | timedelta) -> None:
        """Sleep durably for ``duration`` (seconds, or a ``timedelta``).

        Takes one callsite and journals one ``timer`` step whose result is the
        wake time, so a replay waits only for what is left of it (nothing,
        once past it). A wake time within the runtime's ``inline_sleep_limit``
        is waited out in this turn (the heartbeat keeps the lease); a later one
        pauses the run on a ``timer`` wait that takes no delivery, until a
        sweeper's ``fire_timers`` wakes it once it is due (docs/howto/recovery.md).
        ``InvalidArgumentError`` for a negative or non-finite duration.
        """
        seconds = _seconds(duration)
        site = self._cursor.take()
        recorded = await self._journal.record_value(
            site,
            kind="timer",
            name="sleep",
            key=site.key("timer"),
            args={"seconds": seconds},
            make=lambda: {"wake_at": (utcnow() + timedelta(seconds=seconds)).isoformat()},
        )
        wake_at = datetime.fromisoformat(recorded["wake_at"])
        left = (wake_at - utcnow()).total_seconds()
        if left <= 0:
            return
        if left <= self._journal.inline_sleep_limit:
            await self._journal.hold(left)
            return
        suspend(self._journal, site, name=TIMER, kind="timer", deadline=wake_at)

    # ---------------------------------------------------------- clock, uuid
    async def now(self) -> datetime:
        """The current UTC time, recorded once and replayed identically."""
        value = await self._value("now", lambda: utcnow().isoformat())
        return datetime.fromisoformat(value)

    async def uuid(self) -> str:
        """A uuid4 string, recorded once and replayed identically."""
        return str(await self._value("uuid", lambda: str(uuid4())))

    async def _value(self, kind: str, make: Callable[[], str]) -> Any:
        site = self._cursor.take()
        return await self._journal.record_value(
            site, kind=kind, name=kind, key=site.key(kind), args=None, make=make
        )

    # ---------------------------------------------------------------- misc
    def emit(self, part: Any) -> None:
        """Send a custom part to the turn's stream (not journaled)."""
        self._emit(StreamPart(type="custom", data=part))

    def reserve_callsites(self, n: int) -> list[int]:
        """Reserve ``n`` ordinals now; pass them as ``callsite=`` to later calls."""
        return self._cursor.reserve(n)


def _seconds(duration: float | timedelta) -> float:
    """A sleep's length in seconds, or ``InvalidArgumentError``."""
    if isinstance(duration, timedelta):
        seconds = duration.total_seconds()
    elif isinstance(duration, int | float) and not isinstance(duration, bool):
        seconds = float(duration)
    else:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        msg = f"sleep takes a number of seconds or a timedelta, 0 or more; got {duration!r}"
        raise InvalidArgumentError(msg)
    return seconds


def _explicit_site(callsite: int | None, index: int | None) -> int | None:
    if callsite is not None and index is not None and callsite != index:
        msg = f"callsite={callsite} and index={index} disagree; pass one of them"
        raise InvalidArgumentError(msg)
    return callsite if callsite is not None else index
