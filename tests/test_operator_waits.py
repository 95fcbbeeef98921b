"""Every kind of wait answered from the command line and over HTTP, each through a real
process, on SQLite and PostgreSQL: the table of docs/operators.md, tried door by door.

One run paused on each kind of wait (``tests/procs/waits_app.py``) is answered by the
door the table names. From the command line: ``input``, ``signal``,
``in-doubt resolve``, ``approve --raise-to`` (a spent budget), ``send`` (a message),
``sweep`` (a due timer), and for a parent waiting for its child, nothing on the parent
(``runs show`` names the child, an approval of the parent is refused pointing at it)
and the child's own ``approve``, which ends the parent within that command. Over HTTP
(``kuralle-es serve``): ``/input``, ``/approve``, ``/signals``, ``/in-doubt``,
``/approve`` with ``raise_to``, ``/messages``, and the child's ``/approve``. Each run
ends with what answered it, the journal keeps who answered, a refusal writes nothing,
and a call in doubt runs again only when answered ``retry``. The commands of one batch
run at once, to keep it quick.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from http_kit import Served, StoreHead, start_server
from procs.waits_app import LEDGER_ENV, SLEEP_ENV, build_agents, ledger, start_every_wait
from test_cli_operator_verbs import done, spawn

from kuralle_es import RunState, RunStore, Runtime
from kuralle_es.views.timeline import format_timeline, read_deliveries

APP = "waits_app:build_agents"


@dataclass
class Waits:
    """A runtime of the waits app (its ``capture`` dies once) on the store, and the
    environment the commands and the server get (the same ledger)."""

    runtime: Runtime
    env: dict[str, str]
    store_url: str
    workdir: Path

    @property
    def ledger(self) -> Path:
        return Path(self.env[LEDGER_ENV])


@pytest.fixture
def waits(store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Waits]:
    env = {LEDGER_ENV: str(tmp_path / "captures.jsonl"), SLEEP_ENV: "0.3"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with RunStore.from_url(store_url) as store:
        runtime = Runtime(build_agents(crash=True), store=store, inline_sleep_limit=0)
        yield Waits(runtime, {"KURALLE_STORE": store_url, **env}, store_url, tmp_path)


async def state(runtime: Runtime, run_id: str) -> RunState:
    run = await runtime.store.load_async(run_id)
    assert run is not None
    return run.to_state()


async def actors(runtime: Runtime, run_id: str) -> list[tuple[str, str | None]]:
    """What was delivered to the run (its name) and by whom, in order."""
    found = await asyncio.to_thread(read_deliveries, runtime.store, run_id)
    return [(d.name, d.actor) for d in found]


async def child_of(runtime: Runtime, parent: str) -> str:
    """The child a parent waits for; ``waiting_runs()`` lists the child's approval with
    its parent, like any other approval."""
    wait = (await state(runtime, parent)).waiting_for
    assert wait is not None and wait.kind == "child" and wait.child_run_id is not None
    waiting = {s.run_id: s for s in await runtime.views.waiting_runs()}
    listed = waiting[wait.child_run_id]
    assert listed.waiting_for is not None and listed.waiting_for.kind == "approval"
    assert listed.parent is not None and listed.parent["run_id"] == parent
    return wait.child_run_id


async def until_due(runtime: Runtime, run_id: str) -> None:
    """Until the run's durable timer is due, so that a sweep wakes it."""
    wait = (await state(runtime, run_id)).waiting_for
    assert wait is not None and wait.kind == "timer" and wait.deadline is not None
    await asyncio.sleep(max(0.0, (wait.deadline - datetime.now(UTC)).total_seconds()))


async def outcomes(runtime: Runtime, runs: dict[str, str]) -> dict[str, tuple[str, str | None]]:
    return {kind: ((s := await state(runtime, r)).status, s.outcome) for kind, r in runs.items()}


#: How each run ends once answered as the tests answer it.
ANSWERED = {
    "input": ("finished", "amount 12.5"),
    "approval": ("finished", "approved by ann"),
    "signal": ("finished", 'went {"n": 1}'),
    "budget": ("finished", "said"),
    "message": ("finished", 'got "A-1"'),
    "child": ("finished", "the child says: approved by ann"),
    "timer": ("finished", "rested"),
}


async def test_every_wait_is_answered_from_the_command_line(waits: Waits) -> None:
    runtime, env = waits.runtime, waits.env
    runs = await start_every_wait(runtime, "cli")
    child = await child_of(runtime, runs["child"])
    await until_due(runtime, runs["timer"])

    def kuralle(*args: str) -> object:
        return spawn(env, *args, app=APP)

    running = {
        "input": kuralle("input", runs["input"], "It was 12.50", "--json"),
        "signal": kuralle("signal", runs["signal"], "go", "--payload", '{"n": 1}',
                          "--actor", "dock-7"),
        "in-doubt": kuralle("in-doubt", runs["in-doubt"], "resolve", "--by", "oncall",
                            "--result", '{"captured": "by hand"}'),
        "budget": kuralle("approve", runs["budget"], "--by", "ann", "--raise-to",
                          '{"max_model_calls": 3}'),
        "message": kuralle("send", runs["message"], "item", "--payload", '"A-1"',
                           "--message-id", "m-1", "--actor", "shop"),
        "timer": kuralle("sweep"),
        # The parent's wait is read-only: shown with its child, refused to an approver.
        "child": kuralle("runs", "show", runs["child"]),
        "child refused": kuralle("approve", runs["child"], "--by", "ann"),
    }  # fmt: skip
    printed = {what: done(process) for what, process in running.items() if "refused" not in what}
    refused = done(running["child refused"], 1)
    assert f"waits for its child run {child} to end" in refused
    assert f"kuralle-es runs show {child}" in refused
    assert f"until child run {child} ends" in printed["child"]
    assert f"woken {runs['timer']}" in printed["timer"]
    for kind in ("input", "signal", "in-doubt", "budget", "message"):
        assert json.loads(printed[kind])["status"] == "finished", (kind, printed[kind])

    # The child's own approval (the approval of this test) ends it, and its end resumes
    # the parent within that command.
    approved = done(kuralle("approve", child, "--by", "ann", "--reason", "checked"))
    assert json.loads(approved)["status"] == "finished"

    ended = await outcomes(runtime, {**runs, "approval": child})
    assert ended.pop("in-doubt") == ("finished", 'captured {"captured": "by hand"}')
    assert ended == ANSWERED
    # Resolved, the call in doubt was recorded, not executed again (one capture: the crash's).
    assert [e["run"] for e in ledger(waits.ledger)] == [runs["in-doubt"]]
    assert await actors(runtime, runs["signal"]) == [("go", "dock-7")]
    assert await actors(runtime, runs["in-doubt"]) == [("__in_doubt", "oncall")]
    assert await actors(runtime, runs["message"]) == [("item", "shop")]
    assert await actors(runtime, child) == [("__approval", "ann")]
    model_steps = [s for s in await runtime.get_steps(runs["budget"], "cli-budget")
                   if s.kind == "model"]  # fmt: skip
    assert len(model_steps) == 2  # the raised budget allowed the second call


async def test_every_wait_is_answered_over_http(waits: Waits) -> None:
    runtime = waits.runtime
    runs = await start_every_wait(runtime, "http")
    child = await child_of(runtime, runs["child"])
    server = start_server(waits.store_url, waits.workdir, app=APP, **waits.env)
    served = Served(server, StoreHead(waits.store_url), waits.store_url, waits.workdir, waits.env)
    try:
        # Refusals first: each is the contract's JSON error and writes nothing.
        doubt = f"/api/runs/{runs['in-doubt']}/in-doubt"
        served.refused(422, "InvalidSignalError", "POST", doubt, {"action": "resolve", "by": "x"})
        served.refused(422, "InvalidArgumentError", "POST", doubt, {"action": "undo", "by": "x"})
        served.refused(422, "InvalidArgumentError", "POST", doubt, {"action": "retry"})
        wrong = served.refused(409, "SignalMismatchError", "POST",
                               f"/api/runs/{runs['approval']}/in-doubt",
                               {"action": "retry", "by": "x"})  # fmt: skip
        assert "/approve" in wrong.body["message"]
        parent = f"/api/runs/{runs['child']}"
        held = served.refused(409, "SignalMismatchError", "POST", f"{parent}/approve", {"by": "a"})
        assert child in held.body["message"]
        served.refused(422, "InvalidSignalError", "POST", f"{parent}/signals", {"name": "__child"},
                       headers={"Idempotency-Key": "c-1"})  # fmt: skip
        timer = f"/api/runs/{runs['timer']}/signals"
        asleep = served.refused(422, "InvalidSignalError", "POST", timer, {"name": "__timer"},
                                headers={"Idempotency-Key": "t-1"})  # fmt: skip
        assert "kuralle-es worker" in asleep.body["message"]
        # A parent's wait names its child; the child's approval is listed with its parent.
        assert served.ok("GET", parent)["waiting_for"]["child_run_id"] == child
        paused = {r["run_id"]: r for r in served.ok("GET", "/api/runs?status=paused")}
        assert paused[child]["parent"]["run_id"] == runs["child"]

        answers = {
            "input": ("input", {"text": "It was 12.50"}, None),
            "approval": ("approve", {"by": "ann", "reason": "checked"}, None),
            "signal": ("signals", {"name": "go", "payload": {"n": 1}, "actor": "dock-7"}, "go-1"),
            "in-doubt": ("in-doubt", {"action": "retry", "by": "oncall"}, "doubt-1"),
            "budget": ("approve", {"by": "ann", "raise_to": {"max_model_calls": 3}}, None),
            "message": ("messages", {"name": "item", "payload": "A-1", "actor": "shop"}, "m-1"),
        }
        for kind, (route, body, key) in answers.items():
            headers = {"Idempotency-Key": key} if key else {}
            answer = served.ok("POST", f"/api/runs/{runs[kind]}/{route}", body, headers=headers)
            assert answer["status"] == "finished", (kind, answer)
        # An answer retried with its key is a no-op that answers the same.
        again = served.unchanged("POST", doubt, answers["in-doubt"][1],
                                 headers={"Idempotency-Key": "doubt-1"})  # fmt: skip
        assert again["status"] == "finished"
        child_done = served.ok("POST", f"/api/runs/{child}/approve", {"by": "ann"})
        assert child_done["status"] == "finished"
        assert served.ok("GET", parent)["outcome"] == ANSWERED["child"][1]
    finally:
        server.stop()
        served.log.close()

    ended = await outcomes(runtime, {k: v for k, v in runs.items() if k != "timer"})
    assert ended.pop("in-doubt") == ("finished", 'captured {"captured": true}')
    assert ended == {k: v for k, v in ANSWERED.items() if k != "timer"}
    # Retried, the call in doubt ran again under the same key: twice in all.
    captured = ledger(waits.ledger)
    assert [e["run"] for e in captured] == [runs["in-doubt"]] * 2
    assert captured[0]["key"] == captured[1]["key"]
    assert await actors(runtime, runs["signal"]) == [("go", "dock-7")]
    assert await actors(runtime, runs["in-doubt"]) == [("__in_doubt", "oncall")]
    assert await actors(runtime, runs["message"]) == [("item", "shop")]


async def test_runs_show_names_the_command_that_answers_each_wait(waits: Waits) -> None:
    """What ``kuralle-es runs show`` prints under a run's wait (``format_timeline``)."""
    runtime = waits.runtime
    runs = await start_every_wait(runtime, "show")
    child = await child_of(runtime, runs["child"])
    expected = {
        "input": f"answer: kuralle-es input {runs['input']} TEXT",
        "approval": f"answer: kuralle-es approve {runs['approval']} --by NAME, or kuralle-es "
        f"deny {runs['approval']} --by NAME --reason TEXT",
        "signal": f"answer: kuralle-es signal {runs['signal']} go --payload JSON",
        "in-doubt": f"answer: kuralle-es in-doubt {runs['in-doubt']} retry|resolve|fail --by NAME",
        "budget": f"answer: kuralle-es approve {runs['budget']} --by NAME [--raise-to JSON]",
        "message": f"answer: kuralle-es send {runs['message']} item --payload JSON --message-id ID",
        "child": f"until child run {child} ends (kuralle-es runs show it)",
        "timer": "answer: nothing to answer: a worker (kuralle-es worker) wakes it when it is due",
    }
    for kind, line in expected.items():
        shown = format_timeline(await state(runtime, runs[kind]), [])
        assert line in shown, (kind, shown)
    assert "answer:" not in format_timeline(await state(runtime, runs["child"]), [])
