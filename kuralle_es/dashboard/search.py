"""The front page's search: the form's fields read once, and one page of the runs they
find, from the run views (internal).

Every field is a filter of ``RunViews.list_runs`` (an index of the view tables
answers each): a run id or its first characters, a session, a flow, a status,
and a time range on the runs' last update (the form's ``datetime-local`` fields,
read as UTC). Pages follow the views' cursor (``RunSummary.cursor``), so a run
that changes while an operator reads page 3 moves to page 1 instead of
shifting every page after it. A field that cannot be read is said on the page
and left out of the search; it never fails the page.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import get_args
from urllib.parse import urlencode

from ..errors import InvalidArgumentError
from ..shapes import RunStatus
from ..views import RunSummary, RunViews

__all__ = ["PAGE_SIZE", "RunsPage", "Search", "search_runs"]

#: Runs on one page of the front page's list.
PAGE_SIZE = 50
_STATUSES: tuple[str, ...] = get_args(RunStatus)
#: The longest text a search field keeps (an id is at most 200 characters).
_FIELD_MAX = 200


@dataclass(frozen=True)
class Search:
    """What the operator searches for; empty fields search for anything."""

    run: str = ""
    session: str = ""
    flow: str = ""
    status: str = ""
    since: str = ""
    until: str = ""
    after: str = ""
    problems: tuple[str, ...] = field(default=())

    @classmethod
    def of(cls, params: Mapping[str, str]) -> Search:
        """The search a query string asks for, with what could not be read said."""
        text = {k: (params.get(k) or "").strip()[:_FIELD_MAX] for k in _FIELDS}
        problems = []
        if text["status"] and text["status"] not in _STATUSES:
            problems.append(f"There is no status {text['status']!r}.")
            text["status"] = ""
        for name in ("since", "until"):
            if text[name] and _utc(text[name]) is None:
                problems.append(f"{name.capitalize()} {text[name]!r} is not a date and time.")
                text[name] = ""
        return cls(**text, problems=tuple(problems))

    @property
    def filtered(self) -> bool:
        return any(getattr(self, name) for name in _FIELDS if name != "after")

    def query(self, **changes: str) -> str:
        """This search as a query string (``changes`` applied): a link to it."""
        fields = {name: getattr(self, name) for name in _FIELDS} | changes
        return urlencode({k: v for k, v in fields.items() if v})


_FIELDS = ("run", "session", "flow", "status", "since", "until", "after")


def _utc(text: str) -> datetime | None:
    """A ``datetime-local`` field (or any ISO-8601 time) as UTC; None if it is not one."""
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        return None
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


@dataclass(frozen=True)
class RunsPage:
    """One page of the runs a search found, and the cursor of the next one."""

    search: Search
    runs: list[RunSummary]
    next_after: str | None
    size: int


async def search_runs(views: RunViews, search: Search, size: int = PAGE_SIZE) -> RunsPage:
    """The page of runs ``search`` asks for (one more is read, to know whether a next
    page exists); a page cursor that is not one starts again from the first page."""
    try:
        found = await _page(views, search, size)
    except InvalidArgumentError:
        search = replace(
            search,
            after="",
            problems=(*search.problems, "That page link is not valid: the first page is shown."),
        )
        found = await _page(views, search, size)
    more = len(found) > size
    runs = found[:size]
    return RunsPage(search, runs, runs[-1].cursor if more else None, size)


async def _page(views: RunViews, search: Search, size: int) -> list[RunSummary]:
    return await views.list_runs(
        status=search.status or None,
        session_id=search.session or None,
        flow=search.flow or None,
        limit=size + 1,
        run_id=search.run or None,
        since=_utc(search.since) if search.since else None,
        until=_utc(search.until) if search.until else None,
        after=search.after or None,
    )
