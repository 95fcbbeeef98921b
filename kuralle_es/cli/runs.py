"""The ``runs`` commands (internal): ``list`` and ``show`` read runs, ``start`` starts a
flow run and drives its first turn, ``fork`` replays a run into a new one, ``usage`` sums
what model and tool calls spent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from datetime import datetime

from .._journal.spending import PRICES_ENV
from ..errors import InvalidArgumentError
from ..shapes import Usage
from ..views import RunSummary, RunViews
from ..views.timeline import format_timeline, read_deliveries
from .common import (
    CliError,
    SubParsers,
    act_on_run,
    add_command,
    add_driving_options,
    add_fork_point,
    add_prices,
    driving_runtime,
    load_agents,
    open_store,
    prices_from_args,
    print_result,
    result_text,
    stored_run,
    turn_result,
)
from .drive import add_runs_resume
from .privacy import add_prune

_COLUMNS = (
    "RUN_ID",
    "STATUS",
    "KIND",
    "SESSION",
    "FLOW@NODE",
    "VERSION",
    "WAITING",
    "LEASE",
    "STEPS",
    "UPDATED",
)


def add_runs(sub: SubParsers) -> None:
    runs = sub.add_parser("runs", help="list and inspect runs; start, resume or fork one")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True, metavar="COMMAND")

    listing = add_command(
        runs_sub, "list", "runs, most recently updated first", _runs_list, app=False
    )
    listing.add_argument(
        "--status",
        choices=("running", "paused", "finished", "error", "aborted"),
        help="only runs in this status",
    )
    listing.add_argument("--session", metavar="ID", help="only the runs of this session")
    listing.add_argument("--flow", metavar="NAME", help="only runs of this flow (ended ones too)")
    listing.add_argument(
        "--limit", type=int, default=100, metavar="N", help="at most N runs (default 100)"
    )
    listing.add_argument("--run-id", metavar="ID", help="only runs whose id starts with ID")
    listing.add_argument(
        "--since", metavar="ISO-8601", help="only runs last updated at or after this (UTC if naive)"
    )
    listing.add_argument(
        "--until", metavar="ISO-8601", help="only runs last updated before this (UTC if naive)"
    )
    listing.add_argument(
        "--after",
        metavar="CURSOR",
        help="the next page: the cursor a full page printed on stderr",
    )
    listing.add_argument("--json", action="store_true", help="a JSON array of RunSummary")

    show = add_command(runs_sub, "show", "a run's journal as a timeline", _runs_show, app=False)
    show.add_argument("run_id", metavar="RUN_ID", help="the run's id")
    show.add_argument("--json", action="store_true", help="the RunState with its steps, as JSON")

    fork = add_command(
        runs_sub,
        "fork",
        "a new run replaying a flow run's steps before N, executing afresh from N (loads --app)",
        _runs_fork,
    )
    add_fork_point(
        fork,
        "the flow run to fork (only read)",
        "the first step to execute afresh: 0 to the run's step count",
    )
    fork.add_argument(
        "--into-session", metavar="ID", help="the fork's session (default: the run's)"
    )
    add_driving_options(fork)
    _add_runs_usage(runs_sub)
    add_prune(runs_sub)
    _add_runs_start(runs_sub)
    add_runs_resume(runs_sub)


def _row(s: RunSummary) -> tuple[str, ...]:
    wait = "-"
    if s.waiting_for is not None:
        wait = f"{s.waiting_for.kind}:{s.waiting_for.name}"
        if s.waiting_for.deadline is not None:
            wait += f" until {s.waiting_for.deadline:%Y-%m-%d %H:%M}"
    where = f"{s.active_flow}@{s.active_node}" if s.active_flow else (s.flow or "-")
    lease = s.lease_holder or "-"
    return (
        s.run_id, s.status, s.kind, s.session_id, where, s.flow_version or "-", wait, lease,
        str(s.step_count), f"{s.updated_at:%Y-%m-%d %H:%M:%S}",
    )  # fmt: skip


def format_runs(summaries: Sequence[RunSummary], *, tty: bool) -> str:
    """A table for a terminal; tab-separated lines (header first) for a pipe."""
    rows = [_COLUMNS, *(_row(s) for s in summaries)]
    if not tty:
        return "\n".join("\t".join(r) for r in rows)
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"{len(summaries)} run(s)")
    return "\n".join(lines)


async def _runs_list(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise CliError(f"--limit must be at least 1, got {args.limit}")
    with open_store(args, must_exist=True, read_only=True) as store:
        try:
            summaries = await RunViews(store).list_runs(
                status=args.status, session_id=args.session, flow=args.flow, limit=args.limit,
                run_id=args.run_id, since=args.since, until=args.until, after=args.after,
            )  # fmt: skip
        except InvalidArgumentError as e:
            raise CliError(str(e).replace("after must", "--after must")) from None
    if args.json:
        print(json.dumps([s.model_dump(mode="json") for s in summaries], indent=2))
    else:
        print(format_runs(summaries, tty=sys.stdout.isatty()))
    if len(summaries) == args.limit:
        print(f"more may follow: --after {summaries[-1].cursor}", file=sys.stderr)
    return 0


async def _runs_show(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True, read_only=True) as store:
        run = await stored_run(store, args.run_id, history=True)
        if run is None:
            return 1
        state, steps = run.to_state(await store.lease_async(run.run_id)), run.step_records()
        deliveries = await asyncio.to_thread(read_deliveries, store, args.run_id)
    if args.json:
        shown = {
            **state.model_dump(mode="json"),
            "steps": [s.model_dump(mode="json") for s in steps],
        }
        print(json.dumps(shown, indent=2))
    else:
        print(format_timeline(state, steps, deliveries))
    return 0


async def _runs_fork(args: argparse.Namespace) -> int:
    return await act_on_run(
        args,
        lambda runtime, session_id: runtime.fork(
            args.run_id, session_id, args.at_step, into_session=args.into_session
        ),
    )


def _add_runs_start(runs_sub: SubParsers) -> None:
    start = add_command(
        runs_sub,
        "start",
        "start a flow run and drive its first turn here, to its first pause or its end "
        "(loads --app); exit 0 finished or paused, 1 refused or errored, 2 bad usage",
        _runs_start,
    )
    start.add_argument(
        "--flow", required=True, metavar="NAME", help="the flow to run (an --app agent's)"
    )
    start.add_argument(
        "--session", required=True, metavar="ID", help="the session the run belongs to"
    )
    start.add_argument(
        "--input",
        metavar="TEXT",
        help=(
            "the user's first message; for a flow with typed input (define_flow(..., "
            "input=Model)) a JSON object that Model validates; - reads it from stdin"
        ),
    )
    start.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="a retried start with this key (same session and flow) returns the first run",
    )
    start.add_argument("--json", action="store_true", help="the TurnResult as JSON")
    add_driving_options(start)


async def _runs_start(args: argparse.Namespace) -> int:
    text = args.input
    if text == "-":
        text = await asyncio.to_thread(sys.stdin.read)
    agents = load_agents(args.app)  # before the store: a bad --app creates no database
    with open_store(args) as store:
        handle = driving_runtime(args, agents, store).run(
            args.session,
            input=text,
            kind="flow",
            flow_name=args.flow,
            idempotency_key=args.idempotency_key,
        )
        result = await turn_result(handle)
    if args.json:
        print_result(result)
    else:
        print(result_text(result))
    return 0


# -------------------------------------------------------------- runs usage
def _add_runs_usage(runs_sub: SubParsers) -> None:
    usage = add_command(
        runs_sub,
        "usage",
        "what model and tool calls spent (every attempt), from the run views",
        _runs_usage,
    )
    usage.add_argument("--run", metavar="ID", help="only this run's steps")
    usage.add_argument("--session", metavar="ID", help="only the steps of this session's runs")
    usage.add_argument("--agent", metavar="NAME", help="only steps made under this agent")
    usage.add_argument(
        "--since",
        metavar="ISO-8601",
        help="only steps started at or after this time (UTC if naive)",
    )
    add_prices(usage)
    usage.add_argument("--json", action="store_true", help="one JSON object (the Usage fields)")


def format_usage(usage: Usage) -> str:
    """``Usage`` as aligned lines for a person."""
    cost = "unknown (no price for a model: --prices or " + PRICES_ENV + ")"
    if usage.cost is not None:
        cost = f"{usage.cost:.6f}".rstrip("0").rstrip(".") if usage.cost else "0"
    rows = (
        ("model calls", str(usage.model_calls)),
        ("input tokens", str(usage.input_tokens)),
        ("output tokens", str(usage.output_tokens)),
        ("total tokens", str(usage.total_tokens)),
        ("tool calls", str(usage.tool_calls)),
        ("cost", cost),
    )
    return "\n".join(f"{name:<14}{value}" for name, value in rows)


async def _runs_usage(args: argparse.Namespace) -> int:
    # Read-only: never imports --app; the sums come from the views, not the journals.
    prices = prices_from_args(args)
    if args.since is not None:
        try:
            datetime.fromisoformat(args.since)
        except ValueError:
            raise CliError(
                f"--since must be an ISO-8601 time such as 2025-01-31T09:00:00Z, got {args.since!r}"
            ) from None
    with open_store(args, must_exist=True) as store:
        usage = await RunViews(store, prices=prices).usage(
            run_id=args.run, session_id=args.session, agent_id=args.agent, since=args.since
        )
    if args.json:
        print(json.dumps(usage.model_dump(mode="json")))
    else:
        print(format_usage(usage))
    return 0
