"""``RunLog``: one event log of runs, an ``eventsourcing`` application (internal).

A ``RunStore`` is one or more such logs (partitions; ``store``). Persistence
is chosen the ``eventsourcing`` way (``PERSISTENCE_MODULE`` and that
module's variables, from the environment or an ``env`` mapping). This is the
one boundary where the library's ``IntegrityError`` (a version clash on
append) becomes our ``StaleWriteError``, and a refused lease op becomes
``LeaseHeldError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar
from uuid import UUID

from eventsourcing.application import AggregateNotFoundError, ProcessingEvent
from eventsourcing.domain import (
    Snapshot,
)
from eventsourcing.persistence import (
    ApplicationRecorder,
    EventStore,
    InfrastructureFactory,
    IntegrityError,
    InternalError,
    Mapper,
    OperationalError,
    ProgrammingError,
    Transcoder,
)
from eventsourcing.popo import POPOAggregateRecorder, POPOFactory
from eventsourcing.postgres import PostgresFactory
from eventsourcing.utils import Environment, EnvType, get_topic
from psycopg.errors import DuplicateObject, DuplicateTable, UniqueViolation
from psycopg.errors import InternalError as PsycopgInternalError

from ..errors import LeaseHeldError, StaleWriteError, StoreUnavailableError
from .encryption import check_readable, cipher_env
from .eventsourcing_hooks import AggregatesFirst, SavingApplication
from .leases import Lease, LeaseOp, LeaseRefused
from .pg_async import AsyncOneTripSaver
from .pg_pool import PgConnections
from .recorders import (
    LeasingPOPORecorder,
    LeasingRecorder,
    LeasingSQLiteRecorder,
    OneTripPostgresRecorder,
)
from .run import Run
from .sealing import RunMapper, SealedAsList, SnapshotErased, payload_paths
from .sessions import SavedIndexes, SessionRuns, new_session_runs, session_runs_id
from .store_url import (
    CONNECT_TIMEOUT,
    PostgresAddress,
    ShardedAddress,
    StoreAddress,
    address_from_env,
    server_reason,
)
from .subject_keys import KeyTable, key_table_at
from .transcoding import EscapingJSONTranscoder

__all__ = [
    "KEY_STORE_ENV",
    "RunLog",
    "parse_run_id",
    "retry_schema_setup",
    "snapshot_due",
    "snapshot_spacing",
]

#: Events between snapshots of an aggregate whose state is small; a larger
#: state is snapshotted less often (``snapshot_spacing``).
SNAPSHOT_INTERVAL = 100


def snapshot_spacing(weight: int) -> int:
    """Events between snapshots of an aggregate whose state weighs ``weight``.

    ``weight`` is about how many events replaying would cost as much as
    loading the state (``Run.snapshot_weight``). The spacing is the first of
    100, 200, 400, ... at least that weight, so a snapshot's bytes are paid
    for by at least as many events: the bytes a run stores per event stay
    the same however long it lives, where a fixed interval would make a
    long run's snapshots add up to the square of its length. A load reads
    one snapshot and at most one spacing of events after it, both bounded by
    what the run holds (docs/concepts.md, "What a run holds").
    """
    spacing = SNAPSHOT_INTERVAL
    while spacing < weight:
        spacing *= 2
    return spacing


def snapshot_due(before: int, after: int, weight: int) -> bool:
    """Whether a save that took an aggregate from version ``before`` to ``after``
    crossed a multiple of its ``snapshot_spacing``."""
    spacing = snapshot_spacing(weight)
    return after // spacing > before // spacing


def project_events(aggregate: Any, events: Iterable[Any]) -> Any:
    """The repository's projector without its per-event protocol check.

    ``eventsourcing``'s default asserts ``isinstance(event, CanMutateProtocol)``
    on every event: a runtime-checkable protocol check that costs more than
    decoding and applying the event (half of a long conversation's load,
    benchmarks/RESULTS.md). The store only holds our own events, each with
    ``mutate``.
    """
    for event in events:
        aggregate = event.mutate(aggregate)
    return aggregate


def parse_run_id(run_id: str) -> UUID | None:
    """The aggregate id behind a public run id, or None if it cannot be one."""
    try:
        return UUID(run_id)
    except (ValueError, AttributeError, TypeError):
        return None


_T = TypeVar("_T")

#: The variable that names the subjects' key table's database (a store URL).
KEY_STORE_ENV = "KURALLE_KEY_STORE"


def retry_schema_setup(construct: Callable[[], _T]) -> _T:
    """Construct a recorder, retrying its (idempotent) schema setup.

    Workers starting together race on ``eventsourcing``'s ``CREATE TABLE IF NOT
    EXISTS`` / ``CREATE OR REPLACE FUNCTION`` on PostgreSQL, which fail with
    "tuple concurrently updated" or a duplicate catalog key for all but one of
    them. The statements are idempotent, so trying again is safe.
    """
    for attempt in range(_SCHEMA_SETUP_ATTEMPTS):
        try:
            return construct()
        except (InternalError, IntegrityError, ProgrammingError) as e:
            if attempt == _SCHEMA_SETUP_ATTEMPTS - 1 or not _is_setup_race(e):
                raise
            time.sleep(random.uniform(0.01, 0.05) * (attempt + 1))
    raise AssertionError("unreachable")


def _is_setup_race(error: Exception) -> bool:
    """Whether a schema-setup failure is another worker's setup winning the race."""
    cause = error.__cause__
    if isinstance(cause, DuplicateTable | DuplicateObject | UniqueViolation):
        return True
    return isinstance(cause, PsycopgInternalError) and "concurrently updated" in str(cause)


_SCHEMA_SETUP_ATTEMPTS = 8


class RunLog(SavingApplication):
    """One log of runs: their events, snapshots and lease records, with its own
    lock and notification log; appends are compare-and-set on the aggregate
    version. ``partition`` is its number in its store (0 for the first)."""

    #: The tables of the first log (``runstore_events``, ...), as every store has had.
    name = "RunStore"
    partition = 0
    #: The name of the log's view tables (``runviews_runs``, ...).
    views_name = "RunViews"

    def __init__(
        self,
        env: EnvType | None = None,
        *,
        partition: int = 0,
        own_tables: bool = False,
        keys: KeyTable | None = None,
        connections: PgConnections | None = None,
    ) -> None:
        if own_tables:
            # Another partition of one database: tables of its own
            # (``runstore_p1_events``, ``runviews_p1_runs``, ...), and variables
            # ``RUNSTORE_P1_*`` before the plain ones.
            self.name = f"RunStore_p{partition}"
            self.views_name = f"RunViews_p{partition}"
        self.partition = partition
        self._saved_indexes = SavedIndexes()
        #: The subjects' key table (``subject_keys``): given by the store, else the
        #: one ``KURALLE_KEY_STORE`` names, else one in the log's own database.
        self.keys = keys
        #: The database's connections, shared with the store's other partitions of
        #: it (their store closes them), or this log's own (made and closed here).
        self.connections = connections
        self.owns_connections = connections is None
        super().__init__(env=env)
        try:
            check_readable(self.mapper, _first_stored_event(self.recorder))
        except BaseException:
            self.close()
            raise

    #: The loop-side sender of saves: on the one-trip PostgreSQL recorder only.
    _saver: AsyncOneTripSaver | None = None
    #: Where the log is, read from its environment (None: another persistence module).
    address: StoreAddress | None = None

    def __repr__(self) -> str:
        where = self.address.label() if self.address is not None else "?"
        return f"<{type(self).__name__} partition {self.partition} of {where}>"

    snapshotting_intervals: ClassVar[dict[type[Any], int]] = {
        Run: SNAPSHOT_INTERVAL,
        SessionRuns: SNAPSHOT_INTERVAL,
    }

    def put_snapshots(self, due: list[Any]) -> None:
        for aggregate in due:
            if isinstance(aggregate, Run):
                self.bind_subject(aggregate)
        if due and self.snapshots is not None:
            self.snapshots.put([Snapshot.take(aggregate) for aggregate in due])

    def due_snapshots(self, processing_event: ProcessingEvent[UUID]) -> list[Any]:
        """Each saved aggregate whose save crossed its spacing (``snapshot_due``): its
        snapshot is taken from the aggregate just saved. (The library's default
        snapshots every ``snapshotting_intervals`` events, so a long run's snapshots
        add up to the square of its length, and reloads the aggregate to do it.)
        ``snapshotting_intervals`` still says which aggregate types are snapshotted.
        """
        if self.snapshots is None:
            return []
        first_saved: dict[UUID, int] = {}
        for event in processing_event.events:
            first_saved.setdefault(event.originator_id, event.originator_version)
        due: list[Run | SessionRuns] = []
        for aggregate_id, first in first_saved.items():
            aggregate = processing_event.aggregates.get(aggregate_id)
            if (
                isinstance(aggregate, Run | SessionRuns)
                and type(aggregate) in self.snapshotting_intervals
                and snapshot_due(first - 1, aggregate.version, aggregate.snapshot_weight)
            ):
                due.append(aggregate)
        return due

    def construct_factory(self, env: Environment) -> InfrastructureFactory[Any]:
        """The persistence factory of the log's address (``store_url``), read from
        its environment; on PostgreSQL, using the database's connections
        (``pg_pool``: one pool for every partition, libpq's other parameters such as
        a multi-host URL's ``target_session_attrs`` given before it connects)."""
        self.address = address_from_env(env, env.name)
        if isinstance(self.address, PostgresAddress) and not env.get("POSTGRES_CONNECT_TIMEOUT"):
            env["POSTGRES_CONNECT_TIMEOUT"] = str(CONNECT_TIMEOUT + 2)
        factory = super().construct_factory(env)
        if isinstance(self.address, PostgresAddress) and isinstance(factory, PostgresFactory):
            if self.connections is None:
                self.connections = PgConnections(self.address)
            self.connections.share(factory)
        return factory

    def construct_env(self, name: str, env: EnvType | None = None) -> Environment:
        """The environment, with the recorder that keeps lease records beside the
        events (on PostgreSQL, the one-round-trip one) unless
        ``APPLICATION_RECORDER_TOPIC`` names another; the mapper that seals
        payloads per subject (``sealing``) unless ``MAPPER_TOPIC`` names another;
        and the ``eventsourcing`` cipher when ``KURALLE_CIPHER_KEY`` is set
        (``encryption``)."""
        environment = super().construct_env(name, env)
        environment.update(cipher_env(environment))
        if not environment.get("MAPPER_TOPIC"):
            environment["MAPPER_TOPIC"] = get_topic(RunMapper)
        module = environment.get("PERSISTENCE_MODULE") or ""
        if environment.get("APPLICATION_RECORDER_TOPIC"):
            return environment
        if module.startswith("eventsourcing.postgres"):
            environment["APPLICATION_RECORDER_TOPIC"] = get_topic(OneTripPostgresRecorder)
        elif module.startswith("eventsourcing.sqlite"):
            environment["APPLICATION_RECORDER_TOPIC"] = get_topic(LeasingSQLiteRecorder)
        return environment

    @property
    def saves_block(self) -> bool:
        """Whether a save waits on I/O (SQLite, Postgres) and so belongs off the event
        loop; an in-memory save is pure CPU, cheaper inline than a thread hop."""
        return not isinstance(self.recorder, POPOAggregateRecorder)

    def construct_recorder(self) -> ApplicationRecorder:
        """The persistence module's recorder, with lease records beside the events
        (``recorders``), its schema set up."""
        if isinstance(self.factory, POPOFactory):
            return LeasingPOPORecorder()
        recorder = retry_schema_setup(super().construct_recorder)
        if isinstance(recorder, OneTripPostgresRecorder) and self.connections is not None:
            # Async code's saves are sent from its event loop (``save_run_async``).
            self._saver = AsyncOneTripSaver(recorder, self.connections)
        return recorder

    def construct_snapshot_store(self) -> EventStore[UUID]:
        return retry_schema_setup(super().construct_snapshot_store)

    def construct_transcoder(self) -> Transcoder:
        """Our transcoder: stores user JSON exactly, whatever keys it uses, and sealed
        payloads."""
        transcoder = EscapingJSONTranscoder()
        self.register_transcodings(transcoder)
        transcoder.register(SealedAsList())
        return transcoder

    def construct_mapper(self) -> Mapper[UUID]:
        """The environment's mapper (ours: ``RunMapper``), given the key table."""
        mapper = super().construct_mapper()
        if isinstance(mapper, RunMapper):
            if self.keys is None:
                address = self.address if not isinstance(self.address, ShardedAddress) else None
                self.keys = key_table_at(self.env.get(KEY_STORE_ENV) or address, mapper.cipher)
            mapper.keys = self.keys
        #: The same mapper, reading payloads sealed: what the views keep.
        self.view_mapper: Mapper[UUID] = mapper
        if isinstance(mapper, RunMapper):
            self.view_mapper = RunMapper(mapper.transcoder, mapper.compressor, mapper.cipher)
            self.view_mapper.opens_payloads = False
        return mapper

    def bind_subject(self, run: Run) -> None:
        """Seal the run's next events under its subject's key (before any save of it)."""
        mapper = self.mapper
        if isinstance(mapper, RunMapper):
            mapper.bind(run.id, run.data_subject)

    async def bind_subject_async(self, run: Run) -> None:
        """``bind_subject`` for async code: the key is read off the loop when it is not
        at hand (the first save of a subject's run in this process)."""
        mapper = self.mapper
        if not isinstance(mapper, RunMapper):
            return
        mapper.bind(run.id, run.data_subject)
        keys = mapper.keys
        if (
            keys is not None
            and not keys.has_cached(run.data_subject)
            and any(payload_paths(type(e)) for e in run.pending_events)
        ):
            await self._off_loop(keys.key_for, run.data_subject)

    # ---------------------------------------------------------------- runs
    def load(self, run_id: str) -> Run | None:
        """The run with this public id, or None if this log has none."""
        aggregate_id = parse_run_id(run_id)
        if aggregate_id is None:
            return None
        try:
            with self.reachable():
                run: object = self.repository.get(aggregate_id, projector_func=project_events)
        except AggregateNotFoundError:
            return None
        except SnapshotErased:
            # Its subject was erased: the snapshot cannot be read, the events can.
            return self._folded(aggregate_id, keep_all=False)
        if not isinstance(run, Run):
            return None
        return run

    async def load_async(self, run_id: str, *, history: bool = False) -> Run | None:
        """``load`` (or ``load_history``) for async code: inline in memory, where a
        load is pure CPU and cheaper than a thread hop; on a worker thread where
        it waits on a database."""
        load = RunLog.load_history if history else RunLog.load
        return await self._off_loop(load, self, run_id)

    async def _off_loop(self, call: Callable[..., _T], *args: Any) -> _T:
        """``call(*args)`` from async code: on a worker thread where it waits on a
        database, inline in memory (pure CPU, cheaper than a thread hop)."""
        if self.saves_block:
            return await asyncio.to_thread(call, *args)
        return call(*args)

    def load_history(self, run_id: str) -> Run | None:
        """The run folded from all its events, every step it ever journaled kept
        (a loaded run holds only the steps a resume can replay: ``Run``).

        For reading a run's whole journal (``Runtime.get_steps``, ``runs show``,
        the dashboard); it costs the run's length, where ``load`` does not.
        Never save it.
        """
        aggregate_id = parse_run_id(run_id)
        if aggregate_id is None:
            return None
        return self._folded(aggregate_id, keep_all=True)

    def _folded(self, aggregate_id: UUID, *, keep_all: bool) -> Run | None:
        """The run folded from its events alone (no snapshot)."""
        events: Iterator[Any] = iter(self.events.get(aggregate_id))
        created = next(events, None)
        run = created.mutate(None) if created is not None else None
        if not isinstance(run, Run):
            return None
        run.keeps_all_steps = keep_all  # before any later event can archive a step
        folded: Run = project_events(run, events)
        return folded

    def create_run(self, run: Run, lease: LeaseOp | None = None) -> None:
        """Save a new run together with its entry in its session's index (and the
        ``lease`` op, in the same transaction)."""
        self._saved_indexes.take(run.session_id)  # read afresh below
        self.bind_subject(run)
        self._create_reading_index(run, run.collect_events(), lease)

    def _create_reading_index(self, run: Run, events: Sequence[Any], lease: LeaseOp | None) -> None:
        """Save the new run's ``events`` with its session's index as stored now.

        A clash can only be on the session index (a concurrent creation in the
        same session), since a new run's id is fresh: reload it and try again.
        """
        for _ in range(20):
            index = self.session_runs(run.session_id) or new_session_runs(run.session_id)
            index.add_run(run.run_id)
            try:
                with self.reachable(), _lease_errors(run):
                    self.save(*events, index, **_lease_kwargs(lease))
            except IntegrityError:
                if RunLog.load(self, run.run_id) is not None:
                    raise StaleWriteError(run.run_id, "the run already exists") from None
                continue
            self._saved_indexes.keep(index)
            return
        raise StaleWriteError(run.run_id, "its session index kept changing")

    async def create_run_async(self, run: Run, lease: LeaseOp | None = None) -> None:
        """``create_run`` for async code, without blocking the event loop.

        On PostgreSQL the run goes with the session's index as this process last
        saved it (a new index for a session it has not saved), sent from the
        loop like any save; a clash (another process added a run to the session
        meanwhile, or its index is older than this process) writes nothing, and
        the save is made again with the index read afresh, on a worker thread.
        A thread hop per new run held the loop back more than anything else in a
        busy process (benchmarks/RESULTS.md).
        """
        saver = self._saver
        if saver is None:
            await self._off_loop(RunLog.create_run, self, run, lease)
            return
        await self.bind_subject_async(run)
        events = run.collect_events()
        index = self._saved_indexes.take(run.session_id) or new_session_runs(run.session_id)
        index.add_run(run.run_id)
        try:
            await self._save_from_loop(saver, run, lease, *events, index)
        except IntegrityError:
            await asyncio.to_thread(self._create_reading_index, run, events, lease)
            return
        self._saved_indexes.keep(index)

    def session_run_ids(self, session_id: str) -> list[str]:
        """Ids of the session's runs, oldest first."""
        index = self.session_runs(session_id)
        return list(index.run_ids) if index is not None else []

    def session_runs(self, session_id: str) -> SessionRuns | None:
        """The session's index of runs, if this log has it."""
        try:
            index: object = self.repository.get(
                session_runs_id(session_id), projector_func=project_events
            )
        except AggregateNotFoundError:
            return None
        return index if isinstance(index, SessionRuns) else None

    def save_run(self, run: Run, lease: LeaseOp | None = None) -> None:
        """Append the run's pending events in one transaction, or nothing at all,
        with the ``lease`` op in the same transaction (refused: ``LeaseHeldError``,
        or ``StaleWriteError`` for a lease taken over; nothing is written)."""
        self.bind_subject(run)
        try:
            with self.reachable(), _lease_errors(run):
                self.save(run, **_lease_kwargs(lease))
        except IntegrityError as e:
            raise StaleWriteError(run.run_id, "another writer appended first") from e

    async def save_run_async(self, run: Run, lease: LeaseOp | None = None) -> None:
        """``save_run`` for async code, without blocking the event loop.

        In memory a save is pure CPU and is made inline; on PostgreSQL (the
        one-trip recorder) it is sent from the loop over an async connection;
        anywhere else (SQLite, another recorder) it runs on a worker thread.
        """
        saver = self._saver
        if saver is None:
            await self._off_loop(RunLog.save_run, self, run, lease)
            return
        await self.bind_subject_async(run)
        try:
            await self._save_from_loop(saver, run, lease, run)
        except IntegrityError as e:
            raise StaleWriteError(run.run_id, "another writer appended first") from e

    async def _save_from_loop(
        self, saver: AsyncOneTripSaver, run: Run, lease: LeaseOp | None, *items: Any
    ) -> None:
        """``save`` of ``items`` (aggregates or their events) with the recorder's insert
        sent from the loop, then the snapshots that fall due; a clash is
        ``IntegrityError``, with nothing written. The library's post-save hooks
        (``_notify``, ``notify``) are not called: nothing here uses them, and a
        store in an ``eventsourcing`` system would not save runs."""
        processing_event = AggregatesFirst()
        processing_event.collect_events(*items)
        with self.reachable(), _lease_errors(run):
            stored = [self.mapper.to_stored_event(e) for e in processing_event.events]
            await saver.insert(stored, lease)
        due = self.due_snapshots(processing_event)
        if due:
            await asyncio.to_thread(self.put_snapshots, due)

    def stored_events(self, run_id: str) -> list[Any]:
        """The run's stored events as recorded (not decoded), oldest first."""
        aggregate_id = parse_run_id(run_id)
        if aggregate_id is None:
            return []
        return list(self.recorder.select_events(aggregate_id))

    def run_events(self, run_id: str, after: int | None = None) -> list[Any]:
        """The run's events, decoded and upcast, oldest first (those after version
        ``after`` only, when given)."""
        aggregate_id = parse_run_id(run_id)
        if aggregate_id is None:
            return []
        return list(self.events.get(aggregate_id, gt=after))

    async def run_events_async(self, run_id: str, after: int | None = None) -> list[Any]:
        """``run_events`` for async code (inline in memory, on a worker thread elsewhere)."""
        return await self._off_loop(RunLog.run_events, self, run_id, after)

    # --------------------------------------------------------------- leases
    def lease(self, run_id: str) -> Lease | None:
        """The run's lease record (None: none, or not a run id)."""
        aggregate_id = parse_run_id(run_id)
        if aggregate_id is None:
            return None
        recorder: LeasingRecorder = self.recorder  # type: ignore[assignment]
        with self.reachable():
            return recorder.select_lease(aggregate_id)

    def holds(self, aggregate_id: UUID) -> bool:
        """Whether this log holds any event of ``aggregate_id`` (a run, an index)."""
        return bool(self.recorder.select_events(aggregate_id, limit=1))

    async def holds_async(self, aggregate_id: UUID) -> bool:
        """``holds`` for async code: on the loop's connection on PostgreSQL."""
        if self._saver is not None:
            with self.reachable():
                return await self._saver.holds(aggregate_id)
        return await self._off_loop(self.holds, aggregate_id)

    async def lease_async(self, run_id: str) -> Lease | None:
        """``lease`` for async code: inline in memory, on the loop's connection on
        PostgreSQL, on a worker thread elsewhere."""
        aggregate_id = parse_run_id(run_id)
        if aggregate_id is None:
            return None
        if self._saver is not None:
            with self.reachable():
                return await self._saver.select_lease(aggregate_id)
        return await self._off_loop(RunLog.lease, self, run_id)

    @contextlib.contextmanager
    def reachable(self) -> Iterator[None]:
        """A database that cannot be reached (every retry spent: a server down, a
        failover longer than a save's deadline) as ``StoreUnavailableError`` naming
        it, on PostgreSQL; what was in doubt was read back first (``pg_async``)."""
        try:
            yield
        except OperationalError as lost:
            if not isinstance(self.address, PostgresAddress):
                raise  # SQLite's (a lock timeout) is not a server away
            msg = f"cannot reach {self.address.label()}: {server_reason(lost)}"
            raise StoreUnavailableError(msg) from lost

    def close(self) -> None:
        """Close the log; on PostgreSQL its connections too if they are its own (the
        store closes a database's shared ones after all its logs)."""
        if self._saver is not None:
            self._saver.close()
        if self.connections is None:
            super().close()
            return
        self.closing.set()
        if self.owns_connections:
            self.connections.close()


def _first_stored_event(recorder: ApplicationRecorder) -> Any | None:
    """The log's first stored event (its notification), or None in an empty log."""
    found = recorder.select_notifications(start=None, limit=1)
    return found[0] if found else None


def _lease_kwargs(lease: LeaseOp | None) -> dict[str, Any]:
    return {} if lease is None else {"lease": lease}


@contextlib.contextmanager
def _lease_errors(run: Run) -> Iterator[None]:
    """A refused lease op as the error a caller acts on."""
    try:
        yield
    except LeaseRefused as refused:
        held = refused.held
        if refused.op.kind == "take" and held is not None:
            raise LeaseHeldError(run.run_id, held.holder, held.expires_at) from None
        raise StaleWriteError(run.run_id, "its lease was taken over by another worker") from None
