"""The delivery commands (internal): ``approve``, ``deny``, ``signal`` and ``in-doubt``
deliver to a waiting run on behalf of its session and drive it on in this process;
``send`` puts a message in a run's mailbox, driving the run on here when a ``receive``
waited for it. docs/operators.md says which command answers which wait.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from .._journal.json_data import decode_json
from .._runtime.deliveries import IN_DOUBT_ACTIONS, NO_RESULT, in_doubt_delivery
from .._runtime.runtime import Runtime
from ..shapes import TurnResult
from .common import (
    CliError,
    Handler,
    RunAct,
    SubParsers,
    act_on_run,
    add_command,
    add_driving_options,
    turn_of,
)


def _delivery_command(
    sub: SubParsers, name: str, help: str, handler: Handler
) -> argparse.ArgumentParser:
    """A command that delivers to a paused run, named by its first argument."""
    parser = add_command(sub, name, help, handler)
    parser.add_argument("run_id", metavar="RUN_ID", help="the paused run's id")
    add_driving_options(parser)
    return parser


def add_deliveries(sub: SubParsers) -> None:
    approve = _delivery_command(sub, "approve", "approve what a run waits for", _approve)
    approve.add_argument("--by", required=True, metavar="NAME", help="who approves (the actor)")
    approve.add_argument("--reason", help="why (kept in the journal)")
    approve.add_argument("--signal-id", help="makes a retry of this command a no-op")
    approve.add_argument(
        "--raise-to",
        metavar="JSON",
        help='for a run waiting on its budget: the limits to raise, e.g. \'{"max_total_tokens": '
        "20000}' (docs/usage.md)",
    )

    deny = _delivery_command(sub, "deny", "deny what a run waits for", _deny)
    deny.add_argument("--by", required=True, metavar="NAME", help="who denies (the actor)")
    deny.add_argument("--reason", required=True, help="why (the model or node sees it)")
    deny.add_argument("--signal-id", help="makes a retry of this command a no-op")

    signal = _delivery_command(sub, "signal", "deliver a named signal to a waiting run", _signal)
    signal.add_argument("name", metavar="NAME", help="the signal the run waits for")
    _payload_option(signal)
    signal.add_argument("--signal-id", help="makes a retry of this command a no-op")
    signal.add_argument("--actor", metavar="NAME", help="who sends it (kept in the journal)")

    doubt = _delivery_command(
        sub, "in-doubt",
        "answer a step in doubt (its process died mid-call): retry it, resolve it with its "
        "result, or fail it", _in_doubt,
    )  # fmt: skip
    doubt.add_argument(
        "action",
        choices=IN_DOUBT_ACTIONS,
        metavar="retry|resolve|fail",
        help="retry: execute it again under its key; resolve: record --result, execute "
        "nothing; fail: record a failure (the node sees ToolExecutionError)",
    )
    doubt.add_argument("--by", required=True, metavar="NAME", help="who answers (the actor)")
    doubt.add_argument(
        "--result",
        metavar="JSON",
        help="resolve: the result to record, as JSON; @FILE reads it from a file, - from stdin",
    )
    doubt.add_argument("--message", help="fail: what the failure says")
    doubt.add_argument("--signal-id", help="makes a retry of this command a no-op")

    send = _delivery_command(
        sub, "send", "put a message in a run's mailbox (ctx.receive takes it)", _send
    )
    send.add_argument("name", metavar="NAME", help="the message's name")
    _payload_option(send)
    send.add_argument(
        "--message-id",
        required=True,
        metavar="ID",
        help="the message's id: a retry with it is a no-op",
    )
    send.add_argument("--actor", metavar="NAME", help="who sends it (kept in the journal)")


def _payload_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--payload",
        default="null",
        metavar="JSON",
        help="the payload, as JSON; @FILE reads it from a file, - from stdin (default null)",
    )


async def _deliver(args: argparse.Namespace, act: RunAct) -> int:
    """A delivery resumes the run here: a node that raises fails the command with
    what the turn ended in, where a refusal or frozen error raises as itself."""

    async def delivered(runtime: Runtime, session_id: str) -> TurnResult:
        return await turn_of(args.run_id, act(runtime, session_id))

    return await act_on_run(args, delivered)


async def _approve(args: argparse.Namespace) -> int:
    return await _deliver(
        args,
        lambda runtime, session: runtime.approve(
            args.run_id,
            session,
            by=args.by,
            reason=args.reason,
            signal_id=args.signal_id,
            raise_to=_raise_to(args.raise_to),
        ),
    )


def _raise_to(text: str | None) -> dict[str, Any] | None:
    """``approve --raise-to JSON``: a mapping of budget limits, or a clear refusal."""
    if text is None:
        return None
    try:
        value = decode_json(text)
    except ValueError as e:
        msg = f"--raise-to is not JSON ({e}); e.g. '{{\"max_total_tokens\": 20000}}'"
        raise CliError(msg) from None
    if not isinstance(value, dict):
        raise CliError(f"--raise-to must be a JSON object of budget limits, got {text}")
    return value


async def _deny(args: argparse.Namespace) -> int:
    return await _deliver(
        args,
        lambda runtime, session: runtime.deny(
            args.run_id, session, by=args.by, reason=args.reason, signal_id=args.signal_id
        ),
    )


def _payload_text(value: str, flag: str = "--payload") -> str:
    """A JSON option (``--payload``, ``--result``) as given, or read from ``@FILE`` or
    ``-`` (stdin): a payload too big for the command line (``Argument list too long``)
    goes through either."""
    if value == "-":
        return sys.stdin.read()
    if value.startswith("@"):
        try:
            return Path(value[1:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"cannot read {flag} {value}: {e}") from None
    return value


async def _json_option(value: str, flag: str) -> Any:
    """A JSON option's value (given, ``@FILE`` or ``-``), or a clear refusal."""
    text = await asyncio.to_thread(_payload_text, value, flag)
    try:
        return decode_json(text)
    except ValueError as e:
        raise CliError(f"{flag} is not JSON: {e}") from None


async def _payload(args: argparse.Namespace) -> Any:
    return await _json_option(args.payload, "--payload")


async def _in_doubt(args: argparse.Namespace) -> int:
    result = NO_RESULT if args.result is None else await _json_option(args.result, "--result")
    delivery = in_doubt_delivery(
        args.action, by=args.by, result=result, message=args.message, signal_id=args.signal_id
    )
    return await _deliver(
        args,
        lambda runtime, session: runtime.run(
            session, run_id=args.run_id, signal_delivery=delivery
        ).result(),
    )


async def _send(args: argparse.Namespace) -> int:
    payload = await _payload(args)
    return await _deliver(
        args,
        lambda runtime, session: runtime.send(
            args.run_id, session, args.name, payload, message_id=args.message_id, actor=args.actor
        ),
    )


async def _signal(args: argparse.Namespace) -> int:
    payload = await _payload(args)
    return await _deliver(
        args,
        lambda runtime, session: runtime.signal(
            args.run_id, session, args.name, payload, signal_id=args.signal_id, actor=args.actor
        ),
    )
