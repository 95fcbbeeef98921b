"""Projector processes: killed with SIGKILL mid-stream, or two at once on one database.

The projector is the real ``kuralle-es views follow`` in its own process,
projecting one event per transaction (``--batch 1``) so that a kill lands
between events. Whatever happens, every run's view row must have had each of
its events applied once: ``event_count`` (applications) equals ``version``
(the last event's version, checked to follow the previous one on every
apply), both equal the aggregate's version, and the rows equal views rebuilt
from scratch.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import stripped
from views_kit import SESSION, agent

from kuralle_es import RunStore, Runtime, RunViews

pytestmark = pytest.mark.timeout(240)


def _open(url: str) -> RunStore:
    if url.startswith("sqlite:"):
        return RunStore.sqlite(url.removeprefix("sqlite:///"))
    return RunStore.postgres(url)


def projector(url: str, batch: int = 1) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kuralle_es.cli", "--store", url, "views", "follow",
         "--batch", str(batch), "--interval", "0.02"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not stripped(k, "KURALLE_")},
    )  # fmt: skip


def ready(proc: subprocess.Popen[str]) -> subprocess.Popen[str]:
    """Wait until the projector says it follows (its SIGTERM handler is installed
    by then): a SIGTERM while Python still imports would kill it with -15."""
    assert proc.stderr is not None
    said: list[str] = []
    for line in proc.stderr:
        said.append(line)
        if "following the run views" in line:
            return proc
    raise AssertionError(f"projector exited before following: {''.join(said)}")


async def write_runs(runtime: Runtime, runs: int) -> list[str]:
    ids = []
    for _ in range(runs):
        result = await runtime.run(SESSION, input="go", kind="flow", flow_name="many").result()
        ids.append(result.run_id)
    return ids


async def position(views: RunViews) -> int:
    return await views.position() or 0


async def until(views: RunViews, target: int, procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 120
    while await position(views) < target:
        for proc in procs:
            assert proc.poll() is None, f"projector exited: {proc.communicate()[1]}"
        assert time.monotonic() < deadline, f"views stuck at {await position(views)} < {target}"
        await asyncio.sleep(0.02)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


async def assert_each_event_applied_once(store: RunStore, views: RunViews) -> None:
    assert await views.position() == store.recorder.max_notification_id()
    rows, steps = await views.rows()
    for row in rows:
        run = store.load(row.run_id)
        assert run is not None
        assert row.event_count == row.version == run.version, row.run_id
    rebuilt = RunViews(store, name="from_scratch")
    await rebuilt.catch_up()
    assert await rebuilt.rows() == (rows, steps)


async def test_a_projector_killed_mid_stream_and_restarted_neither_skips_nor_doubles(
    store_url: str,
) -> None:
    store = _open(store_url)
    try:
        runtime = Runtime([agent()], store=store)
        await write_runs(runtime, 8)
        views = RunViews(store)  # reads the position only: no catch-up here
        head = store.recorder.max_notification_id()

        first = projector(store_url)
        await until(views, head // 3, [first])
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        killed_at = await position(views)
        assert 0 < killed_at < head, f"the kill landed at {killed_at} of {head}"

        await write_runs(runtime, 2)  # events arrive while no projector runs
        second = ready(projector(store_url))
        await write_runs(runtime, 2)  # and while the restarted one follows
        await until(views, store.recorder.max_notification_id(), [second])
        stop(second)
        await assert_each_event_applied_once(store, views)
    finally:
        store.close()


async def test_two_projectors_on_one_database_never_apply_an_event_twice(store_url: str) -> None:
    store = _open(store_url)
    try:
        runtime = Runtime([agent()], store=store)
        await write_runs(runtime, 2)
        views = RunViews(store)
        procs = [ready(projector(store_url, batch=3)), ready(projector(store_url, batch=3))]
        await write_runs(runtime, 6)  # both follow the same stream of new events
        await until(views, store.recorder.max_notification_id(), procs)
        for proc in procs:
            stop(proc)
        await assert_each_event_applied_once(store, views)
    finally:
        store.close()
