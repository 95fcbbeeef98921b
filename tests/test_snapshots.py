"""Snapshots at 100, 200, 400, ... events: a long run's snapshots stay linear in its length.

At a fixed interval every snapshot holds the whole run, so their bytes add
up to the square of its length; at each doubling they add up to less than
twice the latest one. Checked on every backend through the store's own
snapshot recorder, with the run reloaded from its snapshot equal to the run
rebuilt from all its events.
"""

from __future__ import annotations

import json
from typing import Any
from uuid import uuid4

from conftest import StoreFactory

from kuralle_es import RunStore
from kuralle_es.domain import Run, new_run
from kuralle_es.store import is_snapshot_version


def test_snapshot_versions_are_100_then_each_doubling() -> None:
    assert [v for v in range(0, 7000) if is_snapshot_version(v)] == [
        100,
        200,
        400,
        800,
        1600,
        3200,
        6400,
    ]


def full_fold(store: RunStore, run: Run) -> Run:
    aggregate: Any = None
    for event in store.events.get(run.id):
        aggregate = event.mutate(aggregate)  # type: ignore[attr-defined]
    assert isinstance(aggregate, Run)
    return aggregate


def test_a_long_runs_snapshots_add_up_to_under_twice_its_latest_one(
    open_store: StoreFactory,
) -> None:
    store = open_store()
    run = new_run(uuid4(), "session-1", "flow", "agent", "refund", "d" * 64)
    store.create_run(run)
    for i in range(450):  # two events a save, as a tool step's intent and result
        index = run.start_step(
            key=f"{i:064x}", kind="tool", name="charge", callsite=i, logical_run="r#", args={"i": i}
        )
        run.finish_step(index, json.dumps({"n": i, "receipt": "r" * 40}))
        store.save_run(run)
    assert run.version == 901
    assert store.snapshots is not None
    snapshots = list(store.snapshots.recorder.select_events(run.id))
    assert [s.originator_version for s in snapshots] == [100, 200, 400, 800]
    sizes = [len(s.state) for s in snapshots]
    assert sizes == sorted(sizes)
    assert sum(sizes) < 2 * sizes[-1]
    loaded = open_store().load(run.run_id)  # the snapshot at 800, then 101 events
    assert loaded is not None
    rebuilt = full_fold(store, run)
    assert loaded.version == rebuilt.version == 901
    assert loaded.to_state() == rebuilt.to_state() == run.to_state()
    assert loaded.step_records() == rebuilt.step_records() == run.step_records()
