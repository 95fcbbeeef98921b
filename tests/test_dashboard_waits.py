"""Every kind of wait in the dashboard, in Debian's Chromium (``test_dashboard``'s
browser, server and login), on SQLite and PostgreSQL: the dashboard's column of
docs/operators.md.

One run paused on each kind of wait (``tests/procs/waits_app.py``) is listed in the
front page's pending section of its kind (messages and child runs too, the child's
approval among the approvals with a link to its parent, the parent among the runs
waiting for a child with a link to the child), and answered from its page: input, a
signal, a step in doubt (resolved with its result: executed once, before the crash), a
message (with the run's published values beside it), a spent budget approved with a
raised limit, and the parent's wait, read-only, which leads to the child and its
approval; a message goes to a run that waits for something else too. The operator is
journaled as the actor. The new forms need the token, the login and the page's CSRF
token, and a refused one writes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from procs.waits_app import LEDGER_ENV, SLEEP_ENV, build_agents, ledger, start_every_wait
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
    visit,
)

from kuralle_es import RunState, Runtime

__all__ = ["backend", "browser", "ledger_path", "serve"]  # fixtures, from test_dashboard


class Waits:
    """One run paused on each kind of wait, made through the library on the dashboard's
    database; ``runs`` by the kind of wait."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.runs = asyncio.run(start_every_wait(runtime, "dash"))
        self.child = self.state("child").waiting_for.child_run_id  # type: ignore[union-attr]

    def state(self, kind: str) -> RunState:
        run_id = self.runs.get(kind, kind)
        run = asyncio.run(self.runtime.store.load_async(run_id))
        assert run is not None
        return run.to_state()


@pytest.fixture
def waits_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "captures.jsonl"))
    monkeypatch.setenv(SLEEP_ENV, "3600")  # the timer sleeps on while the pages are read
    return tmp_path / "captures.jsonl"


@pytest.fixture
def waits(open_store: Any, waits_ledger: Path) -> Waits:
    return Waits(Runtime(build_agents(crash=True), store=open_store(), inline_sleep_limit=0))


def serve_waits(serve: Callable[..., Dashboard], **options: Any) -> Dashboard:
    dashboard: Dashboard = serve(make_agents=build_agents, **options)
    return dashboard


def links(driver: webdriver.Chrome, selector: str) -> list[str]:
    found = driver.find_elements(By.CSS_SELECTOR, selector)
    return [str(a.get_attribute("href")).rsplit("/", 1)[-1] for a in found]


def acted(driver: webdriver.Chrome, button: str) -> None:
    click_and_wait(driver, button)
    assert "done=" in driver.current_url or "delivered=" in driver.current_url, driver.page_source


def deliveries(driver: webdriver.Chrome) -> list[tuple[str, str, str]]:
    """The journal's deliveries: (kind, name, actor)."""
    rows = driver.find_elements(By.CSS_SELECTOR, "#timeline tbody tr.delivery")
    cells = [[c.text for c in r.find_elements(By.TAG_NAME, "td")] for r in rows]
    return [(c[2], c[3], c[-1]) for c in cells]


def test_an_operator_sees_every_wait_and_answers_each_in_the_browser(
    browser: webdriver.Chrome,
    serve: Callable[..., Dashboard],
    waits: Waits,
    waits_ledger: Path,
    tmp_path: Path,
) -> None:
    runs, child = waits.runs, waits.child
    dashboard = serve_waits(serve)
    login(browser, dashboard)
    browser.set_window_size(1280, 1500)
    try:
        # What waits, one section per kind; a child's approval among the approvals.
        visit(browser, dashboard.url + "/")
        sections = {
            "approvals": [runs["approval"], runs["budget"], child],
            "waiting-input": [runs["input"]],
            "signals": [runs["signal"], runs["in-doubt"]],
            "waiting-message": [runs["message"]],
            "waiting-child": [runs["child"]],
            "waiting-timer": [runs["timer"]],
        }
        for section, expected in sections.items():
            assert sorted(links(browser, f"#{section} a.run-link")) == sorted(expected), section
        assert links(browser, "#approvals a.parent-link") == [runs["child"]]
        assert links(browser, "#waiting-child a.child-link") == [child]
        screenshot(browser, "waits.png", tmp_path)

        # A parent's wait is read-only: it says what its child waits for, and leads there.
        visit(browser, f"{dashboard.url}/runs/{runs['child']}")
        note = text_of(browser, "child-note")
        assert child in note and "waiting for approval __approval: Ship the parcel?" in note
        assert browser.find_elements(By.CSS_SELECTOR, "#waiting form") == []  # nothing to answer
        screenshot(browser, "run-child.png", tmp_path)
        click_and_wait(browser, "child-answer")
        click_and_wait(browser, "approve")
        acted(browser, "confirm")
        visit(browser, f"{dashboard.url}/runs/{runs['child']}")
        assert text_of(browser, "outcome") == f"the child says: approved by {OPERATOR}"

        # A step in doubt, resolved with its result: recorded, not executed again.
        visit(browser, f"{dashboard.url}/runs/{runs['in-doubt']}")
        assert "Its process stopped" in text_of(browser, "operation")
        screenshot(browser, "run-in-doubt.png", tmp_path)
        browser.find_element(By.ID, "doubt-resolve").click()
        browser.find_element(By.ID, "doubt-result").send_keys('{"captured": "by hand"}')
        acted(browser, "answer-doubt")
        assert text_of(browser, "outcome") == 'captured {"captured": "by hand"}'
        assert deliveries(browser) == [("signal delivery", "__in_doubt", OPERATOR)]
        assert len(ledger(waits_ledger)) == 1  # the capture before the crash, only

        # A message for the receive it waits in, beside what the run published.
        visit(browser, f"{dashboard.url}/runs/{runs['message']}")
        assert "waiting for the item" in text_of(browser, "published")
        screenshot(browser, "run-message.png", tmp_path)
        browser.find_element(By.ID, "message-payload").send_keys('"A-1"')
        acted(browser, "send-message")
        assert text_of(browser, "outcome") == 'got "A-1"'
        assert ("item", OPERATOR) in [(name, actor) for _, name, actor in deliveries(browser)]

        # A spent budget, approved with a raised limit.
        visit(browser, f"{dashboard.url}/runs/{runs['budget']}")
        assert "The budget is spent" in text_of(browser, "operation")
        click_and_wait(browser, "approve")
        raised = browser.find_element(By.ID, "raise_max_model_calls")
        assert raised.get_attribute("value") == "1"
        raised.clear()
        raised.send_keys("3")
        screenshot(browser, "budget-confirm.png", tmp_path)
        acted(browser, "confirm")
        assert text_of(browser, "outcome") == "said"

        # A message to a run that waits for something else stays in its mailbox;
        # then the signal it waits for, and the input of another.
        visit(browser, f"{dashboard.url}/runs/{runs['signal']}")
        browser.find_element(By.CSS_SELECTOR, "#message-more summary").click()
        browser.find_element(By.ID, "message-name").send_keys("note")
        browser.find_element(By.ID, "message-payload").send_keys('{"seen": true}')
        acted(browser, "send-message")
        assert text_of(browser, "run-status") == "paused"
        browser.find_element(By.ID, "signal-payload").send_keys('{"n": 1}')
        acted(browser, "send-signal")
        assert text_of(browser, "outcome") == 'went {"n": 1}'
        names = [(name, actor) for _, name, actor in deliveries(browser)]
        assert names == [("note", OPERATOR), ("go", OPERATOR)]
        visit(browser, f"{dashboard.url}/runs/{runs['input']}")
        browser.find_element(By.ID, "input-text").send_keys("It was 12.50")
        acted(browser, "send-input")
        assert text_of(browser, "outcome") == "amount 12.5"

        # A durable timer: nothing to answer, a worker wakes it.
        visit(browser, f"{dashboard.url}/runs/{runs['timer']}")
        assert "a worker" in text_of(browser, "timer-note")
    finally:
        browser.set_window_size(1280, 900)


def test_the_in_doubt_and_message_forms_need_the_token_a_login_and_the_pages_csrf_token(
    serve: Callable[..., Dashboard], waits: Waits
) -> None:
    runs = waits.runs
    store = waits.runtime.store
    doubt, message = f"/runs/{runs['in-doubt']}/in-doubt", f"/runs/{runs['message']}/message"
    forms = {
        doubt: {
            "choice": "fail",
            "message": "the acquirer was down",
            "signal_id": "dash-" + "3" * 32,
        },
        message: {"name": "item", "payload": "1", "message_id": "dash-" + "4" * 32},
    }
    read_only = serve_waits(serve, token=None)
    writable = serve_waits(serve)
    operator = Http(writable.url)
    status, _ = operator.request("/login", {"csrf_token": operator.csrf(),
                                            "operator": OPERATOR, "token": TOKEN})  # fmt: skip
    assert status == 303
    csrf = operator.csrf(f"/runs/{runs['in-doubt']}")
    head = store.recorder.max_notification_id()
    for path, form in forms.items():
        assert Http(read_only.url).request(path, {**form, "csrf_token": "x"})[0] == 403, path
        anonymous = Http(writable.url)
        assert anonymous.request(path, {**form, "csrf_token": anonymous.csrf()})[0] == 401, path
        assert operator.request(path, {**form, "csrf_token": "forged"})[0] == 403, path
        assert operator.request(path, form)[0] == 403, path  # no CSRF token at all
        minted = "signal_id" if "signal_id" in form else "message_id"
        assert operator.request(path, {**form, minted: "mine", "csrf_token": csrf})[0] == 400
    # Refusals: the form's own (422) and the library's (the HTTP API's statuses).
    refusals = [
        (doubt, {"choice": "resolve", "result": ""}, 422, "the result"),
        (doubt, {"choice": "undo"}, 422, "InvalidSignalError"),
        (f"/runs/{runs['approval']}/in-doubt", {"choice": "retry"}, 409, "SignalMismatchError"),
        (message, {"name": "item", "payload": "{no"}, 422, "not JSON"),
        (message, {"name": "item", "payload": "[" * 5000}, 422, "nested too deeply"),
        (message, {"name": "__item", "payload": "1"}, 422, "__"),
    ]
    for n, (path, form, code, said) in enumerate(refusals):
        minted = {"signal_id": f"dash-{n:032x}", "message_id": f"dash-{n:032x}"}
        status, page = operator.request(path, {**form, **minted, "csrf_token": csrf})
        assert (status, said in page) == (code, True), (path, form, status, page)
    assert store.recorder.max_notification_id() == head  # nothing was written

    # Answered: a failure recorded with the operator's message.
    status, _ = operator.request(doubt, {**forms[doubt], "csrf_token": csrf})
    assert status == 303 and operator.location == f"/runs/{runs['in-doubt']}?done=in-doubt"
    answered = waits.state("in-doubt")
    assert answered.status == "finished" and answered.outcome is not None
    assert answered.outcome.startswith("failed: ") and "the acquirer was down" in answered.outcome
    sent = {**forms[message], "csrf_token": csrf}
    assert operator.request(message, sent)[0] == 303
    assert operator.request(message, sent)[0] == 303  # sent twice: once
    assert waits.state("message").outcome == "got 1"
    ended = {**sent, "message_id": "dash-" + "5" * 32}
    status, page = operator.request(message, ended)
    assert status == 409 and "SignalMismatchError" in page
