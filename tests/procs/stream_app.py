"""The app of the streaming tests' processes: ``kuralle-es serve --app
stream_app:build_agents`` (importable from this folder), and a doomed turn.

- agent ``streamer``, flow ``chat``: one ``reply`` node whose model
  (``streamer-model``) streams ``TEXT`` word by word, ``STREAM_DELAY``
  seconds apart (default 0.02), then ``end("answered")``.
- ``python stream_app.py kill STORE_URL SESSION MARKER``: starts a ``chat``
  run whose model streams ``KILLED_AFTER`` words, waits until they are
  stored, writes the run's id to ``MARKER`` and SIGKILLs its own process,
  mid-stream: the model step's intent is journaled, its response never is,
  and no retract of that attempt is written by this process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from kuralle_es import (
    Agent,
    ModelRequest,
    ModelResponse,
    RunStore,
    Runtime,
    define_agent,
    define_flow,
    end,
    reply,
)
from kuralle_es.testing import ScriptedModel

TEXT = "Your refund of 42 euros went out this morning; the receipt follows by mail."
MODEL_ID = "streamer-model"
KILLED_AFTER = 3
DELAY_ENV = "STREAM_DELAY"


def chat_flow() -> object:
    return define_flow("chat", "one streamed answer", "answer",
                       [reply("answer", "Answer the customer.", next=end("answered"))])  # fmt: skip


def build_agents(model: object = None) -> list[Agent]:
    delay = float(os.environ.get(DELAY_ENV, "0.02"))
    chosen = model or ScriptedModel(lambda request: TEXT, id=MODEL_ID, delay=delay)
    return [define_agent("streamer", "Be brief.", chosen, [], [chat_flow()])]  # type: ignore[list-item]


class DyingModel:
    """Streams a few words, waits until they are stored, then kills its process."""

    id = MODEL_ID

    def __init__(self, marker: Path, session: str, runtime: list[Runtime]) -> None:
        self.marker = marker
        self.session = session
        self.runtime = runtime

    async def respond(self, request: ModelRequest) -> ModelResponse:
        raise AssertionError("the runtime streams this model")

    async def stream(self, request: ModelRequest) -> AsyncIterator[str | ModelResponse]:
        for word in TEXT.split(" ")[:KILLED_AFTER]:
            yield word + " "
        await asyncio.sleep(0.4)  # the stream's batch is written meanwhile
        [runtime] = self.runtime
        run_ids = runtime.store.session_run_ids(self.session)
        self.marker.write_text(run_ids[-1], encoding="utf-8")
        os.kill(os.getpid(), signal.SIGKILL)


async def _doomed(url: str, session: str, marker: Path) -> None:
    made: list[Runtime] = []
    store = RunStore.from_url(url)
    runtime = Runtime(build_agents(DyingModel(marker, session, made)), store=store, lease_ttl=1.0)
    made.append(runtime)
    await runtime.run(session, kind="flow", flow_name="chat", input="where is my refund?").result()


if __name__ == "__main__":
    command, url, session, marker = sys.argv[1:5]
    assert command == "kill", command
    asyncio.run(_doomed(url, session, Path(marker)))
