"""Tool definitions: what a tool is, how its input is validated and how it is invoked.

A tool knows nothing of journals: the run's writer (``_runtime/writer.py``) decides whether
``invoke`` runs at all.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypedDict, TypeVar, Unpack, overload

from pydantic import BaseModel, ValidationError

from .._callables import wants_call
from .._crash import Crash
from .._durations import positive_seconds
from .._journal.json_data import plain_json_problem
from ..errors import (
    InvalidArgumentError,
    InvalidDefinitionError,
    InvalidToolArgsError,
    ToolTimeoutError,
)
from ..shapes import ToolCall
from .retry import NO_RETRY, RetryPolicy
from .tool_threads import in_tool_thread

__all__ = ["Tool", "ToolExited", "define_tool", "flow_tool"]

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
    #: The flow a call runs as a child run of (``flow_tool``), instead of ``execute``.
    child_flow: str | None = None

    def validate(self, args: Any) -> ArgsT:
        """The tool's input model built from ``args``, or ``InvalidToolArgsError``.

        Always a copy: the caller's own values (a node's model or dict, which it
        may change after the call) are never what the tool gets."""
        if isinstance(args, self.input):
            validated = args.model_copy(deep=True)
        else:
            if isinstance(args, BaseModel):
                args = args.model_dump()
            args = {} if args is None else copy.deepcopy(args)
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
        """The approval policy's answer for this call (the policy sees a copy of the
        args: what it changes is never executed or shown to an approver)."""
        if self.policy is not None:
            answer = self.policy(self.name, args.model_copy(deep=True), call)
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

        This is the one place tool code runs, so it is where a ``SystemExit``,
        ``KeyboardInterrupt`` or other ``BaseException`` of the tool's becomes
        ``ToolExited``, an ordinary failure of the attempt: left alone it would
        end the worker's event loop, and every worker that recovered the run
        would run the tool and die again (docs/guarantees.md, "At the edges").
        """
        if self.is_async:
            work = _contained(self._call(args, call))
        else:
            work = in_tool_thread(lambda: _contained_call(self._call, args, call))
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


class ToolExited(Exception):
    """Tool code raised ``raised``, a ``BaseException`` that is not an ``Exception``
    (``SystemExit`` from argparse on bad input, ``KeyboardInterrupt``): the attempt
    fails with it like with any exception, and the worker goes on."""

    def __init__(self, raised: BaseException) -> None:
        self.raised = raised
        super().__init__(str(raised) or f"the tool raised {type(raised).__name__}")


async def _contained(work: Awaitable[Any]) -> Any:
    """An async tool's attempt, its ``BaseException``s made ``ToolExited``; a
    cancellation (a timeout, the turn cancelled), the coroutine's close and the
    testing kit's ``Crash`` (the process dying there) pass through untouched."""
    try:
        return await work
    except GeneratorExit as exc:
        # Closing this coroutine closes the tool's first and then raises a new
        # GeneratorExit here (PEP 380), with this frame alone in its traceback;
        # one the tool raised itself comes out of the tool's frames.
        traceback = exc.__traceback__
        if traceback is None or traceback.tb_next is None:
            raise
        raise ToolExited(exc) from exc
    except (Exception, asyncio.CancelledError, Crash):
        raise
    except BaseException as exc:
        raise ToolExited(exc) from exc


def _contained_call(
    call: Callable[[Any, ToolCall], Any], args: BaseModel, tool_call: ToolCall
) -> Any:
    """A sync tool's attempt on its thread, every ``BaseException`` but ``Crash`` made
    ``ToolExited`` there (a sync tool's ``GeneratorExit`` or ``CancelledError`` is
    its own, not the loop's)."""
    try:
        return call(args, tool_call)
    except (Exception, Crash):
        raise
    except BaseException as exc:
        raise ToolExited(exc) from exc


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
    if timeout is not None:
        timeout = positive_seconds(timeout, f"tool {name!r}: timeout")
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
        timeout=timeout,
        is_async=_is_async(execute),
    )


def _runs_as_a_child(args: BaseModel) -> Any:
    """A ``flow_tool``'s ``execute``, which the runtime never calls: a call of it
    starts a child run instead."""
    msg = "a flow_tool runs as a child run of its flow; it has no execute of its own"
    raise InvalidDefinitionError(msg)


def flow_tool(name: str, description: str, flow_name: str, input: type[ArgsT]) -> Tool[ArgsT]:
    """A tool whose execution is a child run of flow ``flow_name`` (docs/child-runs.md).

    A call (by a model in a conversation, or ``ctx.tool`` in a node) starts the
    child once, its args (validated by ``input``, then by the flow's own
    ``input`` model; a flow without one gets their JSON as text) being its
    input; the calling run waits while the child runs, and the child's output
    is the tool's result. A child that errors or is aborted is the call's
    error (``ChildRunError``; a model reads it as the tool's result). Raises
    ``InvalidArgumentError`` for a bad name or flow name.
    """
    if not isinstance(flow_name, str) or not flow_name.strip():
        msg = f"flow_tool {name!r}: flow_name must name a flow, got {flow_name!r}"
        raise InvalidArgumentError(msg)
    tool = define_tool(name, description, input, _runs_as_a_child)
    return dataclasses.replace(tool, child_flow=flow_name)
