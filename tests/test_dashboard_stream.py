"""The dashboard's run page shows a run's stream live, in a real browser (Debian's Chromium).

A real uvicorn server serves the dashboard over SQLite or PostgreSQL; a turn is
driven through the library on another store over the same database (as
another process would). Its model's first attempt streams a draft and fails,
so the stream retracts it; the second attempt streams the answer and holds
halfway. The page shows the answer's first words while the model step is
still running, shows them once after a reload mid-answer, and, once the
answer is journaled, shows the whole answer once and nothing of the draft.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from stream_kit import in_thread
from test_dashboard import Dashboard, browser, visit

from kuralle_es import ModelRequest, ModelResponse, RunStore, Runtime

PROCS = Path(__file__).resolve().parent / "procs"
sys.path.insert(0, str(PROCS))
from stream_app import MODEL_ID, TEXT, build_agents  # noqa: E402

__all__ = ["browser"]  # the fixture, shared with the dashboard's other browser tests

SESSION = "s-live"
DRAFT = "A scrapped draft that must never show "
HALF = 6


class DraftThenAnswer:
    """Attempt 1 streams a draft and fails; attempt 2 streams ``TEXT``, held after
    ``HALF`` words until ``go`` is set (``halfway`` says it got there)."""

    id = MODEL_ID

    def __init__(self) -> None:
        self.attempts = 0
        self.halfway = threading.Event()
        self.go = threading.Event()

    async def respond(self, request: ModelRequest) -> ModelResponse:
        raise AssertionError("the runtime streams this model")

    async def stream(self, request: ModelRequest) -> AsyncIterator[str | ModelResponse]:
        self.attempts += 1
        if self.attempts == 1:
            for word in DRAFT.split(" "):
                yield word + " "
            raise ConnectionError("the model server went away mid-answer")
        words = TEXT.split(" ")
        for n, word in enumerate(words):
            if n == HALF:
                self.halfway.set()
                await asyncio.to_thread(self.go.wait, 60)
            await asyncio.sleep(0.02)
            yield word if n == len(words) - 1 else word + " "


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    """Real SQLite and PostgreSQL (a memory store cannot be shared with the server)."""
    return str(request.param)


@pytest.fixture
def dashboard(open_store: Any) -> Iterator[Dashboard]:
    served = Dashboard(open_store(), token=None, refresh=3600).start()
    try:
        yield served
    finally:
        served.stop()


def answer_text(driver: webdriver.Chrome) -> str | None:
    """The run page's streamed answers, or None while a reload has the page away."""
    try:
        found = driver.find_elements(By.CSS_SELECTOR, "#stream .answer")
        return "|".join(str(element.text).strip() for element in found)
    except (StaleElementReferenceException, WebDriverException):
        return None


def until_answer(driver: webdriver.Chrome, text: str, seconds: float = 20) -> None:
    WebDriverWait(driver, seconds, poll_frequency=0.1).until(
        lambda d: answer_text(d) == text, f"the page never showed {text!r}"
    )


def test_the_run_page_shows_the_answer_live_and_once_after_a_reload_mid_answer(
    browser: webdriver.Chrome, dashboard: Dashboard, open_store: Any
) -> None:
    model = DraftThenAnswer()
    opened: list[str] = []
    store = open_store()

    async def turns() -> None:
        runtime = Runtime(build_agents(model), store=store)
        first = runtime.run(SESSION, kind="flow", flow_name="chat", input="refund?")
        opened.append(await first.run_id)
        with pytest.raises(ConnectionError):
            await first.result()
        await runtime.run(SESSION, run_id=opened[0]).result()

    with in_thread(turns, model.go.set) as failures:
        assert model.halfway.wait(30), failures
        page = f"{dashboard.url}/runs/{opened[0]}"
        half = " ".join(TEXT.split(" ")[:HALF]) + " "

        visit(browser, page)
        until_answer(browser, half.strip())
        assert _model_step(open_store(), opened[0]) == ("running", 2), "the step has not ended"
        assert "scrapped" not in browser.find_element(By.ID, "stream").text

        browser.refresh()  # a reload mid-answer
        until_answer(browser, half.strip())

        model.go.set()
        until_answer(browser, TEXT)
    assert not failures, failures
    assert _model_step(open_store(), opened[0]) == ("finished", 2)
    time.sleep(1.5)  # the page reloads itself once the turn ended: it must still say the same
    until_answer(browser, TEXT)
    shown = browser.find_element(By.ID, "stream").text
    assert shown.count(TEXT) == 1 and "scrapped" not in shown


def _model_step(store: RunStore, run_id: str) -> tuple[str, int]:
    async def read() -> tuple[str, int]:
        runtime = Runtime(build_agents(), store=store)
        [step] = await runtime.get_steps(run_id, SESSION)
        return step.status, step.attempts

    return asyncio.run(read())
