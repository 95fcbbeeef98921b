"""The ``erase`` and ``runs prune`` commands (internal): forget one data subject, delete
old ended runs. Neither loads ``--app`` (docs/privacy.md).
"""

from __future__ import annotations

import argparse

from .._runtime.erasure import erase_subject
from .._runtime.retention import ENDED, ended_before_of, prune_runs
from ..views import RunViews
from .common import SubParsers, add_command, open_store

__all__ = ["add_erase", "add_prune"]


def add_erase(sub: SubParsers) -> None:
    erase = add_command(
        sub,
        "erase",
        "forget a data subject: abort its live runs and destroy its key, so every payload "
        "of its runs reads [redacted]",
        _erase,
        app=False,
    )
    erase.add_argument(
        "subject", metavar="SUBJECT", help="the subject (a run's session id by default)"
    )
    erase.add_argument("--json", action="store_true", help="print the ErasureReport as JSON")


def add_prune(runs_sub: SubParsers) -> None:
    prune = add_command(
        runs_sub,
        "prune",
        "delete ended runs (events, snapshots, view rows) that ended before a date",
        _prune,
        app=False,
    )
    prune.add_argument(
        "--ended-before", required=True, metavar="ISO-8601", help="the cut-off, e.g. 2025-01-31"
    )
    prune.add_argument(
        "--status",
        action="append",
        choices=ENDED,
        help="only runs of this status (repeatable; default: finished, aborted, error)",
    )
    prune.add_argument(
        "--drop-usage",
        action="store_true",
        help="also delete what the runs spent from the views (kept by default)",
    )
    prune.add_argument("--json", action="store_true", help="print the PruneReport as JSON")


async def _erase(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True) as store:
        report = await erase_subject(store, RunViews(store), args.subject)
    if args.json:
        print(report.model_dump_json())
    else:
        print(
            f"subject {report.subject!r} erased: {len(report.runs)} runs now read "
            f"[redacted], {len(report.aborted)} aborted"
        )
    return 0


async def _prune(args: argparse.Namespace) -> int:
    cutoff = ended_before_of(args.ended_before)
    with open_store(args, must_exist=True) as store:
        report = await prune_runs(
            store,
            RunViews(store),
            cutoff,
            tuple(args.status or ENDED),
            keep_usage=not args.drop_usage,
        )
    if args.json:
        print(report.model_dump_json())
    else:
        print(
            f"pruned {len(report.runs)} runs ({report.events} events) that ended before "
            f"{report.ended_before.isoformat()}"
        )
    return 0
