"""Streaming from durable turns, on memory, SQLite and PostgreSQL (docs/streaming.md).

A model's text deltas reach the turn's handle as they come and the run's
stored stream in batches; the journaled response is the text of the deltas
no ``retract`` dropped; a consumer that comes late, or follows from another
store over the same database, gets every part after its offset; a failed or
killed attempt is retracted before the next one streams; a replay sends the
recorded text and asks no model. Models are the testing kit's
``ScriptedModel``, small streaming models of the tests' own, and the real
``openai`` client against the loopback server of ``tests/openai_server.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import stripped
from openai import AsyncOpenAI
from openai_server import (
    ScriptedOpenAIServer,
    Streamed,
    serve,
    text_completion,
    tool_call_completion,
)
from pydantic import BaseModel
from stream_kit import shown

from kuralle_es import (
    InvalidArgumentError,
    LeaseHeldError,
    ModelRequest,
    ModelResponse,
    RunContext,
    RunNotFoundError,
    RunStore,
    Runtime,
    StreamPart,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    openai_model,
    reply,
)
from kuralle_es.testing import Crash, ScriptedModel

PROCS = Path(__file__).resolve().parent / "procs"
sys.path.insert(0, str(PROCS))
from stream_app import KILLED_AFTER, MODEL_ID, TEXT, build_agents  # noqa: E402

SESSION = "s-stream"
USAGE = {"prompt_tokens": 12, "completion_tokens": 17, "total_tokens": 29}


# ------------------------------------------------------------------ helpers
def chat(model: Any, tools: list[Any] | None = None) -> Any:
    return define_agent("chat", "Be brief.", model, tools or [])


async def stored(runtime: Runtime, run_id: str, after: int = 0) -> list[StreamPart]:
    return [part async for part in runtime.stream(run_id, SESSION, after=after)]


def of_type(parts: list[StreamPart], kind: str) -> list[StreamPart]:
    return [part for part in parts if part.type == kind]


class Held:
    """A streaming model that sends some words, waits for ``go``, then the rest."""

    id = "held"

    def __init__(self, text: str, hold_after: int) -> None:
        self.text = text
        self.hold_after = hold_after
        self.go = asyncio.Event()
        self.calls = 0

    async def respond(self, request: ModelRequest) -> ModelResponse:
        raise AssertionError("the runtime streams this model")

    async def stream(self, request: ModelRequest) -> AsyncIterator[str | ModelResponse]:
        self.calls += 1
        words = self.text.split(" ")
        for n, word in enumerate(words):
            if n == self.hold_after:
                await self.go.wait()
            yield word if n == len(words) - 1 else word + " "
        yield ModelResponse(content=self.text, usage={"input_tokens": 3, "output_tokens": 9})


class CrashingMidStream:
    """Streams two words, then dies as a killed process would (``Crash``)."""

    id = MODEL_ID

    async def respond(self, request: ModelRequest) -> ModelResponse:
        raise AssertionError("the runtime streams this model")

    async def stream(self, request: ModelRequest) -> AsyncIterator[str | ModelResponse]:
        yield "Not "
        yield "this "
        raise Crash("killed mid-stream")


@pytest.fixture
def server() -> Iterator[ScriptedOpenAIServer]:
    with serve() as scripted:
        yield scripted


@pytest.fixture
async def client(server: ScriptedOpenAIServer) -> AsyncIterator[AsyncOpenAI]:
    made = AsyncOpenAI(base_url=server.base_url, api_key="test-key", max_retries=0)
    yield made
    await made.close()


# --------------------------------------------------------------- deltas
async def test_the_deltas_of_a_turn_concatenate_to_its_journaled_text(open_store: Any) -> None:
    runtime = Runtime([chat(ScriptedModel([TEXT]))], store=open_store())
    handle = runtime.run(SESSION, input="where is my refund?")
    parts = [part async for part in handle]
    run_id = await handle.run_id

    deltas = of_type(parts, "text-delta")
    assert len(deltas) >= 5
    [step] = [s for s in await runtime.get_steps(run_id, SESSION) if s.kind == "model"]
    assert step.result is not None and step.result["content"] == TEXT
    assert "".join(d.delta or "" for d in deltas) == TEXT
    assert {(d.step, d.attempt) for d in deltas} == {(step.index, 1)}
    assert [p.offset for p in parts] == list(range(1, len(parts) + 1))
    [whole] = of_type(parts, "text")
    assert (whole.text, whole.step) == (TEXT, step.index)
    assert parts[-1].type == "finished"
    # The stored stream holds the very parts the handle gave, in order.
    assert await stored(runtime, run_id) == parts


async def test_a_late_consumer_gets_every_part_after_its_offset(open_store: Any) -> None:
    runtime = Runtime([chat(ScriptedModel([TEXT, "And a second answer."]))], store=open_store())
    first = runtime.run(SESSION, input="where is my refund?")
    parts = [part async for part in first]
    second = runtime.run(SESSION, input="thanks")
    parts += [part async for part in second]
    run_id = await first.run_id
    assert await second.run_id == run_id

    # Another store over the same database (a process that connects later).
    late = Runtime([chat(ScriptedModel([]))], store=open_store())
    last = parts[-1].offset
    assert last == len(parts)
    for after in (0, 1, 4, last - 1, last):
        assert await stored(late, run_id, after) == [p for p in parts if p.offset > after]
    assert shown(await stored(late, run_id)) == TEXT + "And a second answer."


async def test_a_follower_sees_the_deltas_before_the_model_step_ends(open_store: Any) -> None:
    model = Held(TEXT, hold_after=4)
    runtime = Runtime([chat(model)], store=open_store())
    handle = runtime.run(SESSION, input="where is my refund?")
    run_id = await handle.run_id
    follower = Runtime([chat(ScriptedModel([]))], store=open_store())
    seen: list[StreamPart] = []

    async def follow() -> None:
        async for part in follower.stream(run_id, SESSION):
            seen.append(part)

    following = asyncio.create_task(follow())
    deadline = time.monotonic() + 10
    while len(of_type(seen, "text-delta")) < 4:
        assert time.monotonic() < deadline, seen
        await asyncio.sleep(0.01)
    [step] = await runtime.get_steps(run_id, SESSION)
    assert step.status == "running", "the deltas came while the model step was running"
    assert shown(seen) == " ".join(TEXT.split(" ")[:4]) + " "

    model.go.set()
    await handle.result()
    await asyncio.wait_for(following, 10)
    assert seen[-1].type == "finished"
    assert shown(seen) == TEXT
    assert seen == await stored(runtime, run_id)


async def test_deltas_are_stored_in_batches_never_in_the_journal(open_store: Any) -> None:
    words = " ".join(f"word{n}" for n in range(120))
    store = open_store()
    streaming = Runtime([chat(ScriptedModel([words], delay=0.004))], store=store)
    started = time.monotonic()
    handle = streaming.run("s-batches", input="talk")
    parts = [part async for part in handle]
    took = time.monotonic() - started
    run_id = await handle.run_id
    whole = Runtime([chat(ScriptedModel([words], stream=False))], store=store)
    quiet = await whole.run("s-whole", input="talk").result()

    assert len(of_type(parts, "text-delta")) == 120
    log = store.stream_log(store.partition_of(run_id))
    # Saves of a run are 50 ms apart at least (the first at once, one more after
    # the turn's last part), whatever the model's pace.
    assert log.saves[run_id] <= took * 20 + 2, (log.saves[run_id], took)
    burst = Runtime([chat(ScriptedModel([words]))], store=store)
    at_once = await burst.run("s-burst", input="talk").result()  # 120 deltas in one go
    await asyncio.sleep(0.2)  # its last batch is written
    assert log.saves[at_once.run_id] <= 3, "a batch carries every delta queued meanwhile"
    # The journal of a streamed turn is the journal of the same turn unstreamed.
    journal = [e.topic for e in store.stored_events(run_id)]
    assert journal == [e.topic for e in store.stored_events(quiet.run_id)]


async def test_a_store_closed_while_a_batch_is_in_flight_still_stores_it(
    open_store: Any,
) -> None:
    """A program that closes its store as soon as its turn ends (``with RunStore...``)
    keeps the turn's last parts: the batch its writer had taken, and not yet
    written, is written by ``close``."""
    if open_store.backend == "memory":
        pytest.skip("a memory store is gone once closed")
    loop = asyncio.get_running_loop()
    for attempt in range(2):
        store = open_store()
        runtime = Runtime([chat(ScriptedModel(["one two three four five"]))], store=store)
        done = await runtime.run(f"s-close-{attempt}", input="talk").result()
        # Worker threads all busy (a loaded machine): the writer task takes the
        # turn's last batch and its write waits for a thread.
        busy = [loop.run_in_executor(None, time.sleep, 0.3) for _ in range(20)]
        await asyncio.sleep(0.1)
        store.close()
        await asyncio.gather(*busy)
        reader = Runtime([chat(ScriptedModel([]))], store=open_store())
        parts = [p async for p in reader.stream(done.run_id, f"s-close-{attempt}")]
        assert shown(parts) == "one two three four five", attempt
        assert parts[-1].type == "finished", attempt


async def test_custom_parts_go_to_the_stored_stream(open_store: Any) -> None:
    async def progress(state: dict[str, Any], ctx: RunContext) -> Any:
        ctx.emit({"progress": 1})
        ctx.emit({"progress": 2, "note": "half way"})
        return end("done")

    flow = define_flow("work", "emits", "go", [action("go", progress)])
    runtime = Runtime([define_agent("w", "", None, [], [flow])], store=open_store())
    done = await runtime.run(SESSION, kind="flow", flow_name="work").result()

    parts = await stored(runtime, done.run_id)
    assert [p.data for p in of_type(parts, "custom")] == [
        {"progress": 1},
        {"progress": 2, "note": "half way"},
    ]
    assert parts[-1].type == "finished"


async def test_a_part_that_is_not_json_is_refused_where_it_is_emitted(open_store: Any) -> None:
    async def odd(state: dict[str, Any], ctx: RunContext) -> Any:
        with pytest.raises(InvalidArgumentError, match="JSON"):
            ctx.emit({"when": object()})
        return end("refused")

    flow = define_flow("odd", "emits", "go", [action("go", odd)])
    runtime = Runtime([define_agent("w", "", None, [], [flow])], store=open_store())
    done = await runtime.run(SESSION, kind="flow", flow_name="odd").result()
    assert (done.status, done.output) == ("finished", "refused")
    assert [p.type for p in await stored(runtime, done.run_id)] == ["finished"]


async def test_stream_addressing_is_fail_closed(open_store: Any) -> None:
    runtime = Runtime([chat(ScriptedModel([TEXT]))], store=open_store())
    done = await runtime.run(SESSION, input="hi").result()

    for run_id, session in (
        ("9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d", SESSION),
        (done.run_id, "someone-else"),
        ("not a run id", SESSION),
    ):
        with pytest.raises(RunNotFoundError):
            await anext(aiter(runtime.stream(run_id, session)))
    for after in (-1, "3", True, 2.0):
        with pytest.raises(InvalidArgumentError):
            await anext(aiter(runtime.stream(done.run_id, SESSION, after=after)))  # type: ignore[arg-type]


# ------------------------------------------------------------- attempts
async def test_a_server_that_drops_mid_stream_gives_a_retract_then_a_clean_second_attempt(
    open_store: Any, server: ScriptedOpenAIServer, client: AsyncOpenAI
) -> None:
    server.queue(Streamed(text_completion("Wrong answer that never ends", usage=USAGE),
                          drop_after=3))  # fmt: skip
    server.queue(text_completion(TEXT, usage=USAGE))
    runtime = Runtime([chat(openai_model("gpt-test", client=client))], store=open_store())

    first = runtime.run(SESSION, input="where is my refund?")
    dropped = [part async for part in _parts_until_error(first)]
    run_id = await first.run_id
    assert [p.type for p in dropped] == ["text-delta"] * 3 + ["retract", "error"]
    assert (dropped[3].step, dropped[3].attempt) == (0, 1)
    assert "".join(p.delta or "" for p in dropped[:3]) == "Wrong answer that "

    again = runtime.run(SESSION, run_id=run_id)
    parts = [part async for part in again]
    assert (await again.result()).status == "finished"
    assert {(p.step, p.attempt) for p in of_type(parts, "text-delta")} == {(0, 2)}
    assert not of_type(parts, "retract"), "attempt 1 was retracted once, by itself"

    [step] = await runtime.get_steps(run_id, SESSION)
    assert (step.attempts, step.result["content"]) == (2, TEXT)  # type: ignore[index]
    everything = await stored(runtime, run_id)
    assert shown(everything) == step.result["content"]  # type: ignore[index]
    retract = everything.index(of_type(everything, "retract")[0])
    assert all(p.attempt == 1 for p in of_type(everything[:retract], "text-delta"))
    assert all(p.attempt == 2 for p in of_type(everything[retract:], "text-delta"))
    assert len(server.requests) == 2


async def test_an_answer_the_journal_refuses_is_retracted_after_its_deltas(
    open_store: Any,
) -> None:
    runtime = Runtime([chat(ScriptedModel(["half an emoji \ud83d"]))], store=open_store())
    handle = runtime.run(SESSION, input="hello")
    parts = [part async for part in _parts_until_error(handle)]
    assert [p.type for p in parts[-2:]] == ["retract", "error"]
    assert parts[-1].error is not None and parts[-1].error.type == "ModelResponseError"
    everything = await stored(runtime, await handle.run_id)
    assert of_type(everything, "text-delta") and shown(everything) == ""


async def _parts_until_error(handle: Any) -> AsyncIterator[StreamPart]:
    try:
        async for part in handle:
            yield part
    except Exception:
        return
    raise AssertionError("the turn was expected to fail")


async def test_an_attempt_cut_off_by_a_crash_is_retracted_by_the_next_attempt(
    open_store: Any,
) -> None:
    doomed = Runtime(build_agents(CrashingMidStream()), store=open_store(), lease_ttl=0.3)
    handle = doomed.run(SESSION, kind="flow", flow_name="chat", input="where is my refund?")
    run_id = await handle.run_id
    with pytest.raises(Crash):
        await handle.result()

    await asyncio.sleep(0.35)  # the dead turn's lease lapses
    later = Runtime(build_agents(), store=open_store())
    parts = [part async for part in later.run(SESSION, run_id=run_id)]
    assert [p.type for p in parts[:1]] == ["retract"]
    assert (parts[0].step, parts[0].attempt) == (0, 1)
    assert shown(parts) == TEXT

    everything = await stored(later, run_id)
    assert [p.attempt for p in of_type(everything, "retract")] == [1]
    assert shown(everything) == TEXT
    [step] = await later.get_steps(run_id, SESSION)
    assert (step.attempts, step.status) == (2, "finished")


def test_a_process_killed_mid_stream_is_retracted_by_the_next_attempt(
    store_url: str, tmp_path: Path
) -> None:
    marker = tmp_path / "run-id"
    env = {k: v for k, v in os.environ.items() if not stripped(k, "KURALLE_")}
    doomed = subprocess.run(
        [sys.executable, str(PROCS / "stream_app.py"), "kill", store_url, SESSION, str(marker)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert doomed.returncode == -signal.SIGKILL, doomed.stderr
    run_id = marker.read_text(encoding="utf-8")

    async def resume() -> tuple[list[StreamPart], list[StreamPart], Any]:
        with RunStore.from_url(store_url) as store:
            runtime = Runtime(build_agents(), store=store)
            before = await stored_while_running(runtime, run_id)
            parts = await _resumed(runtime, run_id)
            [step] = await runtime.get_steps(run_id, SESSION)
            return before, parts, step

    before, parts, step = asyncio.run(resume())
    assert [p.type for p in before] == ["text-delta"] * KILLED_AFTER
    assert parts[0].type == "retract" and (parts[0].step, parts[0].attempt) == (0, 1)
    assert (step.attempts, step.result["content"]) == (2, TEXT)
    assert shown(before + parts) == TEXT


async def stored_while_running(runtime: Runtime, run_id: str) -> list[StreamPart]:
    """What the dead process stored (its run is still ``running``: read, not followed)."""
    log = await runtime.store.stream_log_async(run_id)
    assert log is not None
    return [StreamPart.model_validate_json(p.body) for p in await log.read(run_id, 0, 100)]


async def _resumed(runtime: Runtime, run_id: str) -> list[StreamPart]:
    """The run's next turn, once the dead holder's lease lapsed."""
    deadline = time.monotonic() + 20
    while True:
        handle = runtime.run(SESSION, run_id=run_id)
        try:
            return [part async for part in handle]
        except LeaseHeldError:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)


# --------------------------------------------------------------- replay
CRASHED: list[str] = []


async def settle(state: dict[str, Any], ctx: RunContext) -> Any:
    if not CRASHED:
        CRASHED.append("once")
        raise Crash("killed after the answer was journaled")
    return end("settled")


def answered_flow(model: Any) -> Any:
    flow = define_flow("answered", "answer, then settle", "answer", [
        reply("answer", "Answer the customer.", next="settle"),
        action("settle", settle),
    ])  # fmt: skip
    return define_agent("streamer", "Be brief.", model, [], [flow])


async def _crash_after_the_answer(store: RunStore) -> tuple[str, list[StreamPart]]:
    CRASHED.clear()
    runtime = Runtime([answered_flow(ScriptedModel([TEXT], id=MODEL_ID))], store=store,
                      lease_ttl=0.3)  # fmt: skip
    handle = runtime.run(SESSION, kind="flow", flow_name="answered", input="refund?")
    parts: list[StreamPart] = []
    with pytest.raises(Crash):
        async for part in handle:
            parts.append(part)
    await asyncio.sleep(0.35)  # the dead turn's lease lapses; its parts are stored
    return await handle.run_id, parts


async def test_a_replay_streams_the_recorded_text_and_asks_no_model(open_store: Any) -> None:
    run_id, first = await _crash_after_the_answer(open_store())
    assert shown(first) == TEXT

    silent = ScriptedModel([], id=MODEL_ID)  # any call would raise: it has no answer
    later = Runtime([answered_flow(silent)], store=open_store())
    handle = later.run(SESSION, run_id=run_id)
    parts = [part async for part in handle]
    assert (await handle.result()).status == "finished"
    assert silent.requests == []
    assert shown(parts) == TEXT
    assert of_type(parts, "text-delta") == of_type(first, "text-delta"), "as stored, once"

    everything = await stored(later, run_id)
    assert shown(everything) == TEXT
    assert len(of_type(everything, "text-delta")) == len(of_type(first, "text-delta"))


async def test_a_replay_stores_what_a_crash_kept_from_the_stored_stream(
    backend: str, open_store: Any
) -> None:
    if backend == "memory":
        pytest.skip("a memory store's stream cannot be cut short from outside the process")
    store = open_store()
    run_id, first = await _crash_after_the_answer(store)
    kept = first[1].offset  # as if the process died before its later deltas were written
    _delete_after(open_store, run_id, kept)

    later = Runtime([answered_flow(ScriptedModel([], id=MODEL_ID))], store=open_store())
    parts = [part async for part in later.run(SESSION, run_id=run_id)]
    assert shown(parts) == TEXT
    everything = await stored(later, run_id)
    assert shown(everything) == TEXT
    assert [p.offset for p in everything] == sorted({p.offset for p in everything})


def _delete_after(open_store: Any, run_id: str, offset: int) -> None:
    statement = "DELETE FROM kuralle_stream WHERE run_id = %s AND position > %s"
    if open_store.backend == "sqlite":
        with sqlite3.connect(open_store.target) as conn:
            conn.execute(statement.replace("%s", "?"), (run_id, offset))
        return
    with psycopg.connect(open_store.target, autocommit=True) as conn:
        conn.execute(statement, (run_id, offset))


# --------------------------------------------------------------- openai
class Order(BaseModel):
    order_id: str


def lookup(args: Order) -> dict[str, str]:
    return {"order_id": args.order_id, "status": "shipped"}


@pytest.mark.parametrize("streams", [True, False])
async def test_a_streamed_completion_is_journaled_as_the_whole_one_would_be(
    streams: bool, server: ScriptedOpenAIServer, client: AsyncOpenAI
) -> None:
    server.queue(tool_call_completion([("call_1", "lookup", '{"order_id": "A-1234567"}')],
                                      content="Let me look.", usage=USAGE))  # fmt: skip
    server.queue(text_completion(TEXT, usage=USAGE))
    tools = [define_tool("lookup", "Look an order up", Order, lookup)]
    model = openai_model("gpt-test", client=client, stream=streams)
    runtime = Runtime([chat(model, tools)], store=RunStore.memory())
    handle = runtime.run(SESSION, input="where is A-1234567?")
    parts = [part async for part in handle]
    run_id = await handle.run_id

    steps = [s.result for s in await runtime.get_steps(run_id, SESSION) if s.kind == "model"]
    assert steps == [
        {"content": "Let me look.", "data": None,
         "tool_calls": [{"id": "call_1", "name": "lookup", "args": {"order_id": "A-1234567"}}],
         "usage": {"input_tokens": 12, "output_tokens": 17, "total_tokens": 29}},
        {"content": TEXT, "data": None, "tool_calls": [],
         "usage": {"input_tokens": 12, "output_tokens": 17, "total_tokens": 29}},
    ]  # fmt: skip
    assert [r.get("stream", False) for r in server.requests] == [streams, streams]
    if streams:
        assert all(r["stream_options"] == {"include_usage": True} for r in server.requests)
        assert shown(parts) == "Let me look." + TEXT
    else:
        assert not of_type(parts, "text-delta")
    assert [p.text for p in of_type(parts, "text")] == ["Let me look.", TEXT]


async def test_a_stream_that_ends_before_its_completion_is_not_taken_for_an_answer(
    server: ScriptedOpenAIServer, client: AsyncOpenAI
) -> None:
    body = text_completion(TEXT)
    body["choices"][0]["finish_reason"] = None
    server.queue(body)
    runtime = Runtime([chat(openai_model("gpt-test", client=client))], store=RunStore.memory())
    handle = runtime.run(SESSION, input="hi")
    parts = [part async for part in _parts_until_error(handle)]
    assert parts[-2].type == "retract" and parts[-1].type == "error"
    assert parts[-1].error is not None and "finish_reason" in parts[-1].error.message


# ------------------------------------------------------------- partitions
@pytest.mark.postgres
async def test_each_partition_and_shard_keeps_the_streams_of_its_runs(
    pg_dsn: str, tmp_path: Path
) -> None:
    texts = {f"s-{n}": f"Answer number {n} for you." for n in range(6)}
    model = ScriptedModel(lambda request: texts[request.messages[-1].content or ""])
    for opened in (
        lambda: RunStore.postgres(pg_dsn, partitions=2),
        lambda: RunStore.sharded([f"sqlite:///{tmp_path / n}.db" for n in ("a", "b")]),
    ):
        with opened() as store, opened() as elsewhere:
            runtime = Runtime([chat(model)], store=store)
            reader = Runtime([chat(model)], store=elsewhere)
            done = {s: await runtime.run(s, input=s).result() for s in texts}
            assert {store.partition_of(d.run_id) for d in done.values()} == {0, 1}
            for session, result in done.items():
                parts = [p async for p in reader.stream(result.run_id, session)]
                assert shown(parts) == texts[session]
                with pytest.raises(RunNotFoundError):
                    await anext(aiter(reader.stream(result.run_id, "another-session")))
