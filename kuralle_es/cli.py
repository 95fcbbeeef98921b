"""The ``kuralle-es`` command: the demo, and operating runs from a shell.

Persistence comes from the same environment variables as ``RunStore()``
(``PERSISTENCE_MODULE``, ``SQLITE_DBNAME``, ``POSTGRES_*``), or ``--sqlite``.
Commands that resume runs need the agents that define their flows:
``--app module:attribute`` (or ``KURALLE_APP``) names a list of agents or a
callable returning one; the default is the refund example.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from uuid import uuid4

from .agents import Agent
from .errors import KuralleError
from .examples import refund
from .models import SignalDelivery, TurnResult
from .runtime import Runtime
from .store import RunStore
from .timeline import format_timeline

DEFAULT_APP = "kuralle_es.examples.refund:build_agent"


def _load_agents(spec: str) -> list[Agent]:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        msg = f"--app must look like module:attribute, got {spec!r}"
        raise SystemExit(msg)
    target: Any = getattr(importlib.import_module(module_name), attribute)
    if callable(target) and not isinstance(target, Agent):
        target = target()
    agents = [target] if isinstance(target, Agent) else list(target)
    if not all(isinstance(a, Agent) for a in agents):
        msg = f"{spec} is not an agent, a list of agents, or a callable returning them"
        raise SystemExit(msg)
    return agents


def _store(args: argparse.Namespace) -> RunStore:
    if args.sqlite:
        return RunStore.sqlite(args.sqlite)
    return RunStore()


def _runtime(args: argparse.Namespace) -> Runtime:
    return Runtime(_load_agents(args.app), store=_store(args))


def _print_result(result: TurnResult) -> None:
    print(json.dumps(result.model_dump(mode="json"), indent=2))


async def _show(runtime: Runtime, run_id: str) -> int:
    run = await asyncio.to_thread(runtime.store.load, run_id)
    if run is None:
        print(f"no run {run_id}", file=sys.stderr)
        return 1
    print(format_timeline(run.to_state(), run.step_records()))
    return 0


async def _deliver(runtime: Runtime, run_id: str, delivery: SignalDelivery) -> int:
    # An operator acts on behalf of the run's session, read from the store.
    run = await asyncio.to_thread(runtime.store.load, run_id)
    if run is None:
        print(f"no run {run_id}", file=sys.stderr)
        return 1
    handle = runtime.run(session_id=run.session_id, run_id=run_id, signal_delivery=delivery)
    _print_result(await handle.result())
    return 0


def _approval(args: argparse.Namespace, approved: bool) -> SignalDelivery:
    payload: dict[str, Any] = {"approved": approved, "by": args.by}
    if getattr(args, "reason", None):
        payload["reason"] = args.reason
    return SignalDelivery(
        signal_id=args.signal_id or f"cli-{uuid4().hex}",
        name="__approval",
        payload=payload,
        actor=args.by,
    )


def _run_process(command: list[str]) -> None:
    done = subprocess.run(
        command, check=True, env=os.environ.copy(), capture_output=True, text=True
    )
    result = TurnResult.model_validate_json(done.stdout)
    print(f"   that process's turn: status={result.status} output={result.output!r}")


async def _turn(runtime: Runtime, handle_args: dict[str, Any]) -> TurnResult:
    handle = runtime.run(**handle_args)
    async for part in handle:
        if part.type == "text":
            print(f"   assistant: {part.text}")
        elif part.type in ("tool-call", "tool-result"):
            detail = part.args if part.type == "tool-call" else part.result
            print(f"   {part.type}: {part.tool_name} {json.dumps(detail)}")
        elif part.type == "paused" and part.waiting_for is not None:
            print(f"   paused: waiting for {part.waiting_for.kind} ({part.waiting_for.title})")
    return await handle.result()


async def _demo(args: argparse.Namespace) -> int:
    """The durable refund flow on SQLite, offline, resumed by a second process."""
    workdir = Path(args.dir)
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    db = workdir / "refund.db"
    ledger = workdir / "ledger.jsonl"
    for path in (db, ledger):
        path.unlink(missing_ok=True)
    os.environ[refund.LEDGER_ENV] = str(ledger)
    if args.model:
        os.environ[refund.MODEL_ENV] = args.model

    print(f"== process {os.getpid()}: a customer asks for a refund (SQLite: {db})")
    store = RunStore.sqlite(str(db))
    try:
        runtime = Runtime([refund.build_agent()], store=store)
        print("   user: Hi, I'd like a refund for my order.")
        first = await _turn(
            runtime,
            {
                "session_id": "demo-session",
                "input": "Hi, I'd like a refund for my order.",
                "kind": "flow",
                "flow_name": "refund",
            },
        )
        print("   user: It was $42.50.")
        second = await _turn(
            runtime,
            {"session_id": "demo-session", "run_id": first.run_id, "input": "It was $42.50."},
        )
        print(f"   the turn ended cleanly: status={second.status}")
    finally:
        store.close()

    print("== a NEW process resumes the run by id and delivers the supervisor's approval")
    command = [
        sys.executable,
        "-m",
        "kuralle_es.cli",
        "--sqlite",
        str(db),
        "approve",
        second.run_id,
        "--by",
        "supervisor",
        "--signal-id",
        "approval-1",
    ]
    await asyncio.to_thread(_run_process, command)
    print("== the approval webhook is retried from a third process: a no-op")
    await asyncio.to_thread(_run_process, command)

    refunds = [e for e in refund.ledger_entries() if e["tool"] == "processRefund"]
    print(f"== processRefund executed {len(refunds)} time(s) (the payment's own ledger)")

    print("== the run's journal")
    store = RunStore.sqlite(str(db))
    try:
        run = store.load(second.run_id)
        assert run is not None
        state = run.to_state()
        print(format_timeline(state, run.step_records()))
        for message in state.messages:
            print(f"   {message.role}: {message.content}")
    finally:
        store.close()
    return 0 if len(refunds) == 1 and state.status == "finished" else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kuralle-es", description=__doc__)
    parser.add_argument("--sqlite", help="SQLite file (else PERSISTENCE_MODULE and friends)")
    parser.add_argument(
        "--app",
        default=os.environ.get("KURALLE_APP", DEFAULT_APP),
        help="module:attribute naming the agents (env KURALLE_APP)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the durable refund flow on SQLite, offline")
    demo.add_argument("--dir", default=os.environ.get("KURALLE_DEMO_DIR", ".demo"))
    demo.add_argument("--model", help="'openai:gpt-4o-mini' for a real model (OPENAI_API_KEY)")

    runs = sub.add_parser("runs", help="inspect runs")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    show = runs_sub.add_parser("show", help="a run's journal as a timeline")
    show.add_argument("run_id")

    approve = sub.add_parser("approve", help="approve what a run waits for")
    approve.add_argument("run_id")
    approve.add_argument("--by", required=True)
    approve.add_argument("--signal-id")

    deny = sub.add_parser("deny", help="deny what a run waits for")
    deny.add_argument("run_id")
    deny.add_argument("--by", required=True)
    deny.add_argument("--reason", required=True)
    deny.add_argument("--signal-id")

    signal = sub.add_parser("signal", help="deliver a named signal")
    signal.add_argument("run_id")
    signal.add_argument("name")
    signal.add_argument("--payload", default="null", help="JSON")
    signal.add_argument("--signal-id")
    signal.add_argument("--actor")
    return parser


async def _main(args: argparse.Namespace) -> int:
    if args.command == "demo":
        return await _demo(args)
    runtime = _runtime(args)
    try:
        if args.command == "runs":
            return await _show(runtime, args.run_id)
        if args.command == "approve":
            return await _deliver(runtime, args.run_id, _approval(args, True))
        if args.command == "deny":
            return await _deliver(runtime, args.run_id, _approval(args, False))
        try:
            payload = json.loads(args.payload)
        except json.JSONDecodeError as e:
            print(f"--payload is not JSON: {e}", file=sys.stderr)
            return 2
        delivery = SignalDelivery(
            signal_id=args.signal_id or f"cli-{uuid4().hex}",
            name=args.name,
            payload=payload,
            actor=args.actor,
        )
        return await _deliver(runtime, args.run_id, delivery)
    finally:
        runtime.store.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except KuralleError as e:
        # A refusal is an answer, not a crash: say what and what to do, no traceback.
        print(f"kuralle-es: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
