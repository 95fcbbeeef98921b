"""Moving the views along the notification log (internal).

``catch_up`` pulls: it reads the events after the views' tracking position
and applies them in batches (one transaction each) until none are left. It
is what every query runs first, and all a SQLite or memory projector needs
(``eventsourcing`` 9.5 has no SQLite subscriptions). ``follow`` keeps the
views current until stopped: on PostgreSQL with ``eventsourcing``'s
``ProjectionRunner`` (woken by LISTEN/NOTIFY), elsewhere by polling, and so
behind PgBouncer in transaction mode, where a LISTEN would be lost with its
server session (docs/high-availability.md). A catch-up that loses its
connection (a restart, a failover) is tried again after ``interval``: the
position is in the views' tracking table, so nothing is applied twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import psycopg
from eventsourcing.persistence import InterfaceError, OperationalError, Tracking
from eventsourcing.postgres import PostgresApplicationRecorder
from eventsourcing.projection import ProjectionRunner

from .._journal.log import RunLog
from .._journal.store_url import PostgresAddress
from .backend import ViewBackend
from .postgres import PostgresViews, RunViewsProjection
from .source import ViewSource, read_after

__all__ = ["DEFAULT_BATCH", "catch_up", "follow", "follow_store", "run_projection_runner"]

DEFAULT_BATCH = 500

logger = logging.getLogger(__name__)

#: The driver's errors of a connection lost (a restart, a failover): the views try again.
_LOST = (psycopg.OperationalError, psycopg.InterfaceError)


def catch_up(store: RunLog, views: ViewBackend, batch: int = DEFAULT_BATCH) -> int:
    """Apply every event stored before the call; returns how many this call applied.

    Events stored meanwhile may be applied too, but are not waited for: under
    a steady stream of writes a catch-up still ends.
    """
    return _catch_up(store, views, batch)[0]


def _catch_up(store: RunLog, views: ViewBackend, batch: int) -> tuple[int, int]:
    """``catch_up``, also returning a position the views have reached."""
    until = store.recorder.max_notification_id() or 0
    position = views.view_position()
    applied = 0
    while position is None or position < until:
        events = read_after(store, position, batch)
        if not events:
            break
        # What another projector applied meanwhile, apply() skips; either way
        # every event up to the batch's last is in the views afterwards.
        applied += views.apply(events, events[-1].position)
        position = events[-1].position
    return applied, position or 0


def follow(
    store: RunLog,
    views: ViewBackend,
    stop: threading.Event,
    *,
    name: str = "RunViews",
    interval: float = 0.2,
    batch: int = DEFAULT_BATCH,
) -> None:
    """Keep the views current until ``stop`` is set; raises what stops the projection."""
    pooled = isinstance(store.address, PostgresAddress) and store.address.pooled
    listens = (
        isinstance(store.recorder, PostgresApplicationRecorder)
        and isinstance(views, PostgresViews)
        and not pooled
    )
    while not stop.is_set():
        try:
            catch_up(store, views, batch)  # the backlog (again after a lost connection)
            if listens:  # then as NOTIFY wakes the runner
                run_projection_runner(store, name, stop, batch)
            else:
                stop.wait(interval)
        except (OperationalError, InterfaceError, *_LOST) as lost:
            logger.warning("the views lost their database (%s); trying again", lost)
            stop.wait(interval)


def follow_store(
    logs: Sequence[RunLog],
    open_views: Callable[[RunLog], ViewBackend],
    stop: threading.Event,
    *,
    interval: float = 0.2,
    batch: int = DEFAULT_BATCH,
) -> None:
    """``follow`` for every log of a store (its partitions), one thread each, until
    ``stop`` is set; the first error stops them all and is raised."""
    errors: list[BaseException] = []

    def one(log: RunLog) -> None:
        try:
            follow(log, open_views(log), stop, interval=interval, batch=batch)
        except BaseException as e:
            errors.append(e)
            stop.set()

    threads = [
        threading.Thread(target=one, args=(log,), name=f"views-p{log.partition}", daemon=True)
        for log in logs
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


class _BatchingProjection(RunViewsProjection):
    """Woken by the runner's subscription, applies all that is stored, in batches.

    The runner hands over events one by one; applying each in its own
    transaction caps a projector at a few hundred events a second. Instead,
    an event beyond what this projection has applied triggers a catch-up over
    the log (which includes it); the events that catch-up covered are then
    skipped without touching the database. Exactly once still rests on the
    tracking position checked inside each batch's transaction.
    """

    source: ClassVar[RunLog]
    batch: ClassVar[int] = DEFAULT_BATCH

    def __init__(self, view: PostgresViews) -> None:
        super().__init__(view)
        self._through = 0

    def process_event(self, domain_event: Any, tracking: Tracking) -> None:
        if tracking.notification_id <= self._through:
            return
        _, position = _catch_up(self.source, self.view, self.batch)
        self._through = max(self._through, position)


def run_projection_runner(
    store: RunLog, name: str, stop: threading.Event, batch: int = DEFAULT_BATCH
) -> None:
    """Run ``eventsourcing``'s ``ProjectionRunner`` into the views ``name`` of one
    log (a partition of a store) until ``stop``."""
    views = name + store.views_name.removeprefix("RunViews")
    env: dict[str, Any] = dict(store.env)
    prefix, upstream = views.upper(), store.name.upper()
    # Size the runner's pools on purpose: the subscription holds one
    # connection (LISTEN) and reads with another; the view writes with one.
    env.setdefault(f"{upstream}_POSTGRES_POOL_SIZE", "2")
    env.setdefault(f"{upstream}_POSTGRES_MAX_OVERFLOW", "2")
    env.setdefault(f"{prefix}_POSTGRES_POOL_SIZE", "1")
    env.setdefault(f"{prefix}_POSTGRES_MAX_OVERFLOW", "2")
    projection = type(
        f"{views}Projection",
        (_BatchingProjection,),
        {"name": views, "source": store, "batch": batch},
    )
    # The runner builds its upstream and its view itself: this log's tables.
    source = type(f"{store.name}Source", (ViewSource,), {"name": store.name})
    leases = getattr(store.recorder, "leases_table", PostgresViews.default_leases_table)
    address = store.address if isinstance(store.address, PostgresAddress) else None
    view = type(
        f"{views}Tables", (PostgresViews,), {"default_leases_table": leases, "address": address}
    )
    runner: ProjectionRunner[ViewSource, PostgresViews] = ProjectionRunner(
        application_class=source,
        projection_class=projection,
        view_class=view,
        env=env,
    )
    with runner:
        while not stop.is_set():
            runner.run_forever(timeout=0.2)
            if runner.is_interrupted.is_set():
                break
