"""Tool definitions: what a tool is, how its input is validated and how it is invoked.

A tool knows nothing of journals: the funnel in ``journal`` decides whether
``invoke`` runs at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypedDict, TypeVar, Unpack, overload

from pydantic import BaseModel, ValidationError

from .._callables import wants_call
from .._journal.json_data import plain_json_problem
from .._seconds import is_positive_seconds
from ..errors import (
    InvalidArgumentError,
    InvalidDefinitionError,
    InvalidToolArgsError,
    ToolTimeoutError,
)
from ..shapes import ToolCall
from .retry import NO_RETRY, RetryPolicy

__all__ = ["Tool", "define_tool"]

PolicyAnswer = Literal["allow", "ask", "deny"]
#: The tool's input model: a tool's ``execute``, policy and key see the validated args as it.
ArgsT = TypeVar("ArgsT", bound=BaseModel)
Policy = Callable[[str, ArgsT, ToolCall | None], PolicyAnswer]
InDoubt = Literal["retry", "ask"]


@dataclass(frozen=True)
class Tool(Generic[ArgsT]):
    """A named, validated, durable side effect that agents and flows can call."""

    name: str
    description: str
    input: type[ArgsT]
    execute: Callable[..., Any]
    needs_approval: bool = False
    policy: Policy[ArgsT] | None = None
    idempotency_key: Callable[[ArgsT], str] | None = None
    parallel_safe: bool | Callable[[ArgsT], bool] = False
    replay: bool = True
    on_in_doubt: InDoubt = "retry"
    #: Whether ``execute`` takes the ``ToolCall`` too (decided once, not per call).
    wants_call: bool = False
    #: How failed attempts are retried (default: one attempt, never retried).
    retry: RetryPolicy = NO_RETRY
    #: Seconds one attempt may run before it is cancelled (None: no limit).
    timeout: float | None = None
    #: Whether ``execute`` is a coroutine function (decided once, not per call).
    is_async: bool = False

    def validate(self, args: Any) -> ArgsT:
        """The tool's input model built from ``args``, or ``InvalidToolArgsError``."""
        if isinstance(args, self.input):
            validated = args
        else:
            if isinstance(args, BaseModel):
                args = args.model_dump()
            if args is None:
                args = {}
            try:
                validated = self.input.model_validate(args)
            except ValidationError as e:
                detail = "; ".join(
                    f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}"
                    for err in e.errors()
                )
                raise InvalidToolArgsError(self.name, detail) from None
        # The args are journaled and hashed into the key: they must be plain JSON.
        problem = plain_json_problem(validated.model_dump(mode="json")) or plain_json_problem(
            validated.model_dump(), other_types_ok=True
        )  # JSON mode writes NaN as null: look at the values the tool will get, too
        if problem is not None:
            raise InvalidToolArgsError(self.name, f"the arguments {problem}")
        return validated

    def decide(self, args: ArgsT, call: ToolCall | None) -> PolicyAnswer:
        """The approval policy's answer for this call."""
        if self.policy is not None:
            answer = self.policy(self.name, args, call)
            if answer not in ("allow", "ask", "deny"):
                msg = (
                    f"policy of tool {self.name!r} answered {answer!r}; "
                    "a policy must answer 'allow', 'ask' or 'deny'"
                )
                raise InvalidArgumentError(msg)
            return answer
        return "ask" if self.needs_approval else "allow"

    def is_parallel_safe(self, args: ArgsT) -> bool:
        if callable(self.parallel_safe):
            return bool(self.parallel_safe(args))
        return bool(self.parallel_safe)

    async def invoke(self, args: ArgsT, call: ToolCall) -> Any:
        """Run ``execute`` (sync or async, with or without ``call``), within ``timeout``.

        A sync ``execute`` always runs on a thread of its own, never on the
        event loop: a blocking call must not stop the lease heartbeat (another
        worker would take the run over mid-call) or the other turns. Past the
        timeout an async tool is cancelled; a sync tool, which Python cannot
        interrupt, is abandoned: its thread runs on and its result is ignored
        (docs/node-code.md). Either way ``ToolTimeoutError`` is raised.
        """
        work = (
            self._call(args, call)
            if self.is_async
            else _in_own_thread(lambda: self._call(args, call))
        )
        if self.timeout is None:
            return await work
        try:
            return await asyncio.wait_for(work, self.timeout)
        except TimeoutError:
            raise ToolTimeoutError(
                self.name,
                "ToolTimeoutError",
                f"the attempt ran longer than its timeout of {self.timeout} s and was cancelled",
                {"timeout": self.timeout},
            ) from None

    def _call(self, args: BaseModel, call: ToolCall) -> Any:
        return self.execute(args, call) if self.wants_call else self.execute(args)

    def json_schema(self) -> dict[str, Any]:
        """The OpenAI function-tool description of this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.input.model_json_schema(),
            },
        }


async def _in_own_thread(fn: Callable[[], Any]) -> Any:
    """Run a sync tool on a tool thread (awaiting an awaitable it returns).

    Not the loop's default executor: an abandoned attempt would hold one of
    its threads, and ``asyncio.run`` waits for that executor at exit. The
    tool runs in a copy of the caller's context (as ``asyncio.to_thread``).
    """
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # abandoned after a timeout
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def work() -> None:
        try:
            value, error = context.run(fn), None
        except BaseException as exc:  # handed to the awaiting task
            value, error = None, exc
        # RuntimeError: the loop is gone, nobody waits for this attempt any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, value, error)

    _TOOL_THREADS.submit(work)
    outcome = await future
    if inspect.isawaitable(outcome):
        outcome = await outcome
    return outcome


#: Seconds a tool thread with nothing to do waits for another call before it ends.
IDLE_SECONDS = 30.0


class _ToolThreads:
    """Daemon threads for sync tools, taking calls from one queue.

    Starting a thread costs more than a short tool call, and so does waking a
    sleeping one: a thread that finished a call takes the next queued one
    without sleeping, and an idle thread waits up to ``IDLE_SECONDS`` for
    more. A blocking call never delays another: a call is queued only when an
    idle thread is left to take it, otherwise a new thread starts for it (so a
    call that outlives its timeout keeps its thread to itself).

    Invariant, whenever ``_guard`` is free: ``_unclaimed <= _idle`` (every
    queued call has an idle thread to take it).
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0  # threads not running a call
        self._unclaimed = 0  # calls queued that no thread has taken yet

    def submit(self, work: Callable[[], None]) -> None:
        with self._guard:
            self._unclaimed += 1
            start = self._unclaimed > self._idle
            if start:
                self._idle += 1  # the new thread, idle until it takes a call
        self._calls.put(work)
        if start:
            threading.Thread(target=self._serve, name="kuralle-tool", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                work = self._calls.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._guard:
                    if self._unclaimed < self._idle:  # the others cover every queued call
                        self._idle -= 1
                        return
                continue  # a queued call may count on this thread
            with self._guard:
                self._idle -= 1
                self._unclaimed -= 1
            work()
            with self._guard:
                self._idle += 1


_TOOL_THREADS = _ToolThreads()


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's async __call__
    )


class _ToolOptions(TypedDict, Generic[ArgsT], total=False):
    """The keyword options of ``define_tool``, declared once for both overloads
    (the implementation declares them with their defaults)."""

    needs_approval: bool
    policy: Policy[ArgsT] | None
    idempotency_key: Callable[[ArgsT], str] | None
    parallel_safe: bool | Callable[[ArgsT], bool]
    replay: bool
    on_in_doubt: InDoubt
    retry: RetryPolicy | None
    timeout: float | None


# One overload per shape of ``execute``, so a type checker types a lambda's
# ``args`` as the input model (a union of the two shapes would leave it Any).
@overload
def define_tool(
    name: str,
    description: str,
    input: type[ArgsT],
    execute: Callable[[ArgsT], Any],
    **options: Unpack[_ToolOptions[ArgsT]],
) -> Tool[ArgsT]: ...


@overload
def define_tool(
    name: str,
    description: str,
    input: type[ArgsT],
    execute: Callable[[ArgsT, ToolCall], Any],
    **options: Unpack[_ToolOptions[ArgsT]],
) -> Tool[ArgsT]: ...


def define_tool(
    name: str,
    description: str,
    input: type[ArgsT],
    execute: Callable[..., Any],
    *,
    needs_approval: bool = False,
    policy: Policy[ArgsT] | None = None,
    idempotency_key: Callable[[ArgsT], str] | None = None,
    parallel_safe: bool | Callable[[ArgsT], bool] = False,
    replay: bool = True,
    on_in_doubt: InDoubt = "retry",
    retry: RetryPolicy | None = None,
    timeout: float | None = None,
) -> Tool[ArgsT]:
    """Define a tool; every argument is checked here so mistakes surface at import.

    ``retry`` retries failed attempts (same idempotency key, backoff between
    them); ``timeout`` cancels an attempt that runs longer (``ToolTimeoutError``,
    retryable). Bad values raise ``InvalidArgumentError``.
    """
    if not isinstance(name, str) or not name or name.startswith("__"):
        msg = f"tool name must be a non-empty string not starting with '__', got {name!r}"
        raise InvalidArgumentError(msg)
    if not (isinstance(input, type) and issubclass(input, BaseModel)):
        msg = f"tool {name!r}: input must be a pydantic model class, got {input!r}"
        raise TypeError(msg)
    if not callable(execute):
        msg = f"tool {name!r}: execute must be callable"
        raise InvalidDefinitionError(msg)
    if on_in_doubt not in ("retry", "ask"):
        msg = f"tool {name!r}: on_in_doubt must be 'retry' or 'ask', got {on_in_doubt!r}"
        raise InvalidArgumentError(msg)
    if retry is not None and not isinstance(retry, RetryPolicy):
        msg = f"tool {name!r}: retry must be a RetryPolicy, got {retry!r}"
        raise InvalidArgumentError(msg)
    if timeout is not None and not is_positive_seconds(timeout):
        msg = f"tool {name!r}: timeout must be a positive number of seconds, got {timeout!r}"
        raise InvalidArgumentError(msg)
    return Tool(
        name=name,
        description=description,
        input=input,
        execute=execute,
        needs_approval=needs_approval,
        policy=policy,
        idempotency_key=idempotency_key,
        parallel_safe=parallel_safe,
        replay=replay,
        on_in_doubt=on_in_doubt,
        wants_call=wants_call(execute),
        retry=retry if retry is not None else NO_RETRY,
        timeout=float(timeout) if timeout is not None else None,
        is_async=_is_async(execute),
    )
