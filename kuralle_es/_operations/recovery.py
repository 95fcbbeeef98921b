"""Recovery and sweeps (API): orphaned runs, expired deadlines, due timers, and the sweeper.

Something has to come back for a run when nobody else will:

- a ``running`` run whose lease expired is an **orphan** (its worker died
  mid-turn): ``recover_orphaned_runs`` drives it again through the same
  resume path a plain ``runtime.run(session_id, run_id=...)`` takes, so its
  journal replays and a step left ``running`` follows its tool's
  ``on_in_doubt``;
- a paused run whose wait's deadline passed gets the deadline deny
  (``sweep_deadlines``): an approval reads as denied, ``ctx.signal`` returns
  the deny payload, a ``ctx.receive`` raises ``DeadlineExpiredError``;
- a run paused on a durable sleep (``ctx.sleep``) is woken once its wake
  time came (``fire_timers``);
- a parent run paused for a child run that ended, whose end nobody handed
  to it (the process that ended the child died first), goes on
  (``recover_orphaned_runs``, docs/child-runs.md).
- only when asked (``resume_in_doubt_runs``, off in the sweeper by default),
  a run in ``error`` whose last step is in doubt (a model call that failed,
  its answer never recorded) is resumed once it has been left alone a while:
  the step runs again, what was recorded replays.

Candidates come from the run views (``RunViews.orphaned_runs``,
``expired_deadlines``, ``due_timers``), never from a scan of the streams;
each query first applies every event stored before it, so a sweep sees a
run saved just before it started. Every sweep then re-checks the run itself
in its turn's compare-and-set opening, so several sweepers over one store
(threads, processes, machines) drive each run once: a second sweeper's
recovery finds a live lease (``LeaseHeldError``) or loses the opening save,
its deadline deny is a duplicate ``signal_id`` (``"deadline:" + request_id``),
its wake finds the timer gone. A run that refuses or errors is logged and
skipped; each sweep returns the ids of the runs *it* drove to their next
stop (a pause, the end, or an error). README.md ("Recovery, sweeps and
durable sleep") and docs/howto/recovery.md say how to run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from .._clock import SYSTEM_CLOCK, FixedClock
from .._durations import positive_seconds
from .._journal.wait import DeadlineDeny
from .._runtime.children import ChildEnded
from .._runtime.handle import TurnSink
from .._runtime.observability import LOGGER_NAME, log_event
from .._runtime.runtime import Runtime
from .._runtime.turn import drive_turn
from .._runtime.turn_calls import Command, Deliver, Recover, ResumeInDoubt, TurnEnv, Wake
from ..errors import InvalidArgumentError
from ..shapes import SignalDelivery, StreamPart
from ..views import RunSummary

__all__ = [
    "DEADLINE_ACTOR",
    "Scheduler",
    "SweepJob",
    "SweepReport",
    "Sweeper",
    "create_sweep_job_runner",
    "fire_timers",
    "recover_orphaned_runs",
    "resume_in_doubt_runs",
    "start_run_sweeper",
    "sweep_deadlines",
]

#: The ``actor`` of a deadline deny in the journal (its payload says ``"by": "deadline"``).
DEADLINE_ACTOR = "deadline"
#: How many runs one sweep drives at once.
CONCURRENCY = 8
#: The parts that close a turn: the run reached its next stop and that was saved.
_CLOSING = frozenset({"paused", "finished", "error"})

logger = logging.getLogger(LOGGER_NAME)


class _Watch(TurnSink):
    """A sweep's turn sink: keeps nothing but how the turn closed the run, if it did."""

    def __init__(self) -> None:
        super().__init__()
        self.closed_as: str | None = None

    def emit(self, part: StreamPart) -> None:
        if part.type in _CLOSING:
            self.closed_as = part.type


def _swept_at(runtime: Runtime, now: datetime | None) -> tuple[TurnEnv, datetime]:
    """What a sweep's turns run with, and the moment the sweep counts from: the
    runtime's clock, or ``now`` when given (as a clock that reads ``now``)."""
    if now is None:
        return runtime.env, runtime.clock.now()
    clock = FixedClock(now)
    return dataclasses.replace(runtime.env, clock=clock), clock.at


async def _drive(
    runtime: Runtime, env: TurnEnv, command: Command, run_id: str, done: str, skipped: str
) -> bool:
    """Drive one turn of ``command``; whether this sweeper drove the run to its next stop.

    A turn that found nothing to do (another sweeper was first) is quiet; a
    refusal or an error before the run's close is logged and skipped.
    """
    sink = _Watch()
    error: Exception | None = None
    try:
        await drive_turn(env, command, sink)
    except Exception as exc:
        error = exc
    if sink.closed_as is None:
        if error is not None:
            log_event(
                skipped,
                run_id,
                holder=runtime.holder,
                reason=type(error).__name__,
            )
            logger.debug("sweep of run %s skipped", run_id, exc_info=error)
        return False
    log_event(done, run_id, status=sink.closed_as, holder=runtime.holder)
    return True


async def _drive_all(
    runtime: Runtime,
    env: TurnEnv,
    found: Sequence[RunSummary],
    command: Callable[[RunSummary], Command | None],
    done: str,
    skipped: str,
) -> list[str]:
    """Drive the runs ``found`` (at most ``CONCURRENCY`` at once), in their order."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(summary: RunSummary) -> bool:
        made = command(summary)
        if made is None:
            return False
        async with gate:
            return await _drive(runtime, env, made, summary.run_id, done, skipped)

    driven = await asyncio.gather(*(one(s) for s in found))
    return [s.run_id for s, ok in zip(found, driven, strict=True) if ok]


# ------------------------------------------------------------------- sweeps
async def recover_orphaned_runs(runtime: Runtime, now: datetime | None = None) -> list[str]:
    """Drive every orphan (a ``running`` run whose lease expired before ``now``) again.

    ``now`` only picks the candidates from the views; by default it is the
    later of the runtime's clock and this machine's (a lease's expiry is
    written by the store's clock, so a test clock standing still must not
    hide a real orphan). Whether a lease expired is the store's clock's to
    say, in the take that opens each recovery, so a run whose lease is live
    by the store's clock is never taken, however far ahead ``now`` is. Each orphan is
    re-entered through the resume path with this runtime's holder as its new
    lease holder, and driven to its next pause or its end. A run another
    worker holds (``LeaseHeldError``), or that refuses (``FlowDriftError``,
    ...) or errors, is logged and skipped.

    Then every parent run paused for a child run that has ended gets the
    child's end (the process that ended the child died before it handed the
    end over) and goes on. Returns the ids of the runs this call drove.
    """
    env, at = _swept_at(runtime, now)
    if now is None:
        at = max(at, SYSTEM_CLOCK.now())
    orphans = await runtime.views.orphaned_runs(at)
    recovered = await _drive_all(
        runtime,
        env,
        orphans,
        lambda s: Recover(s.session_id, s.run_id),
        "run recovered",
        "recovery skipped",
    )
    parents = await runtime.views.child_waits()
    handed = await _drive_all(
        runtime, env, parents, _child_end, "child end handed over", "hand-over skipped"
    )
    return recovered + [run_id for run_id in handed if run_id not in recovered]


def _child_end(summary: RunSummary) -> Command | None:
    wait = summary.waiting_for
    if wait is None or wait.kind != "child" or wait.child_run_id is None:
        return None
    return ChildEnded(summary.session_id, summary.run_id, wait.child_run_id)


def _deadline_deny(summary: RunSummary) -> Command | None:
    wait = summary.waiting_for
    if wait is None or wait.kind in ("timer", "input"):
        return None  # a sleep is woken by fire_timers; input has no deadline
    delivery = SignalDelivery(
        signal_id=f"deadline:{wait.request_id}",
        name=wait.name,
        payload=DeadlineDeny.payload(),
        request_id=wait.request_id,
        actor=DEADLINE_ACTOR,
    )
    return Deliver(summary.session_id, summary.run_id, delivery, None, from_sweeper=True)


async def sweep_deadlines(runtime: Runtime, now: datetime | None = None) -> list[str]:
    """Deliver the deadline deny to every paused run whose wait's deadline passed
    (a message wait's receive then raises ``DeadlineExpiredError``).

    The payload is ``{"approved": False, "denied": True, "by": "deadline",
    "reason": "deadline-expired"}`` with ``signal_id = "deadline:" +
    request_id``, so a second sweeper's delivery is a duplicate (a no-op).
    Durable sleeps are skipped (``fire_timers`` wakes them). Returns the ids
    of the runs this call drove.
    """
    env, at = _swept_at(runtime, now)
    expired = await runtime.views.expired_deadlines(at)
    return await _drive_all(runtime, env, expired, _deadline_deny, "run swept", "sweep skipped")


def _wake(summary: RunSummary) -> Command | None:
    wait = summary.waiting_for
    if wait is None or wait.kind != "timer":
        return None
    return Wake(summary.session_id, summary.run_id, wait.request_id)


async def fire_timers(runtime: Runtime, now: datetime | None = None) -> list[str]:
    """Wake every run paused on a durable sleep whose wake time is at or before ``now``.

    The wake is compare-and-set on the timer's wait, so a timer is fired once
    whoever else sweeps; the run re-executes its node, where ``ctx.sleep``
    now returns. Returns the ids of the runs this call drove.
    """
    env, at = _swept_at(runtime, now)
    due = await runtime.views.due_timers(at)
    return await _drive_all(runtime, env, due, _wake, "timer fired", "wake skipped")


#: How long (seconds) a run in doubt is left alone before ``resume_in_doubt_runs``
#: resumes it: a failure that lasts (a model provider down) costs one try per
#: this long, not one per sweep pass.
IN_DOUBT_IDLE = 60.0


async def resume_in_doubt_runs(
    runtime: Runtime, idle_for: float = IN_DOUBT_IDLE, now: datetime | None = None
) -> list[str]:
    """Resume every run in ``error`` whose last step is in doubt and that nothing
    changed for ``idle_for`` seconds: ``runtime.run(session_id, run_id=...)``.

    A step in doubt is one whose outcome was never recorded (a model call that
    failed): the resume runs it again under the same key, replays everything
    recorded before it, and drives the run to its next stop. Frozen errors stay
    frozen; a run that errs again waits ``idle_for`` more. Why the sweeper does
    not do this by default: the step's effect runs again without a human
    looking (a paid model call, a tool whose outcome is unknown), and an error
    that is not transient repeats every ``idle_for``. Returns the ids of the
    runs this call drove.
    """
    idle_for = positive_seconds(idle_for, "idle_for", zero_ok=True)
    env, at = _swept_at(runtime, now)
    found = await runtime.views.in_doubt_runs(at - timedelta(seconds=idle_for))
    return await _drive_all(
        runtime,
        env,
        found,
        lambda s: ResumeInDoubt(s.session_id, s.run_id),
        "run resumed",
        "resume skipped",
    )


# ---------------------------------------------------------------- the job
@dataclass(frozen=True)
class SweepReport:
    """What one pass of the sweeper drove: run ids per sweep (``resumed``: runs in
    doubt, when the job resumes them)."""

    recovered: list[str] = field(default_factory=list)
    swept: list[str] = field(default_factory=list)
    woken: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)

    @property
    def driven(self) -> list[str]:
        """Every run the pass drove, in sweep order."""
        return [*self.recovered, *self.swept, *self.woken, *self.resumed]


class SweepJob:
    """One pass of the sweeps over a runtime's store, as an async callable.

    ``await job()`` recovers orphans, then denies expired deadlines, then
    fires due timers, then (with ``resume_in_doubt`` seconds) resumes the runs
    in doubt left alone that long, and returns a ``SweepReport``.
    """

    def __init__(self, runtime: Runtime, resume_in_doubt: float | None = None) -> None:
        self.runtime = runtime
        self.resume_in_doubt = resume_in_doubt

    async def __call__(self) -> SweepReport:
        recovered = await recover_orphaned_runs(self.runtime)
        swept = await sweep_deadlines(self.runtime)
        woken = await fire_timers(self.runtime)
        resumed = []
        if self.resume_in_doubt is not None:
            resumed = await resume_in_doubt_runs(self.runtime, self.resume_in_doubt)
        return SweepReport(recovered, swept, woken, resumed)


def create_sweep_job_runner(runtime: Runtime, *, resume_in_doubt: float | None = None) -> SweepJob:
    """The recurring job of the sweeper: an async callable running the three sweeps,
    and ``resume_in_doubt_runs`` with that many seconds of ``idle_for`` when given
    (None, the default: runs in doubt wait for a person; see that function)."""
    if not isinstance(runtime, Runtime):
        msg = f"create_sweep_job_runner takes a Runtime, got {type(runtime).__name__}"
        raise InvalidArgumentError(msg)
    if resume_in_doubt is not None:
        resume_in_doubt = positive_seconds(resume_in_doubt, "resume_in_doubt", zero_ok=True)
    return SweepJob(runtime, resume_in_doubt)


# ------------------------------------------------------------ the sweeper
Job = Callable[[], Awaitable[Any]]


@runtime_checkable
class Scheduler(Protocol):
    """Something that runs a job on a schedule (an adapter over your own scheduler).

    ``every(interval, job)`` starts calling ``await job()`` about every
    ``interval`` seconds, one call at a time, and returns a function that
    stops it (which may return an awaitable that completes once stopped).
    """

    def every(self, interval: float, job: Job) -> Callable[[], Any]: ...


class Sweeper:
    """A running sweeper, as ``start_run_sweeper`` returns it.

    ``stop()`` asks it to stop: the pass in progress finishes (its turns end
    at their next stop, nothing is cut off mid-effect) and no pass starts
    after it. ``await wait()`` returns once it stopped; ``await aclose()`` is
    both. ``passes`` counts finished passes and ``last`` is the latest report.
    """

    def __init__(self, job: Job, interval: float, scheduler: Scheduler | None) -> None:
        self.interval = interval
        self.passes = 0
        self.last: Any = None
        self._job = job
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._cancel: Callable[[], Any] | None = None
        self._cancelled: Any = None
        if scheduler is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())
        else:
            self._cancel = scheduler.every(interval, self._one_pass)

    @property
    def stopped(self) -> bool:
        if self._task is not None:
            return self._task.done()
        return self._stopping.is_set()

    def stop(self) -> None:
        """Stop after the pass in progress (safe to call from a signal handler, twice)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._cancel is not None:
            self._cancelled = self._cancel()

    async def wait(self) -> None:
        """Return once the sweeper stopped (after ``stop()``)."""
        if self._task is not None:
            await asyncio.shield(self._task)
            return
        await self._stopping.wait()
        if inspect.isawaitable(self._cancelled):
            await self._cancelled
            self._cancelled = None

    async def aclose(self) -> None:
        """``stop()``, then ``wait()``."""
        self.stop()
        await self.wait()

    async def _one_pass(self) -> Any:
        if self._stopping.is_set():
            return None
        try:
            self.last = await self._job()
        except Exception:
            logger.exception("a sweep pass failed; the next pass tries again")
            return None
        self.passes += 1
        return self.last

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            await self._one_pass()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.interval)


def start_run_sweeper(
    scheduler: Scheduler | Runtime | Job | None = None,
    interval: float = 5.0,
    *,
    runtime: Runtime | None = None,
) -> Sweeper:
    """Run the three sweeps about every ``interval`` seconds; returns the ``Sweeper``.

    ``scheduler`` is what runs the job: ``None`` (an asyncio task on the
    running loop; pass ``runtime=``), a ``Scheduler`` (pass ``runtime=``), or,
    as a shorthand for an asyncio task, the ``Runtime`` itself or a job made
    by ``create_sweep_job_runner`` (any async callable). Call it from async
    code. ``InvalidArgumentError`` for a bad interval or a missing runtime.
    """
    interval = positive_seconds(interval, "interval")
    runner: Scheduler | None = None
    if isinstance(scheduler, Runtime):
        job: Job = create_sweep_job_runner(scheduler)
    elif isinstance(scheduler, Scheduler) or scheduler is None:
        if runtime is None:
            msg = "start_run_sweeper needs the runtime to sweep: pass runtime=..."
            raise InvalidArgumentError(msg)
        runner = scheduler
        job = create_sweep_job_runner(runtime)
    elif callable(scheduler):
        job = scheduler
    else:
        msg = (
            "scheduler must be None, a Scheduler (with every(interval, job)), a Runtime "
            f"or a sweep job; got {type(scheduler).__name__}"
        )
        raise InvalidArgumentError(msg)
    if runner is None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            msg = "start_run_sweeper(None, ...) runs on the event loop: call it from async code"
            raise InvalidArgumentError(msg) from None
    return Sweeper(job, interval, runner)
