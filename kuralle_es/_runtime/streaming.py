"""A turn's stream and a run's stored stream (internal; docs/streaming.md).

``TurnStream`` is what a turn emits its parts through: each part gets the
next offset of the run's stream, goes to the turn's handle at once and is
queued for the run's stored stream (``_journal/stream_log.py``: written in
batches, never in the journal). A model step streams through it:

- before an attempt streams, every earlier attempt of the step that no
  ``retract`` covers yet gets one (a process that died mid-stream could not
  write its own), and an attempt that fails in this process retracts itself,
  so a consumer drops the deltas of an attempt that did not become the
  journaled response before it sees the next attempt's;
- a replayed model step calls no model: its deltas, as stored, go to the
  turn's handle again (not stored twice), and what the stored stream lacks of
  the journaled text (parts a crash kept from being written) is stored
  now, so the stored stream holds the step's text exactly once.

``stored_parts`` is ``Runtime.stream``: the stored parts of a run after an
offset, then the live ones as they are stored, until the run is at rest.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic_core import PydanticSerializationError

from .._journal.store import RunStore
from .._journal.stream_log import StoredPart, StreamLog
from .._journal.subject_keys import SubjectKey
from .._unicode import printable
from ..errors import InvalidArgumentError, RunNotFoundError
from ..shapes import StreamPart

__all__ = ["END_TYPES", "TurnStream", "stored_parts"]

#: The parts that end a turn: after one, a run at rest has nothing more to stream.
END_TYPES = frozenset({"finished", "paused", "error"})
#: Parts read from the stored stream at a time.
READ_BATCH = 500
#: Seconds a caught-up follower waits, seeing the run at rest with no turn-ending
#: part last, before it ends (a turn cut off, or a run cancelled from outside).
AT_REST_GRACE = 1.0
#: Seconds between a caught-up follower's looks at the run's status.
STATUS_EVERY = 1.0


class TurnStream:
    """Emits a turn's parts: to the handle, and to the run's stored stream once
    ``open`` found it (until then, and for a dry run, to the handle only)."""

    def __init__(self, sink: Callable[[StreamPart], None]) -> None:
        self._sink = sink
        self._log: StreamLog | None = None
        self._run_id = ""
        self._key: SubjectKey | None = None
        self._offset = 0

    async def open(self, store: RunStore, run_id: str, subject: str, *, fresh: bool) -> None:
        """Find the run's stored stream and its last offset (a new run has none); its
        parts are stored sealed under ``subject``'s key as it is now, even if the
        subject is erased before they are written (docs/privacy.md)."""
        log = await store.stream_log_async(run_id)
        if log is None:
            return
        self._key = await log.key_for_async(subject)
        self._offset = log.given(run_id) if fresh else await log.last_offset(run_id)
        self._log, self._run_id = log, run_id

    def __call__(self, part: StreamPart, version: int | None = None) -> None:
        """Send ``part``; refused (``InvalidArgumentError``) if it has no JSON form.
        ``version`` (a turn's end): the run's version as the turn left it."""
        log = self._log
        if log is None:
            self._sink(part)
            return
        numbered = part.model_copy(update={"offset": self._offset + 1})
        body = _stored_body(numbered)
        self._offset += 1
        log.add(
            StoredPart(
                self._run_id,
                self._offset,
                part.type,
                part.step,
                part.attempt,
                body,
                version,
                self._key,
            )
        )
        self._sink(numbered)

    # ------------------------------------------------------------ model steps
    def delta(self, step: int, attempt: int, text: str) -> None:
        self(StreamPart(type="text-delta", delta=text, step=step, attempt=attempt))

    def retract(self, step: int, attempt: int) -> None:
        self(StreamPart(type="retract", step=step, attempt=attempt))

    async def before_attempt(self, step: int, attempt: int) -> None:
        """Retract every earlier attempt of ``step`` that no retract covers yet."""
        if attempt <= 1 or self._log is None:
            return
        parts = await self._log.step_parts(self._run_id, step)
        retracted = {p.attempt for p in parts if p.type == "retract"}
        for earlier in range(1, attempt):
            if earlier not in retracted:
                self.retract(step, earlier)

    async def replay(self, step: int, attempt: int, text: str) -> None:
        """Send a replayed step's journaled ``text`` as the stream holds it, and store
        what the stream lacks of it."""
        if self._log is None or not text:
            return
        shown: list[StoredPart] = []
        for part in await self._log.step_parts(self._run_id, step):
            if part.attempt != attempt:
                continue
            if part.type == "retract":
                shown.clear()
            elif part.type == "text-delta":
                shown.append(part)
        so_far = "".join(_delta_of(part) for part in shown)
        if not text.startswith(so_far):
            self.retract(step, attempt)
            self.delta(step, attempt, text)
            return
        for part in shown:
            self._sink(StreamPart.model_validate_json(part.body))
        if len(text) > len(so_far):
            self.delta(step, attempt, text[len(so_far) :])


def _stored_body(part: StreamPart) -> str:
    """The part as the stored stream keeps it: JSON. A model's text with a lone
    surrogate (an emoji cut in half) is kept escaped: its attempt fails, since the
    journal cannot hold it, and is retracted. Anything else that is not JSON data
    is refused (``InvalidArgumentError``)."""
    try:
        return part.model_dump_json(exclude_none=True)
    except (PydanticSerializationError, ValueError, TypeError) as error:
        if part.type in ("text-delta", "text"):
            texts = {"delta": part.delta, "text": part.text}
            escaped = {k: printable(v) for k, v in texts.items() if v is not None}
            return part.model_copy(update=escaped).model_dump_json(exclude_none=True)
        msg = f"a stream part must be JSON data to be stored: {error}"
        raise InvalidArgumentError(msg) from None


def _delta_of(part: StoredPart) -> str:
    delta = json.loads(part.body).get("delta")
    return delta if isinstance(delta, str) else ""


# --------------------------------------------------------------- following
async def stored_parts(
    store: RunStore, run_id: str, session_id: str, after: int = 0
) -> AsyncIterator[StreamPart]:
    """The run's stored parts after offset ``after``, then each new one as it is
    stored; ends once the run is at rest (not running) and its last turn's end
    has been given. ``RunNotFoundError`` for an unknown run or one of another
    session; ``InvalidArgumentError`` for an ``after`` that is not an offset."""
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        msg = f"after must be an offset (an int >= 0), got {after!r}"
        raise InvalidArgumentError(msg)
    await _rest_version(store, run_id, session_id)  # fail-closed, before anything is read
    log = await store.stream_log_async(run_id)
    if log is None:
        raise RunNotFoundError(run_id, session_id)
    async with log.following(run_id) as follower:
        cursor, ended_at = after, None
        rest_since: float | None = None
        looked_at = 0.0
        while True:
            parts = await log.read(run_id, cursor, READ_BATCH)
            for stored in parts:
                cursor = stored.offset
                ended_at = stored.version if stored.type in END_TYPES else None
                yield StreamPart.model_validate_json(stored.body)
            if parts:
                rest_since = None
                if len(parts) == READ_BATCH:
                    continue
            now = time.monotonic()
            if ended_at is not None or now - looked_at >= STATUS_EVERY:
                looked_at = now
                version = await _rest_version(store, run_id, session_id)
                if version is None:
                    rest_since = None
                elif version == ended_at:
                    return  # the run's last turn ended with the part just given
                elif rest_since is None:
                    rest_since = now
                elif now - rest_since >= AT_REST_GRACE:
                    return  # at rest with no turn's end to come (cancelled, cut off)
            await log.wait(follower)


async def _rest_version(store: RunStore, run_id: str, session_id: str) -> int | None:
    """The run's version if it is at rest (not running), None while it runs;
    ``RunNotFoundError`` if it is not the session's."""
    run = await store.load_async(run_id)
    if run is None or run.session_id != session_id:
        raise RunNotFoundError(run_id, session_id)
    status: Any = run.status
    return None if status == "running" else int(run.version)
