"""What every command of ``kuralle-es`` shares (internal): the store and app options and
a command's parser, naming and opening the store, loading ``--app``, the command line's
errors, and reading and printing a run or a turn's result.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

from .._definitions.agents import Agent
from .._durations import positive_seconds
from .._journal.run import Run
from .._journal.spending import PRICES_ENV, prices_from_json
from .._journal.store import RunStore
from .._journal.store_url import (
    POOL_SIZE_VAR,
    STORE_ENV,
    MemoryAddress,
    PostgresAddress,
    ShardedAddress,
    SqliteAddress,
    StoreAddress,
    address_from_env,
    parse_store_url,
    redact,
    server_reason,
)
from .._runtime.handle import TurnHandle
from .._runtime.runtime import Runtime
from ..errors import InvalidArgumentError, KuralleError, StoreUnavailableError
from ..shapes import TurnResult

DEFAULT_APP = "kuralle_es.examples.refund:build_agent"
APP_ENV = "KURALLE_APP"

Handler = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
SubParsers = Any  # argparse's private _SubParsersAction


#: What a command that opens a store says when none was named.
NO_STORE = (
    "no store named: pass --store URL (sqlite:///runs.db, postgresql://user@host:5432/db, "
    f"or memory: for an empty store that lives only as long as this command) or set "
    f"{STORE_ENV}; the eventsourcing variables (PERSISTENCE_MODULE, ...) work too"
)


def store_named(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the options or the environment name a store (``memory:`` included)."""
    env = os.environ if environ is None else environ
    return bool(
        getattr(args, "store", None)
        or getattr(args, "sqlite", None)
        or env.get(STORE_ENV)
        or env.get("PERSISTENCE_MODULE")
    )


def _named_url(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """The store URL the options or ``KURALLE_STORE`` name (``--sqlite F`` is short
    for ``sqlite:///F``), or None: the ``eventsourcing`` variables then."""
    if getattr(args, "store", None):
        return str(args.store)
    if getattr(args, "sqlite", None):
        return f"sqlite:///{args.sqlite}"
    return env.get(STORE_ENV) or None


def store_label(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str:
    """The store a command uses, for its start line: never a password."""
    env = os.environ if environ is None else environ
    url = _named_url(args, env)
    try:
        address = parse_store_url(url) if url else address_from_env(env)
    except InvalidArgumentError:
        return redact(url) if url else "the eventsourcing variables (unreadable)"
    if isinstance(address, SqliteAddress):
        where = f"{address.label()} ({address.path.resolve()})"
    elif isinstance(address, MemoryAddress):
        where = "memory: (this process only, empty at start)"
    else:
        where = address.label() if address is not None else ""
    return where if url else f"{env.get('PERSISTENCE_MODULE', '')} {where}".strip()


#: The connections a read-only command holds to a PostgreSQL database, at most.
READ_ONLY_POOL_SIZE = 2


def open_store(
    args: argparse.Namespace, *, must_exist: bool = False, read_only: bool = False
) -> RunStore:
    """The store the options (or the environment) name; ``must_exist`` refuses a SQLite
    file that is not there (a read-only command must not create an empty database by
    mistake); ``read_only`` (a command that only reads) holds at most
    ``READ_ONLY_POOL_SIZE`` connections to a PostgreSQL database, whatever its
    partitions. ``StoreUnavailableError`` if away; a refusal (exit 2) if nothing names
    one, or what names it cannot be read."""
    if not store_named(args):
        raise CliError(NO_STORE)
    url = _named_url(args, os.environ)
    try:
        address = parse_store_url(url) if url else address_from_env(None)
        if must_exist:
            _refuse_missing_files(address)
        if read_only and isinstance(address, PostgresAddress):
            size = min(address.pool_size, READ_ONLY_POOL_SIZE)
            if url:
                return RunStore.postgres(url, pool_size=size)
            return RunStore(env={POOL_SIZE_VAR: str(size)})
        return RunStore.from_url(url) if url else RunStore()
    except (StoreUnavailableError, CliError):
        raise
    except InvalidArgumentError as e:
        raise CliError(str(e)) from None
    except Exception as e:  # eventsourcing's, SQLite's: one line, never a password
        reason = server_reason(e)
        raise StoreUnavailableError(
            f"cannot open the store: {reason.replace(url, redact(url)) if url else reason}"
        ) from None


def _refuse_missing_files(address: StoreAddress | None) -> None:
    shards = address.shards if isinstance(address, ShardedAddress) else (address,)
    for shard in shards:
        if isinstance(shard, SqliteAddress) and not shard.path.exists():
            raise StoreUnavailableError(f"no SQLite database at {shard.path.resolve()}")


def load_agents(spec: str) -> list[Agent]:
    """The agents ``module:attribute`` names (a list, one agent, or a callable returning them)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise CliError(f"--app must look like module:attribute, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the user's app lives in the current folder
    try:
        target: Any = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as e:
        raise CliError(f"cannot load --app {spec}: {e}") from None
    except Exception as e:  # the user's module raised while it was imported
        raise CliError(
            f"cannot load --app {spec}: importing {module_name} raised {type(e).__name__}: {e}"
        ) from None
    if callable(target) and not isinstance(target, Agent):
        try:
            target = target()
        except Exception as e:
            raise CliError(
                f"cannot load --app {spec}: calling {attribute}() raised {type(e).__name__}: {e}"
            ) from None
    try:
        agents = [target] if isinstance(target, Agent) else list(target)
    except TypeError:
        agents = [target]
    if not all(isinstance(a, Agent) for a in agents):
        raise CliError(f"{spec} is not an agent, a list of agents, or a callable returning them")
    return agents


def app_hint(args: argparse.Namespace) -> str:
    """What to do when the loaded agents lack a run's flow (or agent)."""
    source = (
        f"{args.app} (the default: the refund example)" if args.app == DEFAULT_APP else args.app
    )
    return (
        f"the agents came from --app {source}; pass --app module:attribute (or set "
        f"{APP_ENV}) naming the agents that define the run's flow"
    )


class CliError(KuralleError):
    """A bad command line: printed as one line, exit code 2."""


class TurnFailed(KuralleError):
    """A run's turn ended in error (the node raised): printed as one line, exit code 1."""


def _opened_run(handle: TurnHandle) -> str | None:
    """The id of the run the turn opened, or None when it was refused before."""
    future = handle.run_id
    if future.done() and not future.cancelled() and future.exception() is None:
        return future.result()
    return None


async def turn_result(handle: TurnHandle) -> TurnResult:
    """The turn's result; an error after the run opened is one line naming the run."""
    try:
        return await handle.result()
    except Exception as e:
        run_id = _opened_run(handle)
        if run_id is None:
            raise  # refused before anything was written
        raise TurnFailed(
            f"run {run_id}: the turn ended in error: {type(e).__name__}: {e} "
            f"(kuralle-es runs show {run_id})"
        ) from None


def result_text(result: TurnResult) -> str:
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


async def stored_run(store: RunStore, run_id: str, *, history: bool = False) -> Run | None:
    """The run (an operator acts on its session, read from the store), or None, said on
    stderr; with ``history``, folded with every step it journaled (``load_history``)."""
    run = await store.load_async(run_id, history=history)
    if run is None:
        print(f"kuralle-es: RunNotFoundError: no run {run_id} in this store", file=sys.stderr)
    return run


def print_result(result: TurnResult) -> None:
    """A turn's result as indented JSON on stdout."""
    print(json.dumps(result.model_dump(mode="json"), indent=2))


#: What an operator command does to a run, given the runtime and the run's session.
RunAct = Callable[[Runtime, str], Coroutine[Any, Any, TurnResult]]
_T = TypeVar("_T")


async def act_on_run(
    args: argparse.Namespace,
    act: Callable[[Runtime, str], Awaitable[_T]],
    show: Callable[[_T], None] = print_result,  # type: ignore[assignment]
) -> int:
    """The operator commands that drive a run (approve, deny, signal, input, fork,
    migrate, runs resume, resolve-drift): ``act`` on run ``args.run_id`` with the
    agents of ``--app``, on behalf of the run's session, read from the store (the
    operator holds the store, not a session); its result is shown (``show``:
    a ``TurnResult`` as JSON by default). 1 when there is no such run (said on
    stderr)."""
    agents = load_agents(args.app)
    with open_store(args, must_exist=True) as store:
        # Refuses a bad --app before the run is read.
        runtime = driving_runtime(args, agents, store)
        run = await stored_run(store, args.run_id)
        if run is None:
            return 1
        result = await act(runtime, run.session_id)
    show(result)
    return 0


async def turn_of(run_id: str, work: Awaitable[_T]) -> _T:
    """``work``'s answer, where ``work`` drives a turn of run ``run_id`` without a handle
    (a delivery, a drift resolved): a refusal or a frozen error raises as itself (its
    class and message say it); a node that raised is one line naming the run."""
    try:
        return await work
    except KuralleError:
        raise
    except Exception as e:  # the node raised: the run is saved as error
        raise TurnFailed(
            f"run {run_id}: the turn ended in error: {type(e).__name__}: {e} "
            f"(kuralle-es runs show {run_id})"
        ) from None


#: The lease a command that drives a run takes, unless ``--lease-ttl`` says otherwise.
LEASE_TTL = 30.0
#: The longest ``ctx.sleep`` a command sleeps through, unless ``--inline-sleep-limit``.
INLINE_SLEEP_LIMIT = 1.0


def add_driving_options(parser: argparse.ArgumentParser, who: str = "this command") -> None:
    """``--lease-ttl`` and ``--inline-sleep-limit``: what every command that drives a
    run takes, so a crash inside it is recovered after the lease the operator chose,
    and a deployment whose sleeps must all be durable can say so."""
    parser.add_argument(
        "--lease-ttl",
        type=seconds_flag(),
        default=LEASE_TTL,
        metavar="SECONDS",
        help=f"the lease {who} takes on the runs it drives: if it dies, a worker takes "
        f"them over after that long (default {LEASE_TTL:g})",
    )
    parser.add_argument(
        "--inline-sleep-limit",
        type=seconds_flag(zero_ok=True),
        default=INLINE_SLEEP_LIMIT,
        metavar="SECONDS",
        help="a ctx.sleep this short is slept in the process; a longer one pauses the run "
        f"until a worker wakes it (0: every sleep pauses; default {INLINE_SLEEP_LIMIT:g})",
    )


def driving_runtime(
    args: argparse.Namespace, agents: list[Agent], store: RunStore, **more: Any
) -> Runtime:
    """The ``Runtime`` a command drives runs with: ``--app``'s agents over the store,
    with the command's ``--lease-ttl`` and ``--inline-sleep-limit``."""
    return Runtime(
        agents,
        store=store,
        lease_ttl=getattr(args, "lease_ttl", LEASE_TTL),
        inline_sleep_limit=getattr(args, "inline_sleep_limit", INLINE_SLEEP_LIMIT),
        **more,
    )


def add_common_options(
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
            "postgresql://user[:pw]@host[:port]/db (?partitions=K: K logs in it; several "
            "URLs, comma-separated: a store sharded over them), sqlite:///file.db "
            f"(sqlite:////abs.db) or memory: (env {STORE_ENV}; else PERSISTENCE_MODULE and "
            "its variables); "
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


def add_command(
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
    add_common_options(parser, top=False, store=store, app=app)
    parser.set_defaults(handler=handler, opens_store=store, uses_app=app)
    return parser


def add_fork_point(parser: argparse.ArgumentParser, run_help: str, at_help: str) -> None:
    """The run and ``--at N``, the first of its steps a fork executes afresh: what
    ``runs fork`` and ``deploy migrate`` (which forks) both take."""
    parser.add_argument("run_id", metavar="RUN_ID", help=run_help)
    parser.add_argument("--at", dest="at_step", type=int, required=True, metavar="N", help=at_help)


def seconds_flag(zero_ok: bool = False) -> Callable[[str], float]:
    """An argparse ``type=`` for a flag that takes seconds: refused as the Python API
    refuses it (NaN, infinities, not above 0), so ``--lease-ttl nan`` stops at once."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        try:
            return positive_seconds(value, "the number of seconds", zero_ok=zero_ok)
        except InvalidArgumentError as e:
            raise argparse.ArgumentTypeError(f"{e} (got {text!r})") from None

    return parse


def add_prices(parser: argparse.ArgumentParser) -> None:
    """``--prices JSON``: what a command that shows a cost prices tokens with."""
    parser.add_argument(
        "--prices",
        metavar="JSON",
        help=(
            "model -> [input_per_1k, output_per_1k], e.g. '{\"gpt-4o-mini\": [0.00015, 0.0006]}' "
            f"(env {PRICES_ENV}); without prices the cost is unknown"
        ),
    )


def prices_from_args(args: argparse.Namespace) -> dict[str, tuple[float, float]] | None:
    """The prices ``--prices`` (else ``KURALLE_PRICES``) gives, checked; None without."""
    text, source = args.prices, "--prices"
    if text is None:
        text, source = os.environ.get(PRICES_ENV) or None, PRICES_ENV
    if text is None:
        return None
    try:
        return prices_from_json(text, source)
    except InvalidArgumentError as e:
        raise CliError(str(e)) from None
