"""The dashboard as an operator works in it, in Debian's Chromium (``test_dashboard``'s
browser, server and login), on SQLite and PostgreSQL.

An operator answers a ``collect`` input, delivers a signal (journaled with their name
as the actor), resumes a run whose model step was in doubt after an outage (its
approved charge runs once), settles a drifted run and cancels one (the outcome names
them); each action needs the token, the login and the page's CSRF token, and a refused
one writes nothing. The front page searches by run id, session, flow, status and time
range, pages its list, shows what each run waits for and how it ended (an ended run's
flow and node too), and lists input and timer waits; pages change in place as their
runs do (no reload); a conversation reads like a chat, its tool calls and their
approvals in place. The runs are made through the library, on the same database.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from procs.operator_app import DOWN_ENV, LEDGER_ENV, VARIANT_ENV, build_agents, ledger
from selenium import webdriver
from selenium.webdriver.common.by import By
from test_dashboard import (
    OPERATOR,
    TOKEN,
    Dashboard,
    Http,
    backend,
    browser,
    click_and_wait,
    ledger_path,
    login,
    screenshot,
    serve,
    text_of,
    until_text,
    visit,
)

from kuralle_es import RunStore, Runtime, TurnResult

__all__ = ["backend", "browser", "ledger_path", "serve"]  # fixtures, from test_dashboard


class Ops:
    """Runs of the operator app made through the library, on the dashboard's database."""

    def __init__(self, store: RunStore, flag: Path, **options: Any) -> None:
        self.runtime = Runtime(build_agents(), store=store, **options)
        self.flag = flag

    def run(self, session: str, **kwargs: Any) -> TurnResult:
        async def turn() -> TurnResult:
            return await self.runtime.run(session, **kwargs).result()

        return asyncio.run(turn())

    def flow(self, session: str, flow: str) -> TurnResult:
        return self.run(session, kind="flow", flow_name=flow)

    def in_doubt(self, session: str) -> str:
        """A ``pay`` run approved while the model is down: charged, then ``error``."""
        started = self.flow(session, "pay")
        self.flag.touch()
        try:
            with pytest.raises(ConnectionError):
                asyncio.run(self.runtime.approve(started.run_id, session, by="ann"))
        finally:
            self.flag.unlink()
        return started.run_id

    def state(self, run_id: str, session: str) -> Any:
        return asyncio.run(self.runtime.get_run(run_id, session))


@pytest.fixture
def ops_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "charges.jsonl"))
    monkeypatch.setenv(DOWN_ENV, str(tmp_path / "down"))
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    return tmp_path


@pytest.fixture
def ops(open_store: Any, ops_env: Path) -> Ops:
    return Ops(open_store(), ops_env / "down")


def serve_ops(serve: Callable[..., Dashboard], **options: Any) -> Dashboard:
    dashboard: Dashboard = serve(make_agents=build_agents, **options)
    return dashboard


def row_cells(driver: webdriver.Chrome, table: str, run_id: str) -> list[str]:
    for row in driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr"):
        if run_id in row.text:
            return [cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
    raise AssertionError(f"run {run_id} is not in #{table}")


def post_and_wait(driver: webdriver.Chrome, button: str) -> None:
    click_and_wait(driver, button)
    assert "/runs/" in driver.current_url and "done=" in driver.current_url, driver.page_source


# ----------------------------------------------------------------- actions
def test_an_operator_answers_signals_resumes_settles_drift_and_cancels_in_the_browser(
    browser: webdriver.Chrome,
    serve: Callable[..., Dashboard],
    ops: Ops,
    ops_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    drifted = ops.flow("s-drift", "drifty").run_id  # the first variant of ``drifty``
    monkeypatch.setenv(VARIANT_ENV, "2")  # the dashboard's agents: the second
    ops.runtime = Runtime(build_agents(), store=ops.runtime.store)
    intake = ops.flow("s-intake", "intake").run_id
    waiting = ops.flow("s-signal", "drifty").run_id
    doubt = ops.in_doubt("s-doubt")
    to_cancel = ops.flow("s-cancel", "pay").run_id
    dashboard = serve_ops(serve)
    login(browser, dashboard)

    # Input for a collect node.
    visit(browser, f"{dashboard.url}/runs/{intake}")
    browser.find_element(By.ID, "input-text").send_keys("It was 12.50")
    post_and_wait(browser, "send-input")
    assert text_of(browser, "run-status") == "finished"
    assert text_of(browser, "outcome") == "amount 12.5"

    # A signal, journaled with the operator as its actor.
    visit(browser, f"{dashboard.url}/runs/{waiting}")
    browser.find_element(By.ID, "signal-payload").send_keys('{"note": "ok"}')
    post_and_wait(browser, "send-signal")
    assert (text_of(browser, "run-status"), text_of(browser, "outcome")) == ("finished", "audited")
    delivery = [c for c in _timeline(browser) if c[2] == "signal delivery"]
    assert delivery[0][3] == "go" and delivery[0][-1] == OPERATOR

    # Resume after the outage: the charge replays, the model step runs again.
    visit(browser, f"{dashboard.url}/runs/{doubt}")
    assert "ConnectionError" in text_of(browser, "run-error")
    screenshot(browser, "run-actions.png", tmp_path)
    post_and_wait(browser, "resume")
    assert (text_of(browser, "run-status"), text_of(browser, "outcome")) == ("finished", "paid")
    assert [e["cents"] for e in ledger(ops_env / "charges.jsonl")] == [500]

    # Drift: said on the page, settled by a restart on the current definition.
    visit(browser, f"{dashboard.url}/runs/{drifted}")
    assert "flow changed" in text_of(browser, "drifted")
    post_and_wait(browser, "resolve-drift")
    assert text_of(browser, "run-status") == "paused"
    assert browser.find_elements(By.ID, "drifted") == []
    assert ops.state(drifted, "s-drift").flow_digest == ops.state(waiting, "s-signal").flow_digest

    # Cancel: the outcome names the operator.
    visit(browser, f"{dashboard.url}/runs/{to_cancel}")
    browser.find_element(By.ID, "cancel-reason").send_keys("customer left")
    post_and_wait(browser, "cancel-run")
    assert text_of(browser, "run-status") == "aborted"
    assert text_of(browser, "outcome") == f"cancelled: customer left (by {OPERATOR})"


def _timeline(driver: webdriver.Chrome) -> list[list[str]]:
    rows = driver.find_elements(By.CSS_SELECTOR, "#timeline tbody tr")
    return [[c.text for c in r.find_elements(By.TAG_NAME, "td")] for r in rows]


def test_each_action_needs_the_token_a_login_and_the_pages_csrf_token(
    serve: Callable[..., Dashboard], ops: Ops
) -> None:
    paused = ops.flow("s-gate", "pay").run_id
    store = ops.runtime.store
    head = store.recorder.max_notification_id()
    forms = {
        "cancel": {"reason": "x"},
        "input": {"text": "x", "turn_id": "dash-" + "1" * 32},
        "signal": {"name": "go", "payload": "null", "signal_id": "dash-" + "2" * 32},
        "resume": {},
        "resolve-drift": {"choice": "abandon"},
    }
    read_only = serve_ops(serve, token=None)
    writable = serve_ops(serve)
    operator = Http(writable.url)
    status, _ = operator.request("/login", {"csrf_token": operator.csrf(),
                                            "operator": OPERATOR, "token": TOKEN})  # fmt: skip
    assert status == 303
    csrf = operator.csrf(f"/runs/{paused}")
    for action, form in forms.items():
        path = f"/runs/{paused}/{action}"
        # Read-only (no token): refused before the form is read.
        assert Http(read_only.url).request(path, {**form, "csrf_token": "x"})[0] == 403, action
        anonymous = Http(writable.url)
        assert anonymous.request(path, {**form, "csrf_token": anonymous.csrf()})[0] == 401
        assert operator.request(path, {**form, "csrf_token": "forged"})[0] == 403, action
        assert operator.request(path, form)[0] == 403, action  # no CSRF token at all
    for minted in ("turn_id", "signal_id"):
        action = "input" if minted == "turn_id" else "signal"
        bad = {**forms[action], minted: "mine", "csrf_token": csrf}
        assert operator.request(f"/runs/{paused}/{action}", bad)[0] == 400
    assert store.recorder.max_notification_id() == head  # nothing was written
    # Refusals of the library come back with the HTTP API's statuses, writing nothing.
    status, page = operator.request(f"/runs/{paused}/input", {**forms["input"], "csrf_token": csrf})
    assert status == 409 and "SignalMismatchError" in page
    status, page = operator.request(
        f"/runs/{paused}/resolve-drift", {**forms["resolve-drift"], "csrf_token": csrf}
    )
    assert status == 422 and "no flow drift" in page
    status, page = operator.request(
        f"/runs/{paused}/signal", {**forms["signal"], "payload": "{not json", "csrf_token": csrf}
    )
    assert status == 422 and "not JSON" in page
    assert store.recorder.max_notification_id() == head


# ------------------------------------------------------- search and pages
def test_the_front_page_searches_pages_and_shows_waits_and_outcomes(
    browser: webdriver.Chrome,
    serve: Callable[..., Dashboard],
    ops: Ops,
    open_store: Any,
    tmp_path: Path,
) -> None:
    finished = ops.run("s-chat", input="hello").run_id
    paid = ops.flow("s-pay", "pay").run_id
    asyncio.run(ops.runtime.approve(paid, "s-pay", by="ann"))
    intake = ops.flow("s-intake", "intake").run_id
    sleeper = Runtime(build_agents(), store=open_store(), inline_sleep_limit=0)
    ops_sleeping = Ops(sleeper.store, ops.flag)
    ops_sleeping.runtime = sleeper
    sleeping = ops_sleeping.flow("s-sleep", "sleepy")
    doubt = ops.in_doubt("s-doubt")
    dashboard = serve_ops(serve, page_size=2)
    login(browser, dashboard)

    # Columns: where each run stands or ended, what it waits for, how it ended.
    visit(browser, f"{dashboard.url}/?session=s-pay")
    cells = row_cells(browser, "runs", paid)
    assert cells[4] == "pay / rest" and cells[6] == "paid"  # ended: its last flow and node
    visit(browser, f"{dashboard.url}/?status=error")
    assert row_cells(browser, "runs", doubt)[6] == "ConnectionError"
    visit(browser, f"{dashboard.url}/?flow=intake")
    assert "input" in row_cells(browser, "runs", intake)[5]
    # Input and timer waits have their pending sections.
    assert intake in text_of(browser, "waiting-input")
    assert sleeping.run_id in text_of(browser, "waiting-timer")

    # Search by a run id's first characters, through the form.
    visit(browser, dashboard.url + "/")
    browser.find_element(By.ID, "filter-run").send_keys(finished[:8])
    click_and_wait(browser, "filter")
    assert [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#runs a.run-link")] == [
        finished
    ]
    # A time range: nothing was updated in the future, everything before it.
    later = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S")
    visit(browser, f"{dashboard.url}/?since={later}")
    assert browser.find_elements(By.CSS_SELECTOR, "#runs a.run-link") == []
    visit(browser, f"{dashboard.url}/?until=yesterday")
    assert "is not a date and time" in browser.find_element(By.CLASS_NAME, "search-problem").text

    # Pages of two, most recently updated first: every run once.
    visit(browser, dashboard.url + "/")
    seen: list[str] = []
    for _ in range(5):
        seen += [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#runs a.run-link")]
        if not browser.find_elements(By.ID, "next-page"):
            break
        click_and_wait(browser, "next-page")
    listed = asyncio.run(ops.runtime.views.list_runs(limit=100))
    assert seen == [s.run_id for s in listed] and len(seen) == 5
    click_and_wait(browser, "first-page")
    assert "after=" not in browser.current_url

    shots = serve_ops(serve)  # a page of the default size, for the picture
    login(browser, shots)
    browser.set_window_size(1280, 1250)
    try:
        visit(browser, shots.url + "/")
        screenshot(browser, "runs-search.png", tmp_path)
    finally:
        browser.set_window_size(1280, 900)


def test_pages_change_in_place_as_their_runs_do(
    browser: webdriver.Chrome, serve: Callable[..., Dashboard], ops: Ops
) -> None:
    paused = ops.flow("s-live", "pay").run_id
    dashboard = serve_ops(serve)
    login(browser, dashboard)
    visit(browser, f"{dashboard.url}/runs/{paused}")
    until_text(browser, "run-status", "paused", seconds=5)
    until_connected(browser)
    browser.execute_script("window.stillTheSamePage = 42")
    asyncio.run(ops.runtime.approve(paused, "s-live", by="sam"))
    until_text(browser, "run-status", "finished", seconds=20)
    assert browser.execute_script("return window.stillTheSamePage") == 42  # no reload

    visit(browser, dashboard.url + "/")
    until_connected(browser)
    browser.execute_script("window.stillTheSamePage = 43")
    started = ops.flow("s-new", "intake").run_id
    deadline = time.monotonic() + 20
    while started not in text_of(browser, "runs-page"):
        assert time.monotonic() < deadline, "the new run did not appear"
        time.sleep(0.2)
    assert started in text_of(browser, "waiting-input")
    assert browser.execute_script("return window.stillTheSamePage") == 43


def until_connected(driver: webdriver.Chrome) -> None:
    """Until the page's script says its live stream is open (an attribute of the body)."""
    deadline = time.monotonic() + 15
    while driver.find_element(By.TAG_NAME, "body").get_attribute("data-live-connected") is None:
        assert time.monotonic() < deadline, "the page's live stream never opened"
        time.sleep(0.1)


# ------------------------------------------------------------------ chat
def test_a_conversation_reads_like_a_chat_with_its_tool_calls_and_approvals_in_place(
    browser: webdriver.Chrome, serve: Callable[..., Dashboard], ops: Ops, tmp_path: Path
) -> None:
    ops.run("s-talk", input="where is order 7")
    asked = ops.run("s-talk", input="please refund order 7")
    assert asked.status == "paused" and asked.waiting_for is not None
    run_id = asked.run_id
    dashboard = serve_ops(serve)
    login(browser, dashboard)

    # The run's page lists the tool calls, not an empty assistant line.
    visit(browser, f"{dashboard.url}/runs/{run_id}")
    messages = text_of(browser, "messages")
    assert 'calls lookup({"order": 7}) → {"order": 7, "status": "shipped"}' in messages

    click_and_wait(browser, "chat-link")
    chat = text_of(browser, "chat")
    assert "where is order 7" in chat and "Order 7 is shipped." in chat
    cards = browser.find_elements(By.CSS_SELECTOR, ".tool-card")
    assert [c.find_element(By.CLASS_NAME, "tool-name").text for c in cards] == [
        "lookup", "refund_order",
    ]  # fmt: skip
    assert "waiting for approval" in cards[1].text
    browser.set_window_size(1280, 1300)
    try:
        screenshot(browser, "conversation.png", tmp_path)
    finally:
        browser.set_window_size(1280, 900)

    click_and_wait(browser, "approve")  # from the call's own card: the confirmation
    browser.find_element(By.ID, "reason").send_keys("receipt checked")
    click_and_wait(browser, "confirm")
    visit(browser, f"{dashboard.url}/runs/{run_id}/chat")
    card = browser.find_elements(By.CSS_SELECTOR, ".tool-card")[1]
    assert f"Approved by {OPERATOR}: “receipt checked”" in card.text
    assert '"refunded": 7' in card.text
    assert "Order 7 is refunded." in text_of(browser, "chat")
