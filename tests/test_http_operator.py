"""The operator routes of the HTTP API through real HTTP to a real ``kuralle-es serve``.

``POST /api/sessions/{session_id}/turns`` starts and continues a conversation (a
tool call in it, a retry under its ``Idempotency-Key`` a no-op); ``POST
/api/runs/{run_id}/resume`` re-drives a run whose model step was in doubt after an
outage (its approved charge runs once); ``POST /api/runs/{run_id}/resolve-drift``
restarts or abandons a run whose flow changed. One server per backend (SQLite,
PostgreSQL) serves ``tests/procs/operator_app.py`` with the second variant of its
``drifty`` flow, so runs started in this process (the first variant) drift; every
refusal is the contract's JSON error and writes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest
from http_kit import Served, StoreHead, module_store_url, start_server
from procs.operator_app import DOWN_ENV, LEDGER_ENV, VARIANT_ENV, build_agents, ledger

from kuralle_es import RunState, RunStore, Runtime, TurnResult

__all__ = ["module_store_url"]

APP = "operator_app:build_agents"


@pytest.fixture(scope="module")
def served(module_store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    workdir = tmp_path_factory.mktemp("http-operator")
    env = {
        LEDGER_ENV: str(workdir / "charges.jsonl"),
        DOWN_ENV: str(workdir / "down"),
        VARIANT_ENV: "2",
    }
    server = start_server(module_store_url, workdir, app=APP, **env)
    served = Served(server, StoreHead(module_store_url), module_store_url, workdir, env)
    try:
        yield served
    finally:
        served.server.stop()
        served.log.close()


def session() -> str:
    return f"s-{uuid4().hex[:12]}"


def test_a_conversation_is_started_and_continued_over_http(served: Served) -> None:
    s = session()
    path = f"/api/sessions/{s}/turns"
    first = TurnResult.model_validate(
        served.ok("POST", path, {"text": "where is order 7"}, headers={"Idempotency-Key": "t-1"})
    )
    assert (first.status, first.output) == ("finished", "Order 7 is shipped.")
    # A retry of that turn (same key, same text) answers the same and writes nothing.
    again = served.unchanged("POST", path, {"text": "where is order 7"},
                             headers={"Idempotency-Key": "t-1"})  # fmt: skip
    assert again == first.model_dump(mode="json")
    second = served.ok("POST", path, {"text": "thanks", "agent": "desk"})
    assert (second["run_id"], second["output"]) == (first.run_id, "You said: thanks")
    state = RunState.model_validate(served.ok("GET", f"/api/runs/{first.run_id}"))
    assert [m.role for m in state.messages] == [
        "user", "assistant", "tool", "assistant", "user", "assistant",
    ]  # fmt: skip
    assert state.messages[1].tool_calls is not None

    served.refused(422, "InvalidArgumentError", "POST", path, {"text": "hi", "agent": "ops"})
    served.refused(422, "InvalidArgumentError", "POST", f"/api/sessions/{session()}/turns",
                   {"text": "hi", "agent": "nobody"})  # fmt: skip
    served.refused(422, "InvalidArgumentError", "POST", path, {"txt": "typo"})


def test_an_errored_run_with_a_model_step_in_doubt_is_resumed_over_http(
    served: Served,
) -> None:
    s = session()
    started = served.ok("POST", "/api/runs", {"session_id": s, "flow": "pay"})
    run_id = started["run_id"]
    down = Path(served.env[DOWN_ENV])
    down.touch()
    try:
        # The node's failure is journaled: the answer is the run, in error.
        approved = served.ok("POST", f"/api/runs/{run_id}/approve", {"by": "ann"})
    finally:
        down.unlink()
    assert approved["status"] == "error"
    served.refused(404, "RunNotFoundError", "POST", f"/api/runs/{uuid4()}/resume", {})
    served.refused(422, "InvalidArgumentError", "POST", f"/api/runs/{run_id}/resume", {"x": 1})

    resumed = TurnResult.model_validate(served.ok("POST", f"/api/runs/{run_id}/resume", {}))
    assert (resumed.status, resumed.output) == ("finished", "Paid.")
    charges = [e for e in ledger(Path(served.env[LEDGER_ENV])) if e["cents"] == 500]
    assert len({e["key"] for e in charges}) == len(charges)  # every run charged once
    steps = served.ok("GET", f"/api/runs/{run_id}/steps")
    assert [(x["kind"], x["attempts"]) for x in steps[1:3]] == [("tool", 1), ("model", 2)]
    # A finished run resumed again is a no-op that answers it as it is.
    assert served.unchanged("POST", f"/api/runs/{run_id}/resume") == resumed.model_dump(mode="json")


async def test_a_drifted_run_is_restarted_or_abandoned_over_http(served: Served) -> None:
    s = session()
    saved = os.environ.pop(VARIANT_ENV, None)
    try:
        with RunStore.from_url(served.store_url) as store:
            runtime = Runtime(build_agents(), store=store)  # the first variant of ``drifty``
            first = await runtime.run(s, kind="flow", flow_name="drifty").result()
            second = await runtime.run(s, kind="flow", flow_name="drifty").result()
    finally:
        if saved is not None:
            os.environ[VARIANT_ENV] = saved
    signal = {"name": "go", "payload": None}
    refused = served.refused(409, "FlowDriftError", "POST", f"/api/runs/{first.run_id}/signals",
                             signal, headers={"Idempotency-Key": "go-1"})  # fmt: skip
    assert f"kuralle-es resolve-drift {first.run_id}" in refused.body["message"]
    path = f"/api/runs/{first.run_id}/resolve-drift"
    served.refused(422, "InvalidArgumentError", "POST", path, {"action": "rewind"})

    restarted = RunState.model_validate(served.ok("POST", path, {"action": "restart"}))
    assert restarted.status == "paused" and restarted.waiting_for is not None
    assert restarted.waiting_for.name == "go" and restarted.active_node == "wait"
    # Drift resolved: another resolution is refused, and writes nothing.
    served.refused(422, "InvalidArgumentError", "POST", path, {"action": "abandon"})
    went = served.ok("POST", f"/api/runs/{first.run_id}/signals", signal,
                     headers={"Idempotency-Key": "go-2"})  # fmt: skip
    assert (went["status"], went["output"]) == ("finished", "audited")  # the new node ran

    abandoned = served.ok("POST", f"/api/runs/{second.run_id}/resolve-drift", {"action": "abandon"})
    assert (abandoned["status"], abandoned["outcome"]) == ("aborted", "abandoned: flow drift")
