"""The commands that drive a run the way its users would (internal): ``say`` (a turn of a
session's conversation), ``input`` (the text a ``collect`` node waits for), ``runs resume``
(an errored run driven again) and ``resolve-drift`` (a run whose flow changed).

Each is one call of the Python API in this process, with the agents of ``--app``:
``runtime.run(session, input=..., agent=...)``, ``runtime.run(session, run_id=...,
input=...)``, ``runtime.run(session, run_id=...)`` and ``runtime.resolve_drift``.
A command that names a run acts on behalf of the run's session, read from the store,
as ``approve`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable

from .._runtime.runtime import RECOVERIES, Runtime
from ..shapes import RunState, TurnResult
from .common import (
    SubParsers,
    act_on_run,
    add_command,
    add_driving_options,
    driving_runtime,
    load_agents,
    open_store,
    print_result,
    result_text,
    turn_of,
    turn_result,
)

__all__ = ["add_drive", "add_runs_resume"]


def add_drive(sub: SubParsers) -> None:
    say = add_command(
        sub,
        "say",
        "a turn of a session's conversation: sends TEXT as the user, prints the reply "
        "(the conversation starts on first use)",
        _say,
    )
    say.add_argument("session", metavar="SESSION", help="the session whose conversation it is")
    say.add_argument("text", metavar="TEXT", help="what the user says; - reads it from stdin")
    say.add_argument(
        "--agent",
        metavar="A",
        help="the agent the conversation is with (default: the first of --app); a session "
        "keeps the agent it started with",
    )
    _add_turn_options(say)

    given = add_command(
        sub,
        "input",
        "answer a run waiting for input (a collect node's question) with TEXT, and drive "
        "it on here",
        _input,
    )
    given.add_argument("run_id", metavar="RUN_ID", help="the run waiting for input")
    given.add_argument("text", metavar="TEXT", help="the user's answer; - reads it from stdin")
    _add_turn_options(given)

    drift = add_command(
        sub,
        "resolve-drift",
        "settle a run whose flow changed since it started (FlowDriftError): restart it "
        "from the flow's start under the current definition, or abandon it",
        _resolve_drift,
    )
    drift.add_argument("run_id", metavar="RUN_ID", help="the drifted run")
    drift.add_argument("action", choices=RECOVERIES, help="restart or abandon")
    drift.add_argument("--json", action="store_true", help="the RunState after, as JSON")
    add_driving_options(drift)


def add_runs_resume(runs_sub: SubParsers) -> None:
    resume = add_command(
        runs_sub,
        "resume",
        "drive an errored (or orphaned) run again here: recorded steps replay, frozen "
        "errors stay frozen, a step in doubt (its outcome never recorded) runs again",
        _runs_resume,
    )
    resume.add_argument("run_id", metavar="RUN_ID", help="the run to drive again")
    resume.add_argument("--json", action="store_true", help="the TurnResult as JSON")
    add_driving_options(resume)


def _add_turn_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="a retry of this command with the same key is a no-op that prints the same result",
    )
    parser.add_argument("--json", action="store_true", help="the TurnResult as JSON")
    add_driving_options(parser)


async def _text(value: str) -> str:
    return await asyncio.to_thread(sys.stdin.read) if value == "-" else value


def _show_turn(args: argparse.Namespace) -> Callable[[TurnResult], None]:
    def show(result: TurnResult) -> None:
        if args.json:
            print_result(result)
        else:
            print(result_text(result))

    return show


# --------------------------------------------------------------------- say
def reply_text(result: TurnResult) -> str:
    """A conversation turn for a person: the reply, then what the run waits for when
    it paused instead. A turn paused on anything but input said nothing new (the
    result's output is still the last reply), so only its wait is printed."""
    lines = []
    wait = result.waiting_for
    asks = result.status != "paused" or (wait is not None and wait.kind == "input")
    if result.output is not None and asks:
        lines.append(result.output if isinstance(result.output, str) else json.dumps(result.output))
    if result.status == "paused" and wait is not None:
        what = f"{wait.kind} {wait.name}" + (f": {wait.title}" if wait.title else "")
        lines.append(f"(run {result.run_id} paused, waiting for {what})")
    elif result.status != "finished":
        lines.append(f"(run {result.run_id} {result.status})")
    return "\n".join(lines)


async def _say(args: argparse.Namespace) -> int:
    text = await _text(args.text)
    agents = load_agents(args.app)  # before the store: a bad --app creates no database
    with open_store(args) as store:
        runtime = driving_runtime(args, agents, store)
        handle = runtime.run(
            args.session, input=text, agent=args.agent, idempotency_key=args.idempotency_key
        )
        result = await turn_result(handle)
    if args.json:
        print_result(result)
    else:
        print(reply_text(result))
    return 0


# ------------------------------------------------------------------- input
async def _input(args: argparse.Namespace) -> int:
    text = await _text(args.text)

    async def answer(runtime: Runtime, session_id: str) -> TurnResult:
        handle = runtime.run(
            session_id, run_id=args.run_id, input=text, idempotency_key=args.idempotency_key
        )
        return await turn_result(handle)

    return await act_on_run(args, answer, _show_turn(args))


# ------------------------------------------------------------- runs resume
async def _runs_resume(args: argparse.Namespace) -> int:
    async def resume(runtime: Runtime, session_id: str) -> TurnResult:
        return await turn_result(runtime.run(session_id, run_id=args.run_id))

    return await act_on_run(args, resume, _show_turn(args))


# ----------------------------------------------------------- resolve-drift
async def _resolve_drift(args: argparse.Namespace) -> int:
    async def resolve(runtime: Runtime, session_id: str) -> RunState:
        return await turn_of(
            args.run_id, runtime.resolve_drift(args.run_id, session_id, args.action)
        )

    def show(state: RunState) -> None:
        if args.json:
            print(json.dumps(state.model_dump(mode="json"), indent=2))
            return
        line = f"run {state.run_id} is {state.status}"
        if state.outcome:
            line += f" ({state.outcome})"
        elif state.waiting_for is not None:
            line += f", waiting for {state.waiting_for.kind} {state.waiting_for.name}"
        print(line)

    return await act_on_run(args, resolve, show)
