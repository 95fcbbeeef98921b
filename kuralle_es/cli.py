"""The ``kuralle-es`` command: the demo, and operating runs from a shell (API).

The store: ``--store URL`` (or ``KURALLE_STORE``): ``postgresql://user[:pw]@host[:port]/db``,
``sqlite:///relative.db``, ``sqlite:////absolute.db`` or ``memory:``; ``--sqlite FILE`` is
short for a SQLite URL; without either, the ``eventsourcing`` variables
(``PERSISTENCE_MODULE``, ``SQLITE_DBNAME``, ``POSTGRES_*``). Commands that
drive a run load the agents that define its flows from ``--app module:attr``
(or ``KURALLE_APP``), importable from the current folder; read-only commands
never import it. A store that cannot be reached is one line and exit code 2.

Each command is one ``_add_*`` function (its parser and its handler) listed
in ``COMMANDS``: adding a command is adding a function to that list.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal as signals
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from .agents import Agent
from .cancel import cancel_run
from .domain import Run
from .errors import KuralleError
from .examples import approval_notifier, refund
from .models import TurnResult
from .observability import LOGGER_NAME
from .recovery import fire_timers, recover_orphaned_runs, start_run_sweeper, sweep_deadlines
from .runtime import Runtime
from .store import RunStore
from .store_url import (
    STORE_ENV,
    StoreUnavailableError,
    open_store_from_env,
    open_store_url,
)
from .timeline import format_timeline, read_deliveries
from .views import RunSummary, RunViews
from .views.api import open_backend
from .views.projector import DEFAULT_BATCH, follow

__all__ = ["COMMANDS", "main"]

DEFAULT_APP = "kuralle_es.examples.refund:build_agent"
APP_ENV = "KURALLE_APP"

Handler = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
SubParsers = Any  # argparse's private _SubParsersAction


# ------------------------------------------------------------------ shared
def _version() -> str:
    try:
        return version("kuralle_es")
    except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
        return "unknown"


def open_store(args: argparse.Namespace, *, must_exist: bool = False) -> RunStore:
    """The store the options (or the environment) name; ``StoreUnavailableError`` if away."""
    if getattr(args, "store", None):
        return open_store_url(args.store, must_exist=must_exist)
    if getattr(args, "sqlite", None):
        return open_store_url(f"sqlite:///{args.sqlite}", must_exist=must_exist)
    return open_store_from_env(must_exist=must_exist)


def load_agents(spec: str) -> list[Agent]:
    """The agents ``module:attribute`` names (a list, one agent, or a callable returning them)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise _CliError(f"--app must look like module:attribute, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the user's app lives in the current folder
    try:
        target: Any = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise _CliError(f"cannot load --app {spec}: {e}") from None
    if callable(target) and not isinstance(target, Agent):
        target = target()
    agents = [target] if isinstance(target, Agent) else list(target)
    if not all(isinstance(a, Agent) for a in agents):
        raise _CliError(f"{spec} is not an agent, a list of agents, or a callable returning them")
    return agents


class _CliError(KuralleError):
    """A bad command line: printed as one line, exit code 2."""


async def _stored_run(store: RunStore, run_id: str, *, history: bool = False) -> Run | None:
    """The run (an operator acts on its session, read from the store), or None, said on
    stderr; with ``history``, folded with every step it journaled (``load_history``)."""
    run = await store.load_async(run_id, history=history)
    if run is None:
        print(f"kuralle-es: no run {run_id} in this store", file=sys.stderr)
    return run


def _print_result(result: TurnResult) -> None:
    print(json.dumps(result.model_dump(mode="json"), indent=2))


def _common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The store and app options, accepted before or after the command."""
    default = None if top else argparse.SUPPRESS
    parser.add_argument(
        "--store",
        default=default,
        metavar="URL",
        help=(
            "postgresql://user[:pw]@host[:port]/db, sqlite:///file.db (sqlite:////abs.db) or "
            f"memory: (env {STORE_ENV}; else PERSISTENCE_MODULE and its variables)"
        ),
    )
    parser.add_argument(
        "--sqlite", default=default, metavar="FILE", help="SQLite file: short for --store"
    )
    parser.add_argument(
        "--app",
        default=os.environ.get(APP_ENV, DEFAULT_APP) if top else argparse.SUPPRESS,
        metavar="MODULE:ATTR",
        help=f"the agents of commands that drive runs (env {APP_ENV}; default: the refund demo)",
    )


def _command(sub: SubParsers, name: str, help: str, handler: Handler) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    _common(parser, top=False)
    parser.set_defaults(handler=handler)
    return parser


# -------------------------------------------------------------------- demo
def _add_demo(sub: SubParsers) -> None:
    demo = _command(sub, "demo", "the durable refund flow on SQLite, offline", _demo)
    demo.add_argument(
        "--dir",
        default=os.environ.get("KURALLE_DEMO_DIR", ".demo"),
        help="where the demo's SQLite file and ledger go (env KURALLE_DEMO_DIR; default .demo)",
    )
    demo.add_argument("--model", help="'openai:gpt-4o-mini' for a real model (OPENAI_API_KEY)")


def _run_process(command: list[str]) -> None:
    done = subprocess.run(
        command, check=True, env=os.environ.copy(), capture_output=True, text=True
    )
    result = TurnResult.model_validate_json(done.stdout)
    print(f"   that process's turn: status={result.status} output={result.output!r}")


async def _turn(runtime: Runtime, handle_args: dict[str, Any]) -> TurnResult:
    handle = runtime.run(**handle_args)
    async for part in handle:
        if part.type == "text":
            print(f"   assistant: {part.text}")
        elif part.type in ("tool-call", "tool-result"):
            detail = part.args if part.type == "tool-call" else part.result
            print(f"   {part.type}: {part.tool_name} {json.dumps(detail)}")
        elif part.type == "paused" and part.waiting_for is not None:
            print(f"   paused: waiting for {part.waiting_for.kind} ({part.waiting_for.title})")
    return await handle.result()


async def _demo(args: argparse.Namespace) -> int:
    """The durable refund flow on SQLite, offline, resumed by a second process."""
    named = getattr(args, "store", None) or getattr(args, "sqlite", None)
    if named:
        # The demo makes its own SQLite file; saying nothing would leave a user
        # looking for the demo's run in the store they named.
        raise _CliError(
            f"demo makes its own SQLite file under --dir ({args.dir}/refund.db) and takes no "
            f"--store or --sqlite (got {named!r}); drop it, and point `kuralle-es runs list` "
            f"at sqlite:///{args.dir}/refund.db afterwards"
        )
    workdir = Path(args.dir)
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    db = workdir / "refund.db"
    ledger = workdir / "ledger.jsonl"
    for path in (db, ledger):
        path.unlink(missing_ok=True)
    os.environ[refund.LEDGER_ENV] = str(ledger)
    if args.model:
        os.environ[refund.MODEL_ENV] = args.model

    print(f"== process {os.getpid()}: a customer asks for a refund (SQLite: {db})")
    with RunStore.sqlite(str(db)) as store:
        runtime = Runtime([refund.build_agent()], store=store)
        print("   user: Hi, I'd like a refund for my order.")
        first = await _turn(
            runtime,
            {
                "session_id": "demo-session",
                "input": "Hi, I'd like a refund for my order.",
                "kind": "flow",
                "flow_name": "refund",
            },
        )
        print("   user: It was $42.50.")
        second = await _turn(
            runtime,
            {"session_id": "demo-session", "run_id": first.run_id, "input": "It was $42.50."},
        )
        print(f"   the turn ended cleanly: status={second.status}")

    print("== a NEW process resumes the run by id and delivers the supervisor's approval")
    command = [
        sys.executable, "-m", "kuralle_es.cli", "--sqlite", str(db), "approve",
        second.run_id, "--by", "supervisor", "--signal-id", "approval-1",
    ]  # fmt: skip
    await asyncio.to_thread(_run_process, command)
    print("== the approval webhook is retried from a third process: a no-op")
    await asyncio.to_thread(_run_process, command)

    refunds = [e for e in refund.ledger_entries() if e["tool"] == "processRefund"]
    print(f"== processRefund executed {len(refunds)} time(s) (the payment's own ledger)")

    print(f"== the run's journal (kuralle-es --sqlite {db} runs show {second.run_id})")
    with RunStore.sqlite(str(db)) as store:
        run = store.load_history(second.run_id)
        assert run is not None
        state = run.to_state()
        print(format_timeline(state, run.step_records(), read_deliveries(store, state.run_id)))
        for message in state.messages:
            print(f"   {message.role}: {message.content}")
    return 0 if len(refunds) == 1 and state.status == "finished" else 1


# -------------------------------------------------------------------- runs
_COLUMNS = (
    "RUN_ID",
    "STATUS",
    "KIND",
    "SESSION",
    "FLOW@NODE",
    "WAITING",
    "LEASE",
    "STEPS",
    "UPDATED",
)


def _add_runs(sub: SubParsers) -> None:
    runs = sub.add_parser("runs", help="list and inspect runs (read-only), or fork one")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True, metavar="COMMAND")

    listing = _command(runs_sub, "list", "runs, most recently updated first", _runs_list)
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
    listing.add_argument("--json", action="store_true", help="a JSON array of RunSummary")

    show = _command(runs_sub, "show", "a run's journal as a timeline", _runs_show)
    show.add_argument("run_id", metavar="RUN_ID", help="the run's id")
    show.add_argument("--json", action="store_true", help="the RunState with its steps, as JSON")

    fork = _command(
        runs_sub,
        "fork",
        "a new run replaying a flow run's steps before N, executing afresh from N (loads --app)",
        _runs_fork,
    )
    fork.add_argument("run_id", metavar="RUN_ID", help="the flow run to fork (only read)")
    fork.add_argument(
        "--at",
        dest="at_step",
        type=int,
        required=True,
        metavar="N",
        help="the first step to execute afresh: 0 to the run's step count",
    )
    fork.add_argument(
        "--into-session", metavar="ID", help="the fork's session (default: the run's)"
    )


def _row(s: RunSummary) -> tuple[str, ...]:
    wait = "-"
    if s.waiting_for is not None:
        wait = f"{s.waiting_for.kind}:{s.waiting_for.name}"
        if s.waiting_for.deadline is not None:
            wait += f" until {s.waiting_for.deadline:%Y-%m-%d %H:%M}"
    where = f"{s.active_flow}@{s.active_node}" if s.active_flow else "-"
    lease = s.lease_holder or "-"
    return (
        s.run_id, s.status, s.kind, s.session_id, where, wait, lease, str(s.step_count),
        f"{s.updated_at:%Y-%m-%d %H:%M:%S}",
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
        raise _CliError(f"--limit must be at least 1, got {args.limit}")
    with open_store(args, must_exist=True) as store:
        summaries = await RunViews(store).list_runs(
            status=args.status, session_id=args.session, flow=args.flow, limit=args.limit
        )
    if args.json:
        print(json.dumps([s.model_dump(mode="json") for s in summaries], indent=2))
    else:
        print(format_runs(summaries, tty=sys.stdout.isatty()))
    return 0


async def _runs_show(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True) as store:
        run = await _stored_run(store, args.run_id, history=True)
        if run is None:
            return 1
        state, steps = run.to_state(), run.step_records()
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
    agents = load_agents(args.app)
    with open_store(args, must_exist=True) as store:
        # The run's session is read from the store: the operator acts on its behalf.
        run = await _stored_run(store, args.run_id)
        if run is None:
            return 1
        result = await Runtime(agents, store=store).fork(
            args.run_id, run.session_id, args.at_step, into_session=args.into_session
        )
    _print_result(result)
    return 0


# -------------------------------------------------------------- deliveries
def _add_deliveries(sub: SubParsers) -> None:
    approve = _command(sub, "approve", "approve what a run waits for", _approve)
    approve.add_argument("run_id", metavar="RUN_ID", help="the paused run's id")
    approve.add_argument("--by", required=True, metavar="NAME", help="who approves (the actor)")
    approve.add_argument("--reason", help="why (kept in the journal)")
    approve.add_argument("--signal-id", help="makes a retry of this command a no-op")

    deny = _command(sub, "deny", "deny what a run waits for", _deny)
    deny.add_argument("run_id", metavar="RUN_ID", help="the paused run's id")
    deny.add_argument("--by", required=True, metavar="NAME", help="who denies (the actor)")
    deny.add_argument("--reason", required=True, help="why (the model or node sees it)")
    deny.add_argument("--signal-id", help="makes a retry of this command a no-op")

    signal = _command(sub, "signal", "deliver a named signal to a waiting run", _signal)
    signal.add_argument("run_id", metavar="RUN_ID", help="the paused run's id")
    signal.add_argument("name", metavar="NAME", help="the signal the run waits for")
    signal.add_argument("--payload", default="null", metavar="JSON", help="the payload, as JSON")
    signal.add_argument("--signal-id", help="makes a retry of this command a no-op")
    signal.add_argument("--actor", metavar="NAME", help="who sends it (kept in the journal)")


#: What an operator command does to a run, given the runtime and the run's session.
_Act = Callable[[Runtime, str], Coroutine[Any, Any, TurnResult]]


async def _deliver(args: argparse.Namespace, act: _Act) -> int:
    agents = load_agents(args.app)
    with open_store(args, must_exist=True) as store:
        runtime = Runtime(agents, store=store)
        # An operator acts on behalf of the run's session, read from the store.
        run = await _stored_run(store, args.run_id)
        if run is None:
            return 1
        _print_result(await act(runtime, run.session_id))
    return 0


async def _approve(args: argparse.Namespace) -> int:
    return await _deliver(
        args,
        lambda runtime, session: runtime.approve(
            args.run_id, session, by=args.by, reason=args.reason, signal_id=args.signal_id
        ),
    )


async def _deny(args: argparse.Namespace) -> int:
    return await _deliver(
        args,
        lambda runtime, session: runtime.deny(
            args.run_id, session, by=args.by, reason=args.reason, signal_id=args.signal_id
        ),
    )


async def _signal(args: argparse.Namespace) -> int:
    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as e:
        raise _CliError(f"--payload is not JSON: {e}") from None
    return await _deliver(
        args,
        lambda runtime, session: runtime.signal(
            args.run_id, session, args.name, payload, signal_id=args.signal_id, actor=args.actor
        ),
    )


# ------------------------------------------------------------------ cancel
def _add_cancel(sub: SubParsers) -> None:
    cancel = _command(
        sub,
        "cancel",
        "cancel a run: a flow run is aborted, a conversation's current turn ends",
        _cancel,
    )
    cancel.add_argument("run_id", metavar="RUN_ID", help="the run's id")
    cancel.add_argument(
        "--reason", required=True, help="why (the run's outcome becomes 'cancelled: REASON')"
    )


async def _cancel(args: argparse.Namespace) -> int:
    # Never imports --app: cancelling needs no flow definition.
    with open_store(args, must_exist=True) as store:
        run = await _stored_run(store, args.run_id)
        if run is None:
            return 1
        state = await cancel_run(store, args.run_id, run.session_id, args.reason)
    print(f"run {state.run_id} is {state.status} ({state.outcome})")
    return 0


# ------------------------------------------------------------------- views
def _add_views(sub: SubParsers) -> None:
    views = sub.add_parser("views", help="keep the run views current, or rebuild them")
    views_sub = views.add_subparsers(dest="views_command", required=True, metavar="COMMAND")
    follow_ = _command(
        views_sub, "follow", "project new events into the views until SIGTERM/Ctrl-C", _follow
    )
    follow_.add_argument(
        "--interval", type=float, default=0.2, help="seconds between polls (SQLite, memory)"
    )
    follow_.add_argument(
        "--batch",
        type=int,
        default=DEFAULT_BATCH,
        help=f"events per transaction while catching up (default {DEFAULT_BATCH})",
    )
    _command(views_sub, "rebuild", "empty the views and project the whole log again", _rebuild)
    _command(views_sub, "status", "the views' position against the log's last event", _status)


async def _follow(args: argparse.Namespace) -> int:
    if args.batch < 1:
        raise _CliError(f"--batch must be at least 1, got {args.batch}")
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    for sig in (signals.SIGTERM, signals.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with open_store(args) as store:
        views = open_backend(store)
        print(f"kuralle-es: following the run views (pid {os.getpid()})", file=sys.stderr)
        await asyncio.to_thread(
            follow, store, views, stop, interval=args.interval, batch=args.batch
        )
    return 0


async def _rebuild(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True) as store:
        applied = await RunViews(store).rebuild()
    print(f"rebuilt the run views from {applied} event(s)")
    return 0


async def _status(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True) as store:
        position = await RunViews(store).position()
        head = await asyncio.to_thread(store.recorder.max_notification_id)
    print(f"views at event {position or 0} of {head or 0}")
    return 0


# --------------------------------------------------------------- dashboard
def _add_dashboard(sub: SubParsers) -> None:
    dash = _command(
        sub, "dashboard", "web pages over the runs; approve or deny from a browser", _dashboard
    )
    dash.add_argument(
        "--host",
        default="127.0.0.1",
        help="the interface to bind (default 127.0.0.1; another needs KURALLE_DASHBOARD_TOKEN)",
    )
    dash.add_argument("--port", type=int, default=8765, help="the port (default 8765)")


async def _dashboard(args: argparse.Namespace) -> int:
    try:  # the `dashboard` extra: imported only by this command
        from .dashboard import TOKEN_ENV, check_bind, serve
    except ImportError as e:
        raise _CliError(f"the dashboard needs: pip install 'kuralle_es[dashboard]' ({e})") from None
    token = os.environ.get(TOKEN_ENV) or None
    check_bind(args.host, token)  # before anything is opened
    # Only a dashboard with a token can deliver decisions, so only it needs the agents.
    agents = load_agents(args.app) if token else []
    with open_store(args, must_exist=True) as store:
        await serve(store, lambda s: Runtime(agents, store=s), args.host, args.port, token)
    return 0


# ------------------------------------------------------------------- serve
def _add_serve(sub: SubParsers) -> None:
    serve = _command(
        sub, "serve", "the HTTP API over the runs, JSON in and out (docs/http.md)", _serve
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="the interface to bind (default 127.0.0.1; another needs KURALLE_API_TOKEN)",
    )
    serve.add_argument("--port", type=int, default=8000, help="the port (default 8000)")


async def _serve(args: argparse.Namespace) -> int:
    try:  # the `dashboard` extra (Starlette, uvicorn): imported only by this command
        from .http import TOKEN_ENV, check_bind, serve
    except ImportError as e:
        raise _CliError(f"serve needs: pip install 'kuralle_es[dashboard]' ({e})") from None
    token = os.environ.get(TOKEN_ENV) or None
    check_bind(args.host, token)  # before anything is opened
    agents = load_agents(args.app)  # starts and deliveries drive runs in this process
    with open_store(args) as store:
        await serve(Runtime(agents, store=store), args.host, args.port, token)
    return 0


# ----------------------------------------------------------------- consume
def _add_consume(sub: SubParsers) -> None:
    consume = _command(
        sub, "consume", "run an event consumer until SIGTERM/Ctrl-C (README: Run events)", _consume
    )
    consume.add_argument(
        "consumer",
        choices=[approval_notifier.CONSUMER_NAME],
        help="approvals: one outbox row per run paused on an approval",
    )
    consume.add_argument("--once", action="store_true", help="catch up, then exit")


async def _consume(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        return await approval_notifier.consume(store, once=args.once)


# ---------------------------------------------------------------- recovery
#: The log lines a worker shows without --verbose: one per run it drove or skipped.
_SWEEP_EVENTS = frozenset(
    {"run recovered", "run swept", "timer fired", "recovery skipped", "sweep skipped",
     "wake skipped"}
)  # fmt: skip


def _add_recovery(sub: SubParsers) -> None:
    worker = _command(
        sub,
        "worker",
        "the sweeper as a long-running process: recover orphaned runs, deny expired "
        "deadlines, wake due timers, every --interval seconds until SIGTERM/Ctrl-C",
        _worker,
    )
    worker.add_argument(
        "--interval", type=float, default=5.0, help="seconds between sweep passes (default 5)"
    )
    worker.add_argument("--verbose", action="store_true", help="also log each turn's lines")
    recover = _command(
        sub, "recover", "one pass: drive every orphaned run (its lease expired) again", _recover
    )
    sweep = _command(sub, "sweep", "one pass: deny expired deadlines and wake due timers", _sweep)
    for parser in (worker, recover, sweep):
        parser.add_argument(
            "--lease-ttl",
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="the lease this worker takes on the runs it drives (default 30)",
        )
        parser.add_argument(
            "--holder", metavar="NAME", help="this worker's lease holder name (default host:pid)"
        )


def _sweeping_runtime(args: argparse.Namespace, store: RunStore) -> Runtime:
    if args.lease_ttl <= 0:
        raise _CliError(f"--lease-ttl must be a positive number of seconds, got {args.lease_ttl}")
    return Runtime(load_agents(args.app), store=store, lease_ttl=args.lease_ttl, holder=args.holder)


class _SweepLines(logging.Filter):
    """Keeps the worker's own lines and one line per run it drove (not each turn's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = getattr(record, "kuralle", None)
        return not isinstance(fields, dict) or fields.get("event") in _SWEEP_EVENTS


def _log_to_stderr(verbose: bool) -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    if not verbose:
        handler.addFilter(_SweepLines())
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger


def _stop_before_started(signum: int, frame: object) -> None:
    """SIGTERM before the worker's loop handles it: it holds nothing yet, so stop now."""
    print("worker stopped before it started (nothing held)", file=sys.stderr, flush=True)
    os._exit(0)


async def _worker(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise _CliError(f"--interval must be a positive number of seconds, got {args.interval}")
    logger = _log_to_stderr(args.verbose)
    with open_store(args) as store:
        runtime = _sweeping_runtime(args, store)
        sweeper = start_run_sweeper(runtime, interval=args.interval)
        loop = asyncio.get_running_loop()
        for sig in (signals.SIGTERM, signals.SIGINT):
            loop.add_signal_handler(sig, sweeper.stop)
        logger.info(
            "worker started holder=%s interval=%s lease_ttl=%s pid=%s",
            runtime.holder, args.interval, args.lease_ttl, os.getpid(),
        )  # fmt: skip
        await sweeper.wait()
        logger.info("worker stopped holder=%s passes=%s", runtime.holder, sweeper.passes)
    return 0


async def _recover(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True) as store:
        recovered = await recover_orphaned_runs(_sweeping_runtime(args, store))
    for run_id in recovered:
        print(f"recovered {run_id}")
    print(f"{len(recovered)} run(s) recovered", file=sys.stderr)
    return 0


async def _sweep(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True) as store:
        runtime = _sweeping_runtime(args, store)
        swept = await sweep_deadlines(runtime)
        woken = await fire_timers(runtime)
    for run_id in swept:
        print(f"swept {run_id}")
    for run_id in woken:
        print(f"woken {run_id}")
    print(f"{len(swept)} deadline(s) denied, {len(woken)} timer(s) fired", file=sys.stderr)
    return 0


#: Every command: each adds its parser (and handler) to the subparsers.
COMMANDS: list[Callable[[SubParsers], None]] = [
    _add_demo, _add_runs, _add_deliveries, _add_cancel, _add_views, _add_dashboard, _add_consume,
    _add_recovery, _add_serve,
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kuralle-es",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=f"Store: --store URL or {STORE_ENV}. Agents: --app or {APP_ENV}.",
    )
    parser.add_argument(
        "--version", action="version", version=f"kuralle-es {_version()}", help="print the version"
    )
    _common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if "worker" in (sys.argv[1:] if argv is None else argv):
        # Until the worker's loop handles SIGTERM, a stop request ends it at once.
        signals.signal(signals.SIGTERM, _stop_before_started)
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return asyncio.run(handler(args))
    except (StoreUnavailableError, _CliError) as e:
        print(f"kuralle-es: {e}", file=sys.stderr)
        return 2
    except KuralleError as e:
        # A refusal is an answer, not a crash: say what and what to do, no traceback.
        print(f"kuralle-es: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
