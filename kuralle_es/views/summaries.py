"""The public shapes the views answer with: ``RunSummary`` and ``ToolStats``, and the
cursor that pages a list of runs."""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from ..errors import InvalidArgumentError
from ..shapes import RunHeader, WaitingFor

if TYPE_CHECKING:
    from .fold import RunRow

__all__ = ["RunSummary", "ToolStats", "read_cursor", "summary"]


class RunSummary(RunHeader):
    """One run as the views show it: a ``RunState`` without its journal and messages."""

    active_flow: str | None = None
    active_node: str | None = None
    waiting_for: WaitingFor | None = None
    lease_holder: str | None = None
    lease_expires_at: datetime | None = None
    step_count: int
    updated_at: datetime
    #: The version label of the flow definition the run is pinned to, if any.
    flow_version: str | None = None
    #: The last flow the run was in: unlike ``active_flow`` it stays set when the
    #: run ends (None for a conversation that never entered a flow).
    flow: str | None = None
    #: ``{"run_id": ..., "step": ...}`` for a child run: the run that started it and
    #: that run's step index (docs/child-runs.md); None otherwise.
    parent: dict[str, Any] | None = None
    #: The last node the run entered: like ``flow`` it stays set when the run ends.
    node: str | None = None
    #: How the run ended (``RunState.outcome``): a flow's ``end`` reason, a cancel's.
    outcome: str | None = None
    #: The class of the error a run in ``error`` ended its last turn with.
    error_type: str | None = None
    #: Whose data the run holds (``RunState.subject``; docs/privacy.md).
    subject: str | None = None

    @property
    def cursor(self) -> str:
        """Where a page that ends with this run ends: ``list_runs(after=cursor)``
        lists the runs after it in the list's order (most recently updated first),
        unmoved by runs that change meanwhile above it."""
        text = json.dumps([self.updated_at.isoformat(), self.run_id])
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def read_cursor(cursor: str) -> tuple[datetime, str]:
    """The update time and run id a ``RunSummary.cursor`` names, or
    ``InvalidArgumentError``."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        when, run_id = json.loads(raw)
        at = datetime.fromisoformat(when)
        if not isinstance(run_id, str) or at.tzinfo is None:
            raise ValueError(run_id)
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        msg = f"after must be a RunSummary.cursor, got {cursor!r}"
        raise InvalidArgumentError(msg) from None
    return at, run_id


class ToolStats(BaseModel):
    """How one tool has behaved across every run: calls, failures, latency.

    ``count`` counts journaled calls (steps), ``errors`` the ones whose final
    outcome is an error; ``p50_ms``/``p95_ms`` are over the calls that ended
    (None before any did), from intent to result as journaled.
    """

    name: str
    count: int
    errors: int
    p50_ms: float | None = None
    p95_ms: float | None = None


def summary(row: RunRow) -> RunSummary:
    """The ``RunSummary`` of a view row (one validation; a wait shape newer than
    this version's ``WaitingFor`` is shown as none rather than failing the query)."""
    fields = {
        "run_id": row.run_id,
        "session_id": row.session_id,
        "kind": row.kind,
        "status": row.status,
        "active_flow": row.active_flow,
        "active_node": row.active_node,
        "waiting_for": row.waiting_for,
        "lease_holder": row.lease_holder,
        "lease_expires_at": row.lease_expires_at,
        "step_count": row.step_count,
        "updated_at": row.updated_at,
        "flow_version": row.flow_version,
        "flow": row.flow,
        "parent": (
            None
            if row.parent_run_id is None
            else {"run_id": row.parent_run_id, "step": row.parent_step}
        ),
        "node": row.node,
        "outcome": row.outcome,
        "error_type": row.error_type,
        "subject": row.subject,
    }
    try:
        return RunSummary.model_validate(fields)
    except ValidationError:
        if row.waiting_for is None:
            raise
        return RunSummary.model_validate({**fields, "waiting_for": None})
