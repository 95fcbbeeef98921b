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

Each command is one ``add_*`` function (its parser and its handler) listed
in ``COMMANDS``: adding a command is adding a function to that list. The
functions live in one module per group of commands (``demo``, ``runs``,
``deliveries``, ``drive``, ``cancel``, ``views``, ``servers``, ``consume``, ``sweeps``,
``deploy``); what they share is in ``common`` (and ``sweep_logs``); this module
holds the parser and ``main``. All of them but this one are internal.
"""

from __future__ import annotations

import argparse
import asyncio
import signal as signals
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

from .._journal.store_url import STORE_ENV
from ..errors import FlowNotFoundError, InvalidArgumentError, KuralleError, StoreUnavailableError
from .cancel import add_cancel
from .common import (
    APP_ENV,
    DEFAULT_APP,
    NO_STORE,
    CliError,
    Handler,
    SubParsers,
    TurnFailed,
    add_common_options,
    app_hint,
    load_agents,
    open_store,
    store_label,
    store_named,
)
from .consume import add_consume
from .deliveries import add_deliveries
from .demo import add_demo
from .deploy import add_deploy
from .drive import add_drive
from .privacy import add_erase
from .runs import add_runs, format_runs, format_usage
from .servers import add_dashboard, add_serve
from .sweeps import add_recovery, stop_before_started
from .views import add_views

__all__ = [
    "APP_ENV",
    "COMMANDS",
    "DEFAULT_APP",
    "NO_STORE",
    "build_parser",
    "format_runs",
    "format_usage",
    "load_agents",
    "main",
    "open_store",
    "store_label",
    "store_named",
]


def _version() -> str:
    try:
        return version("kuralle_es")
    except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
        return "unknown"


#: Every command: each adds its parser (and handler) to the subparsers.
COMMANDS: list[Callable[[SubParsers], None]] = [
    add_demo, add_runs, add_deliveries, add_drive, add_cancel, add_views, add_dashboard,
    add_consume, add_recovery, add_serve, add_deploy, add_erase,
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
    add_common_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if "worker" in (sys.argv[1:] if argv is None else argv):
        # Until the worker's loop handles SIGTERM, a stop request ends it at once.
        signals.signal(signals.SIGTERM, stop_before_started)
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    if getattr(args, "opens_store", False) and not store_named(args):
        # Never an empty in-memory store nobody asked for (--store memory: asks).
        print(f"kuralle-es: {NO_STORE}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(handler(args))
    except (StoreUnavailableError, CliError) as e:
        print(f"kuralle-es: {e}", file=sys.stderr)
        return 2
    except TurnFailed as e:
        print(f"kuralle-es: {e}", file=sys.stderr)
        return 1
    except KuralleError as e:
        # A refusal is an answer, not a crash: say what and what to do, no traceback.
        print(f"kuralle-es: {type(e).__name__}: {e}", file=sys.stderr)
        if getattr(args, "uses_app", False) and _lacks_definitions(e):
            print(f"kuralle-es: {app_hint(args)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
