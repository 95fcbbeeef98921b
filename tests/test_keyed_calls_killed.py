"""The ported applications' pattern, end to end with real processes.

A keyed call (a flow start with ``idempotency_key``, or a keyed user turn of
a conversation) runs in a process that is SIGKILLed inside the tool it
calls; ``kuralle-es worker`` (another process) recovers the run; then the
same keyed call arrives again (a webhook retry, a user pressing the button
twice) and must return the recovered run, deliver nothing again and run no
effect again. The tool's ledger keeps one row a key and one a execution: the
only second execution is the in-doubt retry of the killed call, under its
own key (docs/guarantees.md).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_kill_recovery import PROCS, _env, start_worker, stop, targets, wait_finished

from kuralle_es import IdempotencyConflictError, RunStore, Runtime

sys.path.insert(0, str(PROCS))
from charge_app import FLOW, build_agents, read_ledger

SESSION = "s-keyed"
KEY = "order-77"


def kill_inside_the_tool(url: str, ledger: str, kind: str, tmp: Path) -> str:
    marker = tmp / "standing"
    assert read_ledger(ledger) == ([], [])
    doomed = subprocess.Popen(
        [sys.executable, str(PROCS / "charge_app.py"), "start-keyed", url, SESSION, KEY, kind],
        env=_env(KT_LEDGER=ledger, KT_KILL_AT="in-tool", KT_MARKER=str(marker)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert doomed.poll() is None, doomed.communicate()
            assert time.monotonic() < deadline, "the doomed process never reached its tool"
            time.sleep(0.05)
    finally:
        doomed.send_signal(signal.SIGKILL)
        out, _ = doomed.communicate(timeout=30)
    return out.split()[0]


def keyed_call(runtime: Runtime, kind: str, text: str = "") -> object:
    if kind == "flow":
        return runtime.run(
            SESSION, input=text or "pay", kind="flow", flow_name=FLOW, idempotency_key=KEY
        )
    return runtime.run(SESSION, input=text or "pay me", agent="clerk", idempotency_key=KEY)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["flow", "conversation"])
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_a_keyed_call_killed_in_its_tool_and_recovered_is_answered_by_its_run_on_retry(
    backend: str, kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url, ledger = targets(backend, tmp_path, request)
    run_id = kill_inside_the_tool(url, ledger, kind, tmp_path)
    with RunStore.from_url(url) as store:
        worker = start_worker(url, ledger, "rescuer")
        try:
            wait_finished(store, [run_id], [worker])
        finally:
            stop([worker])
        recovered = store.load(run_id)
        assert recovered is not None
        version = recovered.version

        async def retry() -> None:
            runtime = Runtime(build_agents(), store=store, holder="web")
            again = await keyed_call(runtime, kind).result()  # type: ignore[attr-defined]
            assert (again.run_id, again.status) == (run_id, "finished")
            with pytest.raises(IdempotencyConflictError):
                await keyed_call(runtime, kind, "other").result()  # type: ignore[attr-defined]
            state = await runtime.get_run(run_id, SESSION)
            assert state is not None and state.version == version
            users = [m.content for m in state.messages if m.role == "user"]
            assert len(users) == 1

        asyncio.run(retry())
    charges, attempts = read_ledger(ledger)
    assert [run for _, run, _ in charges] == [run_id]
    # The killed execution and its in-doubt retry, both under the one key.
    assert len(attempts) == 2 and {key for key, _ in attempts} == {charges[0][0]}
