"""Payloads sealed under their subject's key at the mapper; ``Redacted`` once gone (internal).

Each stored event class declares which of its fields are payload
(``PAYLOAD``: dotted paths into its fields, ``catalogue``), and so does the
``Run`` aggregate for its snapshots. ``RunMapper`` (the store's
``eventsourcing`` mapper, ``MAPPER_TOPIC``) seals those values when an event
is stored, each as a ``Sealed`` value (AES-GCM under the run's subject's
data key, ``subject_keys``), and opens them when it is read back; a value
whose key was erased reads as ``Redacted``, the rest of the event (kinds,
names, keys, timings, statuses) as it was. A snapshot with an erased value
is not read at all (``SnapshotErased``): the run is folded from its events.
Events stored before subjects had keys hold plain values and read as they
are. ``seal_payload`` / ``open_payload`` are the same sealing for any other
stored payload of a run (docs/privacy.md).

A payload's JSON of ``COMPRESS_FROM`` bytes or more is compressed before it
is sealed (docs/privacy.md, "What sealing costs"): ciphertext does not
compress, so neither PostgreSQL's TOAST nor a store compressor could shrink a
sealed snapshot afterwards.
"""

from __future__ import annotations

import threading
import zlib
from base64 import b64decode, b64encode
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any
from uuid import UUID

from eventsourcing.domain import Snapshot
from eventsourcing.persistence import (
    Mapper,
    MapperDeserialisationError,
    StoredEvent,
    Transcoder,
    Transcoding,
)
from eventsourcing.utils import resolve_topic

from ..redaction import Redacted
from .encryption import unreadable
from .subject_keys import KeyTable, SubjectKey

__all__ = [
    "RunMapper",
    "Sealed",
    "SealedAsList",
    "SnapshotErased",
    "open_payload",
    "open_sealed_json",
    "payload_paths",
    "seal_payload",
    "sealed_json",
]


class Sealed:
    """A payload value encrypted under the data key ``key_id``; ``clear`` is what of it
    stays readable (a model result's token usage), or None."""

    __slots__ = ("blob", "clear", "key_id")

    def __init__(self, key_id: str, blob: bytes, clear: dict[str, Any] | None = None) -> None:
        self.key_id = key_id
        self.blob = blob
        self.clear = clear


class SealedAsList(Transcoding):
    """How a ``Sealed`` value is stored: ``[key id, base64 ciphertext, clear part]``."""

    type = Sealed
    name = "kuralle_es:sealed"

    def encode(self, obj: Sealed) -> list[Any]:
        return [obj.key_id, b64encode(obj.blob).decode("ascii"), obj.clear]

    def decode(self, data: list[Any]) -> Sealed:
        key_id, blob, clear = data
        return Sealed(key_id, b64decode(blob), clear)


class SnapshotErased(Exception):
    """A snapshot holds a value whose subject was erased: fold the run from its events."""


#: What of a sealed value stays readable, by the class and path that declare it.
KeepClear = Callable[[Any], dict[str, Any] | None]


def payload_paths(cls: type[Any]) -> tuple[tuple[str, ...], ...]:
    """The payload paths ``cls`` declares (``PAYLOAD``), each split on its dots."""
    found = _PATHS.get(cls)
    if found is None:
        found = _PATHS[cls] = tuple(tuple(p.split(".")) for p in getattr(cls, "PAYLOAD", ()))
    return found


_PATHS: dict[type[Any], tuple[tuple[str, ...], ...]] = {}


def _kept_clear(cls: type[Any], path: tuple[str, ...]) -> KeepClear | None:
    keep: Mapping[str, KeepClear] = getattr(cls, "PAYLOAD_CLEAR", {})
    return keep.get(".".join(path))


#: Bytes of a payload's JSON from which it is compressed before it is sealed.
COMPRESS_FROM = 1024
#: The first byte of a compressed plaintext (zlib's data follows). JSON text never
#: starts with a control character, so a payload sealed before compression
#: existed reads as it was.
COMPRESSED = b"\x01"


def seal_payload(transcoder: Transcoder, key: SubjectKey, value: Any, clear: Any = None) -> Sealed:
    """``value`` sealed under ``key``: the one way a run's payload is encrypted for
    its subject (events here; any other stored payload of the run, such as a
    stored stream part, the same way). A long one is compressed first."""
    plain = transcoder.encode(value)
    if len(plain) >= COMPRESS_FROM:
        plain = COMPRESSED + zlib.compress(plain, 1)
    return Sealed(key.key_id, key.cipher.encrypt(plain), clear)


def open_payload(transcoder: Transcoder, keys: KeyTable, sealed: Sealed) -> Any:
    """The value ``sealed`` holds, or ``Redacted`` once its subject was erased."""
    key = keys.key_by_id(sealed.key_id)
    if key is None:
        redacted = Redacted()
        redacted.kept = sealed.clear
        return redacted
    plain = key.cipher.decrypt(sealed.blob)
    if plain[:1] == COMPRESSED:
        plain = zlib.decompress(plain[1:])
    return transcoder.decode(plain)


def _walk(state: dict[str, Any], path: tuple[str, ...], change: Callable[[Any], Any]) -> None:
    """Replace the value at ``path`` of ``state`` (a dotted path through dicts) by
    ``change(value)``; nothing when a step of it is absent or None."""
    holder: Any = state
    for part in path[:-1]:
        holder = holder.get(part) if isinstance(holder, dict) else None
        if holder is None:
            return
    if not isinstance(holder, dict):
        return
    value = holder.get(path[-1])
    if value is not None:
        holder[path[-1]] = change(value)


def _copied_along(state: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """``state`` with the dicts on ``path`` copied, so a change there leaves the
    event (or aggregate) that ``state`` came from as it was."""
    top = dict(state)
    holder = top
    for part in path[:-1]:
        inner = holder.get(part)
        if not isinstance(inner, dict):
            break
        holder[part] = dict(inner)
        holder = holder[part]
    return top


class RunMapper(Mapper[UUID]):
    """The store's mapper: ``eventsourcing``'s, with payloads sealed per subject and a
    store that the key cannot read refused with ``EncryptionKeyError``.

    ``keys`` is the store's key table; ``bind`` says, before a save, whose
    subject a run's events belong to (the run knows, its events do not).
    """

    keys: KeyTable | None = None
    #: Whether reads open payloads; the views keep them sealed (``views.source``).
    opens_payloads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._subjects: OrderedDict[UUID, str] = OrderedDict()
        self._bound = threading.Lock()

    # --------------------------------------------------------------- binding
    def bind(self, run_id: UUID, subject: str) -> None:
        """Seal the next events of ``run_id`` under ``subject``'s key. The key is read
        (or made) when an event with a payload is stored: an event without one
        (an erased run's ``Aborted``) makes no key."""
        with self._bound:
            self._subjects[run_id] = subject
            self._subjects.move_to_end(run_id)
            while len(self._subjects) > 50_000:
                self._subjects.popitem(last=False)

    # -------------------------------------------------------------- storing
    def to_stored_event(self, domain_event: Any) -> StoredEvent:
        paths, owner = self._paths_of(domain_event)
        if not paths or self.keys is None:
            return super().to_stored_event(domain_event)
        subject = self._subjects.get(domain_event.originator_id)
        if subject is None:
            msg = (
                f"{type(domain_event).__name__} of {domain_event.originator_id} has payload "
                "but its run was not bound to a subject before the save"
            )
            raise RuntimeError(msg)
        key = self.keys.key_for(subject)
        state = dict(vars(domain_event))
        for path in paths:
            state = _copied_along(state, path)
            keep = _kept_clear(owner, path[1:] if owner is not type(domain_event) else path)

            def seal(value: Any, keep: KeepClear | None = keep) -> Sealed:
                return seal_payload(self.transcoder, key, value, keep(value) if keep else None)

            _walk(state, path, seal)
        sealed = object.__new__(type(domain_event))
        object.__setattr__(sealed, "__dict__", state)
        return super().to_stored_event(sealed)

    # -------------------------------------------------------------- reading
    def to_domain_event(self, stored_event: StoredEvent) -> Any:
        try:
            event = super().to_domain_event(stored_event)
        except MapperDeserialisationError as e:
            raise unreadable(e, self.cipher is not None) from None
        paths, _ = self._paths_of(event)
        if not paths or self.keys is None or not self.opens_payloads:
            return event
        keys = self.keys
        state = vars(event)
        snapshot = isinstance(event, Snapshot)

        def opened(value: Any) -> Any:
            if not isinstance(value, Sealed):
                return value  # stored before subjects had keys
            plain = open_payload(self.transcoder, keys, value)
            if snapshot and isinstance(plain, Redacted):
                raise SnapshotErased(str(event.originator_id))
            return plain

        for path in paths:
            _walk(state, path, opened)
        return event

    @staticmethod
    def _paths_of(event: Any) -> tuple[tuple[tuple[str, ...], ...], type[Any]]:
        """The payload paths of an event; of a snapshot, its aggregate's, under ``state``."""
        if isinstance(event, Snapshot):
            owner = resolve_topic(event.topic)
            return tuple(("state", *p) for p in payload_paths(owner)), owner
        return payload_paths(type(event)), type(event)


#: The one key of a sealed payload's JSON form in a view row.
SEALED_KEY = "__sealed__"


def sealed_json(sealed: Sealed) -> dict[str, Any]:
    """A sealed payload as the view tables hold it (JSON, still sealed)."""
    return {SEALED_KEY: SealedAsList().encode(sealed)}


def open_sealed_json(value: Any, transcoder: Transcoder, keys: KeyTable | None) -> Any:
    """``value`` (JSON read from a view row) with each sealed payload opened, or
    ``Redacted`` where its subject was erased."""
    if isinstance(value, dict):
        if len(value) == 1 and SEALED_KEY in value:
            sealed = SealedAsList().decode(value[SEALED_KEY])
            if keys is None:
                return Redacted()
            return open_payload(transcoder, keys, sealed)
        return {k: open_sealed_json(v, transcoder, keys) for k, v in value.items()}
    if isinstance(value, list):
        return [open_sealed_json(v, transcoder, keys) for v in value]
    return value
