"""Leases: who drives a run now, kept in a record apart from the journal (internal).

A lease is ownership, not history: a turn takes its run's lease record by
compare-and-set, a heartbeat renews it while an effect executes, and the
turn releases it at its close. Nothing of that is appended to the run's
journal. Each change is a ``LeaseOp``; the store applies it in the same
transaction as the run's events when a save carries both (a turn's opening
takes the lease with the events that open it, its close releases it with
the events that close it), or alone (a heartbeat), so a refused take writes
nothing at all (docs/concepts.md, "Leases").

One clock decides a lease: the store's. A take or a renewal carries a TTL,
never an expiry; the store compares the record with its own time and sets
the expiry to its own time plus the TTL (PostgreSQL: the server's clock, so
a worker whose clock runs ahead can never take a live lease; SQLite and
memory: the one machine's). A lease read back says whether it was live by
that same clock.

What does go into the journal is a takeover: a turn that opens a running
run whose lease belonged to another holder appends ``Recovered``, so the
stale writer's next save loses on the run's version (``StaleWriteError``).

Runs stored by 0.1.0 kept their lease in the journal (``LeaseTaken`` /
``LeaseReleased``); the aggregate still folds those events, and while such a
run is ``running`` with no lease record, its folded lease is its lease.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal
from uuid import UUID

__all__ = ["Lease", "LeaseOp", "LeaseRefused", "store_now"]

LeaseOpKind = Literal["take", "renew", "release", "clear"]


def store_now() -> datetime:
    """The clock of a store on this machine (memory, SQLite), which decides its leases."""
    return datetime.now(UTC)


@dataclass(frozen=True)
class Lease:
    """A run's lease: its holder, until when, the token of the turn that took it
    (empty for a lease folded from a journal of 0.1.0), and whether it was live
    when it was read, by the store's clock (a refused take's lease is live)."""

    holder: str
    expires_at: datetime
    token: str = ""
    live: bool = True


@dataclass(frozen=True)
class LeaseOp:
    """A change to one run's lease record.

    ``take``: hold it as ``holder`` with ``token`` for ``ttl``, if it is free by
    the store's clock (no record, an expired one, or this holder's own); else
    the save is refused (``LeaseRefused``) and writes nothing. ``renew``: hold
    the record this ``token`` took for ``ttl`` from now (the store's now);
    refused if another took it since. ``release``: drop the record this
    ``token`` took (a no-op if another took it). ``clear``: drop the record
    whoever holds it (a cancel).
    """

    kind: LeaseOpKind
    run_id: UUID
    holder: str = ""
    token: str = ""
    ttl: timedelta | None = None

    @classmethod
    def take(cls, run_id: UUID, holder: str, token: str, ttl: timedelta) -> LeaseOp:
        return cls("take", run_id, holder, token, ttl)

    @classmethod
    def renew(cls, run_id: UUID, token: str, ttl: timedelta) -> LeaseOp:
        return cls("renew", run_id, token=token, ttl=ttl)

    @classmethod
    def release(cls, run_id: UUID, token: str) -> LeaseOp:
        return cls("release", run_id, token=token)

    @classmethod
    def clear(cls, run_id: UUID) -> LeaseOp:
        return cls("clear", run_id)


class LeaseRefused(Exception):
    """A lease op the record refused: a take while another holder's lease is live
    (``held`` is that lease), or a renewal of a lease taken over (``held`` None).
    Internal: the store turns it into ``LeaseHeldError`` or ``StaleWriteError``."""

    def __init__(self, op: LeaseOp, held: Lease | None) -> None:
        self.op = op
        self.held = held
        super().__init__(f"lease {op.kind} of run {op.run_id} refused (held: {held})")
