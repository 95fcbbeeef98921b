"""The commands that serve over HTTP until stopped (internal): ``dashboard`` (the web
pages) and ``serve`` (the JSON API); each imports its extra only when run.
"""

from __future__ import annotations

import argparse
import os

from .common import (
    CliError,
    SubParsers,
    add_command,
    add_driving_options,
    driving_runtime,
    load_agents,
    open_store,
    store_label,
)


def _add_bind(parser: argparse.ArgumentParser, token_env: str, port: int) -> None:
    """``--host``, ``--port`` and ``--allowed-host``: both servers bind the loopback
    interface by default, and any other only with a token in ``token_env`` and the
    names clients reach it by (checked before anything opens)."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help=f"the interface to bind (default 127.0.0.1; another needs {token_env})",
    )
    parser.add_argument("--port", type=int, default=port, help=f"the port (default {port})")
    parser.add_argument(
        "--allowed-host",
        action="append",
        dest="allowed_hosts",
        metavar="NAME",
        help=(
            "a host name clients reach the server by, answered besides the loopback names "
            "(repeatable; default KURALLE_ALLOWED_HOSTS, comma-separated); any other Host is 400"
        ),
    )


# --------------------------------------------------------------- dashboard
def add_dashboard(sub: SubParsers) -> None:
    dash = add_command(
        sub, "dashboard", "web pages over the runs; approve or deny from a browser", _dashboard
    )
    _add_bind(dash, "KURALLE_DASHBOARD_TOKEN", 8765)
    add_driving_options(dash, "the dashboard")


async def _dashboard(args: argparse.Namespace) -> int:
    try:  # the `dashboard` extra: imported only by this command
        from ..dashboard import TOKEN_ENV, check_bind, serve
    except ImportError as e:
        raise CliError(f"the dashboard needs: pip install 'kuralle_es[dashboard]' ({e})") from None
    token = os.environ.get(TOKEN_ENV) or None
    check_bind(args.host, token, args.allowed_hosts)  # before anything is opened
    # Only a dashboard with a token can deliver decisions, so only it needs the agents.
    agents = load_agents(args.app) if token else []
    with open_store(args, must_exist=True) as store:
        await serve(
            store,
            lambda s: driving_runtime(args, agents, s),
            args.host,
            args.port,
            token,
            allowed_hosts=args.allowed_hosts,
            store_label=store_label(args),
        )
    return 0


# ------------------------------------------------------------------- serve
def add_serve(sub: SubParsers) -> None:
    serve = add_command(
        sub, "serve", "the HTTP API over the runs, JSON in and out (docs/http.md)", _serve
    )
    _add_bind(serve, "KURALLE_API_TOKEN", 8000)
    add_driving_options(serve, "the server")


async def _serve(args: argparse.Namespace) -> int:
    try:  # the `http` extra (FastAPI, uvicorn): imported only by this command
        from ..http import TOKEN_ENV, check_bind, serve
    except ImportError as e:
        raise CliError(f"serve needs: pip install 'kuralle_es[http]' ({e})") from None
    token = os.environ.get(TOKEN_ENV) or None
    check_bind(args.host, token, args.allowed_hosts)  # before anything is opened
    agents = load_agents(args.app)  # starts and deliveries drive runs in this process
    with open_store(args) as store:
        runtime = driving_runtime(args, agents, store)
        await serve(
            runtime, args.host, args.port, token,
            allowed_hosts=args.allowed_hosts, store_label=store_label(args),
        )  # fmt: skip
    return 0
