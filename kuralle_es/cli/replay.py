"""``kuralle-es replay`` (internal): recorded runs re-driven under --app, summarised.

One run (``RUN_ID``) or many (``--since``, ``--flow``, ``--session``, at most
``--limit``): each is re-driven by ``kuralle_es.testing.replay_with`` under
the agents of ``--app``, executing nothing and writing nothing to the runs,
and the summary says how many would decide differently and how the cost
would change (docs/howto/evaluating-models.md). ``--json`` prints one
object for CI: ``runs`` (a ``Counterfactual`` each, or the reason a run was
skipped) and ``summary``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from .._clock import as_utc
from .._definitions.agents import Agent
from .._journal.spending import Prices
from .._journal.store import RunStore
from .._operations.counterfactual import Counterfactual
from .._operations.replay_with import replay_with
from ..errors import KuralleError
from ..views import RunSummary, RunViews
from .common import CliError, load_agents, open_store, prices_from_args, stored_run

__all__ = ["ReplaySummary", "replay_runs", "summarise"]

#: How many runs are re-driven at once.
_AT_ONCE = 8


class Skipped(BaseModel):
    """A run that could not be re-driven, and why."""

    run_id: str
    skipped: str


class ReplaySummary(BaseModel):
    """What the re-driven runs add up to."""

    runs: int
    decided_differently: int
    diverged: int
    would_execute: int
    skipped: int
    model_calls_before: int
    model_calls_after: int
    total_tokens_before: int
    total_tokens_after: int
    #: None unless every run's cost is known on both sides (--prices).
    cost_before: float | None
    cost_after: float | None
    cost_change: float | None


def _sum(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def summarise(results: Sequence[Counterfactual | Skipped]) -> ReplaySummary:
    done = [r for r in results if isinstance(r, Counterfactual)]
    before = _sum([r.cost_before for r in done])
    after = _sum([r.cost_after for r in done])
    return ReplaySummary(
        runs=len(done),
        decided_differently=sum(r.decided_differently for r in done),
        diverged=sum(r.diverged_at is not None for r in done),
        would_execute=sum(bool(r.would_execute) for r in done),
        skipped=len(results) - len(done),
        model_calls_before=sum(r.usage_before.model_calls for r in done),
        model_calls_after=sum(r.usage_after.model_calls for r in done),
        total_tokens_before=sum(r.usage_before.total_tokens for r in done),
        total_tokens_after=sum(r.usage_after.total_tokens for r in done),
        cost_before=before,
        cost_after=after,
        cost_change=None if before is None or after is None else after - before,
    )


async def replay_runs(
    store: RunStore,
    runs: Sequence[tuple[str, str]],
    agents: Sequence[Agent],
    prices: Prices | None,
) -> list[Counterfactual | Skipped]:
    """Re-drive each ``(run_id, session_id)``, a few at once, in the order given."""
    gate = asyncio.Semaphore(_AT_ONCE)

    async def one(run_id: str, session_id: str) -> Counterfactual | Skipped:
        async with gate:
            try:
                return await replay_with(store, run_id, session_id, agents=agents, prices=prices)
            except KuralleError as e:
                return Skipped(run_id=run_id, skipped=f"{type(e).__name__}: {e}")

    return list(await asyncio.gather(*(one(r, s) for r, s in runs)))


def _since(text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise CliError(
            f"--since must be an ISO-8601 time such as 2025-01-31T09:00:00Z, got {text!r}"
        ) from None
    return as_utc(at)


async def _selected(store: RunStore, args: argparse.Namespace) -> list[tuple[str, str]]:
    """The runs the command line names: ``RUN_ID``, or those the filters select."""
    if args.run_id is not None:
        run = await stored_run(store, args.run_id)
        return [] if run is None else [(run.run_id, run.session_id)]
    since = _since(args.since)
    found: list[RunSummary] = await RunViews(store).list_runs(
        session_id=args.session, flow=args.flow, limit=args.limit
    )
    chosen = [s for s in found if since is None or s.updated_at >= since]
    return [(s.run_id, s.session_id) for s in reversed(chosen)]  # oldest first


def _money(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.6f}".rstrip("0").rstrip(".") or "0"


def _line(result: Counterfactual | Skipped) -> str:
    if isinstance(result, Skipped):
        return f"skipped   {result.run_id}  {result.skipped}"
    verdict = "differs" if result.decided_differently else "same"
    line = (
        f"{verdict:<9} {result.run_id}  {result.status_before} -> {result.status_after}"
        f"  cost {_money(result.cost_before)} -> {_money(result.cost_after)}"
    )
    if result.divergence:
        line += f"  {result.divergence}"
    for call in result.would_execute:
        line += f"; would execute {call.name} {json.dumps(call.args, ensure_ascii=False)}"
    return line


def _summary_text(summary: ReplaySummary) -> str:
    cost = (
        f"cost {_money(summary.cost_before)} -> {_money(summary.cost_after)} "
        f"({'+' if (summary.cost_change or 0) >= 0 else ''}{_money(summary.cost_change)})"
        if summary.cost_change is not None
        else "cost unknown (give --prices or KURALLE_PRICES)"
    )
    return (
        f"{summary.runs} run(s) replayed: {summary.decided_differently} would decide "
        f"differently ({summary.diverged} diverged, {summary.would_execute} would execute a "
        f"call the recording lacks), {summary.skipped} skipped; tokens "
        f"{summary.total_tokens_before} -> {summary.total_tokens_after}; {cost}"
    )


async def replay_command(args: argparse.Namespace) -> int:
    agents = load_agents(args.app)
    prices = prices_from_args(args)
    with open_store(args, must_exist=True) as store:
        runs = await _selected(store, args)
        if args.run_id is not None and not runs:
            raise CliError(f"no run {args.run_id} in the store")
        results = await replay_runs(store, runs, agents, prices)
    summary = summarise(results)
    if args.json:
        document: dict[str, Any] = {
            "runs": [r.model_dump(mode="json") for r in results],
            "summary": summary.model_dump(mode="json"),
        }
        print(json.dumps(document, indent=2, ensure_ascii=False))
    else:
        for result in results:
            print(_line(result))
        print(_summary_text(summary))
    return 0
