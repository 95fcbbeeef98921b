"""Messages and published values through the doors, each in a real process, on SQLite
and PostgreSQL: ``kuralle-es send`` and the HTTP API's ``POST /api/runs/{run_id}/messages``
and ``GET /api/runs/{run_id}/published`` (``kuralle-es serve``). docs/messages.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from http_kit import StoreHead, start_server
from procs import mail_app
from test_cli_operator import _ok, kuralle

from kuralle_es import RunStore, Runtime

SESSION = "s-doors"
TESTS = str(Path(__file__).resolve().parent)
APP = "procs.mail_app:AGENTS"


async def started(store_url: str) -> str:
    """An ``order`` run paused in its first receive, started in this process."""
    store = RunStore.from_url(store_url)
    try:
        result = (
            await Runtime(mail_app.AGENTS, store=store)
            .run(SESSION, kind="flow", flow_name="order")
            .result()
        )
        assert result.status == "paused" and result.waiting_for is not None
        assert result.waiting_for.kind == "message"
        return result.run_id
    finally:
        store.close()


async def published(store_url: str, run_id: str) -> Any:
    store = RunStore.from_url(store_url)
    try:
        return await Runtime(mail_app.AGENTS, store=store).published(run_id, SESSION)
    finally:
        store.close()


def cli(store_url: str, *args: str) -> Any:
    return kuralle(
        "--store", store_url, "--app", APP, *args,
        PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
    )  # fmt: skip


async def test_the_cli_sends_messages_that_drive_a_waiting_run_on(store_url: str) -> None:
    run_id = await started(store_url)
    first = json.loads(_ok(cli(store_url, "send", run_id, "item", "--payload", '"A-1"',
                               "--message-id", "m1")))  # fmt: skip
    assert first["status"] == "paused" and first["waiting_for"]["callsite"] == 2
    again = json.loads(_ok(cli(store_url, "send", run_id, "item", "--payload", '"other"',
                               "--message-id", "m1")))  # fmt: skip
    assert again == first  # a retry with its message_id is a no-op
    refused = cli(store_url, "send", run_id, "item", "--payload", '{"nope": 1}',
                  "--message-id", "m2")  # fmt: skip
    assert refused.returncode == 1 and "InvalidSignalError" in refused.stderr
    done = json.loads(_ok(cli(store_url, "send", run_id, "item", "--payload", '{"sku": "B-2"}',
                              "--message-id", "m3")))  # fmt: skip
    assert (done["status"], done["output"]) == ("finished", "A-1+B-2")
    assert await published(store_url, run_id) == {
        "progress": {"pct": 100}, "items": ["A-1", "B-2"],
    }  # fmt: skip
    shown = _ok(cli(store_url, "runs", "show", run_id))
    assert "message  item" in shown and "message_id=m3" in shown and "receive" in shown
    ended = cli(store_url, "send", run_id, "item", "--message-id", "m4")
    assert ended.returncode == 1 and "SignalMismatchError" in ended.stderr
    missing = cli(store_url, "send", run_id, "item")
    assert missing.returncode == 2 and "--message-id" in missing.stderr


async def test_the_http_api_takes_messages_and_shows_published_values(
    store_url: str, tmp_path: Path
) -> None:
    run_id = await started(store_url)
    server = start_server(store_url, tmp_path, app="mail_app:AGENTS")
    head = StoreHead(store_url)
    try:
        shown = server.call("GET", f"/api/runs/{run_id}/published")
        assert (shown.status, shown.body) == (200, {"progress": {"pct": 0}})
        path = f"/api/runs/{run_id}/messages"
        before = head.head()
        unkeyed = server.call("POST", path, {"name": "item", "payload": "A-1"})
        assert unkeyed.is_refusal(422) and head.head() == before
        keyed = {"Idempotency-Key": "m1"}
        first = server.call("POST", path, {"name": "item", "payload": "A-1"}, headers=keyed)
        assert first.status == 200 and first.body["status"] == "paused"
        retried = server.call("POST", path, {"name": "item", "payload": "A-1"}, headers=keyed)
        assert (retried.status, retried.body) == (200, first.body)
        before = head.head()
        bad = server.call("POST", path, {"name": "item", "payload": {"nope": 1}},
                          headers={"Idempotency-Key": "m2"})  # fmt: skip
        assert bad.is_refusal(422, "InvalidSignalError") and head.head() == before
        done = server.call("POST", path, {"name": "item", "payload": {"sku": "B-2"}},
                           headers={"Idempotency-Key": "m3"})  # fmt: skip
        assert (done.status, done.body["output"]) == (200, "A-1+B-2")
        after = server.call("GET", f"/api/runs/{run_id}/published")
        assert after.body == {"progress": {"pct": 100}, "items": ["A-1", "B-2"]}
        before = head.head()
        ended = server.call("POST", path, {"name": "item"}, headers={"Idempotency-Key": "m4"})
        assert ended.is_refusal(409, "SignalMismatchError") and head.head() == before
        unknown = "00000000-0000-0000-0000-000000000007"
        assert server.call("GET", f"/api/runs/{unknown}/published").is_refusal(404)
        lost = server.call("POST", f"/api/runs/{unknown}/messages", {"name": "item"},
                           headers={"Idempotency-Key": "m5"})  # fmt: skip
        assert lost.is_refusal(404, "RunNotFoundError")
        assert server.call("GET", f"/api/runs/{run_id}/published", token=None).is_refusal(401)
        document = server.call("GET", "/openapi.json").body
        assert {"post"} <= set(document["paths"]["/api/runs/{run_id}/messages"])
        assert {"get"} <= set(document["paths"]["/api/runs/{run_id}/published"])
    finally:
        head.close()
        server.stop()
