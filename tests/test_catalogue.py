"""One catalogue of stored events, and every reader of the journal exhaustive over it.

``kuralle_es._journal.catalogue`` declares each stored event class once. The
aggregate's fold, the views, the public events, the timeline and fork each
read the journal through a dispatch table that must handle or explicitly
skip every class of the catalogue (``catalogue.dispatch`` refuses a table
that misses one, at import). These tests walk the catalogue and name the
reader that forgot an event; they also pin the stored topics and versions,
which are history: a topic is never changed, removed or reused, and a
class's version never goes down. A class's topic is derived from its name
unless it declares one, so the pins are what catch a rename.
"""

from __future__ import annotations

import pytest
from eventsourcing.utils import get_topic, resolve_topic

from kuralle_es._journal import catalogue as stored
from kuralle_es._journal import run as aggregate
from kuralle_es._operations import recording
from kuralle_es._runtime import fork
from kuralle_es.events import translate
from kuralle_es.views import fold, timeline

#: Every reader of the journal, by the dispatch table it reads through.
READERS = {
    "aggregate": aggregate._FOLD,
    "views": fold._HANDLERS,
    "public events": translate._RULES,
    "timeline": timeline._READ,
    "fork": fork._WALK,
    "replay": recording._READ,
}

#: The stored topics and class versions every store written so far may hold
#: (0.1.0's, then this release's). Append only.
STORED = {
    "kuralle_es:Run.Created": 2,
    "kuralle_es:Run.Forked": 1,
    "kuralle_es:Run.TurnStarted": 1,
    "kuralle_es:Run.NodeEntered": 1,
    "kuralle_es:Run.FlowPinned": 2,
    "kuralle_es:Run.MessageAppended": 1,
    "kuralle_es:Run.StepStarted": 2,
    "kuralle_es:Run.StepFinished": 1,
    "kuralle_es:Run.StepFailed": 1,
    "kuralle_es:Run.StepAttemptFailed": 1,
    "kuralle_es:Run.StepRetryAllowed": 1,
    "kuralle_es:Run.StepRetried": 1,
    "kuralle_es:Run.Paused": 1,
    "kuralle_es:Run.InputAccepted": 1,
    "kuralle_es:Run.SignalAccepted": 1,
    "kuralle_es:Run.TimerFired": 1,
    "kuralle_es:Run.Resumed": 1,
    "kuralle_es:Run.Recovered": 1,
    "kuralle_es:Run.Finished": 1,
    "kuralle_es:Run.Errored": 1,
    "kuralle_es:Run.Aborted": 1,
    "kuralle_es:Run.Migrated": 1,
    "kuralle_es:Run.TurnRecorded": 1,
    "kuralle_es:Run.BudgetSet": 1,
    "kuralle_es:Run.BudgetRaised": 1,
    "kuralle_es:Run.LeaseTaken": 1,
    "kuralle_es:Run.LeaseReleased": 1,
    "kuralle_es:Run.InboundKeyRecorded": 1,
    "kuralle_es:Run.MailReceived": 1,
    "kuralle_es:Run.MailDelivered": 1,
    "kuralle_es:Run.ParentLinked": 1,
    "kuralle_es:Run.FlowInputGiven": 1,
    "kuralle_es:Run.SubjectAssigned": 1,
    "kuralle_es:SessionRuns.Created": 1,
    "kuralle_es:SessionRuns.RunAdded": 1,
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_handles_or_skips_every_stored_event(reader: str) -> None:
    table = READERS[reader]
    forgotten = [c.__name__ for c in stored.RUN_EVENTS if c not in table]
    assert forgotten == [], f"the {reader} reader neither handles nor skips {forgotten}"
    assert set(table) == set(stored.RUN_EVENTS)


def test_the_aggregate_folds_every_stored_event() -> None:
    """Every event changes the run or says, in its handler, why it does not."""
    assert all(aggregate._FOLD[c] is not None for c in stored.RUN_EVENTS)


def test_a_table_that_forgets_an_event_is_refused_and_names_it() -> None:
    with pytest.raises(TypeError, match="missing \\['Forked'"):
        stored.dispatch(
            "a careless",
            {c: len for c in stored.RUN_EVENTS if c is not stored.Forked},
        )
    with pytest.raises(TypeError, match="both \\['Forked'\\]"):
        stored.dispatch(
            "a careless",
            {c: len for c in stored.RUN_EVENTS},
            skipped=[stored.Forked],
        )


def test_stored_topics_and_versions_are_history() -> None:
    declared = {c.TOPIC: c.class_version for c in (*stored.RUN_EVENTS, *stored.SESSION_EVENTS)}
    lost = sorted(set(STORED) - set(declared))
    assert lost == [], f"a stored topic may never go: {lost}"
    went_down = {t: (STORED[t], declared[t]) for t in STORED if declared[t] < STORED[t]}
    assert went_down == {}, f"a class version may only go up: {went_down}"
    assert len(set(declared)) == len(declared), "two classes share a topic"
    unpinned = sorted(set(declared) - set(STORED))
    assert unpinned == [], f"pin the new stored topics here: {unpinned}"


def test_eventsourcing_writes_and_finds_each_class_by_its_stored_topic() -> None:
    """The topics are derived from class names where not declared: a renamed class
    that forgot to declare its old topic loses it (above), and each stored topic
    must name, both ways, the class that reads it."""
    for topic, version in STORED.items():
        cls = resolve_topic(topic)
        assert cls in (*stored.RUN_EVENTS, *stored.SESSION_EVENTS), topic
        assert get_topic(cls) == topic, f"{cls.__name__} would be written as {get_topic(cls)}"
        assert cls.class_version >= version, f"{cls.__name__} stores version {cls.class_version}"


def test_every_changed_class_declares_its_version_and_a_path_up_to_it() -> None:
    """Version 1 is every event's, inherited; a later one is the class's own,
    declared with its upcasters."""
    for cls in (*stored.RUN_EVENTS, *stored.SESSION_EVENTS, aggregate.Run):
        if cls.class_version > 1:
            assert "class_version" in vars(cls), f"{cls.__name__} inherits its class_version"
        for version in range(1, cls.class_version):
            upcast = f"upcast_v{version}_v{version + 1}"
            assert callable(getattr(cls, upcast, None)), f"{cls.__name__} lacks {upcast}"


def test_a_snapshot_before_mailboxes_has_an_empty_mailbox_and_nothing_published() -> None:
    state: dict[str, object] = {"inbound_keys": {}}
    aggregate.Run.upcast_v3_v4(state)
    assert (state["mailbox"], state["mail_ids"], state["published"]) == ([], {}, {})


def test_intents_stored_by_0_1_0_split_their_lane_off_the_logical_run() -> None:
    for stored_run, run, lane in (
        ("r#0#f@d!approval", "r#0#f@d", "!approval"),
        ("r#0#f@d!budget", "r#0#f@d", "!budget"),
        ("r#2", "r#2", ""),
    ):
        state = {"logical_run": stored_run}
        stored.StepIntended.upcast_v1_v2(state)
        assert state == {"logical_run": run, "lane": lane, "batch": None}


def test_a_snapshot_of_0_1_0_or_earlier_gets_what_later_releases_count() -> None:
    """0.1.0's snapshots kept delivered signal ids as a list, and older ones lacked
    fields 0.1.0 added; the upcaster makes both the current shape."""
    state: dict[str, object] = {
        "signal_ids": ["a", "b"],
        "steps": [{"index": 0, "attempts": 1}],
    }
    aggregate.Run.upcast_v1_v2(state)
    assert state["signal_ids"] == {"a": None, "b": None}
    assert state["step_base"] == 0 and state["forked_from"] is None
    assert state["usage"] is None and state["budget"] is None and state["budget_raises"] == {}
    assert state["steps"] == [{"index": 0, "attempts": 1, "failures": 0, "retry_at": None}]


def test_a_snapshot_before_child_runs_holds_no_input_parent_or_children() -> None:
    state: dict[str, object] = {"inbound_keys": {}}
    aggregate.Run.upcast_v3_v4(state)
    assert (state["input"], state["parent"], state["children"]) == (None, None, [])


def test_every_stored_class_declares_which_of_its_fields_are_payload() -> None:
    """Erasure redacts what a class declares as payload (docs/privacy.md): a class
    added without a declaration of its own would keep its user data readable."""
    classes = (*stored.RUN_EVENTS, *stored.SESSION_EVENTS)
    undeclared = [c.__name__ for c in (*classes, aggregate.Run) if "PAYLOAD" not in vars(c)]
    assert undeclared == [], f"declare PAYLOAD (even ()) on {undeclared}"
    for cls in classes:
        fields = {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
        unknown = [path for path in cls.PAYLOAD if path.split(".")[0] not in fields]
        assert unknown == [], f"{cls.__name__} declares payload it has no field for: {unknown}"
