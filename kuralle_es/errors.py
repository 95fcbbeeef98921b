"""Every public error of kuralle_es, in one module.

Each error carries the fields a caller needs as attributes and a message that
says what happened and what to do. Driver errors (``eventsourcing``'s
``IntegrityError``) are translated into these at one boundary: the store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, dataclass_transform

from ._unicode import printable

if TYPE_CHECKING:
    from ._journal.wait import Wait
    from .shapes import StepError


class KuralleError(Exception):
    """Base class of every error raised by kuralle_es."""


@dataclass_transform(eq_default=False, field_specifiers=(field,))
class _FieldsError(KuralleError):
    """An error whose fields are its constructor's arguments and whose message is
    built from them, so each error declares its fields once and says its message once.

    Every subclass is made a dataclass where it is defined (``__init_subclass__``;
    ``dataclass_transform`` tells type checkers so), so none can forget to be one:
    ``eq=False`` keeps an error equal only to itself, ``repr=False`` keeps the
    exception's own repr of its message. Most messages are a ``_template`` with
    the fields in their places; one that needs more than the fields' values (a
    choice, a date's form) overrides ``_message``.
    """

    #: The message, ``str.format``-ted with the error's fields by name (``{run_id!r}``).
    _template: ClassVar[str]

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        dataclass(eq=False, repr=False)(cls)

    def __post_init__(self) -> None:
        super().__init__(self._message())

    def _message(self) -> str:
        return self._template.format_map(vars(self))


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


class NonDeterminismError(_FieldsError):
    """The code asked for a different effect at a callsite than the journal holds.

    Either another kind or name, or the same one under another idempotency
    key (``recorded_key`` and ``requested_key`` are then set): args computed
    from a value the journal did not record (``datetime.now()``, ``random``)
    would execute the effect again under a new key (docs/node-code.md).
    """

    callsite: int
    expected: str
    actual: str
    recorded_key: str | None = field(default=None, kw_only=True)
    requested_key: str | None = field(default=None, kw_only=True)

    def _message(self) -> str:
        if self.recorded_key is not None and self.recorded_key != self.requested_key:
            return (
                f"non-deterministic replay at callsite {self.callsite}: the journal recorded "
                f"{self.expected} with key {self.recorded_key}, the code now requests it with "
                f"key {self.requested_key} (other args); nothing was executed. Derive the args "
                "from recorded values (ctx.now(), ctx.uuid(), earlier results), not from "
                "datetime.now() or random, or give the tool an idempotency_key override"
            )
        return (
            f"non-deterministic replay at callsite {self.callsite}: the journal recorded "
            f"{self.expected}, the code now requests {self.actual}; nothing was executed. "
            "Restore the previous code path, or run the flow under a new definition "
            "(a changed flow digest starts fresh keys)"
        )


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


class ToolApprovalDeniedError(_FieldsError):
    """A tool call that needed approval was denied."""

    tool_name: str
    denied_by: str | None
    reason: str | None

    def _message(self) -> str:
        return (
            f"tool {self.tool_name!r} was denied by {self.denied_by or 'an approver'}"
            f"{': ' + self.reason if self.reason else ''}; it was not executed and must not "
            "be retried"
        )


class _UnknownNameError(_FieldsError, LookupError):
    """A name looked up among ``known`` names and not found (a tool, a flow): its
    message lists the known names sorted, whatever order they were given in."""

    def _message(self) -> str:
        fields = vars(self)
        return self._template.format_map({**fields, "known": sorted(fields["known"])})


class UnknownToolError(_UnknownNameError):
    """A tool name that the active agent does not define."""

    tool_name: str
    known: list[str]

    _template = (
        "unknown tool {tool_name!r}; the agent defines {known!r}. "
        "Pass one of those names, or add the tool to the agent's tools"
    )


class InvalidToolArgsError(_FieldsError, ValueError):
    """Arguments that fail a tool's input model; nothing was journaled or executed."""

    tool_name: str
    detail: str

    _template = (
        "invalid arguments for tool {tool_name!r}: {detail}. "
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


class RunNotFoundError(_FieldsError, LookupError):
    """No run with that id in that session (the same error either way)."""

    run_id: str
    session_id: str

    _template = (
        "no run {run_id!r} in session {session_id!r}; check the run id and "
        "the session it was started in"
    )


class FlowDriftError(_FieldsError):
    """The run was pinned to another definition of its flow."""

    run_id: str
    pinned: str | None
    current: str
    recovery: tuple[str, ...] = ("restart", "abandon")

    def _message(self) -> str:
        return (
            f"run {self.run_id!r} was started with flow digest {self.pinned} but the flow is "
            f"now {self.current}; settle it with one of {list(self.recovery)!r}: "
            f"kuralle-es resolve-drift {self.run_id} {'|'.join(self.recovery)}, POST "
            f"/api/runs/{self.run_id}/resolve-drift, or runtime.resolve_drift(run_id, "
            "session_id, ...)"
        )


class StaleWriteError(_FieldsError):
    """This turn's copy of the run is behind the store; nothing of this write was stored.

    Either another writer appended first (``clash`` true), or an earlier save of
    this turn failed, so the turn's copy no longer matches what is stored.
    """

    run_id: str
    detail: str = ""
    clash: bool = field(default=True, kw_only=True)
    #: The write was an effect's outcome, recorded on the run as stored after all
    #: (the run was ended from outside while the effect ran).
    recorded: bool = field(default=False, kw_only=True)

    def _message(self) -> str:
        what = (
            "was changed by another writer"
            if self.clash
            else "could not be saved by this turn (an earlier save failed)"
        )
        if self.recorded:
            return f"run {self.run_id!r} {what}: {self.detail}. Reload the run to see it"
        return (
            f"run {self.run_id!r} {what}; nothing of this write was stored. Reload the run "
            f"and try again{': ' + self.detail if self.detail else ''}"
        )


class LeaseHeldError(_FieldsError):
    """Another worker holds a live lease on the run."""

    run_id: str
    holder: str
    expires_at: datetime

    def _message(self) -> str:
        return (
            f"run {self.run_id!r} is leased by {self.holder!r} until "
            f"{self.expires_at.isoformat()}; wait for that turn to end or for the lease to "
            "expire"
        )


class BudgetExceededError(_FieldsError):
    """A model call would start past the run's budget (``Budget(on_exceed="fail")``).

    ``usage`` is what the run spent so far and ``budget`` its limits, as
    plain mappings; ``reached`` names the limits at or past which it stands.
    """

    run_id: str
    reached: list[str]
    usage: dict[str, Any]
    budget: dict[str, Any]

    def _message(self) -> str:
        return (
            f"run {self.run_id} reached its budget ({', '.join(self.reached)}: spent "
            f"{self.usage}, budget {self.budget}), so no further model call was made; give "
            "the run a larger Budget (runtime.run(..., budget=)), or on_exceed='ask' to let "
            "a human decide"
        )


class TurnClosedError(_FieldsError):
    """An effect was asked of a ``RunContext`` after its node visit or turn ended,
    or from another thread or event loop than its turn's.

    A task the node left running, or a thread, cannot act for the run: nothing
    is executed or journaled (docs/node-code.md). ``elsewhere`` tells the two
    apart: True for a call from another thread or event loop.
    """

    run_id: str
    effect: str
    elsewhere: bool = field(default=False, kw_only=True)

    def _message(self) -> str:
        if self.elsewhere:
            return (
                f"run {self.run_id}: {self.effect} was asked from another thread or event "
                "loop than the turn that owns this RunContext, so nothing was executed; "
                "call ctx only from the node's own code on the turn's loop and await every "
                "effect before the node returns (hand a thread the values, not the context)"
            )
        return (
            f"run {self.run_id}: {self.effect} was asked after the node (or turn) that owned "
            "this RunContext had ended, so nothing was executed; await every effect before "
            "the node returns (a task the node starts must be awaited by it)"
        )


class FlowNotFoundError(_UnknownNameError):
    """A flow name no agent of the runtime defines."""

    flow_name: str
    known: list[str]

    _template = "unknown flow {flow_name!r}; the runtime's agents define {known!r}"


class ModelResponseError(_FieldsError, ValueError):
    """A model answered with something that is not a usable response."""

    model: str
    detail: str

    _template = (
        "model {model!r} gave a malformed response: {detail}. Nothing was "
        "journaled for this turn; re-address the run to ask the model again"
    )


class StoreUnavailableError(KuralleError):
    """The store's database cannot be reached or opened; nothing was read or written.

    The message names the database (host, port and name for PostgreSQL) and
    the server's reason, so the fix is plain: start the server, or correct the
    store's settings.
    """


class EncryptionKeyError(KuralleError):
    """The store was opened without its cipher key, with another key, or with a key
    that is not one; nothing was read or written. Open it with the key it was
    written with (``KURALLE_CIPHER_KEY`` or ``cipher_key=``; docs/privacy.md)."""


class PayloadTooLargeError(_FieldsError, ValueError):
    """A result or payload over the configured size bound."""

    what: str
    size: int
    limit: int

    _template = (
        "{what} is {size} bytes of JSON, over the limit of {limit}; "
        "return a smaller value (store large data elsewhere and journal a reference) or "
        "raise KURALLE_MAX_PAYLOAD_BYTES"
    )


class UnrecordableValueError(_FieldsError, TypeError):
    """A value the journal cannot hold exactly: a lone surrogate, NaN, nesting too
    deep, an object with no JSON form (a ``TypeError`` too). ``what`` names the value,
    ``problem`` says what is wrong and where (its path, ``$`` at the top). Refused at
    the door where the value enters: a tool's result fails that step (frozen), a
    node's output, state bag or message fails the turn (docs/guarantees.md)."""

    what: str
    problem: str

    _template = (
        "{what} cannot be journaled: it {problem}; return plain JSON data "
        "(string keys, finite numbers, valid Unicode, at most 100 levels deep)"
    )


class IdempotencyConflictError(_FieldsError):
    """An inbound ``idempotency_key`` already used for another request (another input,
    flow or session); nothing was written. Use a fresh key for a new request."""

    idempotency_key: str
    run_id: str
    detail: str

    _template = (
        "idempotency_key {idempotency_key!r} was already used on run {run_id} for "
        "another request ({detail}); nothing was done. Retry with exactly the first "
        "request, or use a new key for a new request"
    )


class DeadlineExpiredError(_FieldsError):
    """The deadline of a typed wait (``ctx.signal(name, schema=M, deadline=...)``,
    ``ctx.receive``) passed before anything arrived; catch it in the node to go on."""

    name: str
    deadline: datetime | None

    def _message(self) -> str:
        when = self.deadline.isoformat() if self.deadline is not None else "its deadline"
        return (
            f"nothing arrived for {self.name!r} before {when}; catch DeadlineExpiredError "
            "in the node to handle the timeout"
        )


class NotPublishedError(_FieldsError, TimeoutError):
    """``runtime.wait_published`` gave up: the run published nothing under ``key``
    within ``timeout`` seconds, or it ended (``status``) without publishing it.
    A ``TimeoutError`` too, so ``except TimeoutError`` catches it."""

    run_id: str
    key: str
    timeout: float
    status: str

    def _message(self) -> str:
        if self.status in ("finished", "aborted"):
            return (
                f"run {self.run_id} is {self.status} and never published {self.key!r}; "
                "nothing more will be published, read runtime.published() for what was"
            )
        return (
            f"run {self.run_id} published nothing under {self.key!r} within {self.timeout:g} s "
            f"(it is {self.status}); wait longer, or read runtime.published() later"
        )


class ChildRunError(_FieldsError):
    """A child run that node code waited for (``ctx.child``, ``ctx.wait_child``, a
    ``flow_tool`` call) ended ``error`` or ``aborted`` (``status``): ``error`` is the
    child's error (None for an aborted child, whose ``outcome`` says why). The same
    on every replay; catch it in the node to go on (docs/child-runs.md)."""

    child_run_id: str
    status: str
    error: StepError | None = None
    outcome: str | None = field(default=None, kw_only=True)

    def _message(self) -> str:
        if self.error is not None:
            why = f"{self.error.type}: {self.error.message}"
        else:
            why = self.outcome or "no reason recorded"
        return (
            f"child run {self.child_run_id} ended {self.status} ({why}); look at the child "
            f"run (kuralle-es runs show {self.child_run_id}), or catch ChildRunError in "
            "the node to go on"
        )


def _finite(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def error_fields(exc: BaseException) -> dict[str, Any]:
    """The public attributes of an error, as JSON-friendly data for the journal."""
    out: dict[str, Any] = {}
    for name, value in vars(exc).items():
        if name.startswith("_"):
            continue
        if isinstance(value, str):
            out[name] = printable(value)
        elif value is None or isinstance(value, bool | int) or _finite(value):
            out[name] = value
    return out


class ProjectionIntegrityError(_FieldsError):
    """A run's events reached a view out of order: one was skipped or applied twice.

    The view stops rather than store a wrong row; rebuild it
    (``RunViews.rebuild()`` or ``kuralle-es views rebuild``) and report the bug.
    """

    run_id: str
    expected: int
    got: int

    _template = (
        "view of run {run_id} expected its event version {expected}, got "
        "{got}: an event was skipped or applied twice; rebuild the views"
    )


class AlreadyApplied(Exception):
    """Internal (not exported): another instance of a ``Consumer`` recorded this
    position, or a later one, first; the consumer that lost goes on from there."""
