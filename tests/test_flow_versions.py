"""Deploying a changed flow without stranding runs: flow versions and ``runtime.migrate``.

On memory, SQLite and PostgreSQL (a runtime per deploy, each on a store of
its own over the same database): a run paused under version 1 resumes on
version 1 once the runtime has versions 1 and 2 (in one agent, or in two),
while new runs start on version 2; a run pinned to a digest the runtime no
longer has still raises ``FlowDriftError``. ``migrate`` moves a paused run
onto version 2 (a fork at a step, then the original stopped), and the moved
run finishes with each effect executed once; a migration retried after a
crash between its two writes, or racing another, converges on one fork.
Refusals write nothing. The tools write a ledger (tests/procs/deploy_app.py).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import StoreFactory
from procs import deploy_app
from procs.deploy_app import FLOW, order_v1, order_v2

from kuralle_es import (
    FlowDriftError,
    InvalidArgumentError,
    NonDeterminismError,
    RunNotFoundError,
    RunStore,
    Runtime,
    action,
    define_agent,
    define_flow,
    end,
)
from kuralle_es._runtime import migrate as migrate_module
from kuralle_es._runtime.migrate import migration_id
from kuralle_es.testing import Crash, CrashPlan, ScriptedModel, check_runs

SESSION = "s-deploy"


@pytest.fixture(autouse=True)
def ledger_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(deploy_app.LEDGER_ENV, str(path))
    return path


def head(store: RunStore) -> int:
    """The store's last notification id: unchanged means nothing was written."""
    return store.recorder.max_notification_id() or 0


def executed() -> Counter[str]:
    entries = deploy_app.ledger()
    keys = [e["key"] for e in entries]
    assert len(keys) == len(set(keys)), f"an effect ran twice: {entries}"
    return Counter(e["tool"] for e in entries)


async def paused_on_v1(open_store: StoreFactory, count: int = 1) -> list[str]:
    runtime = Runtime(deploy_app.v1(), store=open_store())
    run_ids = []
    for _ in range(count):
        result = await runtime.run(SESSION, kind="flow", flow_name=FLOW).result()
        assert result.status == "paused" and result.waiting_for is not None
        run_ids.append(result.run_id)
    return run_ids


# ------------------------------------------------------------------- check
async def test_check_runs_says_which_runs_would_resume_and_writes_nothing(
    open_store: StoreFactory,
) -> None:
    """``kuralle-es check``'s answer, on every backend: a run paused under v1 is
    ``ok`` against an application that keeps v1 beside v2, ``drift`` against v2
    alone and ``nondeterminism`` (with the step) against v1 with reordered code;
    no answer executes a tool or writes to the store."""
    (old,) = await paused_on_v1(open_store)
    store = open_store()
    before = head(store)

    def verdicts(checks: list[Any]) -> dict[str, tuple[str, int | None]]:
        return {c.run_id: (c.kind, c.step) for c in checks}

    assert verdicts(await check_runs(store, deploy_app.v1_and_v2())) == {old: ("ok", None)}
    assert verdicts(await check_runs(store, deploy_app.v2())) == {old: ("drift", None)}
    assert verdicts(await check_runs(store, deploy_app.v1_reordered())) == {
        old: ("nondeterminism", 0)
    }
    assert head(store) == before
    assert executed() == {"reserve": 1}
    # The run still resumes where it was, on the application that keeps v1.
    done = await Runtime(deploy_app.v1_and_v2(), store=store).approve(old, SESSION, by="ann")
    assert done.status == "finished"
    assert executed() == {"reserve": 1, "ship": 1}


# ------------------------------------------------------------------ versions
@pytest.mark.parametrize("layout", ["one_agent", "two_agents"])
async def test_a_run_paused_under_v1_resumes_on_v1_while_new_runs_start_on_v2(
    open_store: StoreFactory, layout: str
) -> None:
    (old,) = await paused_on_v1(open_store)
    agents = deploy_app.v1_and_v2() if layout == "one_agent" else deploy_app.split()
    runtime = Runtime(agents, store=open_store())  # the deploy: a new process, a new store

    new = await runtime.run(SESSION, kind="flow", flow_name=FLOW).result()
    new_state = await runtime.get_run(new.run_id, SESSION)
    assert new_state is not None
    assert (new_state.flow_version, new_state.flow_digest) == ("2", order_v2().digest)
    old_state = await runtime.get_run(old, SESSION)
    assert old_state is not None
    assert (old_state.flow_version, old_state.flow_digest) == ("1", order_v1().digest)

    listed = {s.run_id: s.flow_version for s in await runtime.views.list_runs(flow=FLOW)}
    assert listed == {old: "1", new.run_id: "2"}

    done_old = await runtime.approve(old, SESSION, by="ann")
    done_new = await runtime.approve(new.run_id, SESSION, by="ann")
    assert done_old.status == done_new.status == "finished"
    assert (await runtime.get_run(old, SESSION)).outcome == "v1: shipped"  # type: ignore[union-attr]
    assert (await runtime.get_run(new.run_id, SESSION)).outcome == "v2: shipped"  # type: ignore[union-attr]
    assert executed() == {"reserve": 2, "ship": 2, "notify": 1}
    # Finished runs still say which version they ran on.
    listed = {s.run_id: s.flow_version for s in await runtime.views.list_runs(flow=FLOW)}
    assert listed == {old: "1", new.run_id: "2"}


async def test_a_run_pinned_to_a_digest_the_runtime_no_longer_has_raises_flow_drift(
    open_store: StoreFactory,
) -> None:
    (old,) = await paused_on_v1(open_store)
    store = open_store()
    runtime = Runtime(deploy_app.v2(), store=store)
    before = head(store)
    with pytest.raises(FlowDriftError) as raised:
        await runtime.approve(old, SESSION, by="ann")
    assert (raised.value.pinned, raised.value.current) == (order_v1().digest, order_v2().digest)
    assert head(store) == before
    assert executed() == {"reserve": 1}


def test_newest_is_the_greatest_version_compared_naturally_whatever_the_order() -> None:
    def flow(version: str | None, marker: str) -> Any:
        async def go(state: dict[str, Any], ctx: Any) -> Any:
            return end(marker)

        return define_flow("f", "", "go", [action("go", go), action(marker, go)], version=version)

    for order in (("9", "10"), ("10", "9")):
        flows = [flow(v, f"n{v}") for v in order]
        agent = define_agent("a", "", None, [], flows)
        assert agent.flows["f"].version == "10"
        assert Runtime([agent]).flow("f")[1].version == "10"
    # A flow without a version is older than any with one; "1.10" is newer than "1.9".
    agent = define_agent("a", "", None, [], [flow("1.10", "x"), flow(None, "y"), flow("1.9", "z")])
    assert agent.flows["f"].version == "1.10"
    split = [
        define_agent("a", "", None, [], [flow(None, "y")]),
        define_agent("b", "", None, [], [flow("1", "x")]),
    ]
    assert Runtime(split).flow("f")[0].id == "b"


async def _nothing(state: dict[str, Any], ctx: Any) -> Any:
    return end()


def test_a_version_never_enters_the_digest_and_clashes_are_refused() -> None:
    unversioned = define_flow(FLOW, "", "order", [action("order", _nothing)])
    assert unversioned.digest == order_v1().digest and unversioned.version is None
    with pytest.raises(InvalidArgumentError, match="two flows are named 'order' with version '1'"):
        define_agent("a", "", None, [], [order_v1(), order_v1()])
    other = define_flow(FLOW, "", "x", [action("x", _nothing)], version="1")
    with pytest.raises(InvalidArgumentError, match="share version '1'"):
        Runtime(
            [
                define_agent("a", "", None, [], [order_v1()]),
                define_agent("b", "", None, [], [other]),
            ]
        )
    with pytest.raises(InvalidArgumentError):
        define_flow(FLOW, "", "order", [action("order", _nothing)], version="")


# ------------------------------------------------------------------- migrate
async def test_migrate_moves_a_paused_run_onto_v2_and_it_finishes_with_each_effect_once(
    open_store: StoreFactory,
) -> None:
    (old,) = await paused_on_v1(open_store)
    runtime = Runtime(deploy_app.v2(), store=open_store())

    moved = await runtime.migrate(old, SESSION, 1)  # after the reserve: it replays

    assert moved.run_id == migration_id(old, 1)
    assert moved.status == "paused" and moved.waiting_for is not None
    original = await runtime.get_run(old, SESSION)
    assert original is not None
    assert (original.status, original.outcome) == ("aborted", f"migrated: {moved.run_id}")
    assert original.migrated_to == moved.run_id
    fork = await runtime.get_run(moved.run_id, SESSION)
    assert fork is not None
    assert (fork.flow_version, fork.forked_from) == ("2", {"run_id": old, "at_step": 1})

    done = await runtime.approve(moved.run_id, SESSION, by="ann")
    assert done.status == "finished"
    assert (await runtime.get_run(moved.run_id, SESSION)).outcome == "v2: shipped"  # type: ignore[union-attr]
    assert executed() == {"reserve": 1, "ship": 1, "notify": 1}
    # The original is stopped for good: a late approval is refused.
    versions = await runtime.views.list_runs(flow=FLOW)
    assert {s.run_id: (s.status, s.flow_version) for s in versions} == {
        old: ("aborted", "1"), moved.run_id: ("finished", "2"),
    }  # fmt: skip


async def test_a_migrate_retried_after_a_crash_between_the_fork_and_the_stop_converges(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    (old,) = await paused_on_v1(open_store)
    store = open_store()
    runtime = Runtime(deploy_app.v2(), store=store)
    stop = migrate_module._stop_original

    async def crash(*args: Any) -> None:
        raise ConnectionError("the process died here")

    monkeypatch.setattr(migrate_module, "_stop_original", crash)
    with pytest.raises(ConnectionError):
        await runtime.migrate(old, SESSION, 1)
    fork_id = migration_id(old, 1)
    assert (await runtime.get_run(old, SESSION)).status == "paused"  # type: ignore[union-attr]
    assert (await runtime.get_run(fork_id, SESSION)).status == "paused"  # type: ignore[union-attr]

    monkeypatch.setattr(migrate_module, "_stop_original", stop)
    again = await runtime.migrate(old, SESSION, 1)
    assert again.run_id == fork_id and again.status == "paused"
    original = await runtime.get_run(old, SESSION)
    assert original is not None and original.migrated_to == fork_id
    assert original.outcome == f"migrated: {fork_id}"
    at = head(store)
    assert (await runtime.migrate(old, SESSION, 1)).run_id == fork_id  # a no-op now
    assert head(store) == at
    runs = await runtime.views.list_runs(session_id=SESSION)
    assert sorted(s.run_id for s in runs) == sorted([old, fork_id])

    await runtime.approve(fork_id, SESSION, by="ann")
    assert executed() == {"reserve": 1, "ship": 1, "notify": 1}


async def test_a_migrate_retried_after_its_fork_died_mid_turn_drives_the_fork_on(
    open_store: StoreFactory,
) -> None:
    store = open_store.crashing()
    (old,) = await paused_on_v1(open_store)
    # The fork's reserve is saved (with the save after it: its pause), then the
    # migrator dies before it marks the original migrated.
    store.plan = CrashPlan("after_finalize")
    with pytest.raises(Crash):
        await Runtime(deploy_app.v2(), store=store, holder="migrator").migrate(old, SESSION, 0)
    store.plan = None
    fork_id = migration_id(old, 0)
    cut_off = Runtime(deploy_app.v2(), store=open_store())
    fork = await cut_off.get_run(fork_id, SESSION)
    assert fork is not None and fork.status in ("running", "paused")
    assert (await cut_off.get_run(old, SESSION)).status == "paused"  # type: ignore[union-attr]

    # The restarted migrator (its holder name) retries: the fork goes on to its pause.
    retried = Runtime(deploy_app.v2(), store=open_store(), holder="migrator")
    again = await retried.migrate(old, SESSION, 0)
    assert (again.run_id, again.status) == (fork_id, "paused")
    assert (await retried.get_run(old, SESSION)).migrated_to == fork_id  # type: ignore[union-attr]
    await retried.approve(fork_id, SESSION, by="ann")
    assert (await retried.get_run(fork_id, SESSION)).outcome == "v2: shipped"  # type: ignore[union-attr]
    # At step 0 the fork reserves afresh, under a key of its own: once each.
    assert executed() == {"reserve": 2, "ship": 1, "notify": 1}


async def test_two_migrations_racing_make_one_fork(open_store: StoreFactory) -> None:
    (old,) = await paused_on_v1(open_store)
    first = Runtime(deploy_app.v2(), store=open_store(), holder="one")
    second = Runtime(deploy_app.v2(), store=open_store(), holder="two")
    results = await asyncio.gather(first.migrate(old, SESSION, 1), second.migrate(old, SESSION, 1))
    assert {r.run_id for r in results} == {migration_id(old, 1)}
    runs = await first.views.list_runs(session_id=SESSION)
    assert sorted(s.run_id for s in runs) == sorted([old, migration_id(old, 1)])
    original = await first.get_run(old, SESSION)
    assert original is not None and original.migrated_to == migration_id(old, 1)
    assert executed() == {"reserve": 1}


async def test_migrate_refusals_write_nothing(open_store: StoreFactory) -> None:
    paused, other = await paused_on_v1(open_store, count=2)
    store = open_store()
    runtime = Runtime(deploy_app.v2(), store=store)
    chat = define_agent("chat", "", ScriptedModel(["hello"]), deploy_app.TOOLS, [order_v1()])
    conversation = await Runtime([chat], store=store).run("s-chat", input="hi").result()
    await runtime.migrate(other, SESSION, 1)  # migrated: at another step it is refused
    before = head(store)

    refusals: list[tuple[Any, type[Exception]]] = [
        (runtime.migrate(paused, SESSION, 99), InvalidArgumentError),
        (runtime.migrate(paused, SESSION, -1), InvalidArgumentError),
        (runtime.migrate(paused, SESSION, "1"), InvalidArgumentError),  # type: ignore[arg-type]
        (runtime.migrate(paused, "another-session", 1), RunNotFoundError),
        (runtime.migrate("00000000-0000-4000-8000-000000000000", SESSION, 0), RunNotFoundError),
        (runtime.migrate(conversation.run_id, "s-chat", 0), InvalidArgumentError),
        (runtime.migrate(other, SESSION, 0), InvalidArgumentError),
    ]
    for call, error in refusals:
        with pytest.raises(error):
            await call
    assert head(store) == before
    assert executed() == {"reserve": 2}


async def test_a_fork_that_no_longer_replays_leaves_the_original_as_it_was(
    open_store: StoreFactory,
) -> None:
    (old,) = await paused_on_v1(open_store)
    # The newest definition has version 1's digest, but its code asks for the clock first.
    store = open_store()
    runtime = Runtime(deploy_app.v1_reordered(), store=store)
    with pytest.raises(NonDeterminismError):
        await runtime.migrate(old, SESSION, 1)
    original = await runtime.get_run(old, SESSION)
    assert original is not None and (original.status, original.migrated_to) == ("paused", None)
    fork = await runtime.get_run(migration_id(old, 1), SESSION)
    assert fork is not None and fork.status == "error"
    assert executed() == {"reserve": 1}
