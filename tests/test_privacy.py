"""Privacy (docs/privacy.md): a store encrypted at rest, one subject's data erased by
destroying its key, and ended runs pruned, on every backend.

The raw bytes of the database (the SQLite file, or every row of every table of
the PostgreSQL database read as text) are searched for a distinctive input.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import StoreFactory
from pydantic import BaseModel

from kuralle_es import (
    EncryptionKeyError,
    InvalidArgumentError,
    Redacted,
    RunStore,
    Runtime,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    generate_cipher_key,
)
from kuralle_es.events import Consumer
from kuralle_es.testing import ScriptedModel, replay_with

SECRET = "Zebulon-Quartzwhistle-4471"


class Refund(BaseModel):
    note: str


def _agent(executed: list[str]) -> Any:
    def refund(args: Refund) -> dict[str, Any]:
        executed.append(args.note)
        return {"refunded": args.note}

    def lookup(args: Refund) -> dict[str, Any]:
        executed.append("lookup")
        return {"found": args.note}

    tools = [
        define_tool("refund", "refund", Refund, refund, needs_approval=True),
        define_tool("lookup", "lookup", Refund, lookup),
    ]

    async def start(state: dict[str, Any], ctx: Any) -> Any:
        state["note"] = SECRET
        await ctx.tool("lookup", {"note": SECRET})
        await ctx.tool("refund", {"note": SECRET})
        return end("done")

    flow = define_flow("refund", "refund", "start", [action("start", start)])
    return define_agent("a", "help", ScriptedModel(["ok " + SECRET] * 20), tools, flows=[flow])


def _raw(factory: StoreFactory) -> bytes:
    """Every byte the database holds, as far as a reader of its files or rows sees."""
    if factory.backend == "sqlite":
        assert factory.target is not None
        data = Path(factory.target).read_bytes()
        wal = Path(factory.target + "-wal")
        return data + (wal.read_bytes() if wal.exists() else b"")
    assert factory.target is not None
    out: list[bytes] = []
    with psycopg.connect(factory.target) as conn:
        tables = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
        ).fetchall()
        for (table,) in tables:
            for row in conn.execute(f'SELECT * FROM "{table}"').fetchall():
                for value in row:
                    out.append(
                        bytes(value)
                        if isinstance(value, bytes | memoryview)
                        else str(value).encode()
                    )
    return b"\n".join(out)


def _encrypted(factory: StoreFactory, key: str) -> RunStore:
    assert factory.target is not None
    if factory.backend == "sqlite":
        store = RunStore.sqlite(factory.target, cipher_key=key)
    else:
        store = RunStore.postgres(factory.target, cipher_key=key)
    factory.stores.append(store)
    return store


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    target = (
        str(tmp_path / "runs.db")
        if request.param == "sqlite"
        else request.getfixturevalue("pg_dsn")
    )
    factory = StoreFactory(request.param, target)
    yield factory
    factory.close_all()


async def test_an_encrypted_store_holds_no_plaintext_and_refuses_a_missing_or_wrong_key(
    database: StoreFactory,
) -> None:
    key = generate_cipher_key()
    store = _encrypted(database, key)
    runtime = Runtime(agents=[_agent([])], store=store)
    result = await runtime.run(session_id="s1", input=SECRET).result()
    assert result.output == "ok " + SECRET
    paused = await runtime.run(
        session_id="s1", kind="flow", flow_name="refund", input=SECRET
    ).result()
    assert paused.status == "paused"
    assert (await runtime.views.waiting_runs())[0].waiting_for is not None
    store.close()
    raw = _raw(database)
    assert SECRET.encode() not in raw
    before = len(raw)

    with pytest.raises(EncryptionKeyError, match="no cipher key"):
        database()
    with pytest.raises(EncryptionKeyError, match="another key"):
        _encrypted(database, generate_cipher_key())
    with pytest.raises(EncryptionKeyError, match="not a cipher key"):
        _encrypted(database, "not-a-key")
    assert len(_raw(database)) == before  # the refusals wrote nothing

    again = Runtime(agents=[_agent([])], store=_encrypted(database, key))
    state = await again.get_run(paused.run_id, "s1")
    assert state is not None and state.status == "paused"
    assert state.waiting_for is not None and state.waiting_for.operation is not None
    assert state.waiting_for.operation.args == {"note": SECRET}


async def test_erasing_a_subject_redacts_its_payloads_everywhere_and_aborts_its_live_runs(
    open_store: StoreFactory,
) -> None:
    executed: list[str] = []
    store = open_store()
    runtime = Runtime(agents=[_agent(executed)], store=store)
    chat = await runtime.run(session_id="s1", input=SECRET, subject="alice").result()
    paused = await runtime.run(
        session_id="s1", kind="flow", flow_name="refund", input=SECRET, subject="alice"
    ).result()
    other = await runtime.run(session_id="s2", input="bob's own words").result()
    assert paused.status == "paused"
    said = [p.delta async for p in runtime.stream(chat.run_id, "s1") if p.type == "text-delta"]
    assert "".join(d for d in said if d) == "ok " + SECRET

    report = await runtime.erase_subject("alice")
    assert report.subject == "alice"
    assert set(report.runs) == {chat.run_id, paused.run_id}
    assert set(report.aborted) == {chat.run_id, paused.run_id}

    fresh = Runtime(agents=[_agent(executed)], store=open_store())
    state = await fresh.get_run(paused.run_id, "s1")
    assert state is not None and state.status == "aborted" and state.outcome == "erased"
    assert state.subject == "alice"  # metadata: it stays readable
    summaries = {r.run_id: r.subject for r in await fresh.views.list_runs()}
    assert summaries[paused.run_id] == "alice" and summaries[other.run_id] == "s2"
    assert isinstance(state.state, Redacted)
    assert all(isinstance(m.content, Redacted) for m in state.messages)
    steps = await fresh.get_steps(paused.run_id, "s1")
    assert [(s.kind, s.name, s.status) for s in steps] == [("tool", "lookup", "finished")]
    assert isinstance(steps[0].result, Redacted)
    executed.clear()
    conversation = await fresh.get_run(chat.run_id, "s1")
    assert conversation is not None
    assert all(isinstance(m.content, Redacted) for m in conversation.messages)
    bob = await fresh.get_run(other.run_id, "s2")
    assert bob is not None and bob.messages[0].content == "bob's own words"
    with pytest.raises(InvalidArgumentError, match="subject was erased"):
        await replay_with(fresh.store, chat.run_id, "s1", agents=[_agent(executed)])
    # The stored stream keeps each part's type and place; its payload is gone.
    parts = [p async for p in fresh.stream(chat.run_id, "s1")]
    deltas = [p for p in parts if p.type == "text-delta"]
    assert deltas and all(p.delta is None and p.offset for p in deltas)
    assert [p.offset for p in parts] == list(range(1, len(parts) + 1))

    # A resume of the erased run executes nothing: it is aborted for good.
    resumed = await fresh.run(session_id="s1", run_id=paused.run_id).result()
    assert resumed.status == "aborted"
    assert executed == []
    said = await fresh.run(session_id="s1", input="more").result()
    assert said.status == "aborted" and isinstance(said.output, Redacted)

    if open_store.backend != "memory":
        for opened in open_store.stores:
            opened.close()
        raw = _raw(open_store)
        assert SECRET.encode() not in raw


async def test_a_run_of_an_erased_subject_reads_redacted_in_the_public_events(
    open_store: StoreFactory,
) -> None:
    runtime = Runtime(agents=[_agent([])], store=open_store())
    run = await runtime.run(session_id="s1", input=SECRET).result()
    await runtime.erase_subject("s1")  # the default subject is the session id
    seen: list[Any] = []
    consumer = Consumer(runtime.store, "privacy", seen.append)
    await consumer.run_until_caught_up()
    finished = [e for e in seen if type(e).__name__ == "StepFinished" and e.run_id == run.run_id]
    assert finished and isinstance(finished[0].result, Redacted)


async def test_prune_deletes_exactly_the_ended_runs_before_the_date_and_keeps_usage(
    open_store: StoreFactory,
) -> None:
    runtime = Runtime(agents=[_agent([])], store=open_store())
    ended = await runtime.run(session_id="old", input="hello").result()
    live = await runtime.run(session_id="old", kind="flow", flow_name="refund", input="x").result()
    assert ended.status == "finished" and live.status == "paused"
    seen: list[Any] = []
    consumer = Consumer(runtime.store, "counter", seen.append)
    await consumer.run_until_caught_up()
    count = len(seen)
    usage_before = await runtime.views.usage()
    for run in (ended, live):  # each stored to its end by now
        assert [p async for p in runtime.stream(run.run_id, "old")]
    streams = runtime.store.stream_log(0)

    cutoff = datetime.now(UTC) + timedelta(seconds=1)
    report = await runtime.prune(cutoff)
    assert report.runs == [ended.run_id]
    assert report.events > 0
    assert await runtime.get_run(ended.run_id, "old") is None
    assert (await runtime.get_run(live.run_id, "old")) is not None
    assert [r.run_id for r in await runtime.views.list_runs()] == [live.run_id]
    assert (await runtime.views.usage()).model_calls == usage_before.model_calls
    assert await streams.read(ended.run_id, 0, 100) == []  # its stored stream went too
    assert await streams.read(live.run_id, 0, 100) != []

    # Followers go on across the gap: new events arrive, nothing is seen twice.
    await asyncio.sleep(0)
    after = await runtime.run(session_id="new", input="again").result()
    await consumer.run_until_caught_up()
    fresh = seen[count:]
    assert fresh and all(e.run_id == after.run_id for e in fresh)
    assert len({(e.partition, e.position) for e in seen}) == len(seen)

    assert (await runtime.prune(cutoff - timedelta(days=1))).runs == []


async def test_a_run_pruned_while_its_last_stream_parts_are_queued_leaves_no_part_behind(
    open_store: StoreFactory,
) -> None:
    """A turn's last stream parts are written after it (in batches): a prune
    right after the turn deletes them too, queued or not. Written after the
    delete, they outlived their run, and the session's next conversation (its
    run takes the same id) found the old answer at its offsets."""
    answers = iter(["OLD pruned answer", "NEW answer after prune"])
    agent = define_agent("a", "help", ScriptedModel(lambda request: next(answers)), [])
    runtime = Runtime(agents=[agent], store=open_store())
    old = await runtime.run(session_id="s1", input="first").result()
    report = await runtime.prune(datetime.now(UTC) + timedelta(minutes=1))
    assert report.runs == [old.run_id]
    await asyncio.sleep(0.3)  # the stream's batches are written by now
    streams = runtime.store.stream_log(0)
    assert await streams.read(old.run_id, 0, 100) == []

    new = await runtime.run(session_id="s1", input="second").result()
    assert new.run_id == old.run_id and new.output == "NEW answer after prune"
    parts = [p async for p in runtime.stream(new.run_id, "s1")]
    assert [p.offset for p in parts] == list(range(1, len(parts) + 1))
    assert [p.text for p in parts if p.type == "text"] == ["NEW answer after prune"]
    assert "".join(p.delta or "" for p in parts) == "NEW answer after prune"


async def _said(runtime: Runtime, session: str) -> Any:
    return await runtime.run(session_id=session, input=SECRET).result()


def test_http_erases_a_subject_with_the_token_and_refuses_without(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from kuralle_es.http import create_app

    runtime = Runtime(agents=[_agent([])], store=RunStore.sqlite(str(tmp_path / "r.db")))
    try:
        run = asyncio.run(_said(runtime, "s9"))
        base = "http://127.0.0.1:8000"
        readonly = TestClient(create_app(runtime, token=None), base_url=base)
        refused = readonly.delete("/api/subjects/s9")
        assert refused.status_code == 403
        client = TestClient(create_app(runtime, token="t0k"), base_url=base)
        headers = {"Authorization": "Bearer t0k"}
        answer = client.delete("/api/subjects/s9", headers=headers)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"subject": "s9", "runs": [run.run_id], "aborted": [run.run_id]}
        state = client.get(f"/api/runs/{run.run_id}", headers=headers).json()
        assert state["messages"][0]["content"] == {"__redacted__": True}
        assert state["outcome"] == "erased"
    finally:
        runtime.store.close()


def test_the_cli_erases_and_prunes_and_says_one_line_for_a_wrong_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kuralle_es.cli import main

    path = tmp_path / "r.db"
    key = generate_cipher_key()
    runtime = Runtime(agents=[_agent([])], store=RunStore.sqlite(str(path), cipher_key=key))
    run = asyncio.run(_said(runtime, "s7"))
    runtime.store.close()
    store = f"sqlite:///{path}"

    monkeypatch.delenv("KURALLE_CIPHER_KEY", raising=False)
    assert main(["runs", "list", "--store", store]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no cipher key" in err and "Traceback" not in err

    monkeypatch.setenv("KURALLE_CIPHER_KEY", key)
    assert main(["erase", "s7", "--store", store, "--json"]) == 0
    assert run.run_id in capsys.readouterr().out
    assert main(["runs", "show", run.run_id, "--store", store]) == 0
    shown = capsys.readouterr().out
    assert (SECRET not in shown and "[redacted]" in shown) or "erased" in shown
    future = (datetime.now(UTC) + timedelta(minutes=1)).isoformat()
    assert main(["runs", "prune", "--ended-before", future, "--store", store, "--json"]) == 0
    assert run.run_id in capsys.readouterr().out
    assert main(["runs", "list", "--store", store, "--json"]) == 0
    assert capsys.readouterr().out.strip() == "[]"


async def test_subject_keys_can_live_in_another_database(tmp_path: Path) -> None:
    import sqlite3

    events, keys = tmp_path / "events.db", tmp_path / "keys.db"
    store = RunStore.sqlite(str(events), key_store=f"sqlite:///{keys}")
    runtime = Runtime(agents=[_agent([])], store=store)
    run = await runtime.run(session_id="s5", input=SECRET).result()
    with sqlite3.connect(keys) as conn:
        assert conn.execute("SELECT subject FROM kuralle_subject_keys").fetchall() == [("s5",)]
    with sqlite3.connect(events) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    assert "kuralle_subject_keys" not in tables  # the events' backups never hold a key
    await runtime.erase_subject("s5")
    state = await runtime.get_run(run.run_id, "s5")
    assert state is not None and isinstance(state.messages[0].content, Redacted)
    store.close()


def test_two_stores_asking_for_a_new_subjects_key_at_once_get_one_key(database: Any) -> None:
    """A subject's key is made once, whoever asks first: stores of several processes
    (here two stores, each with threads) that ask for a new subject's key at the
    same moment all get the one key that was stored, and a subject that has a key
    keeps it (on PostgreSQL, asked in one statement)."""
    from concurrent.futures import ThreadPoolExecutor

    stores = [database(), database()]
    for store in stores:
        assert store.keys is not None
    subjects = [f"s-{n}" for n in range(6)]

    def ask(job: tuple[int, str]) -> str:
        which, subject = job
        keys = stores[which].keys
        assert keys is not None
        return keys.key_for(subject).key_id

    jobs = [(n % 2, subject) for subject in subjects for n in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        key_ids = list(pool.map(ask, jobs))
    by_subject: dict[str, set[str]] = {}
    for (_, subject), key_id in zip(jobs, key_ids, strict=True):
        by_subject.setdefault(subject, set()).add(key_id)
    assert all(len(ids) == 1 for ids in by_subject.values()), by_subject
    assert len({next(iter(ids)) for ids in by_subject.values()}) == len(subjects)
    # Asked again by a store that has not cached it: the same key, not a new one.
    fresh = database()
    assert fresh.keys is not None
    for subject, ids in by_subject.items():
        assert fresh.keys.key_for(subject).key_id in ids


async def test_a_long_payload_is_compressed_before_it_is_sealed_and_reads_back(
    database: StoreFactory,
) -> None:
    """Ciphertext does not compress, so a long payload is compressed before it is
    sealed (docs/privacy.md, "What sealing costs"): a run whose state bag holds
    40 KB of repetitive text stores far fewer bytes than that, none of them its
    text, and reads back whole; a payload sealed before compression existed (as
    runs of earlier releases hold it) still opens; an erased one reads
    ``Redacted``."""
    from kuralle_es._journal.sealing import Sealed, open_payload, seal_payload

    long_note = (SECRET + " said the refund was late. ") * 800

    async def remember(state: dict[str, Any], ctx: Any) -> Any:
        state["note"] = long_note
        await ctx.tool("lookup", {"note": long_note})
        return end("noted")

    tools = [define_tool("lookup", "lookup", Refund, lambda args: {"found": len(args.note)})]
    flow = define_flow("remember", "remember", "start", [action("start", remember)])
    agent = define_agent("a", "help", None, tools, flows=[flow])
    store = database()
    runtime = Runtime(agents=[agent], store=store)
    run = await runtime.run(session_id="s1", kind="flow", flow_name="remember").result()
    assert run.status == "finished"
    assert store.keys is not None
    key = store.keys.key_for("s1")
    transcoder = store.mapper.transcoder
    assert len(seal_payload(transcoder, key, long_note).blob) < len(long_note) // 10
    earlier = Sealed(key.key_id, key.cipher.encrypt(transcoder.encode(long_note)))
    assert open_payload(transcoder, store.keys, earlier) == long_note
    store.close()
    raw = _raw(database)
    assert SECRET.encode() not in raw
    assert len(raw) < 3 * len(long_note)  # the bag, the tool's args, the snapshot-free events

    again = Runtime(agents=[agent], store=database())
    state = await again.get_run(run.run_id, "s1")
    assert state is not None and state.state["note"] == long_note
    steps = await again.get_steps(run.run_id, "s1")
    assert steps[0].result == {"found": len(long_note)}
    await again.erase_subject("s1")
    erased = await again.get_run(run.run_id, "s1")
    assert erased is not None and isinstance(erased.state, Redacted)


async def test_stream_parts_still_queued_when_their_subject_is_erased_stay_unreadable(
    database: StoreFactory,
) -> None:
    """A turn's stream parts are written in batches after the turn: erased before
    they are written, they are sealed under the key their turn took, now gone,
    never under a fresh key made for the subject; the key table keeps no key of
    the subject, and every part reads back with its payload gone."""
    store = database()
    runtime = Runtime(agents=[_agent([])], store=store)
    chat = await runtime.run(session_id="s1", input=SECRET, subject="carol").result()
    paused = await runtime.run(
        session_id="s1", kind="flow", flow_name="refund", input=SECRET, subject="carol"
    ).result()
    assert paused.status == "paused"
    await runtime.erase_subject("carol")  # the turns' parts may still be queued
    await asyncio.sleep(0.3)  # the stream's batches are written by now
    store.close()

    if database.backend == "sqlite":
        import sqlite3

        assert database.target is not None
        with sqlite3.connect(database.target) as conn:
            keyed = [r[0] for r in conn.execute("SELECT subject FROM kuralle_subject_keys")]
    else:
        assert database.target is not None
        with psycopg.connect(database.target) as conn:
            keyed = [r[0] for r in conn.execute("SELECT subject FROM kuralle_subject_keys")]
    assert "carol" not in keyed
    assert SECRET.encode() not in _raw(database)

    fresh = Runtime(agents=[_agent([])], store=database())
    for run in (chat, paused):
        parts = [p async for p in fresh.stream(run.run_id, "s1")]
        assert parts and [p.offset for p in parts] == list(range(1, len(parts) + 1))
        for part in parts:
            kept = part.model_dump(exclude_none=True)
            assert set(kept) <= {"type", "step", "attempt", "offset"}, kept
