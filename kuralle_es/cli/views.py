"""The ``views`` commands (internal): ``follow`` keeps the run views current, ``rebuild``
projects the whole log again, ``status`` compares their position with the log's
(each partition's, in a partitioned store).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal as signals
import sys
import threading

from ..views import RunViews
from ..views.api import open_backend
from ..views.projector import DEFAULT_BATCH, follow_store
from .common import CliError, SubParsers, add_command, open_store, seconds_flag, store_label


def add_views(sub: SubParsers) -> None:
    views = sub.add_parser("views", help="keep the run views current, or rebuild them")
    views_sub = views.add_subparsers(dest="views_command", required=True, metavar="COMMAND")
    follow_ = add_command(
        views_sub,
        "follow",
        "project new events into the views until SIGTERM/Ctrl-C",
        _follow,
        app=False,
    )
    follow_.add_argument(
        "--interval",
        type=seconds_flag(),
        default=0.2,
        help="seconds between polls (SQLite, memory)",
    )
    follow_.add_argument(
        "--batch",
        type=int,
        default=DEFAULT_BATCH,
        help=f"events per transaction while catching up (default {DEFAULT_BATCH})",
    )
    add_command(
        views_sub, "rebuild", "empty the views and project the whole log again", _rebuild, app=False
    )
    add_command(
        views_sub, "status", "the views' position against the log's last event", _status, app=False
    )


async def _follow(args: argparse.Namespace) -> int:
    if args.batch < 1:
        raise CliError(f"--batch must be at least 1, got {args.batch}")
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    for sig in (signals.SIGTERM, signals.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with open_store(args) as store:
        print(
            f"kuralle-es: following the run views of store {store_label(args)} (pid {os.getpid()})",
            file=sys.stderr,
        )
        await asyncio.to_thread(
            follow_store,
            store.partitions,
            open_backend,
            stop,
            interval=args.interval,
            batch=args.batch,
        )
    return 0


async def _rebuild(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True) as store:
        applied = await RunViews(store).rebuild()
    print(f"rebuilt the run views from {applied} event(s)")
    return 0


async def _status(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True, read_only=True) as store:
        positions = await RunViews(store).positions()
        heads = await asyncio.gather(
            *(asyncio.to_thread(log.recorder.max_notification_id) for log in store.partitions)
        )
    for (partition, position), head in zip(positions.items(), heads, strict=True):
        where = f"partition {partition}: " if len(heads) > 1 else ""
        print(f"{where}views at event {position or 0} of {head or 0}")
    return 0
