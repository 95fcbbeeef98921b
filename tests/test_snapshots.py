"""Snapshots spaced by what the run holds: a long run's snapshots stay linear in its length.

At a fixed interval every snapshot of a run whose state grows holds the
whole run, so their bytes add up to the square of its length. Spaced by the
state's weight (100, 200, 400, ... events, the first at least the weight),
a growing run's snapshots add up to less than twice the latest one, and a
run whose steps are archived (a conversation's turns, a flow's nodes) keeps
small snapshots at the short spacing. Checked on every backend through the
store's own snapshot recorder, with the run reloaded from its snapshot equal
to the run rebuilt from all its events.
"""

from __future__ import annotations

import json
from typing import Any
from uuid import uuid4

from conftest import StoreFactory

from kuralle_es import RunStore
from kuralle_es._journal.log import snapshot_due, snapshot_spacing
from kuralle_es._journal.run import Run
from kuralle_es._journal.sites import Effect, Site


def test_the_spacing_is_the_first_of_100_200_400_at_least_the_weight() -> None:
    assert [snapshot_spacing(w) for w in (0, 1, 100, 101, 200, 250, 1000)] == [
        100,
        100,
        100,
        200,
        200,
        400,
        1600,
    ]
    assert snapshot_due(99, 101, 0)
    assert not snapshot_due(101, 199, 0)
    assert not snapshot_due(301, 399, 150)  # spacing 200: 400 not reached
    assert snapshot_due(399, 401, 150)


def full_fold(store: RunStore, run: Run) -> Run:
    aggregate: Any = None
    for event in store.events.get(run.id):
        aggregate = event.mutate(aggregate)  # type: ignore[attr-defined]
    assert isinstance(aggregate, Run)
    return aggregate


def test_a_long_runs_snapshots_add_up_to_about_twice_its_latest_one(
    open_store: StoreFactory,
) -> None:
    store = open_store()
    run = Run(uuid4(), "session-1", "flow", "agent", "refund", "d" * 64)
    store.create_run(run)
    for i in range(450):  # two events a save, as a tool step's intent and result
        index = run.start_step(
            Effect(Site("r#", i), "tool", "charge", {"i": i}, override=f"{i:064x}")
        )
        run.finish_step(index, json.dumps({"n": i, "receipt": "r" * 40}))
        store.save_run(run)
    assert run.version == 901
    assert store.snapshots is not None
    snapshots = list(store.snapshots.recorder.select_events(run.id))
    # 50, 100, 200, 400 steps held: spacings 100, 100, 200, 400.
    assert [s.originator_version for s in snapshots] == [101, 201, 401, 801]
    sizes = [len(s.state) for s in snapshots]
    assert sizes == sorted(sizes)
    # Doubling spacings keep the total near twice the latest snapshot: 2.04x here,
    # above 2 by each snapshot's fixed part (its fields), which the compressed
    # steps no longer dwarf. A snapshot every 100 versions would make it 2.5x at
    # four and grow with the run.
    assert sum(sizes) < 2.2 * sizes[-1]
    loaded = open_store().load(run.run_id)  # the snapshot at 801, then 100 events
    assert loaded is not None
    rebuilt = full_fold(store, run)
    assert loaded.version == rebuilt.version == 901
    assert loaded.to_state() == rebuilt.to_state() == run.to_state()
    assert loaded.step_records() == rebuilt.step_records() == run.step_records()


def test_a_conversation_of_many_turns_keeps_small_snapshots_and_a_short_load(
    open_store: StoreFactory,
) -> None:
    """Each turn archives the steps of the one before: what a load reads (one
    snapshot and the events after it) stays about the same at turn 300 as at
    turn 30, while the history still has every step."""
    store = open_store()
    run = Run(uuid4(), "session-1", "conversation", "agent", None, None)
    store.create_run(run)
    for turn in range(1, 301):
        run.start_turn(turn, None, None)
        for i in range(3):
            index = run.start_step(
                Effect(
                    Site(f"r#{turn}", i),
                    "tool",
                    "lookup",
                    {"turn": turn},
                    override=f"{turn:032x}{i:032x}",
                )
            )
            run.finish_step(index, json.dumps({"found": "x" * 40}))
        store.save_run(run)
    assert len(run.steps) == 3 and run.step_count == 900
    assert store.snapshots is not None
    snapshots = list(store.snapshots.recorder.select_events(run.id))
    sizes = [len(s.state) for s in snapshots]
    assert len(snapshots) >= 20  # every 100 events: one snapshot per 14 turns
    assert max(sizes) < 2 * min(sizes)
    assert run.version - snapshots[-1].originator_version <= 100 + 7
    loaded = open_store().load(run.run_id)
    assert loaded is not None
    assert loaded.to_state() == run.to_state()
    assert loaded.step_records() == run.step_records()
    history = store.load_history(run.run_id)
    assert history is not None
    assert [r.index for r in history.step_records()] == list(range(900))
    assert history.step_records()[-3:] == run.step_records()
