"""The deploy commands (internal): ``check`` replays the live runs against new code,
``migrate`` moves a live flow run onto the newest definition of its flow, ``replay``
re-drives recorded runs under new code or a new model (its handler: ``replay``).
"""

from __future__ import annotations

import argparse
import json
import sys

from .._operations.replay_check import RunCheck, check_runs
from .common import (
    SubParsers,
    act_on_run,
    add_command,
    add_driving_options,
    add_fork_point,
    add_prices,
    load_agents,
    open_store,
)
from .replay import replay_command


def add_deploy(sub: SubParsers) -> None:
    check = add_command(
        sub,
        "check",
        "replay every live run against --app without executing or writing anything; "
        "exit 1 if one would not resume (docs/deploying.md)",
        _check,
    )
    check.add_argument("--json", action="store_true", help="a JSON array, one object per run")
    migrate = add_command(
        sub,
        "migrate",
        "fork a live flow run at step N onto the newest definition of its flow in --app, "
        "then stop the original (outcome 'migrated: FORK_ID')",
        _migrate,
    )
    add_fork_point(
        migrate,
        "the live flow run to move",
        "the first step to execute afresh under the new definition: 0 to the step count",
    )
    add_driving_options(migrate)
    _add_replay(sub)


def _add_replay(sub: SubParsers) -> None:
    replay = add_command(
        sub,
        "replay",
        "re-drive recorded runs under --app (new code, a new prompt or model) without "
        "executing a tool or writing anything to the runs; say how many would decide "
        "differently and how the cost would change (docs/howto/evaluating-models.md)",
        replay_command,
    )
    replay.add_argument(
        "run_id", nargs="?", metavar="RUN_ID", help="one run (else the runs the filters select)"
    )
    replay.add_argument(
        "--since", metavar="ISO-8601", help="runs updated at or after this time (UTC if naive)"
    )
    replay.add_argument("--flow", metavar="NAME", help="only runs of this flow")
    replay.add_argument("--session", metavar="ID", help="only this session's runs")
    replay.add_argument(
        "--limit", type=int, default=1000, metavar="N", help="at most N runs, the latest"
    )
    add_prices(replay)
    replay.add_argument(
        "--json", action="store_true", help="one JSON object: runs and summary (for CI)"
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
    return await act_on_run(
        args, lambda runtime, session_id: runtime.migrate(args.run_id, session_id, args.at_step)
    )
