"""Compare-and-set on PostgreSQL between two real OS processes.

Two spawned worker processes each open their own ``RunStore`` over one
database, load the same run at the same version, meet at a barrier, append
one event and save. Every round exactly one of them gets ``StaleWriteError``,
and nothing of the loser's write is stored.
"""

from __future__ import annotations

import multiprocessing
import queue
from typing import Any

import pytest
from procs.child import open_store

from kuralle_es import (
    Message,
    RunStore,
    Runtime,
    StaleWriteError,
    action,
    define_agent,
    define_flow,
    end,
)

pytestmark = pytest.mark.postgres

SESSION = "session-1"
ROUNDS = 8


def race_saves(
    backend: str,
    target: str,
    run_id: str,
    name: str,
    rounds: int,
    barrier: Any,
    results: Any,
) -> None:
    """A ``multiprocessing`` (spawn) target. For each round: load the run, meet
    the other writer, append one event, save; report the outcome on a queue."""
    store = open_store(backend, target)
    try:
        for round_no in range(rounds):
            run = store.load(run_id)
            assert run is not None, f"{name}: run {run_id} not found"
            loaded_version = run.version
            run.append_message(Message(role="user", content=f"{name}:{round_no}"))
            barrier.wait(timeout=60)
            try:
                store.save_run(run)
                outcome = "saved"
            except StaleWriteError:
                outcome = "stale"
            except Exception as e:  # reported, so the parent can show it
                outcome = f"{type(e).__name__}: {e}"
            results.put((round_no, name, loaded_version, outcome))
            barrier.wait(timeout=60)
    finally:
        store.close()


async def _create_run(dsn: str) -> str:
    async def node(state: dict[str, Any], ctx: Any) -> Any:
        return end("done")

    flow = define_flow("f", "one node", "s1", [action("s1", node)])
    store = RunStore.postgres(dsn)
    try:
        runtime = Runtime([define_agent("a", "test", None, [], [flow])], store=store)
        handle = runtime.run(SESSION, input="hi", kind="flow", flow_name="f")
        result = await handle.result()
        assert result.status == "finished"
        return await handle.run_id
    finally:
        store.close()


@pytest.mark.timeout(180)
async def test_two_processes_saving_one_run_at_one_version_exactly_one_wins_each_round(
    pg_dsn: str,
) -> None:
    run_id = await _create_run(pg_dsn)
    store = RunStore.postgres(pg_dsn)
    try:
        initial = store.load(run_id)
        assert initial is not None
        base_version = initial.version
        base_messages = len(initial.messages)

        ctx = multiprocessing.get_context("spawn")
        barrier = ctx.Barrier(2)
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=race_saves,
                args=("postgres", pg_dsn, run_id, name, ROUNDS, barrier, results),
                name=f"writer-{name}",
            )
            for name in ("A", "B")
        ]
        for p in procs:
            p.start()
        reports: list[tuple[int, str, int, str]] = []
        try:
            for _ in range(2 * ROUNDS):
                reports.append(results.get(timeout=120))
        except queue.Empty:
            pytest.fail(f"workers stopped reporting after {reports!r}")
        for p in procs:
            p.join(timeout=60)
        assert [p.exitcode for p in procs] == [0, 0]
        assert len({p.pid for p in procs}) == 2

        winners: list[str] = []
        for round_no in range(ROUNDS):
            this_round = sorted(r for r in reports if r[0] == round_no)
            assert len(this_round) == 2, this_round
            (_, _, version_a, _), (_, _, version_b, _) = this_round
            assert version_a == version_b == base_version + round_no, (
                "both writers must load the same version"
            )
            outcomes = sorted(outcome for *_, outcome in this_round)
            assert outcomes == ["saved", "stale"], this_round
            winners.extend(name for _, name, _, outcome in this_round if outcome == "saved")

        reloaded = RunStore.postgres(pg_dsn)
        try:
            final = reloaded.load(run_id)
        finally:
            reloaded.close()
        assert final is not None
        assert final.version == base_version + ROUNDS
        appended = [m["content"] for m in final.messages[base_messages:]]
        assert appended == [f"{name}:{n}" for n, name in enumerate(winners)]
    finally:
        store.close()
