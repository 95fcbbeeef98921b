"""Views of runs: projections of the store's events into tables, and their queries.

Public: ``RunViews``, ``RunSummary``, ``ToolStats`` (also exported from
``kuralle_es``). The rest of this package is internal: ``fold`` (events to
rows, in one place), one backend module per persistence module, and the
``projector`` that moves views along the notification log.
"""

from __future__ import annotations

from ..errors import ProjectionIntegrityError
from .api import RunViews
from .summaries import RunSummary, ToolStats

__all__ = ["ProjectionIntegrityError", "RunSummary", "RunViews", "ToolStats"]
