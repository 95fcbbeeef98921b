"""Reading the store's notification log for the views (internal).

Each notification becomes a ``Logged`` entry: its position and the stored
event of the catalogue it holds, decoded and upcast by the store's own
mapper (with its cipher and compressor, if configured), its payloads left
sealed: a view row holds a payload as sealed as the event (docs/privacy.md). A topic this
version does not know (a later release's event) becomes an ``UnknownEvent``
instead of an error: a projection must keep going over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from eventsourcing.persistence import Mapper, Notification, StoredEvent
from eventsourcing.utils import TopicError

from .._journal import catalogue as stored
from .._journal.log import RunLog
from .._journal.sealing import RunMapper

__all__ = ["Logged", "TolerantMapper", "UnknownEvent", "ViewSource", "decode", "read_after"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Stored topics of the ``Run`` aggregate's events all start with this.
_RUN_TOPIC_PREFIX = "kuralle_es:Run."


@dataclass(frozen=True)
class UnknownEvent:
    """A stored event whose topic this version does not know: counted, not shown."""

    topic: str
    originator_id: UUID
    originator_version: int
    timestamp: datetime

    @property
    def of_a_run(self) -> bool:
        return self.topic.startswith(_RUN_TOPIC_PREFIX)


@dataclass(frozen=True)
class Logged:
    """One notification of the log: its position and the event it holds."""

    position: int
    event: stored.Event | stored.SessionEvent | UnknownEvent

    @property
    def run_event(self) -> stored.Event | UnknownEvent | None:
        """The event, if it is one of a run's (known or not)."""
        event = self.event
        if isinstance(event, stored.Event):
            return event
        if isinstance(event, UnknownEvent) and event.of_a_run:
            return event
        return None


def decode(mapper: Mapper[Any], stored_event: StoredEvent, position: int) -> Logged:
    """The notification as a ``Logged`` entry, whatever its topic."""
    try:
        event: Any = mapper.to_domain_event(stored_event)
    except TopicError:
        return Logged(position, _unknown(mapper, stored_event))
    return Logged(position, event)


def _unknown(mapper: Mapper[Any], stored_event: StoredEvent) -> UnknownEvent:
    state = stored_event.state
    if mapper.cipher:
        state = mapper.cipher.decrypt(state)
    if mapper.compressor:
        state = mapper.compressor.decompress(state)
    data: dict[str, Any] = mapper.transcoder.decode(state)
    timestamp = data.get("timestamp")
    originator_id = stored_event.originator_id
    return UnknownEvent(
        topic=stored_event.topic,
        originator_id=originator_id if isinstance(originator_id, UUID) else UUID(originator_id),
        originator_version=int(stored_event.originator_version),
        timestamp=timestamp if isinstance(timestamp, datetime) else _EPOCH,
    )


def read_after(store: RunLog, position: int | None, limit: int) -> list[Logged]:
    """Up to ``limit`` entries of the log after ``position`` (None: from the start)."""
    notifications: Sequence[Notification] = store.recorder.select_notifications(
        start=position if position is not None else None,
        limit=limit,
        inclusive_of_start=position is None,
    )
    return [decode(store.view_mapper, n, n.id) for n in notifications]


class TolerantMapper(RunMapper):
    """A mapper whose events are ``Logged`` entries (an unknown topic included), their
    payloads kept sealed as the view rows hold them."""

    opens_payloads = False

    def to_domain_event(self, stored_event: StoredEvent) -> Any:
        try:
            event: Any = super().to_domain_event(stored_event)
        except TopicError:
            event = _unknown(self, stored_event)
        return Logged(int(getattr(stored_event, "id", 0)), event)


class ViewSource(RunLog):
    """The run store as a projection's upstream: same tables, ``Logged`` entries.

    ``eventsourcing``'s ``ProjectionRunner`` constructs its upstream
    application itself; this one yields ``Logged`` entries, so an unknown
    topic reaches the fold (which counts it) instead of stopping the runner.
    """

    name = "RunStore"

    def construct_mapper(self) -> Mapper[UUID]:
        return self.factory.mapper(
            transcoder=self.construct_transcoder(), mapper_class=TolerantMapper
        )
