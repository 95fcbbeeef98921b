"""The one child OS process of the tests: one turn over a shared SQLite or PostgreSQL database.

    child.py APP BACKEND TARGET LEDGER SESSION start FLOW [TEXT]
    child.py APP BACKEND TARGET LEDGER SESSION input RUN_ID TEXT
    child.py APP BACKEND TARGET LEDGER SESSION resume RUN_ID
    child.py APP BACKEND TARGET LEDGER SESSION deliver RUN_ID|- SIGNAL_ID NAME PAYLOAD_JSON
    child.py APP BACKEND TARGET LEDGER SESSION decide RUN_ID SIGNAL_ID approved|declined BY

``APP`` selects the agent, imported from the module the parent imports too, so
that every flow digest and schema topic is the same in both processes:

- ``flows``: ``procs.flows.make_agent(LEDGER)`` (approval, in-doubt and typed
  signal flows; ``KT_DIE_AT`` and ``KT_AMOUNT`` steer it);
- ``control``: ``procs.control.make_agent(LEDGER)`` (execution control;
  ``KT_INTERVAL`` and ``KT_SLOW`` steer it);
- ``crashy``: ``procs.crashy.crash_agent(LEDGER, die_in_tool=True)``: its tool
  SIGKILLs the child once the step's intent is journaled;
- ``refund``: the refund example, ``kuralle_es.examples.refund.build_agent()``;
  ``LEDGER`` is handed to it as ``REFUND_LEDGER`` (``-``: keep the inherited one).

``BACKEND`` is ``sqlite`` (``TARGET`` a file), ``postgres`` (``TARGET`` a DSN)
or ``url`` (``TARGET`` a store URL, such as a sharded store's).
The commands:

- ``start FLOW [TEXT]``: a new run of the flow, with input ``TEXT`` (default ``go``);
- ``input RUN_ID TEXT``: the user's next message to the run;
- ``resume RUN_ID``: re-address the run, with nothing new;
- ``deliver RUN_ID|- SIGNAL_ID NAME PAYLOAD_JSON``: a signal, actor ``child``
  (``-``: to the session's run that waits for it);
- ``decide RUN_ID SIGNAL_ID approved|declined BY``: an approval decision by
  ``BY`` (declined with the reason ``not eligible``).

It prints JSON lines on stdout: on ``start``, ``{"opened": RUN_ID}`` as soon as
the run is opened, before any node code runs; then the turn's result and the
child's ``pid`` (exit 0), or ``{"error": {"type", "message"}}`` when the turn
raised (exit 2). A child that SIGKILLed itself prints no result (its parent
sees the exit status ``KILLED``); a ``crashy`` turn that returns exits 3.

``KT_LEASE_TTL`` is the child's lease in seconds, so that a parent may take a
run over soon after a kill (default 0.5 for ``flows`` and ``control``, 1.0 for
``crashy``, the runtime's own for ``refund``).

Tests start a child with ``Child`` (or run one turn to its end with
``run_child``); the ``KT_*`` variables a child sees are only those it is given.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from kuralle_es import Agent, RunStore, Runtime, SignalDelivery, TurnHandle

TESTS_DIR = Path(__file__).resolve().parents[1]

#: Process exit status of a child that was SIGKILLed (by itself or by its parent).
KILLED = -signal.SIGKILL
#: Exit status of a turn that raised (it printed ``{"error": ...}``).
TURN_RAISED = 2
#: Exit status of a ``crashy`` turn that returned: its tool should have killed it.
SURVIVED = 3

APPS = ("flows", "control", "crashy", "refund")
USAGE = {
    "start": "FLOW [TEXT]",
    "input": "RUN_ID TEXT",
    "resume": "RUN_ID",
    "deliver": "RUN_ID|- SIGNAL_ID NAME PAYLOAD_JSON",
    "decide": "RUN_ID SIGNAL_ID approved|declined BY",
}
ARITY = {"start": (1, 2), "input": (2, 2), "resume": (1, 1), "deliver": (4, 4), "decide": (4, 4)}


# ------------------------------------------------------------ in the child
def open_store(backend: str, target: str) -> RunStore:
    """A store over the database another process shares."""
    if backend == "sqlite":
        return RunStore.sqlite(target)
    if backend == "postgres":
        return RunStore.postgres(target)
    if backend == "url":  # a store URL: sharded (comma-separated), ?partitions=K, ...
        return RunStore.from_url(target)
    msg = f"backend {backend!r} cannot be shared with another process"
    raise ValueError(msg)


def _agent(app: str, ledger: str) -> tuple[Agent, float | None]:
    """``APP``'s agent and its default lease (None: the runtime's own)."""
    if app == "flows":
        from procs.flows import make_agent

        return make_agent(Path(ledger)), 0.5
    if app == "control":
        from procs.control import make_agent as make_control_agent

        return make_control_agent(Path(ledger)), 0.5
    if app == "crashy":
        from procs.crashy import crash_agent

        return crash_agent(Path(ledger), die_in_tool=True), 1.0
    if app == "refund":
        from kuralle_es.examples import refund

        if ledger != "-":
            os.environ[refund.LEDGER_ENV] = ledger
        return refund.build_agent(), None
    msg = f"unknown app {app!r}: one of {', '.join(APPS)}"
    raise SystemExit(msg)


def _turn(runtime: Runtime, session: str, command: str, rest: list[str]) -> TurnHandle:
    if command == "start":
        flow, *text = rest
        return runtime.run(session, input=text[0] if text else "go", kind="flow", flow_name=flow)
    if command == "input":
        run_id, text = rest
        return runtime.run(session, run_id=run_id, input=text)
    if command == "resume":
        (run_id,) = rest
        return runtime.run(session, run_id=run_id)
    if command == "deliver":
        run_id, signal_id, name, payload = rest
        delivery = SignalDelivery(
            signal_id=signal_id, name=name, payload=json.loads(payload), actor="child"
        )
        return runtime.run(
            session, run_id=None if run_id == "-" else run_id, signal_delivery=delivery
        )
    run_id, signal_id, decision, by = rest  # decide
    if decision not in ("approved", "declined"):
        msg = f"decide: {decision!r} is neither 'approved' nor 'declined'"
        raise SystemExit(msg)
    answer: dict[str, Any] = {"approved": decision == "approved", "by": by}
    if decision == "declined":
        answer["reason"] = "not eligible"
    delivery = SignalDelivery(signal_id=signal_id, name="__approval", payload=answer, actor=by)
    return runtime.run(session, run_id=run_id, signal_delivery=delivery)


def _say(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


async def _main(
    app: str, backend: str, target: str, ledger: str, session: str, command: str, *rest: str
) -> int:
    if command not in ARITY:
        msg = f"unknown command {command!r}: one of {', '.join(ARITY)}"
        raise SystemExit(msg)
    least, most = ARITY[command]
    if not least <= len(rest) <= most:
        msg = f"usage: child.py APP BACKEND TARGET LEDGER SESSION {command} {USAGE[command]}"
        raise SystemExit(msg)
    agent, lease_ttl = _agent(app, ledger)
    if "KT_LEASE_TTL" in os.environ:
        lease_ttl = float(os.environ["KT_LEASE_TTL"])
    options = {} if lease_ttl is None else {"lease_ttl": lease_ttl}
    store = open_store(backend, target)
    try:
        runtime = Runtime([agent], store=store, **options)
        handle = _turn(runtime, session, command, list(rest))
        try:
            if command == "start":
                # Known as soon as the run is opened, before any node code runs.
                _say({"opened": await handle.run_id})
            result = await handle.result()
        except Exception as e:
            _say({"error": {"type": type(e).__name__, "message": str(e)}})
            return TURN_RAISED
        _say({**result.model_dump(mode="json"), "pid": os.getpid()})
        return SURVIVED if app == "crashy" else 0
    finally:
        store.close()


# ----------------------------------------------------------- in the parent
class Child:
    """A child turn, started at once: ``Child(APP, BACKEND, TARGET, LEDGER, SESSION, COMMAND,
    *ARGS, env=...)``.

    The child inherits this process's environment without its ``KT_*``
    variables, then ``env`` (a value of None removes a variable). As a context
    manager, it kills the child if it is still running on the way out.
    """

    def __init__(
        self,
        app: str,
        backend: str,
        target: str,
        ledger: Path | str,
        session: str,
        *args: str,
        env: Mapping[str, str | None] | None = None,
    ) -> None:
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("KT_")}
        for name, value in (env or {}).items():
            if value is None:
                child_env.pop(name, None)
            else:
                child_env[name] = value
        command = [sys.executable, str(Path(__file__).resolve()), app, backend, target,
                   str(ledger), session, *args]  # fmt: skip
        self.process = subprocess.Popen(
            command,
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._out: list[str] = []
        self.stderr = ""

    @property
    def stdout(self) -> str:
        """What the child printed on stdout so far (all of it, once ``wait`` returned)."""
        return "".join(self._out)

    async def opened(self) -> str:
        """The id of the run a ``start`` child opened (its first line)."""
        assert self.process.stdout is not None
        line = await asyncio.to_thread(self.process.stdout.readline)
        self._out.append(line)
        assert line, "the child ended before it opened a run"
        return str(json.loads(line)["opened"])

    def wait(self, timeout: float = 60) -> tuple[int, dict[str, Any] | None]:
        """Wait for the child to end: its exit status and its last JSON line (None if none).

        A child that ran past ``timeout`` is killed (and ``TimeoutExpired``
        raised); an exit status other than 0, 2 or ``KILLED`` raises
        ``AssertionError`` with the child's output.
        """
        try:
            out, err = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            raise
        self._out.append(out)
        self.stderr = err
        lines = [line for line in self.stdout.splitlines() if line.startswith("{")]
        report = json.loads(lines[-1]) if lines else None
        code = self.process.returncode
        if code not in (0, TURN_RAISED, KILLED):
            msg = f"child failed ({code}):\n{self.stdout}\n{self.stderr}"
            raise AssertionError(msg)
        return code, report

    def __enter__(self) -> Child:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.process.poll() is None:
            self.process.kill()
        with self.process:  # closes its pipes and reaps it
            pass


def run_child(
    app: str,
    backend: str,
    target: str,
    ledger: Path | str,
    session: str,
    *args: str,
    env: Mapping[str, str | None] | None = None,
    timeout: float = 60,
) -> tuple[int, dict[str, Any] | None]:
    """Run one child turn to its end: its exit status and its JSON report (None if none)."""
    with Child(app, backend, target, ledger, session, *args, env=env) as child:
        return child.wait(timeout)


async def wait_lease_expired(runtime: Runtime, run_id: str, session: str) -> None:
    """Sleep until the lease a killed child left on the run has expired."""
    state = await runtime.get_run(run_id, session)
    assert state is not None
    if state.lease_expires_at is not None:
        delay = (state.lease_expires_at - datetime.now(UTC)).total_seconds()
        if delay > 0:
            await asyncio.sleep(delay + 0.05)


async def until(check: Callable[[], bool], what: str) -> None:
    """Poll ``check`` until it holds (30 s at most)."""
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


if __name__ == "__main__":
    # The agents come from ``procs.*``, as in the parent.
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(TESTS_DIR))
    if len(sys.argv) < 7:
        raise SystemExit(
            "usage: child.py APP BACKEND TARGET LEDGER SESSION COMMAND ARGS...\n"
            + "\n".join(f"  COMMAND {c} {u}" for c, u in USAGE.items())
        )
    sys.exit(asyncio.run(_main(*sys.argv[1:])))
