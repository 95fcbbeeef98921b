"""A small OpenAI-compatible HTTP server for tests: scripted chat completions.

It speaks real HTTP on 127.0.0.1 (a free port), so the ``openai`` client under
test runs its own request/response code end to end. A test queues responses
and then reads back every request body the client sent::

    with serve() as server:
        server.queue(tool_call_completion([("call_1", "lookup", '{"id": "A1"}')]))
        server.queue(text_completion("A1 shipped"))
        ...
        server.requests  # every POST /v1/chat/completions body, parsed

A queued response is either a completion body (a dict, sent as JSON with
status 200) or a ``Raw`` (any status, headers and body bytes: HTTP 500,
malformed JSON, ...). A request with nothing queued gets HTTP 599 with
``x-should-retry: false`` and is recorded, so an unexpected model call fails
loudly instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "Raw",
    "ScriptedOpenAIServer",
    "completion",
    "json_completion",
    "serve",
    "text_completion",
    "tool_call_completion",
]

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Raw:
    """A response sent exactly as given (status, headers, body bytes)."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def completion(
    message: dict[str, Any],
    *,
    usage: dict[str, int] | None = None,
    finish_reason: str = "stop",
    model: str = "gpt-test",
) -> dict[str, Any]:
    """A chat.completion body with one choice carrying ``message``."""
    body: dict[str, Any] = {
        "id": f"chatcmpl-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **message},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def text_completion(content: str, *, usage: dict[str, int] | None = None) -> dict[str, Any]:
    """The assistant answers with text."""
    return completion({"content": content}, usage=usage)


def tool_call_completion(
    calls: Sequence[tuple[str, str, str]],
    *,
    content: str | None = None,
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The assistant asks for tools: ``(id, function name, arguments JSON text)`` each.

    ``arguments`` is sent verbatim, so a test can send text that is not JSON.
    """
    tool_calls = [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        for call_id, name, arguments in calls
    ]
    return completion(
        {"content": content, "tool_calls": tool_calls}, usage=usage, finish_reason="tool_calls"
    )


def json_completion(data: Any, *, usage: dict[str, int] | None = None) -> dict[str, Any]:
    """Structured output: the assistant's content is ``data`` as JSON text."""
    return completion({"content": json.dumps(data)}, usage=usage)


class ScriptedOpenAIServer:
    """The server's state: the response queue and every request received."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[dict[str, Any] | Raw] = deque()
        self._requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def queue(self, *responses: dict[str, Any] | Raw) -> None:
        with self._lock:
            self._queue.extend(responses)

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every chat-completion request body received so far, in order."""
        with self._lock:
            return list(self._requests)

    @property
    def pending(self) -> int:
        """Queued responses nobody asked for yet."""
        with self._lock:
            return len(self._queue)

    def _take(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | Raw:
        with self._lock:
            self._requests.append(body)
            self.headers.append(headers)
            if self._queue:
                return self._queue.popleft()
        error = {"error": {"message": "no scripted response left", "type": "test_server"}}
        return Raw(599, json.dumps(error).encode(), {"x-should-retry": "false"})


def _handler(server: ScriptedOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # keep test output clean

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path.split("?")[0] != CHAT_PATH:
                self._send(404, b'{"error": {"message": "not found"}}', {})
                return
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                body = {"__unparsable__": raw.decode("utf-8", "replace")}
            answer = server._take(body, {k.lower(): v for k, v in self.headers.items()})
            if isinstance(answer, Raw):
                headers = {"Content-Type": "application/json", **answer.headers}
                self._send(answer.status, answer.body, headers)
            else:
                payload = json.dumps(answer).encode()
                self._send(200, payload, {"Content-Type": "application/json"})

    return Handler


@contextlib.contextmanager
def serve() -> Iterator[ScriptedOpenAIServer]:
    """Run a scripted server on a free loopback port in a background thread."""
    state = ScriptedOpenAIServer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    state.port = int(httpd.server_address[1])
    thread = threading.Thread(
        target=httpd.serve_forever, args=(0.05,), name="openai-test-server", daemon=True
    )
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
