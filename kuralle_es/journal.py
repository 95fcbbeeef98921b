"""The funnel: the one place where steps are written.

Every durable effect (``ctx.tool``, ``ctx.now``, ``ctx.uuid``, approvals,
signals, model turns) goes through ``Journal.effect``, which makes one
decision per callsite:

    recorded, but another kind/name  -> NonDeterminismError, execute nothing
    recorded finished                -> return the recorded result
    recorded error                   -> raise the recorded error (frozen)
    recorded running (crash window)  -> execute again with the same key
    absent                           -> persist intent, execute, persist result or error

The journal also owns the run's single writer: one ``asyncio.Lock`` orders
the appends of a ``gather`` batch, and every save is compare-and-set on the
aggregate version (``StaleWriteError`` for a loser).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from .domain import Run, StepData
from .errors import (
    KuralleError,
    NonDeterminismError,
    StaleWriteError,
    SuspendError,
    ToolExecutionError,
    ToolResultTypeError,
    error_fields,
)
from .keys import idempotency_key
from .models import StepError
from .store import RunStore
from .tools import encode_json

__all__ = ["Journal", "decode", "frozen_error"]

#: ``StepError.data`` marker of a result the journal could not hold.
_UNRECORDABLE = "unrecordable_result"


def utcnow() -> datetime:
    return datetime.now(UTC)


def frozen_error(step: StepData) -> ToolExecutionError:
    """The exception a failed step raises, identical on the first pass and on replay."""
    error = step["error"] or {}
    error_type = str(error.get("type", "Exception"))
    message = str(error.get("message", ""))
    data = error.get("data") or {}
    if data.get("reason") == _UNRECORDABLE:
        return ToolResultTypeError(step["name"], error_type, message)
    return ToolExecutionError(step["name"], error_type, message)


class Journal:
    """A run's journal during one turn: lookups, appends, saves, the lease."""

    def __init__(self, store: RunStore, run: Run, *, holder: str, lease_ttl: float) -> None:
        self.store = store
        self.run = run
        self.holder = holder
        self.lease_ttl = timedelta(seconds=lease_ttl)
        self.logical_run = ""
        self._next_callsite = 0
        self._lock = asyncio.Lock()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.broken: StaleWriteError | None = None

    # ------------------------------------------------------------ callsites
    def begin_visit(self, logical_run: str, callsite_base: int) -> None:
        """Count callsites from ``callsite_base`` in ``logical_run`` (a node (re-)entry)."""
        self.logical_run = logical_run
        self._next_callsite = callsite_base

    @property
    def next_callsite(self) -> int:
        return self._next_callsite

    def reserve(self, n: int = 1) -> list[int]:
        """Reserve ``n`` consecutive callsites, in call order."""
        if n < 0:
            msg = f"cannot reserve {n} callsites; pass a count of 0 or more"
            raise ValueError(msg)
        first = self._next_callsite
        self._next_callsite += n
        return list(range(first, first + n))

    # ---------------------------------------------------------------- saves
    async def persist(self) -> None:
        """Save every pending event of the run (renewing the lease on the way)."""
        async with self._lock:
            await self._persist_locked()

    async def _persist_locked(self) -> None:
        run = self.run
        now = utcnow()
        if run.lease_holder == self.holder and run.lease_needs_renewal(now, self.lease_ttl):
            run.take_lease(self.holder, now + self.lease_ttl)
        if self.broken is not None:
            raise self.broken
        if run.pending_events:
            try:
                if self.store.saves_block:
                    await asyncio.to_thread(self.store.save_run, run)
                else:
                    self.store.save_run(run)
            except BaseException as exc:
                # The unsaved events are gone from the aggregate, which is now
                # ahead of the store: no later save of this turn may follow.
                self.broken = StaleWriteError(run.run_id, f"a save of this turn failed: {exc!r}")
                raise

    # ------------------------------------------------------------ in flight
    async def settle(self) -> None:
        """Wait until no effect of this turn is still executing or journaling."""
        await self._idle.wait()

    def _enter(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    # ---------------------------------------------------------------- lookup
    def recorded(
        self, callsite: int, kind: str, name: str, key: str, lane: str = ""
    ) -> StepData | None:
        """The step recorded for this effect, or None; raises on a kind/name mismatch.

        A ``lane`` keeps a second journal slot at the same callsite: a tool's
        approval lives beside the tool's own step, not in place of it.
        """
        steps: list[StepData] = self.run.steps_at(self.logical_run + lane, callsite)
        if not steps:
            return None
        latest = steps[-1]
        if (latest["kind"], latest["name"]) != (kind, name):
            raise NonDeterminismError(
                callsite, f"{latest['kind']} {latest['name']!r}", f"{kind} {name!r}"
            )
        matching = [step for step in steps if step["key"] == key]
        return matching[-1] if matching else None

    def _start(self, callsite: int, kind: str, name: str, key: str, args: Any, lane: str) -> int:
        return self.run.start_step(
            key=key,
            kind=kind,
            name=name,
            callsite=callsite,
            logical_run=self.logical_run + lane,
            args=args,
        )

    def key_for(self, callsite: int, payload: Any, override: str | None = None) -> str:
        return (
            override
            if override is not None
            else idempotency_key(self.logical_run, callsite, payload)
        )

    # ---------------------------------------------------------------- funnel
    async def effect(
        self,
        *,
        callsite: int,
        kind: str,
        name: str,
        key: str,
        args: Any,
        execute: Callable[[], Awaitable[Any]],
        replay: bool = True,
        lane: str = "",
        on_running: Callable[[StepData], Awaitable[None]] | None = None,
        on_executed: Callable[[Any], None] | None = None,
    ) -> Any:
        """Run one effect through the journal; returns its (recorded) JSON result.

        ``on_running`` is consulted when a step was left ``running`` by a crash
        (it may suspend to ask a human instead of re-executing).
        """
        self._enter()
        try:
            async with self._lock:
                step = self.recorded(callsite, kind, name, key, lane)
                if step is not None and replay:
                    if step["status"] == "finished":
                        return decode(step)
                    if step["status"] == "error":
                        raise frozen_error(step)
                    # Running: the process died between intent and result.
                    if on_running is not None and not step["retry_allowed"]:
                        await on_running(step)
                    index = step["index"]
                    self.run.retry_step(index)
                    await self._persist_locked()
                else:
                    index = self._start(callsite, kind, name, key, args, lane)
                    await self._persist_locked()
            try:
                value = await execute()
            except (SuspendError, asyncio.CancelledError):
                raise
            except Exception as exc:
                error = StepError(type=type(exc).__name__, message=str(exc), data=error_fields(exc))
                raise await self._record_failure(index, error) from exc
            try:
                result_json = encode_json(value, f"the result of {kind} {name!r}")
            except (TypeError, KuralleError) as exc:
                error = StepError(
                    type=type(exc).__name__, message=str(exc), data={"reason": _UNRECORDABLE}
                )
                raise await self._record_failure(index, error) from None
            async with self._lock:
                self.run.finish_step(index, result_json)
                await self._persist_locked()
            if on_executed is not None:
                on_executed(json.loads(result_json))
            return json.loads(result_json)
        finally:
            self._leave()

    async def record_value(
        self,
        *,
        callsite: int,
        kind: str,
        name: str,
        key: str,
        args: Any,
        make: Callable[[], Any],
        lane: str = "",
        on_recorded: Callable[[Any], None] | None = None,
    ) -> Any:
        """Journal an effect with no outside side effect (a clock read, a uuid, a
        delivered payload, a model turn) as intent and result in one save.

        Nobody outside can have seen a value that was never saved, so the
        intent-before-execute window buys nothing here and costs a save. If
        ``make`` fails, nothing is journaled and the error propagates: the next
        pass asks again. ``on_recorded`` runs only when the value is new, and
        whatever events it triggers are saved in the same transaction.
        """
        self._enter()
        try:
            async with self._lock:
                step = self.recorded(callsite, kind, name, key, lane)
                if step is not None:
                    if step["status"] == "finished":
                        return decode(step)
                    if step["status"] == "error":
                        raise frozen_error(step)
            value = make()
            if inspect.isawaitable(value):
                value = await value
            result_json = encode_json(value, f"the result of {kind} {name!r}")
            result = json.loads(result_json)
            async with self._lock:
                index = (
                    self._start(callsite, kind, name, key, args, lane)
                    if step is None
                    else step["index"]
                )
                self.run.finish_step(index, result_json)
                if on_recorded is not None:
                    on_recorded(result)
                await self._persist_locked()
            return result
        finally:
            self._leave()

    def answer_in_doubt(self, index: int, answer: dict[str, Any]) -> None:
        """Apply a human's answer to a step left running: retry, resolve or fail.

        Only triggers events; they are saved with the delivery that carried them.
        """
        action = answer["action"]
        step = self.run.steps[index]
        if action == "retry":
            self.run.allow_retry(index)
        elif action == "resolve":
            what = f"the resolved result of {step['kind']} {step['name']!r}"
            self.run.finish_step(index, encode_json(answer.get("result"), what))
        else:
            message = str(answer.get("message") or "failed by a human after a crash")
            self.run.fail_step(index, StepError(type="InDoubtFailed", message=message, data={}))

    async def _record_failure(self, index: int, error: StepError) -> ToolExecutionError:
        async with self._lock:
            self.run.fail_step(index, error)
            await self._persist_locked()
            return frozen_error(self.run.steps[index])


def decode(step: StepData) -> Any:
    """A finished step's recorded result."""
    text = step["result_json"]
    return None if text is None else json.loads(text)
