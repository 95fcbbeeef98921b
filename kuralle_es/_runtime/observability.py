"""Logging and tracing of runs: one log line per thing an operator cares about.

Internal module. Everything is logged under the ``kuralle_es`` logger: a turn
opened and closed, a suspension, a delivery, a recovery, a sweep. Payloads,
results and arguments are never logged unless ``KURALLE_LOG_PAYLOADS=1``:
they are the users' data. When the ``otel`` extra is installed
(``opentelemetry-api``), each turn and each step is also an OpenTelemetry span
(``kuralle.turn``, ``kuralle.step``) on the global tracer provider; without it
the spans cost nothing. A step replayed from the journal is marked
``kuralle.replayed=true`` (or left out with ``KURALLE_TRACE_REPLAYED=omit``),
and every turn of one run shares one trace, whose id is the run id (a span
link when the caller already has a span). See docs/observability.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, TypeVar, cast
from uuid import UUID

from ..errors import SuspendError

__all__ = [
    "LOGGER_NAME",
    "REPLAYED_ENV",
    "log_event",
    "payloads_logged",
    "replayed_spans",
    "run_trace_id",
    "set_status",
    "span",
    "traced_step",
    "tracing_on",
]

LOGGER_NAME = "kuralle_es"
logger = logging.getLogger(LOGGER_NAME)

_trace: ModuleType | None
try:  # the ``otel`` extra
    import opentelemetry.trace as _trace
except ImportError:  # pragma: no cover - exercised where the extra is absent
    _trace = None

_PAYLOADS_ENV = "KURALLE_LOG_PAYLOADS"
#: ``mark`` (default): a replayed step is a span with ``kuralle.replayed=true``;
#: ``omit``: a replayed step makes no span at all.
REPLAYED_ENV = "KURALLE_TRACE_REPLAYED"
_REPLAYED_MODES = ("mark", "omit")


def payloads_logged() -> bool:
    """Whether log lines may carry users' data (``KURALLE_LOG_PAYLOADS=1``)."""
    return os.environ.get(_PAYLOADS_ENV) == "1"


def log_event(event: str, run_id: str, payload: Any = None, **fields: Any) -> None:
    """One ``INFO`` line: ``<event> run=<run_id> key=value ...``.

    ``fields`` are identifiers and statuses (safe to log); ``payload`` is users'
    data and is only written when ``KURALLE_LOG_PAYLOADS=1``. The fields are also
    attached to the record as ``record.kuralle`` for structured handlers.
    """
    if not logger.isEnabledFor(logging.INFO):
        return
    shown = {k: v for k, v in fields.items() if v is not None}
    if payload is not None and payloads_logged():
        shown["payload"] = payload
    text = " ".join(f"{k}={v}" for k, v in shown.items())
    logger.info(
        "%s run=%s%s",
        event,
        run_id,
        f" {text}" if text else "",
        extra={"kuralle": {"event": event, "run_id": run_id, **shown}},
    )


def tracing_on() -> bool:
    """Whether spans are worth making: the extra is installed and a provider is set
    (until then OpenTelemetry's global provider is a proxy that records nothing)."""
    return _trace is not None and not isinstance(
        _trace.get_tracer_provider(), _trace.ProxyTracerProvider
    )


def run_trace_id(run_id: str) -> int:
    """The trace id every turn of run ``run_id`` shares: the run id's 128 bits
    (a run id is a UUID), so a trace is found by its run id."""
    try:
        value = UUID(run_id).int
    except ValueError:  # not a UUID: a stable digest of it instead
        value = int(hashlib.sha256(run_id.encode()).hexdigest()[:32], 16)
    return value or 1


def _run_context(run_id: str) -> Any:
    """The span context of the run: a remote parent nobody exports, whose trace id
    is ``run_trace_id`` and whose span id is derived from the run id too."""
    assert _trace is not None
    span_id = int(hashlib.sha256(f"kuralle.run:{run_id}".encode()).hexdigest()[:16], 16) or 1
    return _trace.SpanContext(
        trace_id=run_trace_id(run_id),
        span_id=span_id,
        is_remote=True,
        trace_flags=_trace.TraceFlags(_trace.TraceFlags.SAMPLED),
    )


@contextlib.contextmanager
def span(
    name: str,
    attributes: Mapping[str, str | int | bool | None],
    *,
    run_id: str | None = None,
) -> Iterator[Any]:
    """An OpenTelemetry span when the ``otel`` extra is installed and a tracer
    provider is configured, else nothing (and next to no cost).

    ``None`` attributes are dropped (OpenTelemetry refuses them). An exception
    leaving the block is recorded on the span and re-raised; a suspend is not
    an error, so callers mark the status themselves with ``set_status``.

    With ``run_id`` the span joins the run's trace: without a current span it
    is a child of the run's span context (its trace id is ``run_trace_id``), so
    every turn of a run, in any process, lands in one trace; under a caller's
    span it stays in the caller's trace and links to the run's.
    """
    if _trace is None or not tracing_on():
        yield None
        return
    clean = {k: v for k, v in attributes.items() if v is not None}
    tracer = _trace.get_tracer(LOGGER_NAME)
    if run_id is None:
        with tracer.start_as_current_span(name, attributes=clean) as current:
            yield current
        return
    run_context = _run_context(run_id)
    if _trace.get_current_span().get_span_context().is_valid:
        links = [_trace.Link(run_context, {"kuralle.link": "run"})]
        with tracer.start_as_current_span(name, attributes=clean, links=links) as current:
            yield current
        return
    parent = _trace.set_span_in_context(_trace.NonRecordingSpan(run_context))
    with tracer.start_as_current_span(name, context=parent, attributes=clean) as current:
        yield current


def set_status(current: Any, status: str) -> None:
    """Record a run or step status on a span from ``span`` (no-op without one)."""
    if current is not None:
        current.set_attribute("kuralle.status", status)


_Step = TypeVar("_Step", bound=Callable[..., Awaitable[Any]])


def replayed_spans() -> str:
    """``mark`` or ``omit``: what becomes of a replayed step's span
    (``KURALLE_TRACE_REPLAYED``; anything else reads as ``mark``)."""
    mode = os.environ.get(REPLAYED_ENV, "mark").strip().lower()
    return mode if mode in _REPLAYED_MODES else "mark"


def _replays(writer: Any, effect: Any, kwargs: Mapping[str, Any]) -> bool:
    """Whether this call of the writer will replay a recorded step (return its
    result or raise its frozen error) rather than execute: what the journal has
    recorded for the effect, asked before the call (a mismatch the call itself
    refuses, unexecuted, reads as not replayed). A step left running (in doubt,
    or between retries) executes again, and so does a ``replay=False`` tool."""
    if kwargs.get("replay", True) is False:
        return False
    step = writer.peek(effect)
    return step is not None and step["status"] in ("finished", "error")


def traced_step(method: _Step) -> _Step:
    """Make each call of the writer's one decision (``effect``, ``record_value``) a
    ``kuralle.step`` span: run id, step kind, name, callsite, whether it was
    replayed (``kuralle.replayed``) and how it ended (``finished``, ``error``,
    ``suspended``). With ``KURALLE_TRACE_REPLAYED=omit`` a replayed step makes
    no span, so a run resumed ten times shows each executed step once.

    Whether to trace is the writer's ``tracing``, asked once a turn: asking
    OpenTelemetry on every step (an environment lookup) cost a busy process a
    hundredth of its time."""

    @functools.wraps(method)
    async def traced(writer: Any, effect: Any, **kwargs: Any) -> Any:
        if not writer.tracing:
            return await method(writer, effect, **kwargs)
        replayed = _replays(writer, effect, kwargs)
        if replayed and replayed_spans() == "omit":
            return await method(writer, effect, **kwargs)
        attributes = {
            "kuralle.run_id": writer.run_id,
            "kuralle.step.kind": effect.kind,
            "kuralle.step.name": effect.name,
            "kuralle.step.callsite": effect.site.callsite,
            "kuralle.replayed": replayed,
        }
        with span("kuralle.step", attributes) as current:
            try:
                result = await method(writer, effect, **kwargs)
            except SuspendError:
                set_status(current, "suspended")
                raise
            except Exception:
                set_status(current, "error")
                raise
            set_status(current, "finished")
            return result

    return cast(_Step, traced)
