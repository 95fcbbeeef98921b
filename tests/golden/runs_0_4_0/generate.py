"""The script that wrote generation ``runs_0_4_0`` (kuralle_es at commit 2a3455d).

KEPT FOR THE RECORD. NEVER RE-RUN IT TO OVERWRITE THIS FOLDER: the files here
are users' data as the code of commit 2a3455d stored it (the 0.4 line: the
0.3 line's shapes, with payloads of 1 KB or more compressed before they are
sealed under their subject's key), history that later
releases must keep loading and resuming. It refuses to write over existing
files. To pin a later release, copy it (and ``app.py``) into a NEW folder
(``runs_<version>``) and run the copy against that release's code.

It was run from a detached worktree of that commit, so that ``import
kuralle_es`` is that code and not the working tree's::

    git worktree add --detach /tmp/golden-src-040 2a3455d
    GOLDEN_SOURCE=/tmp/golden-src-040 PYTHONPATH=/tmp/golden-src-040 \
        .venv/bin/python tests/golden/runs_0_4_0/generate.py
    git worktree remove --force /tmp/golden-src-040

It writes the same set of runs (``RUNS`` below: generation ``runs_0_2_0``'s,
then the new ones) into a SQLite store (``runs.sqlite``, views, the subjects'
key table and the stored streams in the same file) and into a fresh
PostgreSQL database (dumped as ``runs.pg.sql`` with ``pg_dump --no-owner
--no-privileges``, then dropped), and ``manifest.json``: the flow digests
(keyed ``name`` or ``name@version``), what each run is, how it stands (its
parent and children, its subject, what it published, its stored stream), how
it should be resumed and what the resume adds to the ledger, and per store
its run ids and the effects the generation itself executed. A run id inside a
shared text (the migrated run's outcome, its ``RunAborted`` event, a child's
parent) is written ``{run:<label>}``, since ids differ between the stores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any
from uuid import uuid4

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent.parent
sys.path.insert(0, str(TESTS))

import kuralle_es  # noqa: E402

SOURCE = Path(os.environ.get("GOLDEN_SOURCE", "/tmp/golden-src-040")).resolve()
if not Path(kuralle_es.__file__).resolve().is_relative_to(SOURCE):
    sys.exit(f"kuralle_es is {kuralle_es.__file__}, not under {SOURCE}: PYTHONPATH={SOURCE}")

import psycopg  # noqa: E402
from golden.runs_0_4_0 import app  # noqa: E402
from psycopg import sql  # noqa: E402

from kuralle_es import (  # noqa: E402
    Budget,
    RunStore,
    Runtime,
    ToolExecutionError,
)
from kuralle_es.events import RunEvent, follow  # noqa: E402
from kuralle_es.testing import Crash, CrashingStore, CrashPlan  # noqa: E402

GENERATION = "runs_0_4_0"
COMMIT = "2a3455d"
ADMIN_DSN = os.environ.get(
    "KURALLE_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)
FILES = ("runs.sqlite", "runs.pg.sql", "manifest.json")
#: Where the files go: this folder (``GOLDEN_OUT`` only for trial runs elsewhere).
OUT = Path(os.environ.get("GOLDEN_OUT", str(HERE))).resolve()

# label -> what the run is, how it is left, how a later release resumes it.
# ``resume.do`` is what tests/test_golden_runs.py does; ``adds`` the ledger entries
# (tool names, in order) that the resume must add for this run, each with a key
# never executed before, except ``reexecutes``: tools whose in-doubt step runs again
# under the key the generation already executed once. ``steps``, where given, is the
# journal the resume must leave (``app.step_signature`` of each step).
RUNS: dict[str, dict[str, Any]] = {
    "approval": {
        "flow": "approval",
        "what": "paused on ctx.approve (title 'Charge 12.00?') after a ctx.uuid",
        "session_id": "golden-approval",
        "resume": {"do": "approve", "by": "ann", "status": "finished", "outcome": "charged",
                   "adds": ["charge"]},
    },
    "tool_approval": {
        "flow": "tool_approval",
        "what": "paused on a needs_approval tool (refund 4200): the frozen operation",
        "session_id": "golden-tool-approval",
        "resume": {"do": "approve", "by": "ann", "status": "finished", "outcome": "refunded",
                   "adds": ["refund"]},
    },
    "signal": {
        "flow": "signal",
        "what": "paused on ctx.signal('shipped', schema=Shipment) after a ctx.now",
        "session_id": "golden-signal",
        "resume": {"do": "signal", "name": "shipped", "payload": {"tracking": "1Z999"},
                   "bad_payload": {"parcel": 1}, "status": "finished",
                   "outcome": "shipped 1Z999", "adds": ["ship"]},
    },
    "timer": {
        "flow": "nap",
        "what": "paused on a durable ctx.sleep(2.0) (inline_sleep_limit 1.0), due since",
        "session_id": "golden-timer",
        "resume": {"do": "fire_timers", "status": "finished", "outcome": "woke",
                   "adds": ["notify"]},
    },
    "collect": {
        "flow": "intake",
        "what": "paused on a collect node's input: name given, email missing",
        "session_id": "golden-collect",
        "resume": {"do": "input", "input": "email=ann@example.com", "status": "finished",
                   "outcome": "registered", "adds": ["register"]},
    },
    "finished": {
        "flow": "checkout",
        "what": "finished: charge, ctx.now, ctx.uuid; started with idempotency_key 'checkout-1'",
        "session_id": "golden-finished",
        "resume": {"do": "readdress", "restart_key": "checkout-1", "status": "finished",
                   "outcome": "paid", "adds": []},
    },
    "failed": {
        "flow": "broken",
        "what": "error: its tool raised RuntimeError (a frozen ToolExecutionError)",
        "session_id": "golden-failed",
        "resume": {"do": "readdress", "raises": "ToolExecutionError", "status": "error",
                   "outcome": None, "adds": []},
    },
    "cancelled": {
        "flow": "approval",
        "what": "aborted: paused on an approval, then runtime.cancel(reason='customer left')",
        "session_id": "golden-cancelled",
        "resume": {"do": "readdress", "refused_approval": True, "status": "aborted",
                   "outcome": "cancelled: customer left", "adds": []},
    },
    "conversation": {
        "flow": None,
        "what": "a conversation run after two user turns, each a lookup tool call and an answer",
        "session_id": "golden-conversation",
        "resume": {"do": "converse", "input": "third question", "output": "answered turn 3",
                   "status": "finished", "outcome": None, "adds": ["lookup"]},
    },
    "chat_approval": {
        "flow": None,
        "what": "a conversation paused mid-turn: its model asked for the refund tool, which "
        "needs approval (the model turn replays on resume)",
        "session_id": "golden-chat-approval",
        "resume": {"do": "approve", "by": "ann", "status": "finished", "outcome": None,
                   "output": "answered turn 1", "adds": ["refund"]},
    },
    "fork_origin": {
        "flow": "order",
        "what": "finished: quote, approved, charge; the origin of the fork",
        "session_id": "golden-order",
        "resume": {"do": "readdress", "status": "finished", "outcome": "ordered", "adds": []},
    },
    "fork": {
        "flow": "order",
        "what": "runtime.fork(fork_origin, at_step=1): paused on a new approval",
        "session_id": "golden-order",
        "resume": {"do": "approve", "by": "bob", "status": "finished", "outcome": "ordered",
                   "adds": ["charge"]},
    },
    "expired_deadline": {
        "flow": "expiring",
        "what": "paused on an approval whose 1 s deadline passed",
        "session_id": "golden-expiring",
        "resume": {"do": "sweep_deadlines", "status": "finished",
                   "outcome": "declined by deadline", "adds": []},
    },
    "retried": {
        "flow": "retry",
        "what": "a RetryPolicy tool that failed once and then worked, then paused on 'continue'",
        "session_id": "golden-retried",
        "resume": {"do": "signal", "name": "continue", "payload": {"go": True},
                   "status": "finished", "outcome": "retried", "adds": ["charge"]},
    },
    "long": {
        "flow": "long",
        "what": f"{app.LONG_VISITS} visits of a node, one tool step each (the store holds a "
        "snapshot of it, earlier steps archived), paused on 'finish'",
        "session_id": "golden-long",
        "resume": {"do": "signal", "name": "finish", "payload": {}, "status": "finished",
                   "outcome": f"long total {sum(2 * n for n in range(app.LONG_VISITS))}",
                   "adds": ["charge"]},
    },
    "orphan": {
        "flow": "settle",
        "what": "running: its worker died after the settle tool executed, before its result "
        "was saved (CrashPlan after_execute); its lease, a lease record (no LeaseTaken "
        "event), expired",
        "session_id": "golden-orphan",
        "resume": {"do": "recover", "status": "finished", "outcome": "settled", "adds": ["settle"],
                   "reexecutes": ["settle"]},
    },
    # What generation runs_0_1_0 could not store.
    "versioned": {
        "flow": "parcel",
        "what": "parcel version '1' (started by a runtime with only that version), paused on "
        "its approval; resumed by one with versions '1' and '2', it stays on '1'",
        "session_id": "golden-versioned",
        "resume": {"do": "approve", "by": "ann", "status": "finished", "outcome": "v1: sent",
                   "adds": ["ship"]},
    },
    "migrated_origin": {
        "flow": "parcel",
        "what": "parcel version '1' paused on its approval, then runtime.migrate(at_step=1) "
        "onto version '2': aborted, migrated_to the fork (run 'migrated')",
        "session_id": "golden-parcel",
        "resume": {"do": "readdress", "refused_approval": True, "status": "aborted",
                   "outcome": "migrated: {run:migrated}", "adds": []},
    },
    "migrated": {
        "flow": "parcel",
        "what": "the migration's fork on parcel version '2': its quote replayed from the "
        "original, paused on a new approval",
        "session_id": "golden-parcel",
        "resume": {"do": "approve", "by": "bob", "status": "finished", "outcome": "v2: sent",
                   "adds": ["ship", "notify"],
                   "steps": ["tool quote finished x1", "approval __approval finished x1",
                             "tool ship finished x1", "tool notify finished x1"]},
    },
    "batch": {
        "flow": "batch",
        "what": "two quotes run as one parallel batch (asyncio.gather), then paused on 'go'",
        "session_id": "golden-batch",
        "resume": {"do": "signal", "name": "go", "payload": {}, "status": "finished",
                   "outcome": "batched", "adds": ["charge"]},
    },
    "keyed_conversation": {
        "flow": None,
        "what": "a conversation whose one turn was started with idempotency_key 'turn-1' "
        "(its result stored: TurnRecorded)",
        "session_id": "golden-keyed",
        "resume": {"do": "converse", "restart_key": "turn-1", "restart_input": "keyed question",
                   "restart_output": "answered turn 1", "input": "second question",
                   "output": "answered turn 2", "status": "finished", "outcome": None,
                   "adds": ["lookup"]},
    },
    "budget": {
        "flow": None,
        "what": "a conversation turn run with Budget(max_model_calls=1, on_exceed='ask'): "
        "its lookup done, paused on __budget before its second model call",
        "session_id": "golden-budget",
        "resume": {"do": "approve", "by": "finance", "raise_to": {"max_model_calls": 10},
                   "status": "finished", "outcome": None, "output": "answered turn 1",
                   "adds": []},
    },
    "in_doubt": {
        "flow": "capture",
        "what": "its worker died after the capture tool (on_in_doubt='ask') executed, before "
        "its result was saved; re-addressed after its lease expired, it asks: paused on "
        "__in_doubt",
        "session_id": "golden-in-doubt",
        "resume": {"do": "signal", "name": "__in_doubt",
                   "payload": {"action": "resolve", "result": {"captured": 800}},
                   "bad_payload": {"action": "perhaps"}, "status": "finished",
                   "outcome": "captured", "adds": [], "steps": ["tool capture finished x1"]},
    },
    # What generation runs_0_2_0 could not store. A child comes before its parent: the
    # child's resume ends the parent too (``wakes``), which then finds it ended.
    "child": {
        "flow": "research",
        "what": "the child run 'parent' started (ctx.start_child, typed input Topic "
        "{'topic': 'oolong'}), paused on its approval",
        "session_id": "golden-survey",
        "resume": {"do": "approve", "by": "ann", "status": "finished",
                   "outcome": "notes on oolong", "adds": ["lookup"], "wakes": ["parent"],
                   "steps": ["approval __approval finished x1", "tool lookup finished x1"]},
    },
    "parent": {
        "flow": "survey",
        "what": "started its child 'child' (ctx.start_child), then paused in ctx.wait_child "
        "on it (waiting_for kind 'child', name '__child'); nothing is delivered to it by "
        "hand: the child's approval ends it, within that call",
        "session_id": "golden-survey",
        "resume": {"do": "woken", "by_child": "child", "status": "finished",
                   "outcome": "report: notes on oolong", "adds": [],
                   "steps": ["child research finished x1", "child __child finished x1"]},
    },
    "typed_input": {
        "flow": "dispatch",
        "what": "started with typed input Order {'sku': 'tea', 'qty': 2} (ctx.input), paused "
        "on its approval 'Ship 2 x tea?'",
        "session_id": "golden-typed",
        "input": {"sku": "tea", "qty": 2},
        "resume": {"do": "approve", "by": "ann", "status": "finished",
                   "outcome": "shipped 2 x tea", "adds": ["ship"]},
    },
    "message": {
        "flow": "mailbox",
        "what": "paused in ctx.receive('item'): waiting_for kind 'message', its mailbox empty",
        "session_id": "golden-message",
        "resume": {"do": "send", "name": "item", "payload": {"sku": "A-1"},
                   "message_id": "golden-message-1", "status": "finished",
                   "outcome": "received A-1", "adds": ["ship"],
                   "steps": ["receive item finished x1", "tool ship finished x1"]},
    },
    "early_message": {
        "flow": "late_mail",
        "what": "paused on an approval; a message 'item' {'sku': 'B-2'} (message_id "
        "'golden-early-1') was sent meanwhile and waits in its mailbox",
        "session_id": "golden-early-message",
        "message": {"name": "item", "payload": {"sku": "B-2"}, "message_id": "golden-early-1"},
        "resume": {"do": "approve", "by": "ann", "status": "finished",
                   "outcome": "received B-2", "adds": ["ship"],
                   "steps": ["approval __approval finished x1", "receive item finished x1",
                             "tool ship finished x1"]},
    },
    "published": {
        "flow": "progress",
        "what": "published 'progress' {'pct': 10} and 'payment_url' (ctx.publish), sent a "
        "custom stream part (ctx.emit), then paused on its approval",
        "session_id": "golden-published",
        "resume": {"do": "approve", "by": "ann", "status": "finished", "outcome": "paid",
                   "adds": ["charge"],
                   "published": {"progress": {"pct": 100},
                                 "payment_url": "https://pay.example/golden"}},
    },
    "subject": {
        "flow": "approval",
        "what": "started with subject 'golden-customer-42', not its session id "
        "(SubjectAssigned): its payloads are sealed under that subject's key; its input "
        "names a secret the stored bytes must not show; paused on its approval",
        "session_id": "golden-subject",
        "subject": "golden-customer-42",
        "input": "Zebulon Quartzwhistle, 12 Acacia Avenue",
        "secret": "Quartzwhistle",
        "resume": {"do": "approve", "by": "ann", "status": "finished", "outcome": "charged",
                   "adds": ["charge"]},
    },
    "erased_conversation": {
        "flow": None,
        "what": "a conversation of subject 'golden-erased-subject' after one turn (a lookup, "
        "an answer, streamed), then runtime.erase_subject: aborted, outcome 'erased', its "
        "payloads (messages, step results, stream parts) read Redacted",
        "session_id": "golden-erased-chat",
        "subject": "golden-erased-subject",
        "input": "where does Ottoline Brackenbury live?",
        "secret": "Brackenbury",
        "resume": {"do": "readdress", "status": "aborted", "outcome": "erased", "adds": []},
    },
    "erased_flow": {
        "flow": "tool_approval",
        "what": "a run of subject 'golden-erased-subject' paused on the refund tool's "
        "approval, then runtime.erase_subject: aborted, outcome 'erased', its payloads "
        "read Redacted",
        "session_id": "golden-erased-flow",
        "subject": "golden-erased-subject",
        "input": "refund for Ottoline Brackenbury",
        "secret": "Brackenbury",
        "resume": {"do": "readdress", "refused_approval": True, "status": "aborted",
                   "outcome": "erased", "adds": []},
    },
    "streamed": {
        "flow": None,
        "what": "a conversation turn answered with app.STORY, no tool, streamed by "
        "ScriptedModel word by word: its stored stream (kuralle_stream) holds the deltas, "
        "whose concatenation is the journaled text, then the whole text",
        "session_id": "golden-streamed",
        "resume": {"do": "converse", "input": "tell me another", "output": app.STORY,
                   "status": "finished", "outcome": None, "adds": []},
    },
}  # fmt: skip

#: The data subject whose key the generator destroyed (runtime.erase_subject).
ERASED_SUBJECT = "golden-erased-subject"


async def populate(
    open_store: Callable[[], RunStore], open_crashing: Callable[[], CrashingStore]
) -> dict[str, str]:
    """Write every run of ``RUNS``; returns label -> run id."""
    store = open_store()
    runtime = Runtime(app.build_agents(), store=store, holder="golden-generator")
    ids: dict[str, str] = {}

    async def start(label: str, flow: str, input: str | None = None, **kw: Any) -> Any:
        session = RUNS[label]["session_id"]
        assert RUNS[label]["flow"] == flow, label
        result = await runtime.run(session, input=input, kind="flow", flow_name=flow, **kw).result()
        ids[label] = result.run_id
        return result

    assert (await start("approval", "approval")).status == "paused"
    assert (await start("tool_approval", "tool_approval")).status == "paused"
    assert (await start("signal", "signal")).status == "paused"
    assert (await start("timer", "nap")).status == "paused"
    assert (await start("collect", "intake", input="hi, name=Ann")).status == "paused"
    done = await start("finished", "checkout", idempotency_key="checkout-1")
    assert done.status == "finished"

    session = RUNS["failed"]["session_id"]
    handle = runtime.run(session, kind="flow", flow_name=RUNS["failed"]["flow"])
    try:
        await handle.result()
        raise AssertionError("the broken flow finished")
    except ToolExecutionError:
        ids["failed"] = await handle.run_id

    paused = await start("cancelled", "approval")
    session = RUNS["cancelled"]["session_id"]
    cancelled = await runtime.cancel(paused.run_id, session, "customer left")
    assert cancelled.status == "aborted"

    session = RUNS["conversation"]["session_id"]
    first = await runtime.run(session, input="first question").result()
    second = await runtime.run(session, input="second question").result()
    assert first.run_id == second.run_id and second.output == "answered turn 2", second
    ids["conversation"] = second.run_id
    session = RUNS["chat_approval"]["session_id"]
    asked = await runtime.run(session, input="refund 2500").result()
    assert asked.status == "paused" and asked.waiting_for is not None, asked
    ids["chat_approval"] = asked.run_id

    origin = await start("fork_origin", "order")
    approved = await runtime.approve(origin.run_id, RUNS["fork_origin"]["session_id"], by="ann")
    assert approved.status == "finished"
    fork = await runtime.fork(origin.run_id, RUNS["fork"]["session_id"], 1)
    assert fork.status == "paused" and fork.waiting_for is not None
    ids["fork"] = fork.run_id

    assert (await start("expired_deadline", "expiring")).status == "paused"
    assert (await start("retried", "retry")).status == "paused"
    assert (await start("long", "long")).status == "paused"

    # Generation runs_0_1_0's set ends here (but its orphan, made last). Flow versions:
    # the first deploy (parcel '1' only) starts two runs; the runtime with both
    # versions migrates one of them onto '2'.
    first_deploy = Runtime(app.build_first_deploy(), store=open_store(), holder="golden-first")
    for label in ("versioned", "migrated_origin"):
        spec = RUNS[label]
        handle = first_deploy.run(spec["session_id"], kind="flow", flow_name=spec["flow"])
        paused = await handle.result()
        assert paused.status == "paused", (label, paused)
        ids[label] = paused.run_id
    moved = await runtime.migrate(ids["migrated_origin"], RUNS["migrated_origin"]["session_id"], 1)
    assert moved.status == "paused" and moved.waiting_for is not None, moved
    ids["migrated"] = moved.run_id
    assert (await start("batch", "batch")).status == "paused"

    session = RUNS["keyed_conversation"]["session_id"]
    keyed = await runtime.run(session, input="keyed question", idempotency_key="turn-1").result()
    assert keyed.status == "finished" and keyed.output == "answered turn 1", keyed
    ids["keyed_conversation"] = keyed.run_id
    session = RUNS["budget"]["session_id"]
    capped = await runtime.run(
        session, input="costly question", budget=Budget(max_model_calls=1, on_exceed="ask")
    ).result()
    assert capped.status == "paused" and capped.waiting_for is not None, capped
    assert capped.waiting_for.name == "__budget", capped
    ids["budget"] = capped.run_id

    # Generation runs_0_2_0's set (but its in-doubt run and its orphan) ends here.
    # A parent paused in ctx.wait_child on its child, itself paused on an approval.
    parent = await start("parent", "survey")
    assert parent.status == "paused" and parent.waiting_for is not None, parent
    assert (parent.waiting_for.kind, parent.waiting_for.name) == ("child", "__child"), parent
    ids["child"] = str(parent.waiting_for.child_run_id)
    child = await runtime.get_run(ids["child"], RUNS["child"]["session_id"])
    assert child is not None and child.status == "paused", child
    assert child.parent == {"run_id": parent.run_id, "step": 0}, child.parent
    assert child.waiting_for is not None and child.waiting_for.kind == "approval", child

    typed = await start("typed_input", "dispatch", input=RUNS["typed_input"]["input"])
    assert typed.status == "paused" and typed.waiting_for is not None, typed
    assert typed.waiting_for.title == "Ship 2 x tea?", typed

    waiting = await start("message", "mailbox")
    assert waiting.status == "paused" and waiting.waiting_for is not None, waiting
    assert (waiting.waiting_for.kind, waiting.waiting_for.name) == ("message", "item"), waiting
    early = await start("early_message", "late_mail")
    assert early.status == "paused" and early.waiting_for is not None, early
    mail = RUNS["early_message"]["message"]
    sent = await runtime.send(early.run_id, RUNS["early_message"]["session_id"], mail["name"],
                              mail["payload"], message_id=mail["message_id"])  # fmt: skip
    assert sent.status == "paused" and sent.waiting_for is not None, sent
    assert sent.waiting_for.kind == "approval", sent  # the message waits in the mailbox

    published = await start("published", "progress")
    assert published.status == "paused", published
    values = await runtime.published(published.run_id, RUNS["published"]["session_id"])
    assert values == {"progress": {"pct": 10}, "payment_url": "https://pay.example/golden"}

    spec = RUNS["subject"]
    subject = await start("subject", "approval", input=spec["input"], subject=spec["subject"])
    assert subject.status == "paused", subject

    spec = RUNS["erased_conversation"]
    chat = await runtime.run(spec["session_id"], input=spec["input"],
                             subject=spec["subject"]).result()  # fmt: skip
    assert chat.status == "finished" and chat.output == "answered turn 1", chat
    ids["erased_conversation"] = chat.run_id
    spec = RUNS["erased_flow"]
    asked = await start("erased_flow", "tool_approval", input=spec["input"],
                        subject=spec["subject"])  # fmt: skip
    assert asked.status == "paused", asked
    await runtime.views.wait_until_caught_up(30.0)
    report = await runtime.erase_subject(ERASED_SUBJECT)
    erased = {ids["erased_conversation"], ids["erased_flow"]}
    assert set(report.runs) == erased and set(report.aborted) == erased, report

    session = RUNS["streamed"]["session_id"]
    told = await runtime.run(session, input="tell me a story").result()
    assert told.status == "finished" and told.output == app.STORY, told
    ids["streamed"] = told.run_id

    async def die_after_execute(label: str) -> str:
        """Start ``label``'s flow on a worker whose store dies after the tool's effect."""
        crashing = open_crashing()
        crashing.plan = CrashPlan("after_execute")
        dying = Runtime(
            app.build_agents(), store=crashing, holder="golden-dead-worker", lease_ttl=0.5
        )
        handle = dying.run(RUNS[label]["session_id"], kind="flow", flow_name=RUNS[label]["flow"])
        try:
            await handle.result()
            raise AssertionError(f"the {label} run's worker did not die")
        except Crash:
            run_id = await handle.run_id
        crashing.plan = None
        crashing.close()
        return run_id

    # The in-doubt question: a dead worker's capture, re-addressed once its lease expired.
    ids["in_doubt"] = await die_after_execute("in_doubt")
    await asyncio.sleep(0.7)
    asked = await runtime.run(RUNS["in_doubt"]["session_id"], run_id=ids["in_doubt"]).result()
    assert asked.status == "paused" and asked.waiting_for is not None, asked
    assert asked.waiting_for.name == "__in_doubt", asked

    # The orphan: a worker whose store dies after the settle tool's effect.
    ids["orphan"] = await die_after_execute("orphan")
    await asyncio.sleep(1.2)  # its lease (0.5 s), the expiring deadline (1 s) pass

    await runtime.views.wait_until_caught_up(30.0)
    return ids


async def public_events(store: RunStore) -> list[RunEvent]:
    """Every public event stored so far (read-only: ``follow`` until it waits; the
    timeout cancels the follower)."""
    seen: list[RunEvent] = []
    events = follow(store)
    while True:
        try:
            seen.append(await asyncio.wait_for(anext(events), 2.0))
        except TimeoutError:
            return seen


def _add_subjects(shared: dict[str, Any], ids: dict[str, str], rows: list[Any]) -> None:
    """Each run's data subject, as the run views' table holds it (``rows``: run id,
    subject): no public read gives a run's subject (RunState and RunSummary have none)."""
    subjects = {str(run_id): subject for run_id, subject in rows}
    for label, run_id in ids.items():
        shared[label]["subject"] = subjects[run_id]
        assert subjects[run_id] == RUNS[label].get("subject", RUNS[label]["session_id"]), label


async def stored_stream(runtime: Runtime, run_id: str, session: str) -> list[str]:
    """The run's stored stream (``app.part_signature`` of each part), read to its end."""

    async def read() -> list[str]:
        return [app.part_signature(part) async for part in runtime.stream(run_id, session)]

    return await asyncio.wait_for(read(), 30.0)


def labelled(text: str | None, ids: dict[str, str]) -> str | None:
    """``text`` with each run id in it written ``{run:<label>}``: the same in every store."""
    if text is None:
        return None
    for label, run_id in ids.items():
        text = text.replace(run_id, f"{{run:{label}}}")
    return text


def flow_key(name: str, version: str | None) -> str:
    """A flow's key in the manifest's ``flows``: its name, and its version if it has one."""
    return name if version is None else f"{name}@{version}"


async def describe(store: RunStore, ids: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(facts shared by every store, facts of this store) of each run."""
    runtime = Runtime(app.build_agents(), store=store, holder="golden-describer")
    events = await public_events(store)
    assert all(e.run_id in ids.values() for e in events), "an event of an unknown run"
    await runtime.views.wait_until_caught_up(30.0)
    shared: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for label, run_id in ids.items():
        session = RUNS[label]["session_id"]
        state = await runtime.get_run(run_id, session)
        assert state is not None, label
        steps = await runtime.get_steps(run_id, session)
        wait = state.waiting_for
        # A running run's stream is followed until it rests: the orphan's is not read.
        resting = state.status != "running"
        stream = await stored_stream(runtime, run_id, session) if resting else None
        shared[label] = {
            "kind": state.kind,
            "status": state.status,
            "active_flow": state.active_flow,
            "active_node": state.active_node,
            "flow_version": state.flow_version,
            "outcome": labelled(state.outcome, ids),
            "error": None if state.error is None else state.error.type,
            "waiting_for": None if wait is None else {
                "kind": wait.kind,
                "name": wait.name,
                "title": labelled(wait.title, ids),  # a child wait's names the child
                "operation": None if wait.operation is None else {
                    "tool_name": wait.operation.tool_name, "args": wait.operation.args,
                },
                "child_run_id": labelled(wait.child_run_id, ids),
            },
            "lease": state.lease_holder,
            "step_count": state.step_count,
            "steps": [app.step_signature(s) for s in steps],
            "messages": [m.role for m in state.messages],
            # New in this generation: child links, the data subject, published values,
            # the stored stream.
            "parent": None if state.parent is None else {
                "run_id": labelled(state.parent["run_id"], ids), "step": state.parent["step"],
            },
            "children": [labelled(child, ids) for child in state.children],
            "published": await runtime.published(run_id, session),
        }  # fmt: skip
        own[label] = {
            "run_id": run_id,
            "session_id": session,
            "flow_digest": state.flow_digest,
            "forked_from": None if state.forked_from is None else dict(state.forked_from),
            "migrated_to": state.migrated_to,
            "state": state.state,
            "step_keys": [s.key for s in steps],
            # Per store: the public events in the order the store holds them (a parallel
            # batch's steps finish in the order their threads did, so it differs).
            "events": [labelled(app.event_signature(e), ids) for e in events if e.run_id == run_id],
            # Per store: a dying worker's last parts are stored or not, as its timing
            # fell (docs/streaming.md: a process that dies loses what it had not written).
            "stream": stream,
        }
    return shared, own


def _snapshots(store: RunStore, run_id: str) -> int:
    from uuid import UUID

    assert store.snapshots is not None
    return len(list(store.snapshots.get(UUID(run_id))))


def _check_leases(rows: list[tuple[str, int]], leased: list[str], ids: dict[str, str]) -> None:
    """The store keeps leases as records: no lease event (``rows``: topic, count), and
    the one lease left (``leased``: its run ids) is the orphan's."""
    lease_events = [row for row in rows if row[0].startswith("kuralle_es:Run.Lease")]
    assert not lease_events, f"lease events stored: {lease_events}"
    assert [str(run_id) for run_id in leased] == [ids["orphan"]], leased


def _check_sealed(raw: bytes, keyed: list[str]) -> None:
    """Every payload is sealed under its subject's key: no run's secret is in the
    stored bytes; the key table (``keyed``: its subjects) holds the key of the
    run given a subject, and none of the erased subject."""
    for label, spec in RUNS.items():
        if "secret" in spec:
            assert spec["secret"].encode() not in raw, f"{label}'s secret is stored in clear"
    assert RUNS["subject"]["subject"] in keyed, keyed
    assert ERASED_SUBJECT not in keyed, keyed


def _pg_raw(dsn: str) -> bytes:
    """Every value of every table of the database, its bytes (a bytea's raw, not hex)."""
    out: list[bytes] = []
    with psycopg.connect(dsn) as conn:
        tables = conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        for (table,) in tables.fetchall():
            query = sql.SQL("SELECT * FROM {}").format(sql.Identifier(table))
            for row in conn.execute(query).fetchall():
                out += [bytes(v) if isinstance(v, bytes | memoryview) else str(v).encode()
                        for v in row]  # fmt: skip
    return b"\n".join(out)


def _checkpoint(path: str) -> None:
    """Everything in the one file: the write-ahead log checkpointed and gone."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    for suffix in ("-wal", "-shm"):
        Path(path + suffix).unlink(missing_ok=True)


async def generate_sqlite(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    path = str(work / "runs.sqlite")
    ledger = work / "ledger.sqlite.jsonl"
    app.use_ledger(ledger)
    stores: list[RunStore] = []

    def open_store() -> RunStore:
        stores.append(RunStore.sqlite(path))
        return stores[-1]

    def open_crashing() -> CrashingStore:
        store = CrashingStore.sqlite(path)
        assert isinstance(store, CrashingStore)
        return store

    ids = await populate(open_store, open_crashing)
    shared, own = await describe(open_store(), ids)
    snapshots = _snapshots(stores[0], ids["long"])
    for store in stores:
        store.close()
    await asyncio.to_thread(_checkpoint, path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        topics = "SELECT topic, count(*) FROM stored_events GROUP BY topic"
        leased = [r[0] for r in conn.execute("SELECT run_id FROM stored_leases")]
        _check_leases(conn.execute(topics).fetchall(), leased, ids)
        keyed = [r[0] for r in conn.execute("SELECT subject FROM kuralle_subject_keys")]
        _add_subjects(
            shared, ids, conn.execute("SELECT run_id, subject FROM runviews_runs").fetchall()
        )
    _check_sealed(await asyncio.to_thread(Path(path).read_bytes), keyed)
    assert snapshots >= 1, "the long run has no snapshot"
    return shared, {"file": "runs.sqlite", "runs": own, "ledger": app.read_ledger(ledger),
                    "long_snapshots": snapshots}  # fmt: skip


async def generate_postgres(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    name = f"golden_gen_{uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = psycopg.conninfo.conninfo_to_dict(ADMIN_DSN)
    dsn = psycopg.conninfo.make_conninfo(ADMIN_DSN, dbname=name)
    url = (
        f"postgresql://{params.get('user') or 'postgres'}@{params.get('host') or '127.0.0.1'}:"
        f"{params.get('port') or 5432}/{name}"
    )
    ledger = work / "ledger.pg.jsonl"
    app.use_ledger(ledger)
    stores: list[RunStore] = []
    try:

        def open_store() -> RunStore:
            stores.append(RunStore.postgres(url))
            return stores[-1]

        def open_crashing() -> CrashingStore:
            store = CrashingStore.postgres(url)
            assert isinstance(store, CrashingStore)
            return store

        ids = await populate(open_store, open_crashing)
        shared, own = await describe(open_store(), ids)
        snapshots = _snapshots(stores[0], ids["long"])
        for store in stores:
            store.close()
        with psycopg.connect(dsn) as conn:
            topics = "SELECT topic, count(*) FROM runstore_events GROUP BY topic"
            leased = [r[0] for r in conn.execute("SELECT run_id FROM runstore_leases")]
            _check_leases(conn.execute(topics).fetchall(), leased, ids)
            keyed = [r[0] for r in conn.execute("SELECT subject FROM kuralle_subject_keys")]
            rows = conn.execute("SELECT run_id, subject FROM runviews_runs").fetchall()
            _add_subjects(shared, ids, rows)
        await asyncio.to_thread(
            subprocess.run,
            ["pg_dump", "--no-owner", "--no-privileges", "--file", str(work / "runs.pg.sql"),
             "--dbname", dsn],
            check=True,
        )  # fmt: skip
        _check_sealed(await asyncio.to_thread(_pg_raw, dsn), keyed)
    finally:
        for store in stores:
            store.close()
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
    assert snapshots >= 1, "the long run has no snapshot"
    return shared, {"file": "runs.pg.sql", "runs": own, "ledger": app.read_ledger(ledger),
                    "long_snapshots": snapshots}  # fmt: skip


def _versions() -> dict[str, str]:
    """What else the stored bytes depend on."""
    dump = subprocess.run(["pg_dump", "--version"], capture_output=True, text=True, check=True)
    with psycopg.connect(ADMIN_DSN) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return {
        "python": platform.python_version(),
        "eventsourcing": metadata.version("eventsourcing"),
        "pydantic": metadata.version("pydantic"),
        "psycopg": metadata.version("psycopg"),
        "sqlite": sqlite3.sqlite_version,
        "postgres_server": str(row[0] if row else None),
        "pg_dump": dump.stdout.strip(),
    }


def _check_source() -> None:
    """The code imported is the commit's, unchanged."""
    head = subprocess.run(["git", "-C", str(SOURCE), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert head.startswith(COMMIT), head
    dirty = subprocess.run(["git", "-C", str(SOURCE), "status", "--porcelain"],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert not dirty.strip(), dirty


async def main() -> None:
    # The release its pyproject.toml says (at 2a3455d still 0.1.0: the 0.4 line unreleased).
    release = tomllib.loads((SOURCE / "pyproject.toml").read_text("utf-8"))["project"]["version"]
    existing = [f for f in FILES if (OUT / f).exists()]
    if existing:
        sys.exit(f"refusing to overwrite {existing} in {OUT}: write a NEW generation instead")
    with tempfile.TemporaryDirectory(prefix="golden-gen-") as tmp:
        work = Path(tmp)
        sqlite_shared, sqlite_own = await generate_sqlite(work)
        pg_shared, pg_own = await generate_postgres(work)
        if sqlite_shared != pg_shared:
            diff = {k: (sqlite_shared[k], pg_shared[k]) for k in RUNS
                    if sqlite_shared[k] != pg_shared[k]}  # fmt: skip
            raise AssertionError(f"the stores differ: {json.dumps(diff, indent=1, default=str)}")
        for label in RUNS:  # the same events in both stores, in their own orders
            sqlite_events = sqlite_own["runs"][label]["events"]
            pg_events = pg_own["runs"][label]["events"]
            assert sorted(sqlite_events) == sorted(pg_events), (label, sqlite_events, pg_events)
        flows = {flow_key(flow.name, flow.version): flow.digest for flow in app.FLOWS}
        manifest = {
            "generation": GENERATION,
            "kuralle_es_version": release,
            "commit": COMMIT,
            "generated_at": datetime.now(UTC).isoformat(),
            "versions": _versions(),
            "flows": flows,
            "runs": {label: {**spec, **sqlite_shared[label]} for label, spec in RUNS.items()},
            "stores": {"sqlite": sqlite_own, "postgres": pg_own},
        }
        (work / "manifest.json").write_text(
            json.dumps(manifest, indent=1, sort_keys=False, default=str) + "\n", "utf-8"
        )
        for f in FILES:
            shutil.copyfile(work / f, OUT / f)
    print(f"wrote {', '.join(FILES)} in {OUT}")


if __name__ == "__main__":
    _check_source()
    asyncio.run(main())
