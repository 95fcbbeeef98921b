"""The sweeping commands (internal): ``worker`` runs the sweeper until stopped; ``recover``
(orphaned runs) and ``sweep`` (expired deadlines, due timers) make one pass each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal as signals
import sys

from .._journal.store import RunStore
from .._operations.recovery import (
    IN_DOUBT_IDLE,
    create_sweep_job_runner,
    fire_timers,
    recover_orphaned_runs,
    start_run_sweeper,
    sweep_deadlines,
)
from .._runtime.runtime import Runtime
from ..errors import FlowNotFoundError
from .common import (
    SubParsers,
    add_command,
    add_driving_options,
    app_hint,
    driving_runtime,
    load_agents,
    open_store,
    seconds_flag,
    store_label,
)
from .sweep_logs import collect_skips, log_to_stderr, report_skips


def add_recovery(sub: SubParsers) -> None:
    worker = add_command(
        sub,
        "worker",
        "the sweeper as a long-running process: recover orphaned runs, deny expired "
        "deadlines, wake due timers, every --interval seconds until SIGTERM/Ctrl-C",
        _worker,
    )
    worker.add_argument(
        "--interval",
        type=seconds_flag(),
        default=5.0,
        help="seconds between sweep passes (default 5)",
    )
    worker.add_argument("--verbose", action="store_true", help="also log each turn's lines")
    worker.add_argument(
        "--resume-in-doubt",
        action="store_true",
        help="also resume runs in error whose last step is in doubt (a model call that "
        "failed): off by default, since that step's effect then runs again with no one "
        "looking, and a lasting error repeats (docs/howto/recovery.md)",
    )
    worker.add_argument(
        "--resume-in-doubt-after",
        type=seconds_flag(zero_ok=True),
        default=IN_DOUBT_IDLE,
        metavar="SECONDS",
        help="with --resume-in-doubt: how long such a run is left alone first, and between "
        f"two tries (default {IN_DOUBT_IDLE:g})",
    )
    recover = add_command(
        sub, "recover", "one pass: drive every orphaned run (its lease expired) again", _recover
    )
    sweep = add_command(
        sub, "sweep", "one pass: deny expired deadlines and wake due timers", _sweep
    )
    for parser in (worker, recover, sweep):
        add_driving_options(parser, "this worker")
        parser.add_argument(
            "--holder",
            metavar="NAME",
            help="this worker's lease holder name (default host:pid:random, new each start)",
        )


def _sweeping_runtime(args: argparse.Namespace, store: RunStore) -> Runtime:
    return driving_runtime(args, load_agents(args.app), store, holder=args.holder)


def stop_before_started(signum: int, frame: object) -> None:
    """SIGTERM before the worker's loop handles it: it holds nothing yet, so stop now."""
    print("worker stopped before it started (nothing held)", file=sys.stderr, flush=True)
    os._exit(0)


async def _worker(args: argparse.Namespace) -> int:
    logger = log_to_stderr(args.verbose)
    hinted: set[str] = set()

    def hint(run_id: str, error_type: str, message: str) -> None:
        if error_type == FlowNotFoundError.__name__ and run_id not in hinted:
            hinted.add(run_id)  # once per run, not every pass
            logger.warning("run %s skipped: %s: %s; %s", run_id, error_type, message,
                           app_hint(args))  # fmt: skip

    with open_store(args) as store, collect_skips(hint):
        runtime = _sweeping_runtime(args, store)
        in_doubt = args.resume_in_doubt_after if args.resume_in_doubt else None
        job = create_sweep_job_runner(runtime, resume_in_doubt=in_doubt)
        sweeper = start_run_sweeper(job, interval=args.interval)
        loop = asyncio.get_running_loop()
        for sig in (signals.SIGTERM, signals.SIGINT):
            loop.add_signal_handler(sig, sweeper.stop)
        logger.info(
            "worker started holder=%s interval=%s lease_ttl=%s inline_sleep_limit=%s "
            "resume_in_doubt=%s pid=%s store=%s app=%s",
            runtime.holder, args.interval, args.lease_ttl, args.inline_sleep_limit,
            "off" if in_doubt is None else f"after {in_doubt:g}s", os.getpid(),
            store_label(args), args.app,
        )  # fmt: skip
        await sweeper.wait()
        logger.info("worker stopped holder=%s passes=%s", runtime.holder, sweeper.passes)
    return 0


async def _recover(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True) as store, collect_skips() as skips:
        recovered = await recover_orphaned_runs(_sweeping_runtime(args, store))
    for run_id in recovered:
        print(f"recovered {run_id}")
    code = report_skips(args, skips)
    print(f"{len(recovered)} run(s) recovered, {len(skips.skipped)} skipped", file=sys.stderr)
    return code


async def _sweep(args: argparse.Namespace) -> int:
    with open_store(args, must_exist=True) as store, collect_skips() as skips:
        runtime = _sweeping_runtime(args, store)
        swept = await sweep_deadlines(runtime)
        woken = await fire_timers(runtime)
    for run_id in swept:
        print(f"swept {run_id}")
    for run_id in woken:
        print(f"woken {run_id}")
    code = report_skips(args, skips)
    print(
        f"{len(swept)} deadline(s) denied, {len(woken)} timer(s) fired, "
        f"{len(skips.skipped)} run(s) skipped",
        file=sys.stderr,
    )
    return code
