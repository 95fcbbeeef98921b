"""The approval notifier SIGKILLed mid-stream and restarted writes each outbox row once.

Real processes on SQLite and PostgreSQL: while this process keeps driving
refund runs to their approval pause (and some past it), a notifier process
(``tests/procs/approval_consumer.py``: the example's handler, slowed inside
its transaction) is killed with SIGKILL and started again, alternately at a
random moment and right after it inserted an outbox row, before its commit.
At the end ``python -m kuralle_es.examples.approval_notifier --once`` catches
up, and the outbox must hold exactly one row per approval pause in the stream:
the row is written through ``tx``, in the transaction that records the
consumer's position, on both backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from events_kit import everything, refund_run

from kuralle_es import Runtime
from kuralle_es.events import RunPaused
from kuralle_es.examples import approval_notifier, refund

PROC = Path(__file__).resolve().parent / "procs" / "approval_consumer.py"
KILLS = 6
RUNS = 30


def outbox_positions(store: Any) -> list[int]:
    with store.recorder.datastore.transaction(commit=False) as curs:
        curs.execute(f"SELECT position FROM {approval_notifier.OUTBOX_TABLE}")
        return [int(row["position"]) for row in curs.fetchall()]


async def start_notifier(target: str) -> subprocess.Popen[str]:
    proc = await asyncio.to_thread(
        subprocess.Popen, [sys.executable, str(PROC), target], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = await asyncio.to_thread(proc.stdout.readline)
    assert line.strip() == "ready", line
    return proc


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_killed_notifier_writes_each_outbox_row_once(
    open_store: Any, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(refund.LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    monkeypatch.delenv(refund.MODEL_ENV, raising=False)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    target = open_store.target
    store = open_store()
    runtime = Runtime([refund.build_agent()], store=store)
    await asyncio.to_thread(approval_notifier.create_outbox, store)

    async def drive() -> None:
        for i in range(RUNS):
            await refund_run(runtime, f"s{i}", approve=rng.choice([True, False, None]))

    writer = asyncio.create_task(drive())
    mid_stream = 0
    in_transaction = 0
    for kill in range(KILLS):
        proc = await start_notifier(target)
        assert proc.stdout is not None
        if kill % 2:  # between the outbox insert and the commit of its transaction
            with contextlib.suppress(TimeoutError):
                line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 5)
                in_transaction += line.startswith("inserted")
        else:  # anywhere
            await asyncio.sleep(rng.uniform(0.2, 1.2))
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
        assert proc.returncode == -signal.SIGKILL, f"seed={seed}"
        head = store.recorder.max_notification_id() or 0
        position = await approval_notifier.approval_consumer(store).position()
        mid_stream += (position or 0) < head
    await writer
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "kuralle_es.examples.approval_notifier", *(
            ["--store", target] if backend == "postgres" else ["--sqlite", target]
        ), "--once"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr

    pauses = [
        e.position
        for e in await everything(store)
        if isinstance(e, RunPaused) and e.waiting_for.kind == "approval"
    ]
    rows = outbox_positions(store)
    duplicates = {p: n for p, n in Counter(rows).items() if n > 1}
    assert duplicates == {}, f"seed={seed}: rows written twice {duplicates}"
    assert sorted(rows) == pauses and len(pauses) == RUNS, f"seed={seed}"
    assert mid_stream >= KILLS // 2, f"seed={seed}: only {mid_stream} kills landed mid-stream"
    assert in_transaction >= 1, f"seed={seed}: no kill landed inside a handler's transaction"
