"""The ``kuralle-es`` command: the demo, and operating runs from a shell (API).

The store: ``--store URL`` (or ``KURALLE_STORE``): ``postgresql://user[:pw]@host[:port]/db``,
``sqlite:///relative.db``, ``sqlite:////absolute.db`` or ``memory:``; ``--sqlite FILE`` is
short for a SQLite URL; without either, the ``eventsourcing`` variables
(``PERSISTENCE_MODULE``, ``SQLITE_DBNAME``, ``POSTGRES_*``) when
``PERSISTENCE_MODULE`` is set. A command that opens a store and is told of
none refuses (exit code 2) rather than open an empty in-memory store nobody
asked for (``--store memory:`` asks for one). Commands that drive a run load
the agents that define its flows from ``--app module:attr`` (or
``KURALLE_APP``), importable from the current folder; read-only commands
never import it. A store that cannot be reached is one line and exit code 2.
docs/cli.md documents every command and its exit codes.

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
from collections.abc import Callable, Coroutine, Iterator, Sequence
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ._definitions.agents import Agent
from ._journal.run import Run
from ._journal.spending import PRICES_ENV, prices_from_json
from ._journal.store import RunStore
from ._journal.store_url import (
    STORE_ENV,
    StoreUnavailableError,
    open_store_from_env,
    open_store_url,
)
from ._operations.recovery import (
    fire_timers,
    recover_orphaned_runs,
    start_run_sweeper,
    sweep_deadlines,
)
from ._operations.replay_check import RunCheck, check_runs
from ._runtime.cancel import cancel_run
from ._runtime.handle import TurnHandle
from ._runtime.observability import LOGGER_NAME
from ._runtime.runtime import Runtime
from .errors import FlowNotFoundError, InvalidArgumentError, KuralleError
from .examples import approval_notifier, refund
from .shapes import TurnResult, Usage
from .views import RunSummary, RunViews
from .views.api import open_backend
from .views.projector import DEFAULT_BATCH, follow
from .views.timeline import format_timeline, read_deliveries

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


#: What a command that opens a store says when none was named.
NO_STORE = (
    "no store named: pass --store URL (sqlite:///runs.db, postgresql://user@host:5432/db, "
    f"or memory: for an empty store that lives only as long as this command) or set "
    f"{STORE_ENV}; the eventsourcing variables (PERSISTENCE_MODULE, ...) work too"
)


def store_named(args: argparse.Namespace, environ: dict[str, str] | None = None) -> bool:
    """Whether the options or the environment name a store (``memory:`` included)."""
    env = os.environ if environ is None else environ
    return bool(
        getattr(args, "store", None)
        or getattr(args, "sqlite", None)
        or env.get(STORE_ENV)
        or env.get("PERSISTENCE_MODULE")
    )


def _masked(url: str) -> str:
    """``url`` without its password (in the authority or a ``password=`` parameter)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, has_password, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if has_password else netloc
    query = parts.query
    if "password=" in query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k == "password" else v) for k, v in pairs])
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def store_label(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str:
    """The store a command uses, for its start line: never a password."""
    env = os.environ if environ is None else environ
    url = getattr(args, "store", None)
    if not url and getattr(args, "sqlite", None):
        url = f"sqlite:///{args.sqlite}"
    if not url and env.get(STORE_ENV):
        url = env[STORE_ENV]
    if url:
        if url.startswith("sqlite:///") and len(url) > len("sqlite:///"):
            return f"{url} ({Path(url[len('sqlite:///') :]).resolve()})"
        if url in ("memory:", "memory://"):
            return "memory: (this process only, empty at start)"
        return _masked(url)
    module = env.get("PERSISTENCE_MODULE", "")
    if module.endswith("postgres"):
        where = (
            f"{env.get('POSTGRES_USER', '')}@{env.get('POSTGRES_HOST', '')}:"
            f"{env.get('POSTGRES_PORT', '5432')}/{env.get('POSTGRES_DBNAME', '')}"
        )
        return f"{module} {where}"
    if module.endswith("sqlite"):
        return f"{module} {env.get('SQLITE_DBNAME', '')}"
    return f"{module} (in memory: this process only, empty at start)"


def open_store(args: argparse.Namespace, *, must_exist: bool = False) -> RunStore:
    """The store the options (or the environment) name; ``StoreUnavailableError`` if away,
    a refusal (exit 2) if nothing names one."""
    if not store_named(args):
        raise _CliError(NO_STORE)
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
    except Exception as e:  # the user's module raised while it was imported
        raise _CliError(
            f"cannot load --app {spec}: importing {module_name} raised {type(e).__name__}: {e}"
        ) from None
    if callable(target) and not isinstance(target, Agent):
        try:
            target = target()
        except Exception as e:
            raise _CliError(
                f"cannot load --app {spec}: calling {attribute}() raised {type(e).__name__}: {e}"
            ) from None
    try:
        agents = [target] if isinstance(target, Agent) else list(target)
    except TypeError:
        agents = [target]
    if not all(isinstance(a, Agent) for a in agents):
        raise _CliError(f"{spec} is not an agent, a list of agents, or a callable returning them")
    return agents


class _CliError(KuralleError):
    """A bad command line: printed as one line, exit code 2."""


class _TurnFailed(KuralleError):
    """A run's turn ended in error (the node raised): printed as one line, exit code 1."""


def _opened_run(handle: TurnHandle) -> str | None:
    """The id of the run the turn opened, or None when it was refused before."""
    future = handle.run_id
    if future.done() and not future.cancelled() and future.exception() is None:
        return future.result()
    return None


async def _turn_result(handle: TurnHandle) -> TurnResult:
    """The turn's result; an error after the run opened is one line naming the run."""
    try:
        return await handle.result()
    except Exception as e:
        run_id = _opened_run(handle)
        if run_id is None:
            raise  # refused before anything was written
        raise _TurnFailed(
            f"run {run_id}: the turn ended in error: {type(e).__name__}: {e} "
            f"(kuralle-es runs show {run_id})"
        ) from None


def _result_text(result: TurnResult) -> str:
    """A turn's result for a person: the run, its status, what it waits for, its output."""
    line = f"run {result.run_id} {result.status}"
    wait = result.waiting_for
    if wait is not None:
        line += f", waiting for {wait.kind} {wait.name}"
        if wait.title:
            line += f": {wait.title}"
    lines = [line]
    if result.output is not None:
        output = result.output if isinstance(result.output, str) else json.dumps(result.output)
        lines.append(f"output: {output}")
    return "\n".join(lines)


async def _stored_run(store: RunStore, run_id: str, *, history: bool = False) -> Run | None:
    """The run (an operator acts on its session, read from the store), or None, said on
    stderr; with ``history``, folded with every step it journaled (``load_history``)."""
    run = await store.load_async(run_id, history=history)
    if run is None:
        print(f"kuralle-es: RunNotFoundError: no run {run_id} in this store", file=sys.stderr)
    return run


def _print_result(result: TurnResult) -> None:
    print(json.dumps(result.model_dump(mode="json"), indent=2))


def _common(
    parser: argparse.ArgumentParser, *, top: bool, store: bool = True, app: bool = True
) -> None:
    """The store and app options, accepted before or after the command; a command that
    does not use one still accepts it but does not list it in its help."""
    default = None if top else argparse.SUPPRESS
    parser.add_argument(
        "--store",
        default=default,
        metavar="URL",
        help=(
            "postgresql://user[:pw]@host[:port]/db, sqlite:///file.db (sqlite:////abs.db) or "
            f"memory: (env {STORE_ENV}; else PERSISTENCE_MODULE and its variables); "
            "required: without one the command refuses"
        )
        if store
        else argparse.SUPPRESS,
    )
    parser.add_argument(
        "--sqlite",
        default=default,
        metavar="FILE",
        help="SQLite file: short for --store" if store else argparse.SUPPRESS,
    )
    parser.add_argument(
        "--app",
        default=os.environ.get(APP_ENV, DEFAULT_APP) if top else argparse.SUPPRESS,
        metavar="MODULE:ATTR",
        help=(
            f"the agents that define the runs' flows, for commands that drive runs "
            f"(env {APP_ENV}; default: the refund demo)"
        )
        if app
        else argparse.SUPPRESS,
    )


def _command(
    sub: SubParsers,
    name: str,
    help: str,
    handler: Handler,
    *,
    store: bool = True,
    app: bool = True,
) -> argparse.ArgumentParser:
    """A command's parser. ``store``: it opens a store, so it refuses to run unless one
    is named; ``app``: it loads ``--app`` (else the option is accepted but not listed)."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    _common(parser, top=False, store=store, app=app)
    parser.set_defaults(handler=handler, opens_store=store, uses_app=app)
    return parser


# -------------------------------------------------------------------- demo
def _add_demo(sub: SubParsers) -> None:
    demo = _command(
        sub, "demo", "the durable refund flow on SQLite, offline", _demo, store=False, app=False
    )
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
        state = run.to_state(store.lease(run.run_id))
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
    "VERSION",
    "WAITING",
    "LEASE",
    "STEPS",
    "UPDATED",
)


def _add_runs(sub: SubParsers) -> None:
    runs = sub.add_parser("runs", help="list and inspect runs; start or fork one")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True, metavar="COMMAND")

    listing = _command(runs_sub, "list", "runs, most recently updated first", _runs_list, app=False)
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

    show = _command(runs_sub, "show", "a run's journal as a timeline", _runs_show, app=False)
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
    _add_runs_usage(runs_sub)
    _add_runs_start(runs_sub)


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


def _add_runs_start(runs_sub: SubParsers) -> None:
    start = _command(
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
        "--input", metavar="TEXT", help="the user's first message; - reads it from stdin"
    )
    start.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="a retried start with this key (same session and flow) returns the first run",
    )
    start.add_argument("--json", action="store_true", help="the TurnResult as JSON")


async def _runs_start(args: argparse.Namespace) -> int:
    text = args.input
    if text == "-":
        text = await asyncio.to_thread(sys.stdin.read)
    agents = load_agents(args.app)  # before the store: a bad --app creates no database
    with open_store(args) as store:
        handle = Runtime(agents, store=store).run(
            args.session,
            input=text,
            kind="flow",
            flow_name=args.flow,
            idempotency_key=args.idempotency_key,
        )
        result = await _turn_result(handle)
    if args.json:
        _print_result(result)
    else:
        print(_result_text(result))
    return 0


# -------------------------------------------------------------- runs usage
def _add_runs_usage(runs_sub: SubParsers) -> None:
    usage = _command(
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
    usage.add_argument(
        "--prices",
        metavar="JSON",
        help=(
            "model -> [input_per_1k, output_per_1k], e.g. '{\"gpt-4o-mini\": [0.00015, 0.0006]}' "
            f"(env {PRICES_ENV}); without prices the cost is unknown"
        ),
    )
    usage.add_argument("--json", action="store_true", help="one JSON object (the Usage fields)")


def _usage_prices(args: argparse.Namespace) -> dict[str, tuple[float, float]] | None:
    text, source = args.prices, "--prices"
    if text is None:
        text, source = os.environ.get(PRICES_ENV) or None, PRICES_ENV
    if text is None:
        return None
    try:
        return prices_from_json(text, source)
    except InvalidArgumentError as e:
        raise _CliError(str(e)) from None


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
    prices = _usage_prices(args)
    if args.since is not None:
        try:
            datetime.fromisoformat(args.since)
        except ValueError:
            raise _CliError(
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


# -------------------------------------------------------------- deliveries
def _add_deliveries(sub: SubParsers) -> None:
    approve = _command(sub, "approve", "approve what a run waits for", _approve)
    approve.add_argument("run_id", metavar="RUN_ID", help="the paused run's id")
    approve.add_argument("--by", required=True, metavar="NAME", help="who approves (the actor)")
    approve.add_argument("--reason", help="why (kept in the journal)")
    approve.add_argument("--signal-id", help="makes a retry of this command a no-op")
    approve.add_argument(
        "--raise-to",
        metavar="JSON",
        help='for a run waiting on its budget: the limits to raise, e.g. \'{"max_total_tokens": '
        "20000}' (docs/usage.md)",
    )

    deny = _command(sub, "deny", "deny what a run waits for", _deny)
    deny.add_argument("run_id", metavar="RUN_ID", help="the paused run's id")
    deny.add_argument("--by", required=True, metavar="NAME", help="who denies (the actor)")
    deny.add_argument("--reason", required=True, help="why (the model or node sees it)")
    deny.add_argument("--signal-id", help="makes a retry of this command a no-op")

    signal = _command(sub, "signal", "deliver a named signal to a waiting run", _signal)
    signal.add_argument("run_id", metavar="RUN_ID", help="the paused run's id")
    signal.add_argument("name", metavar="NAME", help="the signal the run waits for")
    signal.add_argument(
        "--payload",
        default="null",
        metavar="JSON",
        help="the payload, as JSON; @FILE reads it from a file, - from stdin (default null)",
    )
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
        try:
            result = await act(runtime, run.session_id)
        except KuralleError:
            raise  # a refusal, or a frozen error: its class and message say it
        except Exception as e:  # the resumed node raised: the run is saved as error
            raise _TurnFailed(
                f"run {args.run_id}: the turn ended in error: {type(e).__name__}: {e} "
                f"(kuralle-es runs show {args.run_id})"
            ) from None
        _print_result(result)
    return 0


async def _approve(args: argparse.Namespace) -> int:
    return await _deliver(
        args,
        lambda runtime, session: runtime.approve(
            args.run_id,
            session,
            by=args.by,
            reason=args.reason,
            signal_id=args.signal_id,
            raise_to=_raise_to(args.raise_to),
        ),
    )


def _raise_to(text: str | None) -> dict[str, Any] | None:
    """``approve --raise-to JSON``: a mapping of budget limits, or a clear refusal."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        msg = f"--raise-to is not JSON ({e}); e.g. '{{\"max_total_tokens\": 20000}}'"
        raise _CliError(msg) from None
    if not isinstance(value, dict):
        raise _CliError(f"--raise-to must be a JSON object of budget limits, got {text}")
    return value


async def _deny(args: argparse.Namespace) -> int:
    return await _deliver(
        args,
        lambda runtime, session: runtime.deny(
            args.run_id, session, by=args.by, reason=args.reason, signal_id=args.signal_id
        ),
    )


def _payload_text(value: str) -> str:
    """``--payload`` as given, or read from ``@FILE`` or ``-`` (stdin): a payload too
    big for the command line (``Argument list too long``) goes through either."""
    if value == "-":
        return sys.stdin.read()
    if value.startswith("@"):
        try:
            return Path(value[1:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise _CliError(f"cannot read --payload {value}: {e}") from None
    return value


async def _signal(args: argparse.Namespace) -> int:
    text = await asyncio.to_thread(_payload_text, args.payload)
    try:
        payload = json.loads(text)
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
        app=False,
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
        views_sub,
        "follow",
        "project new events into the views until SIGTERM/Ctrl-C",
        _follow,
        app=False,
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
    _command(
        views_sub, "rebuild", "empty the views and project the whole log again", _rebuild, app=False
    )
    _command(
        views_sub, "status", "the views' position against the log's last event", _status, app=False
    )


async def _follow(args: argparse.Namespace) -> int:
    if args.batch < 1:
        raise _CliError(f"--batch must be at least 1, got {args.batch}")
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    for sig in (signals.SIGTERM, signals.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with open_store(args) as store:
        views = open_backend(store)
        print(
            f"kuralle-es: following the run views of store {store_label(args)} (pid {os.getpid()})",
            file=sys.stderr,
        )
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
        await serve(
            store,
            lambda s: Runtime(agents, store=s),
            args.host,
            args.port,
            token,
            store_label=store_label(args),
        )
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
        await serve(
            Runtime(agents, store=store), args.host, args.port, token, store_label=store_label(args)
        )
    return 0


# ----------------------------------------------------------------- consume
def _add_consume(sub: SubParsers) -> None:
    consume = _command(
        sub,
        "consume",
        "run an event consumer until SIGTERM/Ctrl-C (docs/events.md)",
        _consume,
        app=False,
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
            "--holder",
            metavar="NAME",
            help="this worker's lease holder name (default host:pid:random, new each start)",
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


#: The log event of a run a sweep skipped, and which sweep it was.
_SKIP_EVENTS = {
    "recovery skipped": "recovery",
    "sweep skipped": "deadline deny",
    "wake skipped": "timer wake",
}


class _Skips(logging.Handler):
    """Collects the runs a sweep skipped and why: the error's type from the skip's log
    line, its message from the debug record that carries the error."""

    def __init__(self, on_skip: Callable[[str, str, str], None] | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.skipped: dict[str, tuple[str, str]] = {}  # run id -> (which sweep, error type)
        self.messages: dict[str, str] = {}  # run id -> the error's message
        self.on_skip = on_skip

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "kuralle", None)
        if isinstance(fields, dict) and fields.get("event") in _SKIP_EVENTS:
            run_id = str(fields.get("run_id"))
            self.skipped[run_id] = (_SKIP_EVENTS[fields["event"]], str(fields.get("reason")))
        elif record.exc_info and record.exc_info[1] is not None and record.args:
            run_id = str(record.args[0] if isinstance(record.args, tuple) else record.args)
            if run_id not in self.skipped:  # not the error of a skip logged just before
                return
            error = record.exc_info[1]
            self.messages[run_id] = str(error)
            if self.on_skip is not None:
                self.on_skip(run_id, type(error).__name__, str(error))

    def lines(self) -> list[str]:
        return [
            f"skipped {run_id} ({what}): {reason}"
            + (f": {self.messages[run_id]}" if self.messages.get(run_id) else "")
            for run_id, (what, reason) in self.skipped.items()
        ]

    def needs_app(self) -> bool:
        return any(reason == FlowNotFoundError.__name__ for _, reason in self.skipped.values())


@contextlib.contextmanager
def _collect_skips(on_skip: Callable[[str, str, str], None] | None = None) -> Iterator[_Skips]:
    logger = logging.getLogger(LOGGER_NAME)
    collector = _Skips(on_skip)
    level = logger.level
    logger.addHandler(collector)
    logger.setLevel(logging.DEBUG)  # the error of a skip is logged at DEBUG
    try:
        yield collector
    finally:
        logger.removeHandler(collector)
        logger.setLevel(level)


def _app_hint(args: argparse.Namespace) -> str:
    """What to do when the loaded agents lack a run's flow (or agent)."""
    source = (
        f"{args.app} (the default: the refund example)" if args.app == DEFAULT_APP else args.app
    )
    return (
        f"the agents came from --app {source}; pass --app module:attribute (or set "
        f"{APP_ENV}) naming the agents that define the run's flow"
    )


def _report_skips(args: argparse.Namespace, skips: _Skips) -> int:
    """Print each skipped run and why; exit code 1 when there was one."""
    for line in skips.lines():
        print(line)
    if skips.needs_app():
        print(f"kuralle-es: {_app_hint(args)}", file=sys.stderr)
    return 1 if skips.skipped else 0


def _log_to_stderr(verbose: bool) -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.INFO)
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
    hinted: set[str] = set()

    def hint(run_id: str, error_type: str, message: str) -> None:
        if error_type == FlowNotFoundError.__name__ and run_id not in hinted:
            hinted.add(run_id)  # once per run, not every pass
            logger.warning("run %s skipped: %s: %s; %s", run_id, error_type, message,
                           _app_hint(args))  # fmt: skip

    with open_store(args) as store, _collect_skips(hint):
        runtime = _sweeping_runtime(args, store)
        sweeper = start_run_sweeper(runtime, interval=args.interval)
        loop = asyncio.get_running_loop()
        for sig in (signals.SIGTERM, signals.SIGINT):
            loop.add_signal_handler(sig, sweeper.stop)
        logger.info(
            "worker started holder=%s interval=%s lease_ttl=%s pid=%s store=%s app=%s",
            runtime.holder, args.interval, args.lease_ttl, os.getpid(), store_label(args),
            args.app,
        )  # fmt: skip
        await sweeper.wait()
        logger.info("worker stopped holder=%s passes=%s", runtime.holder, sweeper.passes)
    return 0


async def _recover(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True) as store, _collect_skips() as skips:
        recovered = await recover_orphaned_runs(_sweeping_runtime(args, store))
    for run_id in recovered:
        print(f"recovered {run_id}")
    code = _report_skips(args, skips)
    print(f"{len(recovered)} run(s) recovered, {len(skips.skipped)} skipped", file=sys.stderr)
    return code


async def _sweep(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True) as store, _collect_skips() as skips:
        runtime = _sweeping_runtime(args, store)
        swept = await sweep_deadlines(runtime)
        woken = await fire_timers(runtime)
    for run_id in swept:
        print(f"swept {run_id}")
    for run_id in woken:
        print(f"woken {run_id}")
    code = _report_skips(args, skips)
    print(
        f"{len(swept)} deadline(s) denied, {len(woken)} timer(s) fired, "
        f"{len(skips.skipped)} run(s) skipped",
        file=sys.stderr,
    )
    return code


# ------------------------------------------------------------------ deploy
def _add_deploy(sub: SubParsers) -> None:
    check = _command(
        sub,
        "check",
        "replay every live run against --app without executing or writing anything; "
        "exit 1 if one would not resume (docs/deploying.md)",
        _check,
    )
    check.add_argument("--json", action="store_true", help="a JSON array, one object per run")
    migrate = _command(
        sub,
        "migrate",
        "fork a live flow run at step N onto the newest definition of its flow in --app, "
        "then stop the original (outcome 'migrated: FORK_ID')",
        _migrate,
    )
    migrate.add_argument("run_id", metavar="RUN_ID", help="the live flow run to move")
    migrate.add_argument(
        "--at",
        dest="at_step",
        type=int,
        required=True,
        metavar="N",
        help="the first step to execute afresh under the new definition: 0 to the step count",
    )


def _check_line(check: RunCheck) -> str:
    flow = "-" if check.flow is None else f"{check.flow}@{check.flow_version or '-'}"
    line = f"{check.kind:<14} {check.run_id}  {check.status:<7}  {flow}"
    if check.step is not None:
        line += f"  step {check.step}"
    return line + (f"  {check.message}" if check.message else "")


async def _check(args: argparse.Namespace) -> int:
    agents = load_agents(args.app)
    with open_store(args, must_exist=True) as store:
        checks = await check_runs(store, agents)
    if args.json:
        print(json.dumps([c.model_dump(mode="json") for c in checks], indent=2))
    else:
        for check in checks:
            print(_check_line(check))
    bad = [c for c in checks if not c.ok]
    kinds = {k: sum(c.kind == k for c in checks) for k in ("ok", "drift", "nondeterminism")}
    print(
        f"{len(checks)} live run(s): {kinds['ok']} ok, {kinds['drift']} drift, "
        f"{kinds['nondeterminism']} nondeterminism",
        file=sys.stderr,
    )
    return 1 if bad else 0


async def _migrate(args: argparse.Namespace) -> int:
    agents = load_agents(args.app)
    with open_store(args, must_exist=True) as store:
        # The run's session is read from the store: the operator acts on its behalf.
        run = await _stored_run(store, args.run_id)
        if run is None:
            return 1
        result = await Runtime(agents, store=store).migrate(
            args.run_id, run.session_id, args.at_step
        )
    _print_result(result)
    return 0


#: Every command: each adds its parser (and handler) to the subparsers.
COMMANDS: list[Callable[[SubParsers], None]] = [
    _add_demo, _add_runs, _add_deliveries, _add_cancel, _add_views, _add_dashboard, _add_consume,
    _add_recovery, _add_serve, _add_deploy,
]  # fmt: skip


def _lacks_definitions(error: KuralleError) -> bool:
    """Whether a refusal says the loaded agents lack a run's flow or agent."""
    if isinstance(error, FlowNotFoundError):
        return True
    return isinstance(error, InvalidArgumentError) and str(error).startswith("unknown agent")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kuralle-es",
        description="kuralle-es: the demo, and operating durable agent runs from a shell.",
        epilog=(
            f"Every command but demo needs a store: --store URL or {STORE_ENV} "
            "(sqlite:///runs.db, postgresql://user@host/db, memory:). Commands that drive "
            f"runs load the agents from --app module:attribute or {APP_ENV}. Exit codes: "
            "0 done, 1 refused or failed (one line says why), 2 bad usage, no store or an "
            "unreachable one, an --app that does not load. More: docs/cli.md."
        ),
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
    if getattr(args, "opens_store", False) and not store_named(args):
        # Never an empty in-memory store nobody asked for (--store memory: asks).
        print(f"kuralle-es: {NO_STORE}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(handler(args))
    except (StoreUnavailableError, _CliError) as e:
        print(f"kuralle-es: {e}", file=sys.stderr)
        return 2
    except _TurnFailed as e:
        print(f"kuralle-es: {e}", file=sys.stderr)
        return 1
    except KuralleError as e:
        # A refusal is an answer, not a crash: say what and what to do, no traceback.
        print(f"kuralle-es: {type(e).__name__}: {e}", file=sys.stderr)
        if getattr(args, "uses_app", False) and _lacks_definitions(e):
            print(f"kuralle-es: {_app_hint(args)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
