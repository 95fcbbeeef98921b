"""``ctx.logger``: a node's logger that stays quiet while the node replays (internal).

Every pass of a node re-runs its code from the top, replaying the steps the
journal holds; a log line written on that path would be written again on
every resume and every recovery, and an operator learns to ignore a log
that repeats itself. So ``ctx.logger`` (a ``logging.LoggerAdapter`` over the
``kuralle.run`` logger) drops records until the node has asked for the last
step recorded before this pass, that is until it reaches new ground, and
writes them from there on, each with ``run_id``, ``node`` and ``step`` (the
index in the run's journal of the node's next step) in its ``extra``
(docs/messages.md, "A logger quiet on replay").
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from .cursor import Cursor
from .writer import RunWriter

__all__ = ["RUN_LOGGER", "ReplayQuietLogger"]

#: The name of the logger that ``ctx.logger`` writes to.
RUN_LOGGER = "kuralle.run"


class ReplayQuietLogger(logging.LoggerAdapter[logging.Logger]):
    """The ``kuralle.run`` logger for one node pass: silent while it replays."""

    def __init__(self, writer: RunWriter, cursor: Cursor) -> None:
        super().__init__(logging.getLogger(RUN_LOGGER), {})
        self._writer = writer
        self._cursor = cursor
        self._node = writer.active_node
        #: The last callsite recorded before this pass: up to it, the pass replays.
        self._replays_through = writer.last_recorded_callsite()

    @property
    def replaying(self) -> bool:
        """Whether the node has yet to ask for a step recorded before this pass."""
        through = self._replays_through
        return through is not None and self._cursor.next <= through

    def isEnabledFor(self, level: int) -> bool:
        return not self.replaying and self.logger.isEnabledFor(level)

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        where = {
            "run_id": self._writer.run_id,
            "node": self._node,
            "step": self._writer.step_count,
        }
        kwargs["extra"] = {**where, **(kwargs.get("extra") or {})}
        return msg, kwargs
