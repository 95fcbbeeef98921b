"""The ``cancel`` command (internal): abort a flow run, or end a conversation's current
turn, without loading ``--app``.
"""

from __future__ import annotations

import argparse

from .._runtime.cancel import cancel_run
from .common import SubParsers, add_command, open_store, stored_run


def add_cancel(sub: SubParsers) -> None:
    cancel = add_command(
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
        run = await stored_run(store, args.run_id)
        if run is None:
            return 1
        state = await cancel_run(store, args.run_id, run.session_id, args.reason)
    print(f"run {state.run_id} is {state.status} ({state.outcome})")
    return 0
