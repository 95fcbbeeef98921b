"""Testing kit for users' own suites: a scripted model and crash injection.

Public API (``kuralle_es.testing``). What it offers, and how to prove a tool
of your own runs exactly once under crashes, is in docs/howto/testing.md:

- ``ScriptedModel``: a model that answers from a script, offline.
- ``CrashPlan`` and ``CrashingStore``: a failing disk that kills the turn at a
  chosen journal boundary, the way ``SIGKILL`` would (``Crash`` is a
  ``BaseException``, so nothing catches or journals it).
- ``crash_plans()``: a Hypothesis strategy of crash plans.
- ``ExactlyOnceLedger``: the external system's view, deduplicated by key.
- ``drive_through_crash``: start a flow run on a store that dies, then resume
  it on fresh runtimes and stores until its turn ends.
- ``TestClock``: a clock that moves only when the test says, for
  ``Runtime(clock=...)``: timers and deadlines tested without waiting.
- ``replay_check``: the live runs today's code could not resume (drift or
  non-determinism), found without executing anything; ``check_runs``: every
  live run of a store checked against an application (``kuralle-es check``).
- ``replay_with``: a recorded run re-driven under new code or a new model,
  executing nothing, as a ``Counterfactual`` (docs/howto/evaluating-models.md).
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ._clock import TestClock
from ._crash import Crash
from ._definitions.llm import ModelRequest, ModelResponse, as_response
from ._journal import catalogue as stored
from ._journal.leases import LeaseOp
from ._journal.run import Run
from ._journal.store import RunStore
from ._operations.counterfactual import Counterfactual, ToolCallSummary
from ._operations.replay_check import ReplayFinding, RunCheck, check_runs, replay_check
from ._operations.replay_with import replay_with
from ._runtime.runtime import Runtime
from .errors import KuralleError
from .shapes import ToolCall, TurnResult

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

    from ._definitions.agents import Agent

__all__ = [
    "BOUNDARIES",
    "Boundary",
    "Counterfactual",
    "Crash",
    "CrashPlan",
    "CrashingStore",
    "ExactlyOnceLedger",
    "ReplayFinding",
    "RunCheck",
    "ScriptedModel",
    "TestClock",
    "ToolCallSummary",
    "check_runs",
    "crash_plans",
    "drive_through_crash",
    "replay_check",
    "replay_with",
]

Script = Sequence[ModelResponse | str] | Callable[[ModelRequest], ModelResponse | str]


class ScriptedModel:
    """A model that answers from a script: responses in order, or a function.

    ``requests`` keeps every request it was asked, so a test can check that a
    resume did not ask the model again. It streams (docs/streaming.md): an
    answer's text comes in several deltas, word by word, ``delay`` seconds
    apart; ``stream=False`` answers whole.
    """

    def __init__(
        self, script: Script, id: str = "scripted", *, stream: bool = True, delay: float = 0.0
    ) -> None:
        self._script = script
        self._id = id
        self._next = 0
        self.requests: list[ModelRequest] = []
        self.streaming = stream
        self.delay = delay

    @property
    def id(self) -> str:
        return self._id

    async def respond(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        if callable(self._script):
            answer: Any = self._script(request)
        else:
            if self._next >= len(self._script):
                msg = (
                    f"ScriptedModel {self._id!r} ran out of responses after "
                    f"{len(self._script)}; add a response for this {request.purpose!r} request"
                )
                raise KuralleError(msg)
            answer = self._script[self._next]
            self._next += 1
        return as_response(self._id, answer)

    async def stream(self, request: ModelRequest) -> AsyncIterator[str | ModelResponse]:
        """The scripted answer, its text in deltas (``delay`` apart), then whole."""
        response = await self.respond(request)
        if self.streaming and response.content and response.data is None:
            for piece in _deltas(response.content):
                if self.delay:
                    await asyncio.sleep(self.delay)
                yield piece
        yield response


def _deltas(text: str) -> list[str]:
    """``text`` in the pieces a streaming model might send: a word and the space
    after it each (a single word in two halves), so a test sees several deltas."""
    pieces = re.findall(r"\s*\S+\s*", text) or [text]
    if len(pieces) == 1 and len(text) > 1:
        half = len(text) // 2
        pieces = [text[:half], text[half:]]
    return pieces


# ------------------------------------------------------------------ crashes
Boundary = Literal["before_intent", "after_intent", "after_execute", "after_finalize"]
#: Where a turn can die, in the order a step reaches them.
BOUNDARIES: tuple[Boundary, ...] = (
    "before_intent",
    "after_intent",
    "after_execute",
    "after_finalize",
)


@dataclass
class CrashPlan:
    """Kill the turn the ``nth`` time (1-based) a step reaches ``boundary``.

    ``before_intent``: nothing of the step is saved. ``after_intent``: the
    intent is saved, the effect has not run. ``after_execute``: the effect ran,
    its result is not saved (the step is left in doubt). ``after_finalize``:
    the result is saved, the turn dies before going on. After it fired,
    ``key`` is the idempotency key of the step it hit, and ``in_doubt`` the
    keys of the steps whose results the dying save carried: a step's result
    rides the turn's next save, so a crash before that save leaves the steps
    executed since the last save in doubt (re-run under their keys).
    """

    boundary: Boundary
    nth: int = 1
    seen: int = 0
    fired: bool = False
    key: str | None = None
    in_doubt: list[str] = field(default_factory=list)

    def reach(self, boundary: Boundary, key: str) -> None:
        """Called at each boundary; raises ``Crash`` at the planned one."""
        if self.fired or boundary != self.boundary:
            return
        self.seen += 1
        if self.seen == self.nth:
            self.fired = True
            self.key = key
            raise Crash(f"killed {boundary.replace('_', ' ')} #{self.nth} (step {key[:12]})")


def _step_keys(store: RunStore, run: Run, kinds: tuple[type[Any], ...]) -> list[str]:
    """Keys of the steps that the run's pending events of ``kinds`` touch (a step
    a later pending event archived, such as the end of a turn, is read from the
    run's saved history)."""
    keys: list[str] = []
    intended = {e.index: e.key for e in run.pending_events if isinstance(e, stored.StepIntended)}
    history: Run | None = None
    for pending in run.pending_events:
        if not isinstance(pending, kinds):
            continue
        if isinstance(pending, stored.StepIntended):
            keys.append(pending.key)
        elif pending.index in intended:
            keys.append(intended[pending.index])
        elif pending.index >= run.step_base:
            keys.append(run.step(pending.index)["key"])
        else:
            history = history or store.load_history(run.run_id)
            assert history is not None, "a step's result for a run never saved"
            keys.append(history.step(pending.index)["key"])
    return keys


class CrashingStore(RunStore):
    """A ``RunStore`` over a failing disk: its saves die where ``plan`` says.

    A save that carries a step's intent (``StepStarted``, or ``StepRetried`` for
    a re-execution) is an intent boundary; one that carries its result or error
    is a finalize boundary ("after execute" is the moment just before that
    save). A clock read or a uuid saves intent and result at once. After the
    crash the store saves nothing more, like a dead process. Open it like any
    store: ``CrashingStore.sqlite(path)``, then set ``plan``.
    """

    plan: CrashPlan | None = None

    async def save_run_async(self, run: Run, lease: LeaseOp | None = None) -> None:
        plan = self.plan
        if plan is None:
            await super().save_run_async(run, lease)
            return
        if plan.fired:
            raise Crash("the process is dead: it saves nothing more")
        intents = _step_keys(self, run, stored.STARTS)
        finals = _step_keys(self, run, stored.RESULTS)
        try:
            for key in intents:
                plan.reach("before_intent", key)
            for key in finals:
                plan.reach("after_execute", key)
        except Crash:
            plan.in_doubt = [key for key in finals if key not in intents]
            raise
        await super().save_run_async(run, lease)
        for key in intents:
            plan.reach("after_intent", key)
        for key in finals:
            plan.reach("after_finalize", key)


def crash_plans(max_nth: int = 4) -> SearchStrategy[CrashPlan]:
    """A Hypothesis strategy of crash plans: every boundary, the 1st to ``max_nth`` time.

    A plan whose boundary is never reached that often simply never fires: the
    run is then crash-free, which is a case worth checking too.
    """
    from hypothesis import strategies as st

    return st.builds(
        CrashPlan,
        boundary=st.sampled_from(BOUNDARIES),
        nth=st.integers(min_value=1, max_value=max_nth),
    )


@dataclass
class ExactlyOnceLedger:
    """An external system's log of effects, keyed by ``call.idempotency_key``.

    Call ``record(call)`` from inside a tool, where the effect happens. A
    re-execution after a crash records the same key again; a system that
    deduplicates on the key shows one effect per key, which is what
    ``assert_exactly_once`` checks.
    """

    entries: list[tuple[str, str, Any]] = field(default_factory=list)

    def record(self, call: ToolCall, data: Any = None) -> None:
        self.entries.append((call.idempotency_key, call.tool_name, data))

    def executions(self, key: str) -> int:
        """How many times the effect with this key was executed (retries included)."""
        return sum(1 for entry_key, _, _ in self.entries if entry_key == key)

    def effects(self) -> dict[str, tuple[str, Any]]:
        """One effect per key, as a deduplicating system keeps them (first wins)."""
        kept: dict[str, tuple[str, Any]] = {}
        for key, tool, data in self.entries:
            kept.setdefault(key, (tool, data))
        return kept

    def assert_exactly_once(self, *, expected_keys: Sequence[str] | None = None) -> None:
        """Every re-execution reused its key (same tool, same data), and, when
        ``expected_keys`` is given, exactly those keys were executed."""
        by_key: dict[str, set[str]] = {}
        for key, tool, data in self.entries:
            by_key.setdefault(key, set()).add(f"{tool}:{data!r}")
        clashes = {key: sorted(seen) for key, seen in by_key.items() if len(seen) > 1}
        if clashes:
            msg = f"one idempotency key carried different effects: {clashes}"
            raise AssertionError(msg)
        if expected_keys is not None:
            missing = set(expected_keys) - set(by_key)
            extra = set(by_key) - set(expected_keys)
            if missing or extra:
                counts = Counter(key for key, _, _ in self.entries)
                msg = (
                    f"executed keys differ: missing {sorted(missing)}, unexpected "
                    f"{sorted(extra)} (executions per key: {dict(counts)})"
                )
                raise AssertionError(msg)


async def drive_through_crash(
    agents: Sequence[Agent],
    open_store: Callable[[], RunStore],
    plan: CrashPlan,
    *,
    session_id: str,
    flow_name: str,
    input: str | None = None,
    max_resumes: int = 20,
) -> TurnResult:
    """Start a flow run whose first turn dies at ``plan``, then resume it until a
    turn ends (finished, paused or errored); returns that turn's result.

    ``open_store`` is called once per turn, so each resume sees only what was
    durable: give it a new store over the same database (SQLite, PostgreSQL),
    or the one memory store. The first store must be a ``CrashingStore``; its
    plan is cleared after the crash. Every turn uses one worker name, as a
    restarted worker would, so the crashed turn's lease is its own.
    """
    first = open_store()
    if not isinstance(first, CrashingStore):
        msg = "open_store must return a CrashingStore for the first turn"
        raise TypeError(msg)
    first.plan = plan
    holder = "kuralle-testing-worker"
    handle = Runtime(list(agents), store=first, holder=holder).run(
        session_id, input=input, kind="flow", flow_name=flow_name
    )
    try:
        return await handle.result()
    except Crash:
        run_id = await handle.run_id
    finally:
        first.plan = None
    for _ in range(max_resumes):
        store = open_store()
        try:
            return (
                await Runtime(list(agents), store=store, holder=holder)
                .run(session_id, run_id=run_id)
                .result()
            )
        except Crash:  # a store opened by the caller with its own plan
            continue
    msg = f"run {run_id} did not end within {max_resumes} resumes"
    raise AssertionError(msg)
