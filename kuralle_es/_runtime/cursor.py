"""Callsites: where in a run's journal an effect lives (internal).

A ``Cursor`` hands out the ordinals of one flow visit (or one conversation
epoch) in call order; a ``Site`` is one of them, in its logical run and lane.
The driver owns the cursor and moves it at each node (re-)entry; the journal
only ever sees sites.

A site also says which parallel batch its effect belongs to. An effect node
code requests while another of its requests has not settled joins that
one's batch (``asyncio.gather(ctx.tool(a), ctx.tool(b))`` requests both
before either runs), so the batch is known when the effect is requested, the
same on every backend, whatever order the effects then run in.
"""

from __future__ import annotations

from .._journal.sites import Site
from ..errors import InvalidArgumentError

__all__ = ["Cursor"]


class Cursor:
    """The next free callsite of one logical run, counted in call order."""

    def __init__(self, logical_run: str, base: int = 0) -> None:
        self._logical_run = logical_run
        self._next = base
        #: Requests not settled yet, and the batch they belong to.
        self._unsettled = 0
        self._batch = base

    @property
    def logical_run(self) -> str:
        return self._logical_run

    @property
    def next(self) -> int:
        """The first callsite not yet handed out."""
        return self._next

    def reserve(self, n: int = 1) -> list[int]:
        """Reserve ``n`` consecutive callsites, in call order."""
        if not isinstance(n, int) or n < 0:
            msg = f"cannot reserve {n!r} callsites; pass a count of 0 or more"
            raise InvalidArgumentError(msg)
        first = self._next
        self._next += n
        return list(range(first, first + n))

    def take(self) -> Site:
        """The next callsite, as a site."""
        site = Site(self._logical_run, self._next)
        self._next += 1
        return site

    def site(self, callsite: int) -> Site:
        return Site(self._logical_run, callsite)

    def request(self, callsite: int | None = None) -> Site:
        """The site of an effect node code requests now (the next callsite, or an
        explicit one), in the batch of the requests not settled yet; pair it
        with ``settled`` once the effect is done."""
        site = self.take() if callsite is None else self.site(callsite)
        if self._unsettled == 0:
            self._batch = site.callsite
        self._unsettled += 1
        return site.in_batch(self._batch)

    def settled(self) -> None:
        """A requested effect is done (returned, raised or was refused)."""
        self._unsettled -= 1
