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

A request with ``"stream": true`` gets its completion as Server-Sent Events
of ``chat.completion.chunk`` objects, as OpenAI sends them (chunked transfer
encoding, the text word by word, the tool calls' arguments in pieces, the
usage in a last chunk without choices when ``stream_options.include_usage``
asks, then ``data: [DONE]``). A ``Streamed`` response says how: the text's
pieces, a pause before each, and ``drop_after=n`` to close the connection
after n pieces, mid-body (``Streamed.started`` is set when the first piece
is sent, ``Streamed.release`` lets a held stream go on).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
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
    "Streamed",
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


@dataclass
class Streamed:
    """A completion sent as a stream: ``pieces`` of its text (default: word by word),
    ``delay`` seconds before each, the connection closed mid-body after
    ``drop_after`` pieces, and the stream held before piece ``hold_at`` until
    ``release`` is set (a test that acts mid-answer)."""

    body: dict[str, Any]
    pieces: list[str] | None = None
    delay: float = 0.0
    drop_after: int | None = None
    hold_at: int | None = None
    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


def _words(text: str) -> list[str]:
    return re.findall(r"\s*\S+\s*", text) or [text]


def chunks_of(body: dict[str, Any], pieces: list[str] | None, usage_asked: bool) -> list[Any]:
    """The ``chat.completion.chunk`` objects of a completion ``body``; each piece of
    its text is one chunk (a list item ``("piece", text)`` marks where one starts)."""
    base = {k: body.get(k) for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"
    out: list[Any] = []
    for choice in body.get("choices", []):
        message = choice.get("message") or {}
        index = choice.get("index", 0)

        def chunk(delta: dict[str, Any], finish: str | None = None, i: int = index) -> Any:
            return {
                **base,
                "choices": [{"index": i, "delta": delta, "finish_reason": finish,
                             "logprobs": None}],
            }  # fmt: skip

        out.append(chunk({"role": "assistant", "content": ""}))
        content = message.get("content")
        if content:
            for piece in pieces if pieces is not None else _words(content):
                out.append(("piece", chunk({"content": piece})))
        for n, call in enumerate(message.get("tool_calls") or []):
            function = call["function"]
            head = {"index": n, "id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": ""}}  # fmt: skip
            out.append(chunk({"tool_calls": [head]}))
            arguments = function.get("arguments") or ""
            for start in range(0, len(arguments), 8):
                piece = {"index": n, "function": {"arguments": arguments[start : start + 8]}}
                out.append(chunk({"tool_calls": [piece]}))
        finish = choice.get("finish_reason", "stop")
        if finish is not None:  # None: a stream that ends before its completion says why
            out.append(chunk({}, finish))
    if usage_asked and body.get("usage") is not None:
        out.append({**base, "choices": [], "usage": body["usage"]})
    return out


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
        self._queue: deque[dict[str, Any] | Raw | Streamed] = deque()
        self._requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def queue(self, *responses: dict[str, Any] | Raw | Streamed) -> None:
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

    def _take(
        self, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | Raw | Streamed:
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
            elif body.get("stream"):
                streamed = answer if isinstance(answer, Streamed) else Streamed(answer)
                self._stream(streamed, bool((body.get("stream_options") or {}).get(
                    "include_usage")))  # fmt: skip
            else:
                whole = answer.body if isinstance(answer, Streamed) else answer
                payload = json.dumps(whole).encode()
                self._send(200, payload, {"Content-Type": "application/json"})

        def _stream(self, streamed: Streamed, usage_asked: bool) -> None:
            """The completion as SSE chunks, in chunked transfer encoding (so a
            connection closed mid-body is a broken response, not a short one)."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            sent = 0
            for item in chunks_of(streamed.body, streamed.pieces, usage_asked):
                if isinstance(item, tuple):
                    if streamed.drop_after is not None and sent >= streamed.drop_after:
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if streamed.hold_at is not None and sent == streamed.hold_at:
                        streamed.release.wait(timeout=30)
                    if streamed.delay:
                        time.sleep(streamed.delay)
                    item = item[1]
                    sent += 1
                self._chunk(f"data: {json.dumps(item)}\n\n".encode())
                if sent == 1:
                    streamed.started.set()
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

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
