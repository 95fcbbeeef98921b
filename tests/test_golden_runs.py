"""Golden runs: stored runs written by an earlier release keep loading and resuming.

Each generation ``tests/golden/runs_<release>/`` holds runs that one release
stored with the frozen app of that folder: a SQLite file and a PostgreSQL dump
of the same set, and ``manifest.json`` saying how each stands and how its
resume should end. ``runs_0_1_0`` (kuralle_es 0.1.0, commit 014f51e): paused
on an approval, on a tool's approval, on a signal with a schema, on a durable
timer, on a collect node's input, finished, failed, cancelled, a
conversation, a conversation paused on a model-requested tool's approval, a
fork, an expired deadline, a retried tool, a run with a snapshot, an orphan.
``runs_0_2_0`` (commit ecbe8d2, the 0.2 line) holds the same set, its orphan's
lease a lease record, and besides: a run pinned to a flow version, a migrated
run and its fork, a parallel batch, a conversation with a keyed turn, a run
paused on a budget's approval and one paused on an in-doubt question.
``runs_0_3_0`` (commit e6d41a5, the 0.3 line) holds 0.2.0's set again (each
run's payloads now sealed under its data subject's key, its parts in the
stored stream) and besides: a parent paused in ``ctx.wait_child`` on its child,
itself paused on an approval; a run with typed input; a run paused in
``ctx.receive`` and one with a message waiting in its mailbox; a run that
published values; a run whose data subject is not its session; two runs of an
erased subject; a streamed conversation turn. ``runs_0_4_0`` (commit
2a3455d, the 0.4 line) holds 0.3.0's set again, stored as that code stores
it: a payload of 1 KB or more (here two stored ``paused`` parts) compressed
before it is sealed. They are users' data: never
regenerated, never edited. Every test runs over every generation; each works
on a copy (a temp file, a fresh database), with the same body for both
stores, and checks that today's code

- loads every run as stored (``get_run``, ``get_steps``) and would resume it
  without drift or non-determinism (``replay_check``), the flows' digests
  being computed as they were;
- answers the run views over the stored view tables (and a rebuild of them);
- streams the public events of every run, in order (``follow``, ``Consumer``);
- reads what 0.3.0 stored besides: child links (``RunState.parent`` and
  ``children``), published values, each run's data subject (sealed payloads,
  the erased subject's ``Redacted``), each run's stored stream;
- resumes every run to its end (approvals, signal, timer, input, deadline
  sweep, orphan recovery, the fork, a budget raised, an in-doubt step
  resolved, a child's approval ending its parent, a message sent), each effect
  executed once (the tools' ledger), the orphan's in-doubt step once more
  under its stored key.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import itertools
import json
import shutil
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any, overload

import psycopg
import pytest

from kuralle_es import (
    InvalidArgumentError,
    InvalidSignalError,
    KuralleError,
    Redacted,
    RunState,
    RunStore,
    Runtime,
    SignalMismatchError,
    StreamPart,
    ToolExecutionError,
    TurnResult,
    fire_timers,
    recover_orphaned_runs,
    sweep_deadlines,
)
from kuralle_es.events import Consumer, RunEvent, follow
from kuralle_es.testing import replay_check, replay_with

GOLDEN = Path(__file__).resolve().parent / "golden"
#: Every generation of golden runs: a folder each, with its manifest and its app.
GENERATIONS = sorted(p.name for p in GOLDEN.glob("runs_*") if (p / "manifest.json").exists())
HOLDER = "golden-test"
#: The status a resume ends in -> the type of the run's last public event.
LAST_EVENT = {"finished": "RunFinished", "error": "RunErrored", "aborted": "RunAborted"}

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@dataclass(frozen=True)
class Generation:
    """One generation's folder, its manifest, and its frozen app (imported as
    ``golden.<name>.app``: the runs store its signal schemas under that topic)."""

    name: str
    folder: Path
    manifest: dict[str, Any]
    app: ModuleType

    @property
    def runs(self) -> dict[str, dict[str, Any]]:
        """Per run label: what it is, how it stands, how it resumes."""
        runs: dict[str, dict[str, Any]] = self.manifest["runs"]
        return runs


@functools.cache
def load_generation(name: str) -> Generation:
    folder = GOLDEN / name
    manifest = json.loads((folder / "manifest.json").read_text("utf-8"))
    assert manifest["generation"] == name
    return Generation(name, folder, manifest, importlib.import_module(f"golden.{name}.app"))


def flow_key(name: str, version: str | None) -> str:
    """A flow's key in a manifest's ``flows``: its name, and its version if it has one."""
    return name if version is None else f"{name}@{version}"


def test_every_generation_is_found_with_its_manifest_and_app() -> None:
    assert {"runs_0_1_0", "runs_0_2_0", "runs_0_3_0", "runs_0_4_0"} <= set(GENERATIONS)
    for name in GENERATIONS:
        generation = load_generation(name)
        assert set(generation.manifest["stores"]) == {"sqlite", "postgres"}, name
        assert generation.app.__name__ == f"golden.{name}.app"


# ------------------------------------------------------------------ loading
def load_pg_dump(dsn: str, dump: Path) -> None:
    """Run a plain ``pg_dump`` script on ``dsn`` with psycopg (no ``psql`` needed).

    Statements run as one script between ``COPY ... FROM stdin`` blocks, whose data
    lines go through psycopg's COPY; psql meta-commands (``\\restrict`` and
    ``\\unrestrict`` of pg_dump 15.14 and later) are skipped.
    """
    lines = iter(dump.read_text("utf-8").splitlines(keepends=True))
    script: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as conn:

        def flush() -> None:
            text = "".join(script).strip()
            if text:
                conn.execute(text.encode("utf-8"))
            script.clear()

        for line in lines:
            if line.startswith("\\"):
                continue
            if line.startswith("COPY ") and line.rstrip().endswith("FROM stdin;"):
                flush()
                with conn.cursor() as cur, cur.copy(line.encode("utf-8")) as copy:
                    for data in lines:
                        if data.rstrip("\n") == "\\.":
                            break
                        copy.write(data.encode("utf-8"))
                continue
            script.append(line)
        flush()


@dataclass
class Golden:
    """One store's copy of the golden runs, and the ledger its tools write to now."""

    generation: Generation
    backend: str
    target: str
    ledger: Path
    stores: list[RunStore] = field(default_factory=list)

    @property
    def manifest(self) -> dict[str, Any]:
        return self.generation.manifest

    @property
    def runs(self) -> dict[str, dict[str, Any]]:
        return self.generation.runs

    @property
    def app(self) -> ModuleType:
        return self.generation.app

    @property
    def own(self) -> dict[str, Any]:
        """The manifest's facts of this store: run ids, states, keys, its ledger."""
        stores: dict[str, Any] = self.manifest["stores"]
        return dict(stores[self.backend])

    def run_id(self, label: str) -> str:
        return str(self.own["runs"][label]["run_id"])

    def session(self, label: str) -> str:
        return str(self.runs[label]["session_id"])

    @overload
    def labelled(self, text: str) -> str: ...
    @overload
    def labelled(self, text: None) -> None: ...
    def labelled(self, text: str | None) -> str | None:
        """``text`` with each run id in it written ``{run:<label>}``, as the manifest
        writes a run id in a fact shared by both stores (their ids differ)."""
        if text is None:
            return None
        for label in self.runs:
            text = text.replace(self.run_id(label), f"{{run:{label}}}")
        return text

    def open(self) -> RunStore:
        if self.backend == "sqlite":
            store = RunStore.sqlite(self.target)
        else:
            store = RunStore.postgres(self.target)
        self.stores.append(store)
        return store

    def runtime(self, holder: str = HOLDER) -> Runtime:
        return Runtime(self.app.build_agents(), store=self.open(), holder=holder)

    def events(self, label: str) -> list[str]:
        """The run's public events as stored: per store from generation runs_0_3_0 on
        (a parallel batch's steps finish in the order their threads did)."""
        own: dict[str, Any] = self.own["runs"][label]
        events: list[str] = own["events"] if "events" in own else self.runs[label]["events"]
        return events

    def sql(self, query: str) -> list[tuple[Any, ...]]:
        """Rows of ``query`` on this copy's database, read as they are stored."""
        if self.backend == "sqlite":
            with contextlib.closing(sqlite3.connect(self.target)) as conn:
                return list(conn.execute(query).fetchall())
        with psycopg.connect(self.target) as conn:
            return list(conn.execute(query).fetchall())

    def generated_ledger(self, label: str) -> list[dict[str, Any]]:
        """The effects the generation executed for this run."""
        run_id = self.run_id(label)
        return [e for e in self.own["ledger"] if e["run_id"] == run_id]


@pytest.fixture(params=GENERATIONS)
def generation(request: pytest.FixtureRequest) -> Generation:
    return load_generation(str(request.param))


@pytest.fixture(params=BACKENDS)
def golden(
    request: pytest.FixtureRequest, generation: Generation, tmp_path: Path
) -> Iterator[Golden]:
    backend = str(request.param)
    if backend == "sqlite":
        target = tmp_path / "runs.sqlite"
        # never touch the committed file
        shutil.copyfile(generation.folder / "runs.sqlite", target)
        copy = str(target)
    else:
        copy = str(request.getfixturevalue("pg_dsn"))  # a fresh database, dropped after
        # On the server itself: a dump sets the session's search_path to '', which
        # through a transaction pooler would stay on a server connection the
        # stores are given next.
        load_pg_dump(request.getfixturevalue("pg_server_dsn"), generation.folder / "runs.pg.sql")
    ledger = tmp_path / "ledger.jsonl"
    generation.app.use_ledger(ledger)
    found = Golden(generation, backend, copy, ledger)
    try:
        yield found
    finally:
        generation.app.use_ledger(None)
        for store in found.stores:
            with contextlib.suppress(Exception):
                store.close()


def test_the_golden_flows_digests_are_computed_as_they_were(generation: Generation) -> None:
    flows = {flow_key(flow.name, flow.version): flow.digest for flow in generation.app.FLOWS}
    assert flows == generation.manifest["flows"]


# -------------------------------------------------------------------- loads
async def test_every_golden_run_loads_as_it_was_stored(golden: Golden) -> None:
    runtime = golden.runtime()
    app, manifest = golden.app, golden.manifest
    for label, expected in golden.runs.items():
        own = golden.own["runs"][label]
        state = await runtime.get_run(own["run_id"], expected["session_id"])
        assert state is not None, f"{label}: run {own['run_id']} not found"
        steps = await runtime.get_steps(own["run_id"], expected["session_id"])
        wait = state.waiting_for
        seen = {
            "kind": state.kind,
            "status": state.status,
            "active_flow": state.active_flow,
            "active_node": state.active_node,
            "outcome": golden.labelled(state.outcome),
            "error": None if state.error is None else state.error.type,
            "waiting_for": None if wait is None else {
                "kind": wait.kind,
                "name": wait.name,
                "title": golden.labelled(wait.title),  # a child wait's names the child
                "operation": None if wait.operation is None else {
                    "tool_name": wait.operation.tool_name, "args": wait.operation.args,
                },
                "child_run_id": golden.labelled(wait.child_run_id),
            },
            "lease": state.lease_holder,
            "step_count": state.step_count,
            "steps": [app.step_signature(s) for s in steps],
            "messages": [m.role for m in state.messages],
        }  # fmt: skip
        if "flow_version" in expected:  # recorded from generation runs_0_2_0 on
            seen["flow_version"] = state.flow_version
        if "parent" in expected:  # recorded from generation runs_0_3_0 on
            seen["parent"] = None if state.parent is None else {
                "run_id": golden.labelled(state.parent["run_id"]), "step": state.parent["step"],
            }  # fmt: skip
            seen["children"] = [golden.labelled(child) for child in state.children]
            seen["published"] = await runtime.published(own["run_id"], expected["session_id"])
        elif seen["waiting_for"] is not None:  # earlier manifests have no child_run_id
            assert seen["waiting_for"].pop("child_run_id") is None, label
        assert seen == {k: expected[k] for k in seen}, label
        assert state.state == own["state"], label
        assert [s.key for s in steps] == own["step_keys"], label
        assert state.flow_digest == own["flow_digest"], label
        forked = None if state.forked_from is None else dict(state.forked_from)
        assert forked == own["forked_from"], label
        if "migrated_to" in own:
            assert state.migrated_to == own["migrated_to"], label
        if state.active_flow is not None:
            key = flow_key(state.active_flow, state.flow_version)
            assert state.flow_digest == manifest["flows"][key], label
        if wait is not None and wait.deadline is not None:
            assert wait.deadline.tzinfo is not None, label

    fork = await runtime.get_run(golden.run_id("fork"), golden.session("fork"))
    assert fork is not None
    assert fork.forked_from == {"run_id": golden.run_id("fork_origin"), "at_step": 1}
    orphan = await runtime.get_run(golden.run_id("orphan"), golden.session("orphan"))
    assert orphan is not None and orphan.lease_expires_at is not None
    assert orphan.lease_expires_at < datetime.now(UTC)

    # Today's code would resume every live run as recorded: no drift, no non-determinism
    # (each flow checked with all its versions).
    store = golden.open()
    by_name = sorted(app.FLOWS, key=lambda flow: flow.name)
    for name, versions in itertools.groupby(by_name, key=lambda flow: flow.name):
        found = await replay_check(store, list(versions), agents=app.build_agents())
        assert found == [], name


async def test_every_golden_run_replays_under_its_own_app_with_no_divergence(
    golden: Golden,
) -> None:
    """``replay_with`` re-drives each stored run (but the forks, which it refuses)
    from its first turn under the app that wrote it: no step differs, no run
    would decide otherwise (a cancel from outside is given again), no tool runs."""
    store = golden.open()
    head = store.recorder.max_notification_id()
    agents = golden.app.build_agents()
    for label, expected in golden.runs.items():
        run_id, session = golden.run_id(label), expected["session_id"]
        if golden.own["runs"][label]["forked_from"] is not None:
            with pytest.raises(InvalidArgumentError, match="fork"):
                await replay_with(store, run_id, session, agents=agents)
            continue
        if expected.get("outcome") == "erased":  # the test below
            continue
        result = await replay_with(store, run_id, session, agents=agents)
        assert result.diverged_at is None, (label, result.divergence)
        assert not result.decided_differently, (label, result)
    assert store.recorder.max_notification_id() == head
    assert not golden.ledger.exists() or golden.ledger.read_text() == ""


async def test_replay_with_an_erased_subjects_runs_replays_them_or_refuses_them(
    golden: Golden,
) -> None:
    needs_0_3_0(golden)
    store = golden.open()
    head = store.recorder.max_notification_id()
    for label in ("erased_flow", "erased_conversation"):
        run_id, session = golden.run_id(label), golden.session(label)
        try:
            result = await replay_with(store, run_id, session, agents=golden.app.build_agents())
        except KuralleError:
            continue  # a refusal is an answer too
        assert result.diverged_at is None, (label, result.divergence)
    assert store.recorder.max_notification_id() == head


# ------------------------------------------------- what 0.3.0 stored besides
def raw_bytes(golden: Golden) -> bytes:
    """Every byte the copy's database holds, as a reader of its file or rows sees it."""
    if golden.backend == "sqlite":
        return Path(golden.target).read_bytes()
    out: list[bytes] = []
    with psycopg.connect(golden.target) as conn:
        tables = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        for (table,) in tables.fetchall():
            for row in conn.execute(f'SELECT * FROM "{table}"').fetchall():
                out += [bytes(v) if isinstance(v, bytes | memoryview) else str(v).encode()
                        for v in row]  # fmt: skip
    return b"\n".join(out)


async def read_stream(runtime: Runtime, golden: Golden, label: str) -> list[StreamPart]:
    """The run's stored stream, read to its end (the run is at rest)."""

    async def read() -> list[StreamPart]:
        return [p async for p in runtime.stream(golden.run_id(label), golden.session(label))]

    return await asyncio.wait_for(read(), 30.0)


def deltas(parts: list[StreamPart], step: int) -> str:
    """The text a consumer shows for a model step: its deltas, concatenated."""
    return "".join(p.delta or "" for p in parts if p.type == "text-delta" and p.step == step)


def needs_0_3_0(golden: Golden) -> None:
    if "streamed" not in golden.runs:
        pytest.skip(f"{golden.generation.name} stored none of 0.3.0's shapes")


async def test_the_stored_streams_of_the_golden_runs_read_as_stored(golden: Golden) -> None:
    """Each run's stored stream (the ``kuralle_stream`` table) reads back part for
    part; the streamed turn's deltas make its journaled text."""
    needs_0_3_0(golden)
    runtime = golden.runtime()
    for label in golden.runs:
        stored = golden.own["runs"][label]["stream"]
        if stored is None:  # a running run (the orphan): its stream is followed, not read
            continue
        parts = await read_stream(runtime, golden, label)
        assert [golden.app.part_signature(p) for p in parts] == stored, label
        assert [p.offset for p in parts] == list(range(1, len(parts) + 1)), label

    parts = await read_stream(runtime, golden, "streamed")
    state = await final_state(runtime, golden, "streamed")
    (model,) = await runtime.get_steps(golden.run_id("streamed"), golden.session("streamed"))
    journaled = state.messages[-1].content
    assert journaled == golden.app.STORY
    assert deltas(parts, model.index) == journaled
    assert len([p for p in parts if p.type == "text-delta"]) == len(journaled.split(" "))
    (whole,) = [p for p in parts if p.type == "text"]
    assert (whole.text, whole.step, whole.attempt) == (journaled, model.index, model.attempts)
    # A late reader from an offset gets the rest only.
    rest = [p async for p in runtime.stream(golden.run_id("streamed"), golden.session("streamed"),
                                            after=3)]  # fmt: skip
    assert [p.offset for p in rest] == [p.offset for p in parts[3:]]


async def test_the_child_runs_typed_input_messages_and_published_values_read_as_stored(
    golden: Golden,
) -> None:
    needs_0_3_0(golden)
    runtime = golden.runtime()
    parent = await final_state(runtime, golden, "parent")
    child = await final_state(runtime, golden, "child")
    assert parent.children == [child.run_id] and parent.parent is None
    assert child.parent == {"run_id": parent.run_id, "step": 0} and child.children == []
    assert parent.waiting_for is not None and parent.waiting_for.child_run_id == child.run_id
    assert child.waiting_for is not None and child.waiting_for.kind == "approval"
    await runtime.views.wait_until_caught_up(30.0)
    (summary,) = await runtime.views.list_runs(run_id=child.run_id)
    assert summary.parent == child.parent
    waiting = summaries_by_label(golden, await runtime.views.waiting_runs())
    assert {"parent", "child"} <= set(waiting)
    # Nobody answers a child wait by hand: an approval of the parent is refused.
    version = parent.version
    with pytest.raises(SignalMismatchError):
        await runtime.approve(parent.run_id, golden.session("parent"), by="mallory")
    assert await state_version(runtime, golden, "parent") == version

    typed = await final_state(runtime, golden, "typed_input")
    assert typed.messages[0].role == "user"
    assert json.loads(str(typed.messages[0].content)) == golden.runs["typed_input"]["input"]

    message = await final_state(runtime, golden, "message")
    assert message.waiting_for is not None
    assert (message.waiting_for.kind, message.waiting_for.name) == ("message", "item")

    run_id, session = golden.run_id("published"), golden.session("published")
    assert await runtime.published(run_id, session) == golden.runs["published"]["published"]
    assert await runtime.published(run_id, session, "progress") == {"pct": 10}
    link = await runtime.wait_published(run_id, session, "payment_url", timeout=5.0)
    assert link == "https://pay.example/golden"


async def test_the_data_subjects_of_the_golden_runs_seal_their_payloads_and_erasure_holds(
    golden: Golden,
) -> None:
    """Every run's subject is as stored (and as a rebuild of the views folds it from
    ``SubjectAssigned``); no run's secret is in the stored bytes; the given subject's
    key is kept, so its run reads in clear; the erased subject's runs read Redacted."""
    needs_0_3_0(golden)
    for label, spec in golden.runs.items():
        if "secret" in spec:
            assert spec["secret"].encode() not in raw_bytes(golden), label
    keyed = {row[0] for row in golden.sql("SELECT subject FROM kuralle_subject_keys")}
    assert golden.runs["subject"]["subject"] in keyed
    assert golden.runs["erased_flow"]["subject"] not in keyed
    runtime = golden.runtime()

    def subjects() -> dict[str, str]:
        labels = {golden.run_id(label): label for label in golden.runs}
        rows = golden.sql("SELECT run_id, subject FROM runviews_runs")
        return {labels[str(run_id)]: subject for run_id, subject in rows}

    expected = {label: run["subject"] for label, run in golden.runs.items()}
    assert subjects() == expected
    await runtime.views.rebuild()
    assert subjects() == expected

    subject = await final_state(runtime, golden, "subject")
    assert subject.messages[0].content == golden.runs["subject"]["input"]
    assert subject.waiting_for is not None and subject.waiting_for.title == "Charge 12.00?"

    for label in ("erased_conversation", "erased_flow"):
        state = await final_state(runtime, golden, label)
        assert (state.status, state.outcome) == ("aborted", "erased"), label
        assert isinstance(state.state, Redacted), label
        assert state.messages[0].role == "user", label
        assert isinstance(state.messages[0].content, Redacted), label
        for m in state.messages:  # an assistant's call has no content, only its calls
            assert m.content is None or isinstance(m.content, Redacted), (label, m)
            assert m.tool_calls is None or isinstance(m.tool_calls, Redacted), (label, m)
        steps = await runtime.get_steps(golden.run_id(label), golden.session(label))
        assert all(isinstance(s.result, Redacted) for s in steps), label
    chat = await read_stream(runtime, golden, "erased_conversation")
    said = [p for p in chat if p.type == "text-delta"]
    assert said and all(p.delta is None for p in said)
    events: list[RunEvent] = []
    await Consumer(golden.open(), "golden-erased", events.append).run_until_caught_up()
    erased = {golden.run_id("erased_conversation"), golden.run_id("erased_flow")}
    finished = [e for e in events if e.run_id in erased and e.type == "StepFinished"]
    assert finished and all(isinstance(e.result, Redacted) for e in finished)


# -------------------------------------------------------------------- views
def summaries_by_label(golden: Golden, summaries: list[Any]) -> dict[str, Any]:
    labels = {golden.run_id(label): label for label in golden.runs}
    return {labels.get(s.run_id, s.run_id): s for s in summaries}


async def test_the_views_of_the_golden_runs_answer_as_stored_and_rebuilt(golden: Golden) -> None:
    views = golden.runtime().views
    await views.wait_until_caught_up(30.0)
    now = datetime.now(UTC)

    runs = golden.runs
    listed = summaries_by_label(golden, await views.list_runs(limit=100))
    assert {label: s.status for label, s in listed.items()} == {
        label: run["status"] for label, run in runs.items()
    }
    for label, summary in listed.items():
        run = runs[label]
        assert summary.session_id == run["session_id"], label
        assert (summary.kind, summary.step_count) == (run["kind"], run["step_count"]), label
        assert summary.active_flow == run["active_flow"], label
        if "flow_version" in run:
            assert summary.flow_version == run["flow_version"], label
        wait = run["waiting_for"]
        assert (None if summary.waiting_for is None else summary.waiting_for.kind) == (
            None if wait is None else wait["kind"]
        ), label

    paused = {label for label, run in runs.items() if run["status"] == "paused"}
    assert set(summaries_by_label(golden, await views.waiting_runs())) == paused
    assert list(summaries_by_label(golden, await views.orphaned_runs(now))) == ["orphan"]
    assert list(summaries_by_label(golden, await views.due_timers(now))) == ["timer"]
    assert list(summaries_by_label(golden, await views.expired_deadlines(now))) == [
        "expired_deadline"
    ]
    order = golden.session("fork")
    assert set(summaries_by_label(golden, await views.list_runs(session_id=order))) == {
        "fork", "fork_origin",
    }  # fmt: skip
    stats = {s.name: s for s in await views.step_stats()}
    assert {"charge", "quote", "explode", "flaky", "double", "settle", "lookup"} <= set(stats)
    assert stats["explode"].errors == 1 and stats["double"].count == golden.app.LONG_VISITS

    # The stored view tables say what a projection of the stored events says.
    before = [s.model_dump() for s in await views.list_runs(limit=100)]
    await views.rebuild()
    assert [s.model_dump() for s in await views.list_runs(limit=100)] == before


# ------------------------------------------------------------------- events
async def take_all(events: AsyncIterator[RunEvent], count: int) -> list[RunEvent]:
    taken = [await asyncio.wait_for(anext(events), 10.0) for _ in range(count)]
    with pytest.raises(TimeoutError):  # nothing more is stored
        await asyncio.wait_for(anext(events), 0.5)
    return taken


def by_label(golden: Golden, events: list[RunEvent]) -> dict[str, list[str]]:
    labels = {golden.run_id(label): label for label in golden.runs}
    grouped: dict[str, list[str]] = {}
    for event in events:
        assert event.run_id in labels, f"an event of an unknown run: {event}"
        label = labels[event.run_id]
        assert event.session_id == golden.runs[label]["session_id"], event
        grouped.setdefault(label, []).append(golden.labelled(golden.app.event_signature(event)))
    return grouped


async def test_the_public_events_of_the_golden_runs_stream_in_order(golden: Golden) -> None:
    store = golden.open()
    expected = {label: golden.events(label) for label in golden.runs}
    count = sum(len(events) for events in expected.values())

    streamed = await take_all(follow(store), count)

    positions = [e.position for e in streamed]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    assert by_label(golden, streamed) == expected
    consumed: list[RunEvent] = []
    assert await Consumer(store, "golden-reader", consumed.append).run_until_caught_up() == count
    assert [e.model_dump() for e in consumed] == [e.model_dump() for e in streamed]
    # A follower started in the middle reads the same events from there.
    middle = streamed[count // 2].position
    rest = await take_all(follow(store, after=middle), count - count // 2 - 1)
    assert [e.model_dump() for e in rest] == [e.model_dump() for e in streamed[count // 2 + 1 :]]


# ------------------------------------------------------------------ resumes
Action = Callable[[Runtime, Golden, str], Any]


async def approve(runtime: Runtime, golden: Golden, label: str) -> TurnResult:
    spec = golden.runs[label]["resume"]
    run_id, session = golden.run_id(label), golden.session(label)
    signal_id = f"golden-{label}"
    raise_to = spec.get("raise_to")  # a budget's approval: the limits it raises
    result = await runtime.approve(
        run_id, session, by=spec["by"], signal_id=signal_id, raise_to=raise_to
    )
    # The same decision again (a webhook retry) is a no-op.
    version = await state_version(runtime, golden, label)
    again = await runtime.approve(run_id, session, by=spec["by"], signal_id=signal_id)
    assert again.status == result.status
    assert await state_version(runtime, golden, label) == version
    if "output" in spec:
        assert result.output == spec["output"], label
    return result


async def signal(runtime: Runtime, golden: Golden, label: str) -> TurnResult:
    spec = golden.runs[label]["resume"]
    run_id, session = golden.run_id(label), golden.session(label)
    if "bad_payload" in spec:  # the stored schema topic still resolves: a bad payload is refused
        version = await state_version(runtime, golden, label)
        with pytest.raises(InvalidSignalError):
            await runtime.signal(run_id, session, spec["name"], spec["bad_payload"])
        assert await state_version(runtime, golden, label) == version
    return await runtime.signal(
        run_id, session, spec["name"], spec["payload"], signal_id=f"golden-{label}"
    )


async def fire(runtime: Runtime, golden: Golden, label: str) -> None:
    assert await fire_timers(runtime) == [golden.run_id(label)]


async def sweep(runtime: Runtime, golden: Golden, label: str) -> None:
    assert await sweep_deadlines(runtime) == [golden.run_id(label)]


async def recover(runtime: Runtime, golden: Golden, label: str) -> None:
    assert await recover_orphaned_runs(runtime) == [golden.run_id(label)]


async def give_input(runtime: Runtime, golden: Golden, label: str) -> TurnResult:
    spec = golden.runs[label]["resume"]
    return await runtime.run(
        golden.session(label), run_id=golden.run_id(label), input=spec["input"]
    ).result()


async def converse(runtime: Runtime, golden: Golden, label: str) -> TurnResult:
    spec = golden.runs[label]["resume"]
    await readdress(runtime, golden, label)
    result = await runtime.run(golden.session(label), input=spec["input"]).result()
    assert (result.run_id, result.output) == (golden.run_id(label), spec["output"])
    return result


async def readdress(runtime: Runtime, golden: Golden, label: str) -> None:
    """A run that ended, addressed again: it executes nothing."""
    spec = golden.runs[label]["resume"]
    run_id, session = golden.run_id(label), golden.session(label)
    before = await state_version(runtime, golden, label)
    if spec.get("raises") == "ToolExecutionError":
        # An errored run drives its node again: the frozen error replays, nothing runs.
        with pytest.raises(ToolExecutionError):
            await runtime.run(session, run_id=run_id).result()
        return
    if spec.get("refused_approval"):
        with pytest.raises(SignalMismatchError):
            await runtime.approve(run_id, session, by="late")
    status = golden.runs[label]["status"]
    result = await runtime.run(session, run_id=run_id).result()
    assert result.status == status
    if "restart_key" in spec:  # a retried start or turn with the same key finds the stored run
        flow = golden.runs[label]["flow"]
        if flow is None:  # a conversation's keyed turn: its stored result, nothing run again
            again = await runtime.run(
                session, input=spec["restart_input"], idempotency_key=spec["restart_key"]
            ).result()
            assert again.output == spec["restart_output"], label
        else:
            again = await runtime.run(
                session, kind="flow", flow_name=flow, idempotency_key=spec["restart_key"]
            ).result()
        assert (again.run_id, again.status) == (run_id, status)
    assert await state_version(runtime, golden, label) == before


async def send(runtime: Runtime, golden: Golden, label: str) -> TurnResult:
    """A message to a run paused in ``ctx.receive``: it goes on within the call; the
    same ``message_id`` again is a no-op."""
    spec = golden.runs[label]["resume"]
    run_id, session = golden.run_id(label), golden.session(label)
    result = await runtime.send(
        run_id, session, spec["name"], spec["payload"], message_id=spec["message_id"]
    )
    version = await state_version(runtime, golden, label)
    again = await runtime.send(
        run_id, session, spec["name"], spec["payload"], message_id=spec["message_id"]
    )
    assert again.status == result.status
    assert await state_version(runtime, golden, label) == version
    with pytest.raises(SignalMismatchError):  # it ended: a new message is refused
        await runtime.send(run_id, session, spec["name"], spec["payload"], message_id="late")
    assert await state_version(runtime, golden, label) == version
    return result


async def woken(runtime: Runtime, golden: Golden, label: str) -> None:
    """A parent ended by its child's resume (``wakes``): it ended, within that call,
    and addressed again it executes nothing."""
    spec = golden.runs[label]["resume"]
    child = golden.runs[spec["by_child"]]["resume"]
    assert label in child.get("wakes", []), label
    state = await final_state(runtime, golden, label)
    assert state.status == spec["status"], label
    result = await runtime.run(golden.session(label), run_id=golden.run_id(label)).result()
    assert result.status == spec["status"]
    assert await state_version(runtime, golden, label) == state.version


ACTIONS: dict[str, Action] = {
    "approve": approve,
    "signal": signal,
    "fire_timers": fire,
    "sweep_deadlines": sweep,
    "recover": recover,
    "input": give_input,
    "converse": converse,
    "readdress": readdress,
    "send": send,
    "woken": woken,
}


async def state_version(runtime: Runtime, golden: Golden, label: str) -> int:
    return (await final_state(runtime, golden, label)).version


async def final_state(runtime: Runtime, golden: Golden, label: str) -> RunState:
    state = await runtime.get_run(golden.run_id(label), golden.session(label))
    assert state is not None, label
    return state


async def test_every_golden_run_resumes_to_its_end_with_each_effect_once(golden: Golden) -> None:
    runtime = golden.runtime()
    app, runs = golden.app, golden.runs
    added: dict[str, list[dict[str, Any]]] = {}
    for label, run in runs.items():
        spec = run["resume"]
        before = len(app.read_ledger())
        stored = await runtime.get_steps(golden.run_id(label), golden.session(label))
        await ACTIONS[spec["do"]](runtime, golden, label)

        # The stored journal is history: every step that had ended is as it was
        # (its key, result, times), and the resume only appended to it.
        steps = await runtime.get_steps(golden.run_id(label), golden.session(label))
        assert [s.key for s in steps[: len(stored)]] == [s.key for s in stored], label
        for was, is_now in zip(stored, steps, strict=False):
            if was.status != "running":
                assert is_now == was, (label, was.index)

        if "steps" in spec:
            assert [app.step_signature(s) for s in steps] == spec["steps"], label
        if "published" in spec:
            assert (
                await runtime.published(golden.run_id(label), golden.session(label))
                == (spec["published"])
            ), label
        state = await final_state(runtime, golden, label)
        outcome = golden.labelled(state.outcome)
        assert (state.status, outcome) == (spec["status"], spec["outcome"]), label
        assert state.waiting_for is None and state.lease_holder is None, label
        new = app.read_ledger()[before:]
        assert {e["run_id"] for e in new} <= {golden.run_id(label)}, (label, new)
        assert [e["tool"] for e in new] == spec["adds"], label
        added[label] = new

    # The orphan: its in-doubt settle ran once more, under the key the dead worker
    # executed (so a payment system deduplicating on it sees one settlement).
    (settled,) = added["orphan"]
    (generated,) = golden.generated_ledger("orphan")
    assert settled["key"] == generated["key"] == golden.own["runs"]["orphan"]["step_keys"][0]
    steps = await runtime.get_steps(golden.run_id("orphan"), golden.session("orphan"))
    assert [app.step_signature(s) for s in steps] == ["tool settle finished x2"]
    # The frozen refund executed with the arguments its approver saw.
    (refund,) = added["tool_approval"]
    assert refund["args"] == runs["tool_approval"]["waiting_for"]["operation"]["args"]
    # The retried tool and the fork's quote replayed; the long run's total is its own.
    retried = await runtime.get_steps(golden.run_id("retried"), golden.session("retried"))
    assert [app.step_signature(s) for s in retried] == [
        "tool flaky finished x2",
        "signal continue finished x1",
        "tool charge finished x1",
    ]
    fork = await runtime.get_steps(golden.run_id("fork"), golden.session("fork"))
    assert [s.name for s in fork] == ["quote", "__approval", "charge"]
    assert added["long"][0]["args"] == {"cents": sum(2 * n for n in range(app.LONG_VISITS))}
    if "message" in runs:  # each receive took the message sent, journaled with its id
        for label in ("message", "early_message"):
            sent = runs[label]["resume"] if label == "message" else runs[label]["message"]
            steps = await runtime.get_steps(golden.run_id(label), golden.session(label))
            (took,) = [s for s in steps if s.kind == "receive"]
            assert took.name == sent["name"], label
            assert took.result["message_id"] == sent["message_id"], label
            assert took.result["payload"] == sent["payload"], label
        (shipped,) = added["typed_input"]  # ctx.input, read again on the resume
        assert shipped["args"] == {"tracking": "tea-2"}
        child = await final_state(runtime, golden, "child")
        parent = await final_state(runtime, golden, "parent")
        assert child.parent == {"run_id": parent.run_id, "step": 0}
        assert parent.children == [child.run_id]
        told = await read_stream(runtime, golden, "streamed")  # the second turn streamed too
        stored = golden.own["runs"]["streamed"]["stream"]
        assert [app.part_signature(p) for p in told[: len(stored)]] == stored
        models = [s for s in await runtime.get_steps(golden.run_id("streamed"),
                                                     golden.session("streamed"))
                  if s.kind == "model"]  # fmt: skip
        assert [deltas(told, s.index) for s in models] == [app.STORY, app.STORY]
    if "in_doubt" in runs:  # the in-doubt step holds the result the human gave, unexecuted
        (resolved,) = await runtime.get_steps(golden.run_id("in_doubt"), golden.session("in_doubt"))
        assert resolved.result == runs["in_doubt"]["resume"]["payload"]["result"]
        assert resolved.key == golden.own["runs"]["in_doubt"]["step_keys"][0]

    # Every effect once: no key twice now, and none the generation executed, but the
    # in-doubt steps the manifest says re-execute (the orphan's settle), each under a
    # key the generation executed for that very run.
    now_keys = [e["key"] for label in added for e in added[label]]
    assert len(now_keys) == len(set(now_keys))
    reexecuted: set[str] = set()
    for label, run in runs.items():
        again = [e for e in added[label] if e["tool"] in run["resume"].get("reexecutes", [])]
        assert [e["tool"] for e in again] == run["resume"].get("reexecutes", []), label
        assert {e["key"] for e in again} <= {e["key"] for e in golden.generated_ledger(label)}
        reexecuted |= {e["key"] for e in again}
    assert reexecuted == {settled["key"]}
    generated_keys = {e["key"] for e in golden.own["ledger"]}
    assert set(now_keys) & generated_keys == reexecuted

    # Nothing is left to do, and the views and the events say how each run ended.
    assert await recover_orphaned_runs(runtime) == []
    assert await fire_timers(runtime) == []
    assert await sweep_deadlines(runtime) == []
    assert await runtime.views.waiting_runs() == []
    assert await runtime.views.orphaned_runs(datetime.now(UTC)) == []
    listed = summaries_by_label(golden, await runtime.views.list_runs(limit=100))
    assert {label: s.status for label, s in listed.items()} == {
        label: run["resume"]["status"] for label, run in runs.items()
    }
    store = golden.open()
    events: list[RunEvent] = []
    await Consumer(store, "golden-after", events.append).run_until_caught_up()
    positions = [e.position for e in events]
    assert positions == sorted(positions)
    grouped = by_label(golden, events)
    for label, run in runs.items():
        assert grouped[label][: len(golden.events(label))] == golden.events(label), label
        assert grouped[label][-1].split()[0] == LAST_EVENT[run["resume"]["status"]], label
    assert len(app.read_ledger()) == sum(len(run["resume"]["adds"]) for run in runs.values())


async def test_a_keyed_start_of_an_earlier_release_retried_now_finds_its_run_and_runs_nothing(
    golden: Golden,
) -> None:
    """Earlier releases derived a keyed start's run id from its session, flow and key;
    starts now derive it from the key alone, and still find the runs keyed before."""
    runtime = golden.runtime()
    before = len(golden.app.read_ledger())
    session = golden.session("finished")
    retry = await runtime.run(
        session, kind="flow", flow_name="checkout", idempotency_key="checkout-1"
    ).result()
    assert (retry.run_id, retry.status) == (golden.run_id("finished"), "finished")
    assert len(golden.app.read_ledger()) == before
