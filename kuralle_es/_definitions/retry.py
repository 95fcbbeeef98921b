"""Tool retries: ``RetryPolicy`` (API) and the rules the journal applies with it.

A tool's failed attempt is journaled and, while the policy allows, the same
step runs again with the same idempotency key after a backoff; only the last
failure is frozen. The journal owns the loop (it writes the events); this
module only answers two questions: is this error worth another attempt, and
how long to wait before it. See README.md, "Retries and timeouts".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._durations import positive_seconds
from ..errors import (
    InvalidArgumentError,
    InvalidToolArgsError,
    NonDeterminismError,
    StaleWriteError,
    SuspendError,
    ToolApprovalDeniedError,
    ToolResultTypeError,
)

__all__ = ["NEVER_RETRIED", "NO_RETRY", "RetryPolicy"]

#: Errors no policy retries: a denial, bad arguments and an unrecordable result
#: would fail the same way again, and the runtime's own signals are not failures.
NEVER_RETRIED: tuple[type[BaseException], ...] = (
    ToolApprovalDeniedError,
    InvalidToolArgsError,
    ToolResultTypeError,
    NonDeterminismError,
    StaleWriteError,
    SuspendError,
)


def _errors(value: object, field: str) -> tuple[type[BaseException], ...]:
    items = value if isinstance(value, tuple | list) else (value,)
    if not all(isinstance(i, type) and issubclass(i, BaseException) for i in items):
        msg = f"RetryPolicy.{field} must be exception classes, got {value!r}"
        raise InvalidArgumentError(msg)
    return tuple(items)


@dataclass(frozen=True)
class RetryPolicy:
    """How often a tool is attempted and how long to wait between attempts.

    ``max_attempts`` counts failed attempts (1 = never retried). Attempt
    ``n + 1`` starts ``initial_interval * backoff ** (n - 1)`` seconds (at most
    ``max_interval``) after attempt ``n`` failed. An error is retried when it is
    an instance of ``retry_on`` and not of ``no_retry_on``; denials, invalid
    arguments and unrecordable results never are. Bad values raise
    ``InvalidArgumentError``.
    """

    max_attempts: int = 3
    initial_interval: float = 1.0
    backoff: float = 2.0
    max_interval: float = 60.0
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    no_retry_on: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        if (
            not isinstance(self.max_attempts, int)
            or isinstance(self.max_attempts, bool)
            or self.max_attempts < 1
        ):
            msg = f"RetryPolicy.max_attempts must be a whole number >= 1, got {self.max_attempts!r}"
            raise InvalidArgumentError(msg)
        for field in ("initial_interval", "max_interval"):
            seconds = positive_seconds(getattr(self, field), f"RetryPolicy.{field}")
            object.__setattr__(self, field, seconds)
        backoff = self.backoff
        if (
            not isinstance(backoff, int | float)
            or isinstance(backoff, bool)
            or not math.isfinite(backoff)
            or backoff < 1
        ):
            msg = (
                "RetryPolicy.backoff must be a finite number >= 1 (intervals never shrink), "
                f"got {backoff!r}"
            )
            raise InvalidArgumentError(msg)
        object.__setattr__(self, "retry_on", _errors(self.retry_on, "retry_on"))
        object.__setattr__(self, "no_retry_on", _errors(self.no_retry_on, "no_retry_on"))

    def retries(self, error: BaseException, failures: int) -> bool:
        """Whether a step that has now failed ``failures`` times gets another attempt."""
        return failures < self.max_attempts and self.retryable(error)

    def retryable(self, error: BaseException) -> bool:
        """Whether ``error`` is worth another attempt under this policy at all."""
        if isinstance(error, (*NEVER_RETRIED, *self.no_retry_on)):
            return False
        return isinstance(error, self.retry_on)

    def delay(self, failures: int) -> float:
        """Seconds between the ``failures``-th failed attempt and the next one."""
        exponent = max(failures - 1, 0)
        try:
            interval = self.initial_interval * self.backoff**exponent
        except OverflowError:
            interval = self.max_interval
        return float(min(interval, self.max_interval))


#: The policy of a tool defined without ``retry=``: one attempt, today's behaviour.
NO_RETRY = RetryPolicy(max_attempts=1)
