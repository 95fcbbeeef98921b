"""Runs stored straight through the store, for the tests of the write path."""

from __future__ import annotations

from uuid import uuid4

from kuralle_es import Message, RunStore
from kuralle_es._journal.run import Run


def stored_run(store: RunStore, session_id: str = "s-group") -> Run:
    """A new flow run, created in ``store`` and loaded back."""
    run = Run(uuid4(), session_id, "flow", "agent", "f", "d")
    store.create_run(run)
    loaded = store.load(run.run_id)
    assert loaded is not None
    return loaded


def with_message(run: Run, text: str) -> Run:
    """``run`` with one more user message pending."""
    run.append_message(Message(role="user", content=text))
    return run
