"""Logging and tracing of runs: one log line per thing an operator cares about.

Internal module. Everything is logged under the ``kuralle_es`` logger: a turn
opened and closed, a suspension, a delivery, a recovery, a sweep. Payloads,
results and arguments are never logged unless ``KURALLE_LOG_PAYLOADS=1``:
they are the users' data. When the ``otel`` extra is installed
(``opentelemetry-api``), each turn and each step is also an OpenTelemetry span
(``kuralle.turn``, ``kuralle.step``) on the global tracer provider; without it
the spans cost nothing. See docs/observability.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, TypeVar, cast

from .errors import SuspendError

__all__ = [
    "LOGGER_NAME",
    "log_event",
    "payloads_logged",
    "set_status",
    "span",
    "traced_step",
]

LOGGER_NAME = "kuralle_es"
logger = logging.getLogger(LOGGER_NAME)

_trace: ModuleType | None
try:  # the ``otel`` extra
    import opentelemetry.trace as _trace
except ImportError:  # pragma: no cover - exercised where the extra is absent
    _trace = None

_PAYLOADS_ENV = "KURALLE_LOG_PAYLOADS"


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


def _tracing() -> bool:
    """Whether spans are worth making: the extra is installed and a provider is set
    (until then OpenTelemetry's global provider is a proxy that records nothing)."""
    return _trace is not None and not isinstance(
        _trace.get_tracer_provider(), _trace.ProxyTracerProvider
    )


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, str | int | bool | None]) -> Iterator[Any]:
    """An OpenTelemetry span when the ``otel`` extra is installed and a tracer
    provider is configured, else nothing (and next to no cost).

    ``None`` attributes are dropped (OpenTelemetry refuses them). An exception
    leaving the block is recorded on the span and re-raised; a suspend is not
    an error, so callers mark the status themselves with ``set_status``.
    """
    if _trace is None or not _tracing():
        yield None
        return
    clean = {k: v for k, v in attributes.items() if v is not None}
    tracer = _trace.get_tracer(LOGGER_NAME)
    with tracer.start_as_current_span(name, attributes=clean) as current:
        yield current


def set_status(current: Any, status: str) -> None:
    """Record a run or step status on a span from ``span`` (no-op without one)."""
    if current is not None:
        current.set_attribute("kuralle.status", status)


_Step = TypeVar("_Step", bound=Callable[..., Awaitable[Any]])


def traced_step(method: _Step) -> _Step:
    """Make each call of a journal funnel method (``effect``, ``record_value``) a
    ``kuralle.step`` span: run id, step kind, name, callsite, and how it ended
    (``finished``, ``error``, ``suspended``). A replayed step is a span too."""

    @functools.wraps(method)
    async def traced(journal: Any, site: Any, **kwargs: Any) -> Any:
        if not _tracing():
            return await method(journal, site, **kwargs)
        attributes = {
            "kuralle.run_id": journal.run_id,
            "kuralle.step.kind": kwargs.get("kind"),
            "kuralle.step.name": kwargs.get("name"),
            "kuralle.step.callsite": site.callsite,
        }
        with span("kuralle.step", attributes) as current:
            try:
                result = await method(journal, site, **kwargs)
            except SuspendError:
                set_status(current, "suspended")
                raise
            except Exception:
                set_status(current, "error")
                raise
            set_status(current, "finished")
            return result

    return cast(_Step, traced)
