"""``RunContext``: what an ``action`` node sees (API). Thin wrappers over the writer.

A context is bound to one node visit: once the node has returned (or
raised), every effect asked of it raises ``TurnClosedError`` and executes
nothing, so a task the node left running cannot act for the run. It is
bound to its turn's event loop too: a call from another thread or another
loop is refused the same way, before it reserves a callsite or touches the
journal (whose lock, cursor and run belong to the turn's loop). While the
visit lasts, the journal admits each effect (it refuses every effect after
the turn suspended), docs/node-code.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Callable, Coroutine, Mapping
from datetime import datetime, timedelta
from typing import Any, Literal
from uuid import uuid4

from pydantic import BaseModel, ValidationError

from .._definitions.tools import Tool
from .._durations import deadline_at, positive_seconds
from .._journal.run import StepData
from .._journal.sites import Effect, Lane, Site
from .._journal.wait import APPROVAL, TIMER, DeadlineDeny
from ..errors import (
    DeadlineExpiredError,
    InvalidArgumentError,
    InvalidSignalError,
    TurnClosedError,
    UnknownToolError,
)
from ..shapes import ApprovalDecision, StreamPart
from .children import ChildRequest, child_request, start_child, wait_child
from .cursor import Cursor
from .deliveries import EXPIRED, take_message
from .input_checks import check_name
from .replay_logger import ReplayQuietLogger
from .step_results import decode
from .suspensions import Schemas, WaitRequest, approval_decision, suspend
from .tool_calls import run_tool
from .writer import RunWriter

__all__ = ["RunContext", "TurnBound"]


class TurnBound:
    """What a node's context and an agent loop's turn share: the run's writer and
    callsite cursor, and the turn's stream (docs/concepts.md, "Callsites")."""

    def __init__(
        self, writer: RunWriter, cursor: Cursor, emit: Callable[[StreamPart], None]
    ) -> None:
        self._writer = writer
        self._cursor = cursor
        self._emit = emit

    @property
    def run_id(self) -> str:
        return self._writer.run_id

    @property
    def session_id(self) -> str:
        return self._writer.session_id


class RunContext(TurnBound):
    """Durable effects for one node execution of one run."""

    def __init__(
        self,
        writer: RunWriter,
        cursor: Cursor,
        tools: Mapping[str, Tool[Any]],
        emit: Callable[[StreamPart], None],
        schemas: Schemas,
        input_model: type[BaseModel] | None = None,
    ) -> None:
        super().__init__(writer, cursor, emit)
        self._tools = tools
        self._schemas = schemas
        #: The flow's ``input`` model (``define_flow(..., input=...)``), if it has one.
        self._input_model = input_model
        self._input: BaseModel | None = None
        self._closed = False
        #: The turn's event loop, the only one this context answers on.
        self._loop = asyncio.get_running_loop()
        #: The node's logger, quiet while this pass replays (docs/messages.md).
        self.logger = ReplayQuietLogger(writer, cursor)

    def close(self) -> None:
        """End this context's node visit (the driver calls it when the node is done)."""
        self._closed = True

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise TurnClosedError(self._writer.run_id, what)
        try:
            on_its_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # a plain thread: no loop at all
            on_its_loop = False
        if not on_its_loop:
            raise TurnClosedError(self._writer.run_id, what, elsewhere=True)

    def _admit(self, what: str) -> None:
        """Refuse an effect once the visit ended (``TurnClosedError``) or the turn
        suspended (``SuspendError``); nothing is reserved or executed then."""
        self._require_open(what)
        self._writer.admission.admit(what)

    @property
    def input(self) -> Any:
        """The run's input, validated by the flow's ``input`` model: the model the run
        was started with, read from the run's journal (the same on every replay
        and in any process). None for a flow without ``input=``, whose start is
        text (the run's first user message), or a run given no typed input."""
        self._require_open("input")
        given = self._writer.input
        if self._input is None and self._input_model is not None and given is not None:
            self._input = self._input_model.model_validate(given)
        return self._input

    # ----------------------------------------------------------------- tools
    def tool(
        self,
        name: str,
        args: Any = None,
        *,
        callsite: int | None = None,
        index: int | None = None,
    ) -> Coroutine[Any, Any, Any]:
        """Run a tool durably. The callsite is reserved now, when called, not when awaited.

        Unknown names and invalid args are refused here, before any callsite
        is taken or anything is journaled, and so is a request made after the
        turn suspended. Awaited after the node returned, it raises ``TurnClosedError``.
        """
        self._admit(f"tool {name!r}")
        tool = self._tools.get(name)
        if tool is None:
            raise UnknownToolError(name, list(self._tools))
        validated = tool.validate(args)
        explicit = _explicit_site(callsite, index)
        return self._run_tool(self._cursor.request(explicit), tool, validated)

    async def _run_tool(self, site: Site, tool: Tool[Any], args: BaseModel) -> Any:
        try:
            self._require_open(f"tool {tool.name!r}")
        except TurnClosedError:
            self._settle_refused()
            raise
        try:
            return await run_tool(self._writer, site, tool, args, self._emit)
        finally:
            self._cursor.settled()

    def _settle_refused(self) -> None:
        """Settle the callsite ``tool`` reserved for an effect refused when awaited,
        on the turn's loop: the cursor is the loop's, and the await may have been
        on another loop, in another thread."""
        if _running_loop() is self._loop:
            self._cursor.settled()
            return
        with contextlib.suppress(RuntimeError):  # the turn's loop is closed: nothing waits
            self._loop.call_soon_threadsafe(self._cursor.settled)

    # ---------------------------------------------------------- child runs
    def child(
        self, flow_name: str, input: Any = None, *, session_id: str | None = None
    ) -> Coroutine[Any, Any, Any]:
        """Start a child run of flow ``flow_name`` once, wait for it to end, and return
        its output (docs/child-runs.md).

        ``input`` is the child's start, validated as any flow start (text, or for a
        typed flow a mapping, JSON string or model); ``session_id`` defaults to
        this run's session. The start is one step of this run (the child's id
        derives from its key, so a replay or a crash never starts a second
        child); while the child runs, this run pauses on a ``child`` wait, and
        resumes when the child ends. A child that errored or was aborted raises
        ``ChildRunError``. Refused when called (nothing reserved): an unknown
        flow (``FlowNotFoundError``), an input the flow refuses
        (``InvalidArgumentError``).
        """
        return self._start(flow_name, input, session_id, wait=True)

    def start_child(
        self, flow_name: str, input: Any = None, *, session_id: str | None = None
    ) -> Coroutine[Any, Any, str]:
        """Start a child run once, like ``child``, without waiting for it: returns its
        id, for ``wait_child`` (or nothing: it runs on its own)."""
        return self._start(flow_name, input, session_id, wait=False)

    def _start(
        self, flow_name: str, input: Any, session_id: str | None, *, wait: bool
    ) -> Coroutine[Any, Any, Any]:
        self._admit(f"child run of {flow_name!r}")
        request = child_request(flow_name, input, session_id, self._writer.session_id)
        return self._child(self._cursor.request(), request, wait)

    async def _child(self, site: Site, request: ChildRequest, wait: bool) -> Any:
        try:
            self._require_open(f"child run of {request.name!r}")
        except TurnClosedError:
            self._settle_refused()
            raise
        try:
            child_run_id = await start_child(self._writer, site, request)
            if not wait:
                return child_run_id
            return await wait_child(self._writer, site.in_lane(Lane.CHILD), child_run_id)
        finally:
            self._cursor.settled()

    def wait_child(self, child_run_id: str) -> Coroutine[Any, Any, Any]:
        """Wait for a child run this run started (``start_child``) to end; returns its
        output, or raises ``ChildRunError`` (it errored or was aborted). Takes one
        callsite; pauses the run (a ``child`` wait) until the child ends.
        ``InvalidArgumentError`` for an id that is not one of this run's children."""
        self._admit("wait_child")
        if child_run_id not in self._writer.children:
            msg = (
                f"run {self._writer.run_id} started no child run {child_run_id!r}; wait for "
                "an id that ctx.start_child returned"
            )
            raise InvalidArgumentError(msg)
        return self._wait_child(self._cursor.request(), child_run_id)

    async def _wait_child(self, site: Site, child_run_id: str) -> Any:
        try:
            self._require_open("wait_child")
        except TurnClosedError:
            self._settle_refused()
            raise
        try:
            return await wait_child(self._writer, site, child_run_id)
        finally:
            self._cursor.settled()

    # ------------------------------------------------------------- waiting
    def approve(
        self,
        title: str,
        description: str | None = None,
        deadline: datetime | timedelta | float | None = None,
    ) -> Coroutine[Any, Any, ApprovalDecision]:
        """Suspend until an ``__approval`` signal arrives; returns the decision."""
        deadline_at(deadline, self._writer.now())  # refused now, not when awaited
        self._admit("approval")
        return self._approve(title, description, deadline)

    async def _approve(
        self, title: str, description: str | None, deadline: datetime | timedelta | float | None
    ) -> ApprovalDecision:
        self._require_open("approval")
        payload, _ = await self._wait(
            "approval", WaitRequest(APPROVAL, title, description, deadline)
        )
        return approval_decision(payload)

    def signal(
        self,
        name: str,
        deadline: datetime | timedelta | float | None = None,
        schema: type[BaseModel] | None = None,
    ) -> Coroutine[Any, Any, Any]:
        """Suspend until signal ``name`` arrives; returns its payload (validated by
        ``schema`` when given). Past its ``deadline`` (the sweeper's deny), a wait
        with a ``schema`` raises ``DeadlineExpiredError``, which the node may catch;
        one without returns the deny's payload."""
        if not isinstance(name, str) or not name or name.startswith("__"):
            msg = f"signal name must be a non-empty string not starting with '__', got {name!r}"
            raise InvalidArgumentError(msg)
        deadline_at(deadline, self._writer.now())  # refused now, not when awaited
        self._admit(f"signal {name!r}")
        return self._signal(name, deadline, schema)

    async def _signal(
        self,
        name: str,
        deadline: datetime | timedelta | float | None,
        schema: type[BaseModel] | None,
    ) -> Any:
        self._require_open(f"signal {name!r}")
        payload, step = await self._wait(
            "signal", WaitRequest(name, deadline=deadline, schema=schema)
        )
        if schema is None:
            return payload
        if DeadlineDeny.is_one(payload):
            # A typed wait never hands node code an untyped deny: the deadline is
            # an exception the node may catch (docs/node-code.md).
            args = step.get("args") or {}
            expired = args.get("deadline") if isinstance(args, dict) else None
            when = datetime.fromisoformat(expired) if isinstance(expired, str) else None
            raise DeadlineExpiredError(name, when)
        try:
            return schema.model_validate(payload)
        except ValidationError as e:
            raise InvalidSignalError(name, f"payload of signal {name!r}: {e}") from None

    async def _wait(
        self, kind: Literal["approval", "signal"], request: WaitRequest
    ) -> tuple[Any, StepData]:
        """The payload delivered for ``request`` (an approval or a signal), recorded,
        with its step; or the turn suspends on it."""
        site = self._cursor.request()
        try:
            step = self._writer.recorded(Effect(site, kind, request.name))
            if step is not None and step["status"] == "finished":
                return decode(step), step
            suspend(self._writer, site, kind, request, self._schemas)
        finally:
            self._cursor.settled()

    # ------------------------------------------------------ messages, values
    def receive(
        self,
        name: str,
        *,
        deadline: datetime | timedelta | float | None = None,
        schema: type[BaseModel] | None = None,
    ) -> Coroutine[Any, Any, Any]:
        """Take the oldest unread message ``name`` from the run's mailbox
        (``runtime.send``) and return its payload (validated by ``schema``, a
        pydantic model, when given: ``InvalidSignalError`` if it does not fit).

        With none there, the turn suspends (``waiting_for.kind == "message"``)
        until one is sent. Which message a receive took is journaled, so a
        replay takes the same one. Past ``deadline`` (the sweeper's
        ``sweep_deadlines``) it raises ``DeadlineExpiredError``, which the node
        may catch: a timer that a message can cut short (docs/messages.md).
        """
        check_name(name, "message name")
        deadline_at(deadline, self._writer.now())  # refused now, not when awaited
        self._admit(f"receive {name!r}")
        return self._receive(name, deadline, schema)

    async def _receive(
        self,
        name: str,
        deadline: datetime | timedelta | float | None,
        schema: type[BaseModel] | None,
    ) -> Any:
        self._require_open(f"receive {name!r}")
        site = self._cursor.request()
        try:
            recorded = await self._take(site, WaitRequest(name, deadline=deadline, schema=schema))
        finally:
            self._cursor.settled()
        if EXPIRED in recorded:
            expired = recorded[EXPIRED]
            raise DeadlineExpiredError(name, datetime.fromisoformat(expired) if expired else None)
        payload = recorded["payload"]
        if schema is None:
            return payload
        try:
            return schema.model_validate(payload)
        except ValidationError as e:
            raise InvalidSignalError(name, f"payload of message {name!r}: {e}") from None

    async def _take(self, site: Site, request: WaitRequest) -> dict[str, Any]:
        """What the receive at ``site`` took: recorded, or the oldest unread message
        (journaled now), or the turn suspends on the wait for one."""
        writer, name = self._writer, request.name
        step = writer.recorded(Effect(site, "receive", name))
        if step is not None:
            recorded: dict[str, Any] = decode(step)
            return recorded
        if writer.unread(name) is None:  # sent since this turn last saved? Look once more.
            await writer.saver.take_in_mail()
        taken = await take_message(writer, site, name)
        if taken is None:
            suspend(writer, site, "message", request, self._schemas)
        return taken

    def publish(self, key: str, value: Any) -> Coroutine[Any, Any, None]:
        """Publish ``value`` (JSON) under ``key`` for others to read while the run
        lives: ``runtime.published``, ``runtime.wait_published``, ``GET
        /api/runs/{run_id}/published``, the dashboard. Journaled as a ``publish``
        step, so a replay publishes nothing again; a later publish of the same
        key replaces the value others read (docs/messages.md)."""
        check_name(key, "published key")
        self._admit(f"publish {key!r}")
        return self._publish(key, copy.deepcopy(value))

    async def _publish(self, key: str, value: Any) -> None:
        self._require_open(f"publish {key!r}")
        site = self._cursor.request()
        try:
            await self._writer.record_value(Effect(site, "publish", key), make=lambda: value)
        finally:
            self._cursor.settled()

    # ----------------------------------------------------------------- sleep
    def sleep(self, duration: float | timedelta) -> Coroutine[Any, Any, None]:
        """Sleep durably for ``duration`` (seconds, or a ``timedelta``).

        Takes one callsite and journals one ``timer`` step whose result is the
        wake time, so a replay waits only for what is left of it (nothing,
        once past it). A wake time within the runtime's ``inline_sleep_limit``
        is waited out in this turn (the heartbeat keeps the lease); a later one
        pauses the run on a ``timer`` wait that takes no delivery, until a
        sweeper's ``fire_timers`` wakes it once it is due (docs/howto/recovery.md).
        ``InvalidArgumentError`` for a duration that is not a finite number of
        seconds above 0, or that would wake past the year 9999.
        """
        seconds = positive_seconds(duration, "sleep")
        self._admit("sleep")
        return self._sleep(seconds)

    async def _sleep(self, seconds: float) -> None:
        self._require_open("sleep")
        site = self._cursor.request()
        try:
            await self._sleep_at(site, seconds)
        finally:
            self._cursor.settled()

    async def _sleep_at(self, site: Site, seconds: float) -> None:
        recorded = await self._writer.record_value(
            Effect(site, "timer", "sleep", {"seconds": seconds}),
            make=lambda: {"wake_at": (self._writer.now() + timedelta(seconds=seconds)).isoformat()},
        )
        wake_at = datetime.fromisoformat(recorded["wake_at"])
        left = (wake_at - self._writer.now()).total_seconds()
        if left <= 0:
            return
        if left <= self._writer.inline_sleep_limit:
            await self._writer.saver.hold(left)
            return
        suspend(self._writer, site, "timer", WaitRequest(TIMER, deadline=wake_at))

    # ---------------------------------------------------------- clock, uuid
    def now(self) -> Coroutine[Any, Any, datetime]:
        """The current UTC time, recorded once and replayed identically."""
        self._admit("now")
        return self._now()

    async def _now(self) -> datetime:
        value = await self._value("now", lambda: self._writer.now().isoformat())
        return datetime.fromisoformat(value)

    def uuid(self) -> Coroutine[Any, Any, str]:
        """A uuid4 string, recorded once and replayed identically."""
        self._admit("uuid")
        return self._uuid()

    async def _uuid(self) -> str:
        return str(await self._value("uuid", lambda: str(uuid4())))

    async def _value(self, kind: Literal["now", "uuid"], make: Callable[[], str]) -> Any:
        self._require_open(kind)
        site = self._cursor.request()
        try:
            return await self._writer.record_value(Effect(site, kind, kind), make=make, defer=True)
        finally:
            self._cursor.settled()

    # ---------------------------------------------------------------- misc
    def emit(self, part: Any) -> None:
        """Send a custom part to the turn's stream (not journaled)."""
        self._require_open("emit")
        self._emit(StreamPart(type="custom", data=part))

    def reserve_callsites(self, n: int) -> list[int]:
        """Reserve ``n`` ordinals now; pass them as ``callsite=`` to later calls."""
        self._require_open("reserve_callsites")
        return self._cursor.reserve(n)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running on this thread, if any (a plain thread has none)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _explicit_site(callsite: int | None, index: int | None) -> int | None:
    if callsite is not None and index is not None and callsite != index:
        msg = f"callsite={callsite} and index={index} disagree; pass one of them"
        raise InvalidArgumentError(msg)
    return callsite if callsite is not None else index
