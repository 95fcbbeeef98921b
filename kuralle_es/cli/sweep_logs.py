"""The log lines of the sweeping commands (internal): what ``worker`` writes to stderr
(without ``--verbose``, one line per run it drove or skipped), and the runs a ``recover``
or ``sweep`` pass skipped and why, read from the runtime's log records.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator

from .._runtime.observability import LOGGER_NAME
from ..errors import FlowNotFoundError
from .common import app_hint

#: The log lines a worker shows without --verbose: one per run it drove or skipped.
_SWEEP_EVENTS = frozenset(
    {"run recovered", "run swept", "timer fired", "run resumed", "recovery skipped",
     "sweep skipped", "wake skipped", "resume skipped"}
)  # fmt: skip


class _SweepLines(logging.Filter):
    """Keeps the worker's own lines and one line per run it drove (not each turn's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = getattr(record, "kuralle", None)
        return not isinstance(fields, dict) or fields.get("event") in _SWEEP_EVENTS


#: The log event of a run a sweep skipped, and which sweep it was.
_SKIP_EVENTS = {
    "recovery skipped": "recovery",
    "sweep skipped": "deadline deny",
    "wake skipped": "timer wake",
    "resume skipped": "resume in doubt",
}


class Skips(logging.Handler):
    """Collects the runs a sweep skipped and why: the error's type from the skip's log
    line, its message from the debug record that carries the error."""

    def __init__(self, on_skip: Callable[[str, str, str], None] | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.skipped: dict[str, tuple[str, str]] = {}  # run id -> (which sweep, error type)
        self.messages: dict[str, str] = {}  # run id -> the error's message
        self.on_skip = on_skip

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "kuralle", None)
        if isinstance(fields, dict) and fields.get("event") in _SKIP_EVENTS:
            run_id = str(fields.get("run_id"))
            self.skipped[run_id] = (_SKIP_EVENTS[fields["event"]], str(fields.get("reason")))
        elif record.exc_info and record.exc_info[1] is not None and record.args:
            run_id = str(record.args[0] if isinstance(record.args, tuple) else record.args)
            if run_id not in self.skipped:  # not the error of a skip logged just before
                return
            error = record.exc_info[1]
            self.messages[run_id] = str(error)
            if self.on_skip is not None:
                self.on_skip(run_id, type(error).__name__, str(error))

    def lines(self) -> list[str]:
        return [
            f"skipped {run_id} ({what}): {reason}"
            + (f": {self.messages[run_id]}" if self.messages.get(run_id) else "")
            for run_id, (what, reason) in self.skipped.items()
        ]

    def needs_app(self) -> bool:
        return any(reason == FlowNotFoundError.__name__ for _, reason in self.skipped.values())


@contextlib.contextmanager
def collect_skips(on_skip: Callable[[str, str, str], None] | None = None) -> Iterator[Skips]:
    logger = logging.getLogger(LOGGER_NAME)
    collector = Skips(on_skip)
    level = logger.level
    logger.addHandler(collector)
    logger.setLevel(logging.DEBUG)  # the error of a skip is logged at DEBUG
    try:
        yield collector
    finally:
        logger.removeHandler(collector)
        logger.setLevel(level)


def report_skips(args: argparse.Namespace, skips: Skips) -> int:
    """Print each skipped run and why; exit code 1 when there was one."""
    for line in skips.lines():
        print(line)
    if skips.needs_app():
        print(f"kuralle-es: {app_hint(args)}", file=sys.stderr)
    return 1 if skips.skipped else 0


def log_to_stderr(verbose: bool) -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    if not verbose:
        handler.addFilter(_SweepLines())
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger
