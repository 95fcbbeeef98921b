"""Every public error of kuralle_es, in one module.

Each error carries the fields a caller needs as attributes and a message that
says what happened and what to do. Driver errors (``eventsourcing``'s
``IntegrityError``) are translated into these at one boundary: the store.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._journal.wait import Wait


class KuralleError(Exception):
    """Base class of every error raised by kuralle_es."""


class InvalidArgumentError(KuralleError, ValueError):
    """A bad argument to a public function or method; nothing was written."""


class InvalidDefinitionError(KuralleError, TypeError):
    """A tool, node, flow or agent defined with a value of the wrong kind (a
    ``TypeError`` too); raised where it is defined, before any run exists."""


class SuspendError(KuralleError):
    """Raised inside a run to stop the turn until a signal arrives.

    A suspend is not a failure: the runtime catches it, marks the run
    ``paused`` and ends the turn cleanly. It is never journaled as an error.
    """

    def __init__(self, wait: Wait) -> None:
        #: The wait, with what resuming needs besides the public fields.
        self.wait = wait
        #: The public view of the wait (what ``RunState.waiting_for`` shows).
        self.waiting_for = wait.public()
        super().__init__(
            f"run suspended waiting for {wait.name!r} "
            f"(request_id={wait.request_id}); deliver it with SignalDelivery"
        )


class NonDeterminismError(KuralleError):
    """The code asked for a different effect at a callsite than the journal holds.

    Either another kind or name, or the same one under another idempotency
    key (``recorded_key`` and ``requested_key`` are then set): args computed
    from a value the journal did not record (``datetime.now()``, ``random``)
    would execute the effect again under a new key (docs/node-code.md).
    """

    def __init__(
        self,
        callsite: int,
        expected: str,
        actual: str,
        *,
        recorded_key: str | None = None,
        requested_key: str | None = None,
    ) -> None:
        self.callsite = callsite
        self.expected = expected
        self.actual = actual
        self.recorded_key = recorded_key
        self.requested_key = requested_key
        if recorded_key is not None and recorded_key != requested_key:
            message = (
                f"non-deterministic replay at callsite {callsite}: the journal recorded "
                f"{expected} with key {recorded_key}, the code now requests it with key "
                f"{requested_key} (other args); nothing was executed. Derive the args from "
                "recorded values (ctx.now(), ctx.uuid(), earlier results), not from "
                "datetime.now() or random, or give the tool an idempotency_key override"
            )
        else:
            message = (
                f"non-deterministic replay at callsite {callsite}: the journal recorded "
                f"{expected}, the code now requests {actual}; nothing was executed. "
                "Restore the previous code path, or run the flow under a new definition "
                "(a changed flow digest starts fresh keys)"
            )
        super().__init__(message)


class ToolExecutionError(KuralleError):
    """A tool raised; the failure is frozen in the journal and re-raised on replay.

    ``data`` is the journaled error data (the original error's public fields),
    the same on the first pass and on every replay.
    """

    def __init__(
        self,
        tool_name: str,
        error_type: str,
        message: str,
        data: dict[str, Any] | None = None,
    ) -> None:
        self.tool_name = tool_name
        self.error_type = error_type
        self.message = message
        self.data: dict[str, Any] = dict(data or {})
        super().__init__(
            f"tool {tool_name!r} failed with {error_type}: {message} "
            "(the failure is recorded and will be raised again on replay, not retried)"
        )


class ToolResultTypeError(ToolExecutionError, TypeError):
    """A tool returned something that is not JSON-serialisable (or too large)."""


class ToolTimeoutError(ToolExecutionError):
    """A tool attempt ran longer than its ``timeout`` and was cancelled."""


class ToolApprovalDeniedError(KuralleError):
    """A tool call that needed approval was denied."""

    def __init__(self, tool_name: str, denied_by: str | None, reason: str | None) -> None:
        self.tool_name = tool_name
        self.denied_by = denied_by
        self.reason = reason
        super().__init__(
            f"tool {tool_name!r} was denied by {denied_by or 'an approver'}"
            f"{': ' + reason if reason else ''}; it was not executed and must not be retried"
        )


class UnknownToolError(KuralleError, LookupError):
    """A tool name that the active agent does not define."""

    def __init__(self, tool_name: str, known: list[str]) -> None:
        self.tool_name = tool_name
        self.known = known
        super().__init__(
            f"unknown tool {tool_name!r}; the agent defines {sorted(known)!r}. "
            "Pass one of those names, or add the tool to the agent's tools"
        )


class InvalidToolArgsError(KuralleError, ValueError):
    """Arguments that fail a tool's input model; nothing was journaled or executed."""

    def __init__(self, tool_name: str, detail: str) -> None:
        self.tool_name = tool_name
        self.detail = detail
        super().__init__(
            f"invalid arguments for tool {tool_name!r}: {detail}. "
            "Fix the arguments to match the tool's input model"
        )


class SignalMismatchError(KuralleError):
    """A delivery that does not match what the run waits for."""

    def __init__(self, run_id: str, message: str) -> None:
        self.run_id = run_id
        super().__init__(message)


class InvalidSignalError(KuralleError, ValueError):
    """A signal payload that fails validation."""

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        super().__init__(message)


class RunNotFoundError(KuralleError, LookupError):
    """No run with that id in that session (the same error either way)."""

    def __init__(self, run_id: str, session_id: str) -> None:
        self.run_id = run_id
        self.session_id = session_id
        super().__init__(
            f"no run {run_id!r} in session {session_id!r}; check the run id and the "
            "session it was started in"
        )


class FlowDriftError(KuralleError):
    """The run was pinned to another definition of its flow."""

    def __init__(
        self,
        run_id: str,
        pinned: str | None,
        current: str,
        recovery: tuple[str, ...] = ("restart", "abandon"),
    ) -> None:
        self.run_id = run_id
        self.pinned = pinned
        self.current = current
        self.recovery = recovery
        super().__init__(
            f"run {run_id!r} was started with flow digest {pinned} but the flow is now "
            f"{current}; call runtime.resolve_drift(run_id, session_id, one of "
            f"{list(recovery)!r})"
        )


class StaleWriteError(KuralleError):
    """This turn's copy of the run is behind the store; nothing of this write was stored.

    Either another writer appended first (``clash`` true), or an earlier save of
    this turn failed, so the turn's copy no longer matches what is stored.
    """

    def __init__(self, run_id: str, detail: str = "", *, clash: bool = True) -> None:
        self.run_id = run_id
        self.detail = detail
        self.clash = clash
        what = (
            "was changed by another writer"
            if clash
            else "could not be saved by this turn (an earlier save failed)"
        )
        super().__init__(
            f"run {run_id!r} {what}; nothing of this write was "
            f"stored. Reload the run and try again{': ' + detail if detail else ''}"
        )


class LeaseHeldError(KuralleError):
    """Another worker holds a live lease on the run."""

    def __init__(self, run_id: str, holder: str, expires_at: datetime) -> None:
        self.run_id = run_id
        self.holder = holder
        self.expires_at = expires_at
        super().__init__(
            f"run {run_id!r} is leased by {holder!r} until {expires_at.isoformat()}; "
            "wait for that turn to end or for the lease to expire"
        )


class BudgetExceededError(KuralleError):
    """A model call would start past the run's budget (``Budget(on_exceed="fail")``).

    ``usage`` is what the run spent so far and ``budget`` its limits, as
    plain mappings; ``reached`` names the limits at or past which it stands.
    """

    def __init__(
        self, run_id: str, reached: list[str], usage: dict[str, Any], budget: dict[str, Any]
    ) -> None:
        self.run_id = run_id
        self.reached = reached
        self.usage = usage
        self.budget = budget
        super().__init__(
            f"run {run_id} reached its budget ({', '.join(reached)}: spent {usage}, "
            f"budget {budget}), so no further model call was made; give the run a larger "
            "Budget (runtime.run(..., budget=)), or on_exceed='ask' to let a human decide"
        )


class TurnClosedError(KuralleError):
    """An effect was asked of a ``RunContext`` after its node visit or turn ended.

    A task the node left running (or a thread) cannot act for the run once
    the turn is over: nothing is executed or journaled (docs/node-code.md).
    """

    def __init__(self, run_id: str, effect: str) -> None:
        self.run_id = run_id
        self.effect = effect
        super().__init__(
            f"run {run_id}: {effect} was asked after the node (or turn) that owned this "
            "RunContext had ended, so nothing was executed; await every effect before the "
            "node returns (a task the node starts must be awaited by it)"
        )


class FlowNotFoundError(KuralleError, LookupError):
    """A flow name no agent of the runtime defines."""

    def __init__(self, flow_name: str, known: list[str]) -> None:
        self.flow_name = flow_name
        self.known = known
        super().__init__(
            f"unknown flow {flow_name!r}; the runtime's agents define {sorted(known)!r}"
        )


class ModelResponseError(KuralleError, ValueError):
    """A model answered with something that is not a usable response."""

    def __init__(self, model: str, detail: str) -> None:
        self.model = model
        self.detail = detail
        super().__init__(
            f"model {model!r} gave a malformed response: {detail}. Nothing was journaled "
            "for this turn; re-address the run to ask the model again"
        )


class StoreUnavailableError(KuralleError):
    """The store's database cannot be reached or opened; nothing was read or written.

    The message names the database (host, port and name for PostgreSQL) and
    the server's reason, so the fix is plain: start the server, or correct the
    store's settings.
    """


class PayloadTooLargeError(KuralleError, ValueError):
    """A result or payload over the configured size bound."""

    def __init__(self, what: str, size: int, limit: int) -> None:
        self.what = what
        self.size = size
        self.limit = limit
        super().__init__(
            f"{what} is {size} bytes of JSON, over the limit of {limit}; return a smaller "
            "value (store large data elsewhere and journal a reference) or raise "
            "KURALLE_MAX_PAYLOAD_BYTES"
        )


def error_fields(exc: BaseException) -> dict[str, Any]:
    """The public attributes of an error, as JSON-friendly data for the journal."""
    out: dict[str, Any] = {}
    for name, value in vars(exc).items():
        if name.startswith("_"):
            continue
        if isinstance(value, str | int | float | bool) or value is None:
            out[name] = value
    return out


class ProjectionIntegrityError(KuralleError):
    """A run's events reached a view out of order: one was skipped or applied twice.

    The view stops rather than store a wrong row; rebuild it
    (``RunViews.rebuild()`` or ``kuralle-es views rebuild``) and report the bug.
    """

    def __init__(self, run_id: str, expected: int, got: int) -> None:
        self.run_id = run_id
        self.expected = expected
        self.got = got
        super().__init__(
            f"view of run {run_id} expected its event version {expected}, got {got}: "
            "an event was skipped or applied twice; rebuild the views"
        )


class AlreadyApplied(Exception):
    """Internal (not exported): another instance of a ``Consumer`` recorded this
    position, or a later one, first; the consumer that lost goes on from there."""
