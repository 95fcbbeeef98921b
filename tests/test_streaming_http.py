"""A run's stream over HTTP: ``GET /api/runs/{run_id}/stream`` of a real ``kuralle-es
serve`` process (docs/streaming.md).

Server-Sent Events whose ids are the parts' offsets, ``Last-Event-ID`` resuming
after the last one a client saw, an ``end`` event once the run is at rest, and
the refusals of every route (404 for a run of another session, 422 for an id
that is no offset). A turn driven by the test process, over the same database,
is followed live by the server: its first deltas come while the model is still
answering.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from http_kit import TOKEN, Server, start_server
from stream_kit import in_thread, shown

from kuralle_es import ModelRequest, ModelResponse, RunStore, Runtime, StreamPart

PROCS = Path(__file__).resolve().parent / "procs"
sys.path.insert(0, str(PROCS))
from stream_app import MODEL_ID, TEXT, build_agents  # noqa: E402

SESSION = "s-sse"


def events(raw: bytes) -> list[dict[str, str]]:
    """The events of an SSE body: each a mapping of its fields (comments left out)."""
    found = []
    for block in raw.decode("utf-8").split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            if line.startswith(":") or ":" not in line:
                continue
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")
        if fields:
            found.append(fields)
    return found


def parts_of(found: list[dict[str, str]]) -> list[StreamPart]:
    return [StreamPart.model_validate_json(e["data"]) for e in found if "id" in e]


@pytest.fixture
def served(store_url: str, tmp_path: Path) -> Iterator[Server]:
    server = start_server(store_url, tmp_path, app="stream_app:build_agents", STREAM_DELAY="0")
    try:
        yield server
    finally:
        server.stop()


def test_the_stream_is_server_sent_events_whose_ids_are_offsets_and_last_event_id_resumes(
    served: Server,
) -> None:
    started = served.call("POST", "/api/runs", {"session_id": SESSION, "flow": "chat",
                                                "input": "where is my refund?"})  # fmt: skip
    assert started.status == 200 and started.body["status"] == "finished", started.body
    stream = f"/api/runs/{started.body['run_id']}/stream"

    whole = served.call("GET", stream)
    assert whole.status == 200
    assert whole.headers["content-type"].startswith("text/event-stream")
    assert whole.headers["cache-control"] == "no-store"
    found = events(whole.raw)
    assert found[0] == {"retry": "1000"}
    assert found[-1] == {"event": "end", "data": "{}"}
    parts = parts_of(found)
    assert [int(e["id"]) for e in found if "id" in e] == [p.offset for p in parts]
    assert [p.offset for p in parts] == list(range(1, len(parts) + 1))
    assert shown(parts) == TEXT
    assert parts[-1].type == "finished"

    resumed = parts_of(events(served.call("GET", stream, headers={"Last-Event-ID": "3"}).raw))
    assert resumed == parts[3:]
    # The reconnection's Last-Event-ID wins over the page's own ?after=.
    header_wins = served.call("GET", f"{stream}?after=1", headers={"Last-Event-ID": "5"})
    assert parts_of(events(header_wins.raw)) == parts[5:]
    assert parts_of(events(served.call("GET", f"{stream}?after=2").raw)) == parts[2:]
    by_session = served.call("GET", f"{stream}?session_id={SESSION}")
    assert parts_of(events(by_session.raw)) == parts
    caught_up = served.call("GET", stream, headers={"Last-Event-ID": str(len(parts))})
    assert events(caught_up.raw)[1:] == [{"event": "end", "data": "{}"}]


def test_a_stream_is_refused_as_every_route_refuses(served: Server) -> None:
    started = served.call("POST", "/api/runs", {"session_id": SESSION, "flow": "chat",
                                                "input": "hello"})  # fmt: skip
    stream = f"/api/runs/{started.body['run_id']}/stream"

    assert served.call("GET", f"{stream}?session_id=someone-else").is_refusal(
        404, "RunNotFoundError"
    )
    unknown = "/api/runs/9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d/stream"
    assert served.call("GET", unknown).is_refusal(404, "RunNotFoundError")
    assert served.call("GET", stream, headers={"Last-Event-ID": "x"}).is_refusal(422)
    assert served.call("GET", f"{stream}?after=-1").is_refusal(422)
    assert served.call("GET", stream, token="wrong").is_refusal(401)


class Held:
    """The app's model, held after ``hold_after`` words until ``go`` is set."""

    id = MODEL_ID

    def __init__(self, hold_after: int) -> None:
        self.hold_after = hold_after
        self.go = threading.Event()

    async def respond(self, request: ModelRequest) -> ModelResponse:
        raise AssertionError("the runtime streams this model")

    async def stream(self, request: ModelRequest) -> AsyncIterator[str | ModelResponse]:
        words = TEXT.split(" ")
        for n, word in enumerate(words):
            if n == self.hold_after:
                await asyncio.to_thread(self.go.wait, 30)
            yield word if n == len(words) - 1 else word + " "


def test_the_server_streams_a_turn_of_another_process_live(served: Server, store_url: str) -> None:
    model = Held(hold_after=4)
    opened: list[str] = []

    async def turn() -> None:
        with RunStore.from_url(store_url) as store:
            runtime = Runtime(build_agents(model), store=store)
            handle = runtime.run(SESSION, kind="flow", flow_name="chat", input="refund?")
            opened.append(await handle.run_id)
            await handle.result()

    with in_thread(turn, model.go.set) as errors:
        deadline = time.monotonic() + 30
        while not opened:
            assert not errors and time.monotonic() < deadline, errors
            time.sleep(0.01)
        request = urllib.request.Request(
            f"{served.base}/api/runs/{opened[0]}/stream?session_id={SESSION}",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            seen = _read_until(response, lambda found: len(parts_of(found)) == 4)
            assert not model.go.is_set()
            first = " ".join(TEXT.split(" ")[:4]) + " "
            assert shown(parts_of(seen)) == first, "the deltas came before the step ended"
            model.go.set()
            seen += _read_until(response, lambda found: found[-1:] == [END])
    assert not errors, errors
    parts = parts_of(seen)
    assert shown(parts) == TEXT
    assert parts[-1].type == "finished"


END = {"event": "end", "data": "{}"}


def _read_until(response: Any, done: Any) -> list[dict[str, str]]:
    """Events read off a live response until ``done(events)``."""
    found: list[dict[str, str]] = []
    block = b""
    while not done(found):
        line = response.readline()
        assert line, "the stream ended early"
        block += line
        if line.strip():
            continue
        found += events(block)
        block = b""
    return found
