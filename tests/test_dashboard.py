"""The dashboard in a real browser: Debian's Chromium, driven by Selenium.

A real uvicorn server serves ``create_app`` over real SQLite and PostgreSQL
stores; the runs it shows are made by the refund example and small flows
below, through a separate ``RunStore`` on the same database (as another
process would). Chromium comes from the system (``make test`` installs
Debian's package as root); without it these tests skip with the reason,
except in CI, where they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from datetime import UTC, datetime, timedelta
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvicorn
from conftest import stripped
from pydantic import BaseModel
from selenium import webdriver
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from kuralle_es import (
    Budget,
    ModelResponse,
    RunContext,
    RunState,
    RunStore,
    Runtime,
    SignalDelivery,
    ToolCallRequest,
    ToolExecutionError,
    TurnResult,
    action,
    define_agent,
    define_flow,
    define_tool,
    end,
    goto,
    reply,
)
from kuralle_es.dashboard import REFRESH_SECONDS, create_app
from kuralle_es.errors import InvalidArgumentError
from kuralle_es.examples import refund
from kuralle_es.testing import ScriptedModel

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = "s3cret-dashboard-token"
OPERATOR = "Ada Ops"
XSS = "<script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'>"
T = TypeVar("T")


# ------------------------------------------------------------------ flows
class Payout(BaseModel):
    to: str
    cents: int


PAID: list[dict[str, Any]] = []


def pay(args: Payout) -> dict[str, Any]:
    PAID.append(args.model_dump())
    return {"paid": args.cents, "note": XSS}


def lookup(args: Payout) -> dict[str, Any]:
    if args.cents < 0:
        raise RuntimeError(f"no account {args.to}")
    return {"found": args.to}


async def payout_node(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.tool("lookup", {"to": XSS, "cents": 700})
    receipt = await ctx.tool("pay", {"to": XSS, "cents": 700})
    return end(json.dumps(receipt))


async def wait_node(state: dict[str, Any], ctx: RunContext) -> Any:
    payload = await ctx.signal("shipment", deadline=datetime.now(UTC) + timedelta(hours=2))
    return end(str(payload))


async def quick_approval_node(state: dict[str, Any], ctx: RunContext) -> Any:
    decision = await ctx.approve("Quick one", deadline=datetime.now(UTC) + timedelta(seconds=1))
    return end("approved" if decision.approved else "denied")


async def household_node(state: dict[str, Any], ctx: RunContext) -> Any:
    return end(f"shipped: {await ctx.child('shipping', 'go')}")


async def failing_node(state: dict[str, Any], ctx: RunContext) -> Any:
    await ctx.tool("lookup", {"to": "nobody", "cents": -1})
    return end("unreachable")


def ops_agent() -> Any:
    tools = [
        define_tool("pay", "Pay out", Payout, pay, needs_approval=True),
        define_tool("lookup", "Find an account", Payout, lookup),
    ]
    flows = [
        define_flow("payout", "pay after approval", "pay", [action("pay", payout_node)]),
        define_flow("shipping", "wait for a shipment", "wait", [action("wait", wait_node)]),
        define_flow("quick", "short deadline", "ask", [action("ask", quick_approval_node)]),
        define_flow("broken", "fails", "fail", [action("fail", failing_node)]),
        define_flow("household", "a parent", "go", [action("go", household_node)]),
    ]
    return define_agent("ops", "operations", ScriptedModel(["ok"]), tools, flows)


def budgeted_agent() -> Any:
    """Two model turns in a row (``reply`` nodes), so a budget of one call pauses
    the run before the second."""
    flow = define_flow(
        "chatty",
        "two replies",
        "first",
        [
            reply("first", "Say hello.", goto("second")),
            reply("second", "Say more.", end("said")),
        ],
    )
    model = ScriptedModel(lambda request: "ok", id="chatty-model")
    return define_agent("chatter", "talks", model, [], [flow])


def agents() -> list[Any]:
    return [refund.build_agent(), ops_agent(), budgeted_agent()]


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class Maker:
    """Makes runs through the library on its own store over the dashboard's database."""

    def __init__(self, store: RunStore) -> None:
        self.runtime = Runtime(agents(), store=store)

    def refund_paused(self, session: str, amount: str = "42.50") -> TurnResult:
        async def go() -> TurnResult:
            first = await self.runtime.run(
                session, input="I want a refund", kind="flow", flow_name="refund"
            ).result()
            return await self.runtime.run(
                session, run_id=first.run_id, input=f"It was ${amount}."
            ).result()

        result = run_sync(go())
        assert result.status == "paused", result
        return result

    def flow(self, session: str, flow: str) -> TurnResult:
        return self._turn(session, input="go", kind="flow", flow_name=flow)

    def deliver(self, result: TurnResult, session: str, payload: Any, name: str) -> TurnResult:
        delivery = SignalDelivery(
            signal_id=f"lib-{time.monotonic_ns()}", name=name, payload=payload, actor="library"
        )
        return self._turn(session, run_id=result.run_id, signal_delivery=delivery)

    def session_runs(self, session: str) -> list[RunState]:
        async def go() -> list[RunState]:
            ids = self.runtime.store.session_run_ids(session)
            return [s for s in [await self.runtime.get_run(i, session) for i in ids] if s]

        return run_sync(go())

    def _turn(self, session: str, **kwargs: Any) -> TurnResult:
        async def go() -> TurnResult:
            return await self.runtime.run(session, **kwargs).result()

        return run_sync(go())


# --------------------------------------------------------------- browser
def _in_ci() -> bool:
    return os.environ.get("CI") == "true" or os.environ.get("KURALLE_REQUIRE_POSTGRES") == "1"


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    """Headless Debian Chromium with a fresh profile; skip loudly (fail in CI) without it."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        message = (
            f"NO BROWSER: {', '.join(missing)} missing, so the dashboard's browser tests "
            "cannot run. Install Debian's chromium and chromium-driver "
            "(`make browser` does it as root)."
        )
        if _in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    profile = tempfile.mkdtemp(prefix="kuralle-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--window-size=1280,900", f"--user-data-dir={profile}",
    ):  # fmt: skip
        options.add_argument(flag)
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    except WebDriverException as e:
        message = f"NO BROWSER: Chromium at {CHROMIUM} did not start: {e.msg}"
        if _in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


# ---------------------------------------------------------------- server
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Dashboard:
    """A real uvicorn server on a loopback port, in a thread, over its own store."""

    def __init__(
        self,
        store: RunStore,
        token: str | None,
        refresh: int,
        prices: Any = None,
        make_agents: Callable[[], list[Any]] = agents,
        **options: Any,
    ) -> None:
        app = create_app(store, lambda s: Runtime(make_agents(), store=s), token=token,
                         refresh_seconds=refresh, prices=prices, **options)  # fmt: skip
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning",
            timeout_graceful_shutdown=1,  # a page's live stream stays open
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> Dashboard:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError("the dashboard server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    """The dashboard's stores: real SQLite and PostgreSQL (memory cannot be shared)."""
    return str(request.param)


@pytest.fixture
def ledger_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(refund.LEDGER_ENV, str(path))
    monkeypatch.delenv(refund.MODEL_ENV, raising=False)
    PAID.clear()
    return path


@pytest.fixture
def serve(open_store: Any, ledger_path: Path) -> Iterator[Callable[..., Dashboard]]:
    started: list[Dashboard] = []

    def start(
        token: str | None = TOKEN, refresh: int = 3600, prices: Any = None, **options: Any
    ) -> Dashboard:
        dashboard = Dashboard(open_store(), token, refresh, prices, **options).start()
        started.append(dashboard)
        return dashboard

    try:
        yield start
    finally:
        for dashboard in started:
            dashboard.stop()


@pytest.fixture
def maker(open_store: Any, ledger_path: Path) -> Maker:
    return Maker(open_store())


def refunds(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [e for e in map(json.loads, lines) if e["tool"] == "processRefund"]


# --------------------------------------------------------------- helpers
def visit(driver: webdriver.Chrome, url: str) -> None:
    driver.get(url)
    WebDriverWait(driver, 15).until(lambda d: d.execute_script("return document.readyState")
                                    == "complete")  # fmt: skip


def click_and_wait(driver: webdriver.Chrome, element_id: str, by: str = By.ID) -> None:
    """Click something that navigates, and wait for the next page."""
    old = driver.find_element(By.TAG_NAME, "html")
    driver.find_element(by, element_id).click()
    WebDriverWait(driver, 30).until(lambda d: _stale(old))
    WebDriverWait(driver, 15).until(lambda d: d.execute_script("return document.readyState")
                                    == "complete")  # fmt: skip


def _stale(element: Any) -> bool:
    try:
        element.is_enabled()
    except WebDriverException:
        return True
    return False


def text_of(driver: webdriver.Chrome, element_id: str) -> str:
    """The element's text; read again if a live page replaced the element between
    finding it and reading it (its runs changed meanwhile)."""
    for _ in range(20):
        try:
            return str(driver.find_element(By.ID, element_id).text)
        except StaleElementReferenceException:
            time.sleep(0.05)
    return str(driver.find_element(By.ID, element_id).text)


def login(driver: webdriver.Chrome, dashboard: Dashboard, next_path: str = "/") -> None:
    driver.delete_all_cookies()
    visit(driver, f"{dashboard.url}/login?next={urllib.parse.quote(next_path)}")
    driver.find_element(By.ID, "operator").send_keys(OPERATOR)
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    click_and_wait(driver, "login")
    assert text_of(driver, "operator-name") == OPERATOR


def wait_for_status(driver: webdriver.Chrome, url: str, status: str) -> None:
    def shows(d: webdriver.Chrome) -> bool:
        visit(d, url)
        return text_of(d, "run-status") == status

    WebDriverWait(driver, 20, poll_frequency=0.3).until(shows)


def screenshot(driver: webdriver.Chrome, name: str, tmp_path: Path) -> None:
    """Save a page's picture; also into $KURALLE_SCREENSHOTS_DIR when set (the docs')."""
    driver.save_screenshot(str(tmp_path / name))
    assert (tmp_path / name).stat().st_size > 10_000
    target = os.environ.get("KURALLE_SCREENSHOTS_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(target) / name))


class Http:
    """A cookie-keeping HTTP client without a browser: for what a browser would not send."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.jar = CookieJar()
        self.location: str | None = None
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(self.jar), _NoRedirect()
        )

    def request(
        self, path: str, form: dict[str, str] | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, str]:
        data = urllib.parse.urlencode(form).encode() if form is not None else None
        request = urllib.request.Request(f"{self.base}{path}", data=data, headers=headers or {})
        try:
            with self.opener.open(request, timeout=30) as response:
                self.location = response.headers.get("location")
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as e:
            self.location = e.headers.get("location")
            return int(e.code), e.read().decode()

    def csrf(self, path: str = "/login") -> str:
        _, page = self.request(path)
        marker = 'name="csrf_token" value="'
        start = page.index(marker) + len(marker)
        return page[start : page.index('"', start)]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


# ----------------------------------------------------------------- tests
def test_pages_show_real_runs_by_status_with_waits_oldest_first_a_filter_and_tool_stats(
    browser: webdriver.Chrome, serve: Callable[..., Dashboard], maker: Maker, tmp_path: Path
) -> None:
    older = maker.refund_paused("s-old", "10")
    newer = maker.refund_paused("s-new", "20")
    payout = maker.flow("s-pay", "payout")
    shipping = maker.flow("s-ship", "shipping")
    with pytest.raises(ToolExecutionError):
        maker.flow("s-broken", "broken")
    [broken] = maker.session_runs("s-broken")
    done = maker.deliver(maker.refund_paused("s-done", "5"), "s-done",
                         {"approved": True, "by": "sam"}, "__approval")  # fmt: skip
    assert (payout.status, shipping.status, broken.status) == ("paused", "paused", "error")
    assert done.status == "finished"
    dashboard = serve()

    login(browser, dashboard)  # every page needs the login where there is a token
    visit(browser, dashboard.url + "/")
    counts = {s: text_of(browser, f"count-{s}").split()[0] for s in ("paused", "finished", "error")}
    assert counts == {"paused": "4", "finished": "1", "error": "1"}
    approvals = browser.find_elements(By.CSS_SELECTOR, "#approvals a.run-link")
    assert [a.text for a in approvals] == [older.run_id, newer.run_id, payout.run_id]
    assert "Refund $10.00?" in text_of(browser, "approvals")
    signals = text_of(browser, "signals")
    assert shipping.run_id in signals
    assert "(in 2.0 h)" in signals or "(in 120 min)" in signals, signals

    # The filter, through the form's own controls.
    browser.find_element(By.CSS_SELECTOR, "#filter-status option[value=error]").click()
    click_and_wait(browser, "filter")
    assert "status=error" in browser.current_url
    listed = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#runs a.run-link")]
    assert listed == [broken.run_id]

    # A run's page from its link: the journal, the failed step's error.
    click_and_wait(browser, "#runs a.run-link", By.CSS_SELECTOR)
    assert text_of(browser, "run-id") == broken.run_id
    assert text_of(browser, "run-status") == "error"
    timeline = text_of(browser, "timeline")
    assert "lookup" in timeline and "RuntimeError: no account nobody" in timeline

    # A paused payout shows the frozen operation it waits to have approved.
    visit(browser, f"{dashboard.url}/runs/{payout.run_id}")
    assert text_of(browser, "operation-tool") == "pay"
    assert json.loads(text_of(browser, "operation-args")) == {"cents": 700, "to": XSS}

    # The finished refund's journal names who delivered the approval (the actor,
    # "library" here, not the payload's "by").
    visit(browser, f"{dashboard.url}/runs/{done.run_id}")
    rows = browser.find_elements(By.CSS_SELECTOR, "#timeline tbody tr")
    cells = [[c.text for c in r.find_elements(By.TAG_NAME, "td")] for r in rows]
    delivered, step = (c for c in cells if c[3] == "__approval")  # delivery, then its step
    assert delivered[2:5] == ["signal delivery", "__approval", "accepted"]
    assert delivered[-1] == "library" and '"by": "sam"' in delivered[-2]
    assert step[2:6] == ["approval", "__approval", "finished", "1"]

    visit(browser, dashboard.url + "/tools")
    table = text_of(browser, "tools")
    assert "lookup" in table and "processRefund" in table
    lookup_row = next(r for r in browser.find_elements(By.CSS_SELECTOR, "#tools tbody tr")
                      if r.text.startswith("lookup"))  # fmt: skip
    cells = [c.text for c in lookup_row.find_elements(By.TAG_NAME, "td")]
    assert cells[1:4] == ["2", "1", "50.0 %"]
    bars = browser.find_elements(By.CSS_SELECTOR, "#latency-chart rect")
    assert len(bars) >= 4

    # Pictures of the three pages as an operator sees them (default refresh, logged in).
    shots = serve(refresh=REFRESH_SECONDS)
    login(browser, shots)
    browser.set_window_size(1280, 1250)
    try:
        for name, path in (
            ("runs", "/"),
            ("run", f"/runs/{payout.run_id}"),
            ("run-finished", f"/runs/{done.run_id}"),
            ("tools", "/tools"),
        ):
            visit(browser, shots.url + path)
            screenshot(browser, f"{name}.png", tmp_path)
    finally:
        browser.set_window_size(1280, 900)


def test_approve_in_the_browser_resumes_the_run_and_its_tool_executes_once(
    browser: webdriver.Chrome, serve: Callable[..., Dashboard], maker: Maker, ledger_path: Path
) -> None:
    paused = maker.refund_paused("s-approve", "42.50")
    dashboard = serve()
    run_url = f"{dashboard.url}/runs/{paused.run_id}"
    login(browser, dashboard, f"/runs/{paused.run_id}")
    assert browser.current_url == run_url
    assert text_of(browser, "run-status") == "paused"

    click_and_wait(browser, "approve")  # the confirmation step, not the decision yet
    assert browser.current_url == run_url + "/approve"
    assert "Refund $42.50?" in browser.page_source
    assert refunds(ledger_path) == []
    browser.find_element(By.ID, "reason").send_keys("customer is right")
    click_and_wait(browser, "confirm")

    assert browser.current_url.startswith(run_url + "?delivered=dash-")
    assert "Your decision was delivered" in text_of(browser, "delivered")
    assert text_of(browser, "run-status") == "finished"
    assert text_of(browser, "outcome") == "approved"
    assert [e["amount_cents"] for e in refunds(ledger_path)] == [4250]
    rows = browser.find_elements(By.CSS_SELECTOR, "#timeline tbody tr.delivery")
    delivered = [r for r in rows if "__approval" in r.text]
    assert len(delivered) == 1
    cells = [c.text for c in delivered[0].find_elements(By.TAG_NAME, "td")]
    assert cells[-1] == OPERATOR and "customer is right" in cells[-2]

    # The same confirmation submitted again (back, resubmit) is the same signal: a no-op.
    browser.back()
    WebDriverWait(browser, 15).until(lambda d: d.current_url == run_url + "/approve")
    click_and_wait(browser, "confirm")
    assert text_of(browser, "run-status") == "finished"
    assert len(refunds(ledger_path)) == 1


def test_a_parent_and_its_child_link_to_each_other_and_the_childs_wait_has_no_buttons(
    browser: webdriver.Chrome, serve: Callable[..., Dashboard], maker: Maker
) -> None:
    parent = maker.flow("s-family", "household")
    assert parent.waiting_for is not None and parent.waiting_for.kind == "child"
    child_id = parent.waiting_for.child_run_id
    dashboard = serve()
    login(browser, dashboard, f"/runs/{parent.run_id}")
    assert text_of(browser, "children") == child_id
    assert browser.find_elements(By.ID, "approve") == []  # nothing to answer on a child wait
    click_and_wait(browser, "child-wait")
    assert browser.current_url == f"{dashboard.url}/runs/{child_id}"
    assert text_of(browser, "parent").startswith(parent.run_id)
    click_and_wait(browser, "#parent a", By.CSS_SELECTOR)
    assert browser.current_url == f"{dashboard.url}/runs/{parent.run_id}"
    maker.deliver(TurnResult(run_id=child_id, status="paused"), "s-family", {"n": 1}, "shipment")
    wait_for_status(browser, f"{dashboard.url}/runs/{parent.run_id}", "finished")
    assert text_of(browser, "outcome") == "shipped: {'n': 1}"


def test_deny_in_the_browser_declines_and_the_refund_never_executes(
    browser: webdriver.Chrome, serve: Callable[..., Dashboard], maker: Maker, ledger_path: Path
) -> None:
    paused = maker.refund_paused("s-deny", "99")
    dashboard = serve()
    login(browser, dashboard, f"/runs/{paused.run_id}")
    click_and_wait(browser, "deny")
    browser.find_element(By.ID, "reason").send_keys("outside the window")
    click_and_wait(browser, "confirm")
    assert text_of(browser, "run-status") == "finished"
    assert text_of(browser, "outcome") == "declined"
    assert refunds(ledger_path) == []


def test_a_refused_delivery_is_shown_plainly_and_changes_nothing(
    browser: webdriver.Chrome, serve: Callable[..., Dashboard], maker: Maker, ledger_path: Path
) -> None:
    paused = maker.refund_paused("s-late", "12")
    quick = maker.flow("s-quick", "quick")
    dashboard = serve()
    login(browser, dashboard, f"/runs/{paused.run_id}")

    # Someone else decides while the operator reads the confirmation.
    click_and_wait(browser, "approve")
    maker.deliver(paused, "s-late", {"approved": False, "by": "other", "reason": "no"},
                  "__approval")  # fmt: skip
    click_and_wait(browser, "confirm")
    assert text_of(browser, "refused-type") == "SignalMismatchError"
    assert "Refused: nothing was delivered" in text_of(browser, "refused")
    assert refunds(ledger_path) == []

    # An approval whose deadline passed is refused, in so many words.
    visit(browser, f"{dashboard.url}/runs/{quick.run_id}/approve")
    time.sleep(1.2)
    click_and_wait(browser, "confirm")
    assert text_of(browser, "refused-type") == "SignalMismatchError"
    assert "expired before delivery" in text_of(browser, "refused-message")
    visit(browser, f"{dashboard.url}/runs/{quick.run_id}")
    assert text_of(browser, "run-status") == "paused"


def test_run_data_renders_as_text_never_as_markup(
    browser: webdriver.Chrome, serve: Callable[..., Dashboard], maker: Maker
) -> None:
    payout = maker.flow("s-xss", "payout")
    done = maker.deliver(payout, "s-xss", {"approved": True, "by": "sam"}, "__approval")
    assert done.status == "finished"
    dashboard = serve()
    login(browser, dashboard)
    visit(browser, f"{dashboard.url}/runs/{payout.run_id}")
    assert XSS in text_of(browser, "timeline")  # the tool's result, shown as its text
    assert browser.execute_script("return window.pwned === undefined") is True
    assert browser.find_elements(By.CSS_SELECTOR, "main script, main img") == []
    visit(browser, dashboard.url + "/")
    assert browser.execute_script("return window.pwned === undefined") is True


def test_pages_refresh_themselves(
    browser: webdriver.Chrome, serve: Callable[..., Dashboard], maker: Maker
) -> None:
    paused = maker.refund_paused("s-refresh", "3")
    dashboard = serve(refresh=1)
    login(browser, dashboard)
    visit(browser, f"{dashboard.url}/runs/{paused.run_id}")
    # The page changes in place as the run does (its live stream; without a script
    # it would reload itself every second): an element found just before a swap is
    # stale by the time its text is read, so each wait looks again.
    until_text(browser, "run-status", "paused", seconds=2)
    maker.deliver(paused, "s-refresh", {"approved": True, "by": "sam"}, "__approval")
    until_text(browser, "run-status", "finished", seconds=15)


def until_text(driver: webdriver.Chrome, element_id: str, text: str, seconds: float) -> None:
    """Wait until the element shows ``text`` on a page that reloads itself."""
    WebDriverWait(
        driver,
        seconds,
        poll_frequency=0.3,
        ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
    ).until(lambda d: shown_text(d, element_id) == text)


def shown_text(driver: webdriver.Chrome, element_id: str) -> str | None:
    """The element's text, or None when a reload took the element away between
    finding it and reading it (Chromium may say so as an inspector error rather
    than as a stale element)."""
    try:
        return str(driver.find_element(By.ID, element_id).text)
    except WebDriverException as gone:
        if "does not belong to the document" in str(gone):
            return None
        raise


def test_state_changes_need_the_token_and_a_valid_csrf_token(
    serve: Callable[..., Dashboard], maker: Maker, ledger_path: Path
) -> None:
    paused = maker.refund_paused("s-gate", "8")
    dashboard = serve()
    path = f"/runs/{paused.run_id}/approve"
    anonymous = Http(dashboard.url)
    csrf = anonymous.csrf()
    form = {"csrf_token": csrf, "signal_id": "dash-" + "0" * 32}
    assert anonymous.request(path, form)[0] == 401

    wrong = Http(dashboard.url)
    status, page = wrong.request("/login", {"csrf_token": wrong.csrf(), "operator": "x",
                                            "token": "guess"})  # fmt: skip
    assert status == 401 and "not the dashboard token" in page

    operator = Http(dashboard.url)
    status, _ = operator.request(
        "/login",
        {"csrf_token": operator.csrf(), "operator": OPERATOR, "token": TOKEN, "next": "//evil"},
    )
    assert status == 303 and operator.location == "/"  # never a redirect off this site
    signal = {"signal_id": "dash-" + "1" * 32}
    from_elsewhere = {"Origin": "http://evil.example"}
    good = {**signal, "csrf_token": operator.csrf(path)}
    assert operator.request(path, good, from_elsewhere)[0] == 403
    assert operator.request(path, signal)[0] == 403  # no CSRF token
    assert operator.request(path, {**signal, "csrf_token": "forged"})[0] == 403
    assert operator.request(path, {**signal, "csrf_token": csrf})[0] == 403  # another browser's
    assert refunds(ledger_path) == []

    status, _ = operator.request(path, {**signal, "csrf_token": operator.csrf(path)})
    assert status == 303
    assert len(refunds(ledger_path)) == 1

    read_only = serve(token=None)
    client = Http(read_only.url)
    status, page = client.request(path, {"csrf_token": "none to be had", **signal})
    assert status == 403 and "KURALLE_DASHBOARD_TOKEN" in page


def test_the_confirmation_of_a_run_waiting_for_a_signal_offers_no_decision(
    serve: Callable[..., Dashboard], maker: Maker
) -> None:
    shipping = maker.flow("s-confirm", "shipping")
    assert shipping.waiting_for is not None and shipping.waiting_for.kind == "signal"
    dashboard = serve()
    operator = Http(dashboard.url)
    login = {"csrf_token": operator.csrf(), "operator": OPERATOR, "token": TOKEN}
    assert operator.request("/login", login)[0] == 303
    for decision in ("approve", "deny"):
        status, page = operator.request(f"/runs/{shipping.run_id}/{decision}")
        assert status == 200
        assert f"Nothing to {decision}" in page and "this request?" not in page
        assert 'id="not-an-approval"' in page and "waits for a signal" in page
        assert 'id="confirm"' not in page  # no form to submit
    paused = maker.refund_paused("s-confirm-2", "3")
    _, page = operator.request(f"/runs/{paused.run_id}/approve")
    assert "Approve this request?" in page and 'id="confirm"' in page


def test_a_dashboard_beyond_loopback_needs_a_token_and_then_a_login_for_every_page(
    open_store: Any,
) -> None:
    store = open_store()
    with pytest.raises(InvalidArgumentError, match="KURALLE_DASHBOARD_TOKEN"):
        create_app(store, lambda s: Runtime(agents(), store=s), host="0.0.0.0", token=None)
    with pytest.raises(InvalidArgumentError, match="--allowed-host"):
        create_app(store, lambda s: Runtime(agents(), store=s), host="0.0.0.0", token=TOKEN)
    app = create_app(
        store, lambda s: Runtime(agents(), store=s), host="0.0.0.0", token=TOKEN,
        allowed_hosts=["127.0.0.1"],
    )  # fmt: skip
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        client = Http(f"http://127.0.0.1:{port}")
        for page in ("/", "/tools", "/usage", "/runs/whatever"):
            status, _ = client.request(page)
            assert status == 303
        status, page = client.request("/login")
        assert status == 200 and 'name="token"' in page
    finally:
        server.should_exit = True
        thread.join(20)


def test_with_a_token_every_page_needs_the_login_on_loopback_too(
    serve: Callable[..., Dashboard], maker: Maker
) -> None:
    paused = maker.refund_paused("s-private", "4")
    pages = ["/", "/tools", "/usage", f"/runs/{paused.run_id}", f"/runs/{paused.run_id}/approve"]
    dashboard = serve()  # on 127.0.0.1, with a token
    anonymous = Http(dashboard.url)
    for page in pages:
        status, body = anonymous.request(page)
        assert status == 303 and anonymous.location == f"/login?next={page}", page
        assert paused.run_id not in body
    operator = Http(dashboard.url)
    form = {"csrf_token": operator.csrf(), "operator": OPERATOR, "token": TOKEN}
    assert operator.request("/login", form)[0] == 303
    for page in pages:
        status, body = operator.request(page)
        assert status == 200 and 'id="operator-name"' in body, page
    # Without a token there is no login to ask for: the pages only read.
    read_only = Http(serve(token=None).url)
    for page in pages[:4]:
        assert read_only.request(page)[0] == 200, page


def test_the_dashboard_answers_no_host_but_its_own(
    serve: Callable[..., Dashboard], maker: Maker
) -> None:
    paused = maker.refund_paused("s-rebind", "6")
    for dashboard in (serve(), serve(token=None)):
        client = Http(dashboard.url)
        for host in ("attacker.example", f"attacker.example:{dashboard.port}", "[::2]", ""):
            for page in ("/", f"/runs/{paused.run_id}", "/login", "/static/dashboard.css"):
                status, body = client.request(page, headers={"Host": host})
                assert status == 400 and "--allowed-host" in body, (host, page)
                assert paused.run_id not in body
            status, _ = client.request("/login", {"csrf_token": "x"}, headers={"Host": host})
            assert status == 400
        for host in ("localhost", f"127.0.0.1:{dashboard.port}", f"[::1]:{dashboard.port}"):
            assert client.request("/login", headers={"Host": host})[0] == 200, host


def test_the_dashboard_command_answers_its_allowed_hosts(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    RunStore.sqlite(str(db)).close()
    env = {k: v for k, v in os.environ.items() if not stripped(k, "KURALLE_")}
    command = [sys.executable, "-m", "kuralle_es.cli", "--store", f"sqlite:///{db}", "dashboard"]
    public = subprocess.run(
        [*command, "--host", "0.0.0.0"], env={**env, "KURALLE_DASHBOARD_TOKEN": TOKEN},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert public.returncode == 1 and "--allowed-host" in public.stderr, public.stderr
    flags = [*command, "--allowed-host", "ops.example", "--allowed-host", "desk.example"]
    for started, names in ((flags, ["ops.example", "desk.example:8765"]),
                           (command, ["env.example"])):  # fmt: skip
        with cli_dashboard(started, {**env, "KURALLE_ALLOWED_HOSTS": "env.example"}) as (c, _):
            for host in [*names, "localhost"]:
                assert c.request("/", headers={"Host": host})[0] == 200, host
            assert c.request("/", headers={"Host": "attacker.example"})[0] == 400


def test_malformed_cookies_and_form_fields_are_4xx_never_5xx(ledger_path: Path) -> None:
    from starlette.testclient import TestClient

    store = RunStore.memory()
    maker = Maker(store)
    paused = maker.refund_paused("s-malformed", "9")
    app = create_app(store, lambda s: maker.runtime, token=TOKEN)
    client = TestClient(
        app, base_url="http://127.0.0.1", raise_server_exceptions=False, follow_redirects=False
    )
    page = client.get("/login").text
    client.post("/login", data={"csrf_token": hidden(page, "csrf_token"), "operator": OPERATOR,
                                "token": TOKEN})  # fmt: skip
    good = client.cookies["kuralle_dashboard_session"]
    client.cookies.clear()
    other = TestClient(create_app(store, lambda s: maker.runtime, token=TOKEN),
                       base_url="http://127.0.0.1")  # fmt: skip
    other_cookie = other.get("/login").cookies["kuralle_dashboard_session"]
    approve = f"/runs/{paused.run_id}/approve"
    cookies = [
        "é".encode(),
        "sesión=✓".encode(),
        b"\xff\xfe\x00",
        good[:-7].encode(),
        good[:20].encode(),
        # A signature character changed. Not the last: the signature is 20 bytes in
        # 27 base64 characters, and the last one's low bits are padding, so "A"
        # for "B" there decodes to the same signature (a valid cookie).
        (good[:-5] + ("A" if good[-5] != "A" else "B") + good[-4:]).encode(),
        other_cookie.encode(),
        b'"unterminated',
        b"=",
        b"%%%",
        b"x" * 4000,
        b"a.b.c",
    ]
    requests: list[tuple[str, str, Any]] = [
        ("GET", "/", None), ("GET", f"/runs/{paused.run_id}", None), ("GET", "/login", None),
        ("GET", approve, None), ("POST", "/login", {"csrf_token": "x", "token": TOKEN}),
        ("POST", approve, {"csrf_token": "x", "signal_id": "dash-" + "0" * 32}),
        ("POST", "/logout", {"csrf_token": "x"}),
    ]  # fmt: skip
    for cookie in cookies:
        for method, path, form in requests:
            client.cookies.clear()  # the malformed cookie alone, not the one last answered
            reply = client.request(
                method, path, data=form, headers={"cookie": b"kuralle_dashboard_session=" + cookie}
            )
            assert reply.status_code < 500, (cookie, method, path, reply.text[:300])
            assert method == "GET" or 400 <= reply.status_code < 500, (cookie, path)
            assert reply.status_code != 200 or path == "/login", (cookie, path)

    # Logged in, with a valid session: malformed fields of every form.
    client.cookies.clear()
    client.cookies.set("kuralle_dashboard_session", good)
    csrf = hidden(client.get(approve).text, "csrf_token")
    signal = {"csrf_token": csrf, "signal_id": "dash-" + "1" * 32}
    forms: list[tuple[str, Any]] = [
        (approve, {**signal, "csrf_token": "é" * 40}), (approve, {**signal, "csrf_token": "\x00"}),
        (approve, {**signal, "csrf_token": csrf[:-3]}), (approve, {"signal_id": "dash-é"}),
        (approve, {**signal, "signal_id": "dash-" + "é" * 32}),
        (approve, {**signal, "raise_max_cost": "NaN"}),
        (approve, {**signal, "raise_max_cost": "1e999"}),
        (approve, {**signal, "raise_max_model_calls": "٣"}),
        (approve, {**signal, "request_id": "é\u202e"}),
        ("/login", {"csrf_token": csrf, "operator": "Zoë\u202e\x00", "token": TOKEN}),
        ("/login", {"csrf_token": csrf, "operator": OPERATOR, "token": "tökén"}),
        ("/logout", {"csrf_token": "é"}),
        (approve, b"csrf_token=%ff%fe&signal_id=%ed%a0%80"), (approve, b"\xff\xfe=\xff&&=&"),
        ("/login", b"csrf_token=" + csrf.encode() + b"&operator=%ff&token=%ff"),
    ]  # fmt: skip
    for path, form in forms:
        kind = "application/x-www-form-urlencoded"
        body = form if isinstance(form, bytes) else None
        reply = client.post(path, data=None if body else form, content=body,
                            headers={"content-type": kind} if body else {})  # fmt: skip
        assert 400 <= reply.status_code < 500, (path, form, reply.status_code, reply.text[:300])
    for kind, body in (
        ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form"),
        ("multipart/form-data", b"--x--"),
        ("multipart/form-data; boundary=x", b""),
    ):
        reply = client.post(approve, content=body, headers={"content-type": kind})
        assert 400 <= reply.status_code < 500, (kind, reply.status_code, reply.text[:300])
    assert maker.session_runs("s-malformed")[0].status == "paused"  # nothing was delivered
    assert refunds(ledger_path) == []


@contextlib.contextmanager
def cli_dashboard(command: list[str], env: dict[str, str]) -> Iterator[tuple[Http, list[str]]]:
    """``kuralle-es ... dashboard`` in its own process; SIGTERM must stop it with exit 0."""
    port = _free_port()
    server = subprocess.Popen([*command, "--port", str(port)], env=env, stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
    client = Http(f"http://127.0.0.1:{port}")
    log: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client.request("/login")
                break
            except urllib.error.URLError:
                assert server.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        yield client, log
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=30)
        log.append(stderr)
    assert server.returncode == 0, stderr
    assert f"dashboard on http://127.0.0.1:{port}/" in stderr


def hidden(page: str, name: str) -> str:
    marker = f'name="{name}" value="'
    start = page.index(marker) + len(marker)
    return page[start : page.index('"', start)]


def test_the_kuralle_es_dashboard_command_serves_the_store_and_stops_on_sigterm(
    maker: Maker, open_store: Any, backend: str, ledger_path: Path
) -> None:
    paused = maker.refund_paused("s-cli", "7")
    url = open_store.target if backend == "postgres" else f"sqlite:///{open_store.target}"
    env = {k: v for k, v in os.environ.items() if k != "KURALLE_DASHBOARD_TOKEN"}
    command = [sys.executable, "-m", "kuralle_es.cli", "--store", url, "dashboard"]

    refused = subprocess.run([*command, "--host", "0.0.0.0"], env=env, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 1
    assert "refusing to serve the dashboard on '0.0.0.0' without KURALLE_DASHBOARD_TOKEN" in (
        refused.stderr
    )

    with cli_dashboard(command, env) as (client, log):  # no token: read-only
        status, page = client.request(f"/runs/{paused.run_id}")
        assert status == 200 and paused.run_id in page and "Refund $7.00?" in page
        assert "read-only" in page and 'id="approve"' not in page
        assert client.request(f"/runs/{paused.run_id}/approve", {"csrf_token": "x"})[0] == 403
    # The start line names the store it serves.
    assert f"(read-only: KURALLE_DASHBOARD_TOKEN is unset, store {url}" in log[0]

    # With a token, the command loads the agents (--app default: the refund example)
    # and a decision resumes the run in the dashboard's process.
    with cli_dashboard(command, {**env, "KURALLE_DASHBOARD_TOKEN": TOKEN}) as (client, _):
        form = {"csrf_token": client.csrf(), "operator": OPERATOR, "token": TOKEN}
        assert client.request("/login", form)[0] == 303
        _, confirm = client.request(f"/runs/{paused.run_id}/approve")
        decision = {k: hidden(confirm, k) for k in ("csrf_token", "signal_id", "request_id")}
        status, _ = client.request(f"/runs/{paused.run_id}/approve", decision)
        assert status == 303
        _, page = client.request(f"/runs/{paused.run_id}")
        assert 'id="run-status">finished<' in page
    assert [e["amount_cents"] for e in refunds(ledger_path)] == [700]


# ------------------------------------------------------------------ usage
def _spending_agent(agent_id: str, model_id: str, turns: int, tokens: int) -> Any:
    """A conversation agent whose model reports ``tokens`` input and output tokens
    per answer, and looks an account up once a turn."""
    script: list[ModelResponse] = []
    for n in range(turns):
        call = ToolCallRequest(id=f"c{n}", name="lookup", args={"to": f"acct-{n}", "cents": 1})
        usage = {"input_tokens": tokens, "output_tokens": tokens, "total_tokens": 2 * tokens}
        script += [
            ModelResponse(tool_calls=[call], usage=usage),
            ModelResponse(content=f"done {n}", usage=usage),
        ]
    tool = define_tool("lookup", "Find an account", Payout, lookup)
    return define_agent(agent_id, "spends", ScriptedModel(script, id=model_id), [tool])


def test_the_usage_page_shows_usage_per_agent_and_per_run_and_a_run_shows_its_own(
    browser: webdriver.Chrome,
    serve: Callable[..., Dashboard],
    open_store: Any,
    backend: str,
    tmp_path: Path,
) -> None:
    store = open_store()
    big = Runtime([_spending_agent("planner", "m-big", 2, 100)], store=store)
    small = Runtime([_spending_agent("helper", "m-small", 1, 10)], store=store)

    async def converse(runtime: Runtime, session: str, text: str) -> TurnResult:
        return await runtime.run(session, input=text).result()

    planned = run_sync(converse(big, "u-plan", "plan it"))
    run_sync(converse(big, "u-plan", "and again"))
    helped = run_sync(converse(small, "u-help", "help"))
    assert (planned.status, helped.status) == ("finished", "finished")
    prices = {"m-big": (1.0, 2.0), "m-small": (10.0, 10.0)}
    dashboard = serve(prices=prices)

    # Linked from the overview.
    login(browser, dashboard)
    visit(browser, dashboard.url + "/")
    click_and_wait(browser, "usage-link")
    assert urllib.parse.urlparse(browser.current_url).path == "/usage"

    def cells(row: Any) -> list[str]:
        return [c.text for c in row.find_elements(By.TAG_NAME, "td")]

    # planner: 4 model calls of 100 + 100 tokens, 2 lookups; helper: 2 calls of 10 + 10, 1.
    big_cost, small_cost = (400 * 1.0 + 400 * 2.0) / 1000, (20 * 10.0 + 20 * 10.0) / 1000
    [total] = browser.find_elements(By.CSS_SELECTOR, "#usage-total tbody tr")
    assert cells(total) == ["6", "420", "420", "840", "3", f"{big_cost + small_cost:.4f}"]
    agents = browser.find_elements(By.CSS_SELECTOR, "#usage-agents tbody tr")
    assert [cells(r) for r in agents] == [
        ["planner", "4", "400", "400", "800", "2", f"{big_cost:.4f}"],
        ["helper", "2", "20", "20", "40", "1", f"{small_cost:.4f}"],
    ]
    bars = browser.find_elements(By.CSS_SELECTOR, "#agents-chart rect")
    assert len(bars) == 2
    widths = [float(b.get_attribute("width") or 0) for b in bars]
    assert widths[0] == pytest.approx(440.0) and widths[1] == pytest.approx(22.0)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#runs-chart rect")) == 2
    runs = browser.find_elements(By.CSS_SELECTOR, "#usage-runs tbody tr")
    assert [cells(r)[0] for r in runs] == [planned.run_id, helped.run_id]
    screenshot(browser, "usage.png", tmp_path)

    # The last 24 hours hold every step made just now.
    click_and_wait(browser, "window-24h")
    assert cells(browser.find_element(By.CSS_SELECTOR, "#usage-total tbody tr"))[0] == "6"

    # A run's page from its link shows that run's usage.
    click_and_wait(browser, "#usage-runs a.run-link", By.CSS_SELECTOR)
    assert text_of(browser, "run-id") == planned.run_id
    [own] = browser.find_elements(By.CSS_SELECTOR, "#run-usage tbody tr")
    assert cells(own) == ["4", "400", "400", "800", "2", f"{big_cost:.4f}"]

    # The dashboard command takes its prices from KURALLE_PRICES.
    url = open_store.target if backend == "postgres" else f"sqlite:///{open_store.target}"
    env = {k: v for k, v in os.environ.items() if k != "KURALLE_DASHBOARD_TOKEN"}
    command = [sys.executable, "-m", "kuralle_es.cli", "--store", url, "dashboard"]
    with cli_dashboard(command, {**env, "KURALLE_PRICES": json.dumps(prices)}) as (client, _):
        status, page = client.request(f"/runs/{helped.run_id}")
        assert status == 200 and f'<td class="num">{small_cost:.4f}</td>' in page
    with cli_dashboard(command, env) as (client, _):
        status, page = client.request("/usage")
        assert status == 200 and "KURALLE_PRICES" in page and f"{small_cost:.4f}" not in page


def test_a_run_past_its_budget_is_approved_in_the_browser_with_a_raised_limit(
    browser: webdriver.Chrome, serve: Callable[..., Dashboard], maker: Maker
) -> None:
    paused = maker._turn(
        "s-budget", input="go", kind="flow", flow_name="chatty", budget=Budget(max_model_calls=1)
    )
    assert paused.status == "paused" and paused.waiting_for is not None
    assert paused.waiting_for.name == "__budget"
    dashboard = serve()
    run_url = f"{dashboard.url}/runs/{paused.run_id}"
    login(browser, dashboard, f"/runs/{paused.run_id}")
    click_and_wait(browser, "approve")
    assert browser.current_url == run_url + "/approve"
    field = browser.find_element(By.ID, "raise_max_model_calls")
    assert field.get_attribute("value") == "1"  # the limit the run was held to
    assert browser.find_element(By.ID, "raise_max_total_tokens").get_attribute("value") == ""

    # Not a number: refused, nothing delivered.
    field.clear()
    field.send_keys("lots")
    click_and_wait(browser, "confirm")
    assert "must be a whole number" in browser.page_source
    assert maker.session_runs("s-budget")[0].status == "paused"

    visit(browser, run_url + "/approve")
    field = browser.find_element(By.ID, "raise_max_model_calls")
    field.clear()
    field.send_keys("5")
    click_and_wait(browser, "confirm")
    assert text_of(browser, "run-status") == "finished"
    assert text_of(browser, "outcome") == "said"

    async def budget_steps() -> list[Any]:
        steps = await maker.runtime.get_steps(paused.run_id, "s-budget")
        return [s for s in steps if s.name == "__budget"]

    [decided] = run_sync(budget_steps())
    assert decided.result["approved"] is True
    assert decided.result["raise_to"] == {"max_model_calls": 5}
