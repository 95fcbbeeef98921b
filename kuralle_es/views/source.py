"""Reading the store's notification log as ``RunEvent`` values (internal).

Events are decoded with the store's own transcoder (and cipher/compressor, if
configured) but never resolved to a domain class: a projection must keep
going over an event whose class this version does not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from eventsourcing.persistence import Mapper, Notification, StoredEvent

from ..store import RunStore
from .fold import RunEvent

__all__ = ["RawEventMapper", "ViewSource", "decode", "read_after"]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def decode(mapper: Mapper[Any], stored: StoredEvent, notification_id: int) -> RunEvent:
    """The stored event's topic and fields, whatever its topic."""
    state = stored.state
    if mapper.cipher:
        state = mapper.cipher.decrypt(state)
    if mapper.compressor:
        state = mapper.compressor.decompress(state)
    data: dict[str, Any] = mapper.transcoder.decode(state)
    timestamp = data.get("timestamp")
    originator_id = stored.originator_id
    return RunEvent(
        notification_id=notification_id,
        topic=stored.topic,
        originator_id=originator_id if isinstance(originator_id, UUID) else UUID(originator_id),
        originator_version=int(stored.originator_version),
        timestamp=timestamp if isinstance(timestamp, datetime) else _EPOCH,
        data=data,
    )


def read_after(store: RunStore, position: int | None, limit: int) -> list[RunEvent]:
    """Up to ``limit`` events of the log after ``position`` (None: from the start)."""
    notifications: Sequence[Notification] = store.recorder.select_notifications(
        start=position if position is not None else None,
        limit=limit,
        inclusive_of_start=position is None,
    )
    return [decode(store.mapper, n, n.id) for n in notifications]


class RawEventMapper(Mapper[UUID]):
    """A mapper whose "domain events" are ``RunEvent`` values (see ``decode``)."""

    def to_domain_event(self, stored_event: StoredEvent) -> Any:
        notification_id = getattr(stored_event, "id", 0)
        return decode(self, stored_event, int(notification_id))


class ViewSource(RunStore):
    """The run store as a projection's upstream: same tables, raw events.

    ``eventsourcing``'s ``ProjectionRunner`` constructs its upstream
    application itself; this one yields ``RunEvent`` values, so an unknown
    topic reaches the fold (which skips it) instead of stopping the runner.
    """

    name = "RunStore"

    def construct_mapper(self) -> Mapper[UUID]:
        return self.factory.mapper(
            transcoder=self.construct_transcoder(), mapper_class=RawEventMapper
        )
