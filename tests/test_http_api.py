"""The HTTP API (docs/http.md) through real HTTP to a real ``kuralle-es serve`` process.

Each backend (SQLite, PostgreSQL) gets one server for the module, over its
own database, serving ``tests/procs/http_app.py``; every test works in
sessions of its own. Every refusal is checked for the contract's shape
(``{error, message, fields}``, a 4xx) and against the store's notification
log, read from this process: a refused request wrote nothing. The
kill-and-resume proof SIGKILLs a server with a run parked on an approval and
approves it through a new server process: the charge executes exactly once.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from http_kit import (
    COMMAND,
    PROCS,
    TOKEN,
    Served,
    Server,
    StoreHead,
    clean_env,
    module_store_url,
    start_server,
)
from procs.http_app import ledger_lines

from kuralle_es import RunState, RunStore, RunSummary, StepRecord, TurnResult
from kuralle_es._journal.leases import LeaseOp

__all__ = ["module_store_url"]  # a fixture, from http_kit

#: The servers' payload bound (``KURALLE_MAX_PAYLOAD_BYTES``): small, so 413 is cheap to reach.
PAYLOAD_LIMIT = 4096


@pytest.fixture(scope="module")
def served(module_store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    workdir = tmp_path_factory.mktemp("http-served")
    env = {
        "HTTP_LEDGER": str(workdir / "charges.jsonl"),
        "REFUND_LEDGER": str(workdir / "refunds.jsonl"),
        "KURALLE_MAX_PAYLOAD_BYTES": str(PAYLOAD_LIMIT),
    }
    server = start_server(module_store_url, workdir, **env)
    served = Served(server, StoreHead(module_store_url), module_store_url, workdir, env)
    try:
        yield served
    finally:
        served.server.stop()
        served.log.close()


def session() -> str:
    return f"s-{uuid4().hex[:12]}"


def key() -> str:
    return f"k-{uuid4().hex}"


def runs(path: str) -> str:
    return f"/api/runs{path}"


# ------------------------------------------------------------------- reads
def test_a_started_flow_run_is_read_back_listed_and_its_steps_shown(served: Served) -> None:
    s, k = session(), key()
    started = TurnResult.model_validate(served.start("refund", s, "I want a refund", key=k))
    assert started.status == "paused" and started.waiting_for is not None
    assert started.waiting_for.kind == "input"
    assert started.output == "How much should be refunded, in dollars?"

    # A retried start (same Idempotency-Key) is a no-op that answers the same run.
    again = served.unchanged(
        "POST", "/api/runs", {"session_id": s, "flow": "refund", "input": "I want a refund"},
        headers={"Idempotency-Key": k},
    )  # fmt: skip
    assert again == started.model_dump(mode="json")
    # The same key with another input is a conflict, and writes nothing.
    served.refused(
        409, "IdempotencyConflictError", "POST", "/api/runs",
        {"session_id": s, "flow": "refund", "input": "another refund"},
        headers={"Idempotency-Key": k},
    )  # fmt: skip

    state = RunState.model_validate(served.ok("GET", runs(f"/{started.run_id}")))
    assert (state.run_id, state.session_id, state.kind) == (started.run_id, s, "flow")
    assert state.status == "paused" and state.active_flow == "refund"
    assert [m.content for m in state.messages if m.role == "user"] == ["I want a refund"]

    listed = [RunSummary.model_validate(r) for r in served.ok("GET", runs(f"?session_id={s}"))]
    assert [r.run_id for r in listed] == [started.run_id]
    assert listed[0].waiting_for is not None and listed[0].waiting_for.kind == "input"
    filtered = served.ok("GET", runs(f"?session_id={s}&status=paused&flow=refund&limit=1"))
    assert [r["run_id"] for r in filtered] == [started.run_id]
    assert served.ok("GET", runs(f"?session_id={s}&status=finished")) == []

    steps = [
        StepRecord.model_validate(x) for x in served.ok("GET", runs(f"/{started.run_id}/steps"))
    ]
    assert steps and steps[0].kind == "model" and steps[0].status == "finished"


def test_the_openapi_document_describes_this_server(served: Served) -> None:
    document = served.ok("GET", "/openapi.json")
    assert document["openapi"] == "3.1.0"
    assert set(document["paths"]) >= {
        "/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/steps",
        "/api/runs/{run_id}/signals", "/api/runs/{run_id}/approve", "/api/runs/{run_id}/deny",
        "/api/runs/{run_id}/input", "/api/runs/{run_id}/cancel", "/api/runs/{run_id}/messages",
        "/api/runs/{run_id}/published", "/api/runs/{run_id}/stream",
        "/api/sessions/{session_id}/turns", "/api/runs/{run_id}/resume",
        "/api/runs/{run_id}/resolve-drift", "/api/subjects/{subject}",
    }  # fmt: skip
    schemas = document["components"]["schemas"]
    assert {"TurnResult", "RunState", "StepRecord", "RunSummary", "ErrorBody"} <= set(schemas)
    assert schemas["StartRun"]["properties"]["flow"]["enum"] == [
        "boom",
        "charge",
        "household",
        "order",
        "refund",
        "ship",
    ]
    assert schemas["StartRun"]["additionalProperties"] is False
    assert document["security"] == [{"bearer": []}]


# ------------------------------------------------------------- deliveries
def test_input_to_a_collect_node_then_approve_refunds_exactly_once(served: Served) -> None:
    s = session()
    run_id = served.start("refund", s, "Hi, I'd like a refund")["run_id"]

    input_key = key()
    asked = served.ok(
        "POST", runs(f"/{run_id}/input"), {"text": "It was $42.50"},
        headers={"Idempotency-Key": input_key},
    )  # fmt: skip
    assert asked["status"] == "paused" and asked["waiting_for"]["kind"] == "approval"
    assert asked["waiting_for"]["title"] == "Refund $42.50?"
    retried = served.unchanged(
        "POST", runs(f"/{run_id}/input"), {"text": "It was $42.50"},
        headers={"Idempotency-Key": input_key},
    )  # fmt: skip
    assert retried == asked

    approval = {"by": "supervisor", "reason": "receipt checked"}
    headers = {"Idempotency-Key": f"approve-{run_id}"}
    done = served.ok("POST", runs(f"/{run_id}/approve"), approval, headers=headers)
    assert done["status"] == "finished"
    assert done["output"] == "Good news: your refund was approved and is on its way."
    # The approver's retry (same Idempotency-Key) is a no-op with the same answer.
    assert served.unchanged("POST", runs(f"/{run_id}/approve"), approval, headers=headers) == done
    # A second, different approval finds nothing to approve.
    served.refused(409, "SignalMismatchError", "POST", runs(f"/{run_id}/approve"), approval)

    refunds = [
        e
        for e in refund_entries(served)
        if e["tool"] == "processRefund" and e["amount_cents"] == 4250
    ]
    steps = served.ok("GET", runs(f"/{run_id}/steps"))
    tool_steps = [x for x in steps if x["kind"] == "tool"]
    assert [(x["name"], x["status"], x["attempts"]) for x in tool_steps] == [
        ("processRefund", "finished", 1)
    ]
    assert [e["key"] for e in refunds] == [tool_steps[0]["key"]]
    state = served.ok("GET", runs(f"/{run_id}"))
    assert state["status"] == "finished" and state["state"]["approved_by"] == "supervisor"


def refund_entries(served: Served) -> list[dict[str, Any]]:
    path = served.refund_ledger
    return ledger_lines(path) if path.exists() else []


def test_approving_a_tool_that_needs_approval_executes_it_once(served: Served) -> None:
    paused = served.start("charge", session())
    run_id, wait = paused["run_id"], paused["waiting_for"]
    assert paused["status"] == "paused" and wait["kind"] == "approval"
    assert wait["operation"]["tool_name"] == "charge" and wait["operation"]["args"] == {
        "cents": 500
    }

    done = served.ok("POST", runs(f"/{run_id}/approve"), {"by": "ann"})
    assert done["status"] == "finished" and done["output"] == "charged"
    step = next(x for x in served.ok("GET", runs(f"/{run_id}/steps")) if x["kind"] == "tool")
    assert [e["key"] for e in ledger_lines(served.ledger) if e["key"] == step["key"]] == [
        step["key"]
    ]


def test_deny_ends_the_run_without_executing_the_tool(served: Served) -> None:
    run_id = served.start("charge", session())["run_id"]
    charged_before = ledger_lines(served.ledger)
    denied = served.ok("POST", runs(f"/{run_id}/deny"), {"by": "bob", "reason": "duplicate"})
    assert denied["status"] == "finished" and denied["output"] == "denied"
    state = served.ok("GET", runs(f"/{run_id}"))
    assert state["state"]["denied"] == {"by": "bob", "reason": "duplicate"}
    assert not any(x["kind"] == "tool" for x in served.ok("GET", runs(f"/{run_id}/steps")))
    assert ledger_lines(served.ledger) == charged_before  # nothing charged


def test_a_signal_needs_its_idempotency_key_and_a_retried_delivery_is_a_no_op(
    served: Served,
) -> None:
    run_id = served.start("ship", session())["run_id"]
    path = runs(f"/{run_id}/signals")
    good = {"name": "shipped", "payload": {"tracking": "1Z999"}}

    reply = served.refused(422, "InvalidArgumentError", "POST", path, good)
    assert "Idempotency-Key" in reply.body["message"]
    served.refused(
        422, "InvalidSignalError", "POST", path, {"name": "shipped", "payload": {"oops": 1}},
        headers={"Idempotency-Key": key()},
    )  # fmt: skip
    served.refused(
        409, "SignalMismatchError", "POST", path, {"name": "delivered", "payload": None},
        headers={"Idempotency-Key": key()},
    )  # fmt: skip
    # The library's own waits are not signals: input goes to /input, timers to the sweeper.
    for reserved in ("__input", "__timer"):
        served.refused(
            422, "InvalidSignalError", "POST", path, {"name": reserved, "payload": "x"},
            headers={"Idempotency-Key": key()},
        )  # fmt: skip
    served.refused(
        413, "PayloadTooLargeError", "POST", path,
        {"name": "shipped", "payload": {"tracking": "x" * (PAYLOAD_LIMIT + 1)}},
        headers={"Idempotency-Key": key()},
    )  # fmt: skip

    delivery = {"Idempotency-Key": "carrier-event-1"}
    done = served.ok("POST", path, good, headers=delivery)
    assert done["status"] == "finished" and done["output"] == "1Z999"
    # The carrier retries its webhook: same Idempotency-Key, same answer, nothing written.
    assert served.unchanged("POST", path, good, headers=delivery) == done
    # Another delivery finds the run no longer waiting.
    served.refused(
        409, "SignalMismatchError", "POST", path, good, headers={"Idempotency-Key": key()}
    )


def test_cancel_aborts_a_flow_run_and_repeats_as_a_no_op(served: Served) -> None:
    run_id = served.start("ship", session())["run_id"]
    cancelled = RunState.model_validate(
        served.ok("POST", runs(f"/{run_id}/cancel"), {"reason": "customer left"})
    )
    assert cancelled.status == "aborted" and cancelled.outcome == "cancelled: customer left"
    assert cancelled.waiting_for is None
    again = served.unchanged("POST", runs(f"/{run_id}/cancel"), {"reason": "customer left"})
    assert again["status"] == "aborted"

    finished = served.start("ship", session())["run_id"]
    served.ok(
        "POST", runs(f"/{finished}/signals"), {"name": "shipped", "payload": {"tracking": "T"}},
        headers={"Idempotency-Key": key()},
    )  # fmt: skip
    served.refused(
        422, "InvalidArgumentError", "POST", runs(f"/{finished}/cancel"), {"reason": "x"}
    )
    served.refused(422, "InvalidArgumentError", "POST", runs(f"/{run_id}/cancel"), {"reason": " "})


def test_a_node_that_fails_answers_the_runs_error_result(served: Served) -> None:
    failed = served.start("boom", session())
    assert failed["status"] == "error"
    state = served.ok("GET", runs(f"/{failed['run_id']}"))
    assert state["status"] == "error"
    assert state["error"]["type"] == "RuntimeError"
    assert state["error"]["message"] == "the boom node always fails"


# ---------------------------------------------------------------- refusals
def test_every_refusal_is_a_json_4xx_that_writes_nothing(served: Served) -> None:
    run_id = served.start("ship", session())["run_id"]
    ghost = str(uuid4())
    approval = {"by": "ann"}

    # 404: an unknown run on every route that names one; a path no route serves.
    served.refused(404, "RunNotFoundError", "GET", runs("/not-a-run"))
    served.refused(404, "RunNotFoundError", "GET", runs(f"/{ghost}"))
    served.refused(404, "RunNotFoundError", "GET", runs(f"/{ghost}/steps"))
    for verb, body in (
        ("approve", approval), ("deny", approval), ("input", {"text": "hi"}),
        ("cancel", {"reason": "r"}), ("signals", {"name": "shipped"}),
    ):  # fmt: skip
        served.refused(
            404, "RunNotFoundError", "POST", runs(f"/{ghost}/{verb}"), body,
            headers={"Idempotency-Key": key()},
        )  # fmt: skip
    served.refused(404, "UnknownRouteError", "GET", "/api/nothing")

    # 405, with the methods the path takes.
    reply = served.refused(405, "MethodNotAllowedError", "DELETE", runs(f"/{run_id}"))
    assert set(reply.headers["allow"].split(", ")) == {"GET", "HEAD"}
    reply = served.refused(405, "MethodNotAllowedError", "PUT", runs(""))
    assert set(reply.headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}

    # 401: no token, another token, another scheme; reads too.
    for token_headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
    ):
        reply = served.refused(
            401, "UnauthorizedError", "POST", runs(f"/{run_id}/approve"), approval,
            token=None, headers=token_headers,
        )  # fmt: skip
        assert reply.headers["www-authenticate"] == "Bearer"
    served.refused(401, "UnauthorizedError", "GET", runs(f"/{run_id}"), token=None)
    served.refused(401, "UnauthorizedError", "GET", "/openapi.json", token="wrong")

    # 422: a body that is not JSON, not an object, or does not fit its model.
    approve = runs(f"/{run_id}/approve")
    for raw in (b"{bad", b"[1, 2]", b'"text"', b'{"by": NaN}', b'{"by": "\\ud800"}', b"\xff\xfe"):
        served.refused(422, "InvalidArgumentError", "POST", approve, raw=raw)
    reply = served.refused(422, "InvalidArgumentError", "POST", approve, {"by": "a", "extra": 1})
    assert reply.body["fields"]["problems"][0]["field"] == "extra"
    served.refused(422, "InvalidArgumentError", "POST", approve, {"by": 5})
    served.refused(422, "InvalidArgumentError", "POST", approve, {"reason": "no one decided"})
    served.refused(422, "InvalidArgumentError", "POST", approve, {"by": "   "})
    served.refused(422, "InvalidArgumentError", "POST", approve, {"by": "x" * 257})
    start = {"session_id": session(), "flow": "ship"}
    served.refused(422, "InvalidArgumentError", "POST", runs(""), {**start, "session_id": ""})
    served.refused(
        422, "InvalidArgumentError", "POST", runs(""), start, headers={"Idempotency-Key": "k" * 300}
    )
    for bad_key in ("", "tab\tin key"):  # present but empty, or a control character
        served.refused(
            422, "InvalidArgumentError", "POST", approve, approval,
            headers={"Idempotency-Key": bad_key},
        )  # fmt: skip
    reply = served.refused(422, "FlowNotFoundError", "POST", runs(""), {**start, "flow": "nope"})
    assert reply.body["fields"]["flow_name"] == "nope"
    for query in ("?status=sleeping", "?limit=0", "?limit=1001", "?limit=many"):
        served.refused(422, "InvalidArgumentError", "GET", runs(query))

    # 409: the run's state refuses it (it waits for a signal, not for an approval or input).
    served.refused(409, "SignalMismatchError", "POST", approve, approval)
    served.refused(409, "SignalMismatchError", "POST", runs(f"/{run_id}/input"), {"text": "hi"})

    # 413: a body over the bound is not read past it.
    big = b'{"by": "ann", "reason": "' + b"x" * (PAYLOAD_LIMIT + 70_000) + b'"}'
    served.refused(413, "PayloadTooLargeError", "POST", approve, raw=big)

    # After all of that the run still waits, untouched.
    assert served.ok("GET", runs(f"/{run_id}"))["status"] == "paused"


def test_a_typed_start_takes_an_object_and_refuses_a_bad_one_naming_its_fields(
    served: Served,
) -> None:
    s = session()
    bad = {"session_id": s, "flow": "order", "input": {"qty": "many"}}
    refused = served.refused(422, "InvalidArgumentError", "POST", "/api/runs", bad)
    assert "sku" in refused.body["message"] and "qty" in refused.body["message"]
    good = {"session_id": s, "flow": "order", "input": {"sku": "tea", "qty": 3}}
    paused = served.ok("POST", "/api/runs", good)
    assert paused["status"] == "paused"
    done = served.ok("POST", runs(f"/{paused['run_id']}/approve"), {"by": "ann"})
    assert (done["status"], done["output"]) == ("finished", "3xtea")


def test_a_parents_child_wait_is_read_only_and_the_childs_approval_resumes_it(
    served: Served,
) -> None:
    s = session()
    parent = served.start("household", s)
    assert parent["waiting_for"]["kind"] == "child"
    child_id = parent["waiting_for"]["child_run_id"]
    state = served.ok("GET", runs(f"/{parent['run_id']}"))
    assert state["children"] == [child_id] and state["parent"] is None
    child = served.ok("GET", runs(f"/{child_id}"))
    assert child["parent"] == {"run_id": parent["run_id"], "step": 0}
    listed = served.ok("GET", f"/api/runs?session_id={s}")
    assert {r["run_id"]: r["parent"] for r in listed}[child_id]["run_id"] == parent["run_id"]

    served.refused(409, "SignalMismatchError", "POST", runs(f"/{parent['run_id']}/approve"),
                   {"by": "ann"})  # fmt: skip
    signal = {"name": "__child", "payload": {"status": "finished"}}
    served.refused(422, None, "POST", runs(f"/{parent['run_id']}/signals"), signal,
                   headers={"Idempotency-Key": key()})  # fmt: skip
    served.ok("POST", runs(f"/{child_id}/approve"), {"by": "ann"})
    done = served.ok("GET", runs(f"/{parent['run_id']}"))
    assert (done["status"], done["outcome"]) == ("finished", "ordered 2xtea")


def test_a_lease_held_by_another_worker_is_409_and_writes_nothing(served: Served) -> None:
    run_id = served.start("ship", session())["run_id"]
    store = RunStore.from_url(served.store_url)
    try:  # another worker takes the run's lease, as a worker mid-turn holds it
        run = store.load(run_id)
        assert run is not None
        lease = LeaseOp.take(run.id, "other-worker:1", "t", timedelta(minutes=10))
        store.save_run(run, lease)
    finally:
        store.close()
    reply = served.refused(
        409, "LeaseHeldError", "POST", runs(f"/{run_id}/signals"),
        {"name": "shipped", "payload": {"tracking": "T"}}, headers={"Idempotency-Key": key()},
    )  # fmt: skip
    assert reply.body["fields"]["holder"] == "other-worker:1"
    assert reply.body["fields"]["expires_at"]


def test_a_run_whose_flow_changed_is_409_flow_drift_and_writes_nothing(served: Served) -> None:
    run_id = served.start("ship", session())["run_id"]
    changed = start_server(
        served.store_url, served.workdir, name="variant", HTTP_SHIP_VARIANT="2", **served.env
    )
    try:
        before = served.log.head()
        reply = changed.call(
            "POST", runs(f"/{run_id}/signals"), {"name": "shipped", "payload": {"tracking": "T"}},
            headers={"Idempotency-Key": key()},
        )  # fmt: skip
        assert reply.is_refusal(409, "FlowDriftError"), reply.body
        assert reply.body["fields"]["recovery"] == ["restart", "abandon"]
        assert served.log.head() == before
    finally:
        changed.stop()


# ------------------------------------------------------------ no token set
def test_without_a_token_the_server_reads_and_refuses_every_change(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    server = start_server(url, tmp_path, token=None)
    log = StoreHead(url)
    try:
        assert server.call("GET", "/api/runs").status == 200
        assert server.call("GET", "/openapi.json").body.get("security") is None
        before = log.head()
        body = {"session_id": "s", "flow": "ship"}
        for path in ("/api/runs", f"/api/runs/{uuid4()}/approve", "/api/nothing"):
            reply = server.call("POST", path, body)
            assert reply.is_refusal(403, "ReadOnlyServerError"), reply.body
            assert "KURALLE_API_TOKEN" in reply.body["message"]
        assert log.head() == before
    finally:
        log.close()
        server.stop()


# ------------------------------------------------------------ who knocks
#: What a page on another site sends after pointing its own name at 127.0.0.1 (DNS
#: rebinding), and other Host headers that name no host this server serves.
FOREIGN_HOSTS = ("attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example",
                 "localhost@attacker.example", "[::2]", "")  # fmt: skip


def loopback_hosts(server: Server) -> list[str]:
    port = server.base.rsplit(":", 1)[1]
    return ["localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}",
            "[::1]", f"[::1]:{port}", f"LOCALHOST:{port}"]  # fmt: skip


def test_a_request_for_another_host_is_400_and_reads_nothing(served: Served) -> None:
    run_id = served.start("ship", session())["run_id"]
    for host in FOREIGN_HOSTS:
        for path in (runs(f"/{run_id}"), runs(""), "/openapi.json", "/api/nothing"):
            reply = served.refused(400, "UnservedHostError", "GET", path, headers={"Host": host})
            assert run_id.encode() not in reply.raw
        # A state change is refused the same way, before its token is even looked at.
        served.refused(
            400, "UnservedHostError", "POST", runs(f"/{run_id}/cancel"), {"reason": "x"},
            headers={"Host": host},
        )  # fmt: skip
    assert "--allowed-host" in reply.body["message"]
    for host in loopback_hosts(served.server):
        assert served.ok("GET", runs(f"/{run_id}"), headers={"Host": host})["run_id"] == run_id


def test_an_app_made_without_a_host_answers_in_process_test_clients() -> None:
    """``create_app(runtime)`` is tested as it is made: Starlette's ``TestClient``
    sends ``Host: testserver`` and httpx's ``ASGITransport`` is usually set up
    with ``http://test``; both are answered, a foreign host is not, and an app
    told where it is served (as ``kuralle-es serve`` tells it) answers neither."""
    from fastapi.testclient import TestClient

    from kuralle_es import Runtime, action, define_agent, define_flow, end
    from kuralle_es.dashboard import create_app as create_dashboard
    from kuralle_es.http import create_app

    async def done(state: dict[str, Any], ctx: Any) -> Any:
        return end("done")

    flow = define_flow("ship", "", "go", [action("go", done)])
    store = RunStore.memory()
    runtime = Runtime([define_agent("a", "", None, [], [flow])], store=store)
    bearer = {"Authorization": "Bearer t0k"}
    app = create_app(runtime, token="t0k")
    started = TestClient(app).post("/api/runs", json={"session_id": "s", "flow": "ship"},
                                   headers=bearer)  # fmt: skip
    assert started.status_code == 200 and started.json()["status"] == "finished"
    assert TestClient(app, base_url="http://test").get("/api/runs", headers=bearer).json()
    foreign = TestClient(app).get("/api/runs", headers={**bearer, "Host": "attacker.example"})
    assert foreign.status_code == 400 and foreign.json()["error"] == "UnservedHostError"
    served = create_app(runtime, token="t0k", host="127.0.0.1")
    assert TestClient(served).get("/api/runs", headers=bearer).status_code == 400
    dashboard = create_dashboard(store, lambda s: runtime)
    assert TestClient(dashboard).get("/").status_code == 200
    assert TestClient(dashboard).get("/", headers={"Host": "attacker.example"}).status_code == 400


def test_serve_without_a_token_answers_no_other_host_dns_rebinding(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    with_token = start_server(url, tmp_path, name="writer")
    try:
        run_id = with_token.call("POST", "/api/runs", {"session_id": "s", "flow": "ship"}).body
    finally:
        with_token.stop()
    server = start_server(url, tmp_path, token=None)
    try:
        for path in ("/api/runs", f"/api/runs/{run_id['run_id']}"):
            reply = server.call("GET", path, headers={"Host": "attacker.example"})
            assert reply.is_refusal(400, "UnservedHostError"), reply.body
            assert run_id["run_id"].encode() not in reply.raw
            assert server.call("GET", path, headers={"Host": "localhost"}).status == 200
    finally:
        server.stop()


def test_allowed_host_names_are_answered_besides_the_loopback_ones(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    flags = start_server(
        url, tmp_path, name="flags", args=("--allowed-host", "api.example", "--allowed-host",
                                           "runs.example.com:443"),
    )  # fmt: skip
    env = start_server(url, tmp_path, name="env", KURALLE_ALLOWED_HOSTS="api.example, [::5]")
    try:
        for server, names in ((flags, ["api.example", "API.example:8000", "runs.example.com"]),
                              (env, ["api.example:80", "[::5]"])):  # fmt: skip
            for host in [*names, *loopback_hosts(server)]:
                assert server.call("GET", "/api/runs", headers={"Host": host}).status == 200
            reply = server.call("GET", "/api/runs", headers={"Host": "attacker.example"})
            assert reply.is_refusal(400, "UnservedHostError")
    finally:
        flags.stop()
        env.stop()


def test_serve_on_a_public_interface_needs_the_names_it_answers_for(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    for extra, env in (((), {}), (("--allowed-host", "a b"), {}),
                       ((), {"KURALLE_ALLOWED_HOSTS": " , "})):  # fmt: skip
        done = subprocess.run(
            [*COMMAND, "serve", "--app", "http_app:build_agents", "--store", f"sqlite:///{db}",
             "--host", "0.0.0.0", "--port", "1", *extra],
            cwd=PROCS, env=clean_env(KURALLE_API_TOKEN=TOKEN, **env), capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert "--allowed-host" in done.stderr or "not a host name" in done.stderr, done.stderr
        assert not db.exists()  # refused before anything was opened


def test_serve_refuses_a_public_interface_without_a_token(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    done = subprocess.run(
        [*COMMAND, "serve", "--app", "http_app:build_agents", "--store", f"sqlite:///{db}",
         "--host", "0.0.0.0", "--port", "1"],
        cwd=PROCS, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "KURALLE_API_TOKEN" in done.stderr and "0.0.0.0" in done.stderr
    assert not db.exists()  # refused before anything was opened


# -------------------------------------------------------- kill and resume
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_a_server_killed_with_a_run_parked_on_an_approval_is_replaced_and_charges_once(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        f"sqlite:///{tmp_path / 'runs.db'}"
        if backend == "sqlite"
        else request.getfixturevalue("pg_dsn")
    )
    ledger = tmp_path / "charges.jsonl"
    env = {"HTTP_LEDGER": str(ledger)}
    first = start_server(url, tmp_path, name="first", **env)
    try:
        start = {"session_id": "shop-1", "flow": "charge", "input": "charge order 1001"}
        parked = first.call("POST", "/api/runs", start, headers={"Idempotency-Key": "order-1001"})
        assert parked.status == 200 and parked.body["status"] == "paused"
        run_id = parked.body["run_id"]
        assert parked.body["waiting_for"]["operation"]["tool_name"] == "charge"
    finally:
        first.kill()  # SIGKILL: no shutdown, nothing flushed by the server
    assert first.process.returncode == -9
    assert ledger_lines(ledger) == []

    second = start_server(url, tmp_path, name="second", **env)
    try:
        assert second.call("GET", f"/api/runs/{run_id}").body["status"] == "paused"
        # The client that started the run retries its start: the same run, not a new one.
        retried = second.call("POST", "/api/runs", start, headers={"Idempotency-Key": "order-1001"})
        assert retried.status == 200 and retried.body["run_id"] == run_id

        headers = {"Idempotency-Key": "slack-action-77"}
        approved = second.call(
            "POST", f"/api/runs/{run_id}/approve", {"by": "ann"}, headers=headers
        )
        assert approved.status == 200, approved.body
        assert approved.body["status"] == "finished" and approved.body["output"] == "charged"
        again = second.call("POST", f"/api/runs/{run_id}/approve", {"by": "ann"}, headers=headers)
        assert again.status == 200 and again.body == approved.body

        steps = second.call("GET", f"/api/runs/{run_id}/steps").body
        charge_steps = [x for x in steps if x["kind"] == "tool" and x["name"] == "charge"]
        assert [(x["status"], x["attempts"]) for x in charge_steps] == [("finished", 1)]
        state = second.call("GET", f"/api/runs/{run_id}").body
        assert state["status"] == "finished" and state["outcome"] == "charged"
        assert state["state"]["receipt"] == {"charged": 500}
    finally:
        second.stop()
    charges = ledger_lines(ledger)
    assert [(c["key"], c["pid"]) for c in charges] == [
        (charge_steps[0]["key"], second.process.pid)
    ], "the charge must execute exactly once, in the second server"
