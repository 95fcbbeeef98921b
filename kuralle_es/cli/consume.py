"""The ``consume`` command (internal): run one of the package's event consumers until
stopped, or once to catch up.
"""

from __future__ import annotations

import argparse

from ..examples import approval_notifier
from .common import SubParsers, add_command, open_store


def add_consume(sub: SubParsers) -> None:
    consume = add_command(
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
