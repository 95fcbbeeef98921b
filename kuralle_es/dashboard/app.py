"""The dashboard's web app: pages over the views, and an operator's decisions (API).

``create_app(store, runtime_factory, host=..., token=...)`` builds the ASGI
app; ``serve(...)`` runs it with uvicorn. Pages are rendered on the server
(Jinja2 with autoescape, so run data is always text) and change in place as
their runs do: the page's script (``static/live.js``) listens to the run
events (``live``) and swaps the page's live parts (without a script, the page
reloads itself every ``refresh_seconds``); a run's page also shows its stream
live (``static/stream.js`` on the run's Server-Sent Events, docs/streaming.md).
Reads go to the store and its views; the writes are an operator's decisions
and actions (``decisions``, ``actions``), each a call of the library's own
API. The runtime (and with it the user's agents) is built on the first
write, or the first run page an operator opens (it says whether the run's
flow drifted), so the read-only pages never import the user's app.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import (
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._journal.spending import PRICES_ENV, Prices, prices_from_json, validate_prices
from .._journal.store import RunStore
from .._runtime.runtime import Runtime
from .._runtime.streaming import stored_parts
from .._serving import HostGate, Server, UnservedHostError, refuse_open_bind, served_hosts
from ..errors import InvalidArgumentError, KuralleError
from ..http.errors import status_of  # the statuses of the HTTP API's refusals, one mapping
from ..http.sse import EventStream, last_event_id
from ..redaction import loads
from ..shapes import RunState
from ..views import RunViews
from ..views.timeline import read_deliveries
from .actions import ACTIONS, ActionRefused, drifted, perform
from .chat import chat_items
from .decisions import (
    RAISABLE,
    Decision,
    budget_limits,
    deliver,
    new_signal_id,
    raise_to_of,
    valid_signal_id,
)
from .live import heads, positions_text, read_positions, run_events
from .overview import overview, tool_overview, usage_overview
from .search import PAGE_SIZE, Search
from .security import TOKEN_ENV, Gate, Operator
from .security import valid_operator_name as _valid_name
from .timeline import compact_json, pretty_json, timeline_rows

__all__ = ["REFRESH_SECONDS", "RuntimeFactory", "check_bind", "create_app", "serve"]

RuntimeFactory = Callable[[RunStore], Runtime]
logger = logging.getLogger("kuralle_es.dashboard")
Handler = Callable[[Request], Awaitable[Response]]
REFRESH_SECONDS = 5
_FAILED_LOGIN_PAUSE = 0.5
#: How long a stopping dashboard waits for open requests (live streams) to end.
STOP_SECONDS = 2
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self' data:; script-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def check_bind(
    host: str | None, token: str | None, allowed_hosts: Iterable[str] | None = None
) -> frozenset[str]:
    """Refuse to expose run data beyond this machine without a token, or on an interface
    with no host name to answer for; the names it answers for (``served_hosts``)."""
    refuse_open_bind(host, token, server="the dashboard", data="run data", token_env=TOKEN_ENV)
    return served_hosts(host, allowed_hosts)


def _unserved(error: UnservedHostError) -> Response:
    return PlainTextResponse(str(error), status_code=400)


def _when(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if value else "—"


def _when_ms(value: datetime | None) -> str:
    """A journal time to the millisecond: steps of one turn share their second."""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] if value else "—"


def _relative(value: datetime | None) -> str:
    if value is None:
        return ""
    seconds = (value - datetime.now(UTC)).total_seconds()
    span = abs(seconds)
    if span < 90:
        amount = f"{span:.0f} s"
    elif span < 5400:
        amount = f"{span / 60:.0f} min"
    elif span < 172800:
        amount = f"{span / 3600:.1f} h"
    else:
        amount = f"{span / 86400:.1f} days"
    return f"in {amount}" if seconds > 0 else f"{amount} ago"


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("kuralle_es.dashboard", "templates"),
        autoescape=True,  # every template, whatever its name: run data is never markup
        undefined=jinja2.StrictUndefined,
    )
    env.filters["when"] = _when
    env.filters["when_ms"] = _when_ms
    env.filters["relative"] = _relative
    env.filters["pretty"] = pretty_json
    env.filters["compact"] = compact_json
    return Jinja2Templates(env=env)


def _local_path(target: str | None) -> str:
    """Where to go after login: only a path on this site (no open redirect)."""
    if target and target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/"


@dataclass(eq=False)
class _Dashboard:
    """What the pages and actions share: the store, who may read and write, and
    what is made once (the templates), or on first use (the views, the runtime)."""

    store: RunStore
    runtime_factory: RuntimeFactory
    gate: Gate
    refresh_seconds: int
    prices: Prices | None = None
    page_size: int = PAGE_SIZE
    templates: Jinja2Templates = field(default_factory=_templates, init=False)
    _runtime: Runtime | None = field(default=None, init=False)
    _runtime_lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)
    _views: RunViews | None = field(default=None, init=False)

    # ------------------------------------------------------------- plumbing
    def operator(self, request: Request) -> Operator | None:
        return self.gate.operator(request.session)

    def render(
        self,
        request: Request,
        name: str,
        context: dict[str, Any],
        status: int = 200,
        refresh: bool = False,
        live: str | None = None,
    ) -> Response:
        """A page; ``refresh``: one that changes as its runs do, live (``live`` names its
        event stream) or, without a script, by reloading itself."""
        page = {
            "operator": self.operator(request),
            "writable": self.gate.writable,
            "csrf_token": self.gate.csrf_token(request.session),
            "refresh": self.refresh_seconds if refresh else None,
            "live": live,
            "path": request.url.path,
            **context,
        }
        return self.templates.TemplateResponse(request, name, page, status_code=status)

    def problem(self, request: Request, status: int, title: str, detail: str) -> Response:
        return self.render(request, "problem.html", {"title": title, "detail": detail}, status)

    def page(self, handler: Handler) -> Handler:
        """A read page: behind the login whenever there is a token to log in with."""

        async def guarded(request: Request) -> Response:
            if self.gate.writable and self.operator(request) is None:
                target = quote(str(request.url.path), safe="/")
                return RedirectResponse(f"/login?next={target}", status_code=303)
            return await handler(request)

        return guarded

    async def form(
        self, request: Request, needs_operator: bool = True
    ) -> dict[str, str] | Response:
        """The posted form, or the response that refuses it (token first, then CSRF)."""
        if not self.gate.writable:
            return self.problem(
                request, 403, "Read-only dashboard",
                f"This dashboard was started without {TOKEN_ENV}, so it cannot change runs. "
                f"Restart it with {TOKEN_ENV} set to a secret and log in with it.",
            )  # fmt: skip
        if needs_operator and self.operator(request) is None:
            return self.problem(
                request, 401, "Log in first",
                "Changing a run needs the dashboard token: log in on the login page.",
            )  # fmt: skip
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            return self.problem(request, 403, "Refused", "This form was posted from another site.")
        fields = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        if not self.gate.csrf_ok(request.session, fields.get("csrf_token")):
            return self.problem(
                request, 403, "Refused: stale or forged form",
                "The form's CSRF token is missing or wrong. Reload the page and try again.",
            )  # fmt: skip
        return fields

    def views(self) -> RunViews:
        if self._views is None:
            self._views = RunViews(self.store, prices=self.prices)
        return self._views

    async def runtime(self) -> Runtime:
        async with self._runtime_lock:
            if self._runtime is None:
                self._runtime = await asyncio.to_thread(self.runtime_factory, self.store)
            return self._runtime

    async def load(self, run_id: str) -> RunState | None:
        run = await self.store.load_async(run_id)
        if run is None:
            return None
        return run.to_state(await self.store.lease_async(run_id))

    # ---------------------------------------------------------------- pages
    async def index(self, request: Request) -> Response:
        live = await self.live()  # first: what the page reads is at or after it
        search = Search.of(request.query_params)
        context = await overview(self.views(), search, self.page_size)
        return self.render(request, "index.html", {"o": context}, refresh=True, live=live)

    async def tools(self, request: Request) -> Response:
        live = await self.live()
        context = {"tools": await tool_overview(self.views())}
        return self.render(request, "tools.html", context, refresh=True, live=live)

    async def usage(self, request: Request) -> Response:
        live = await self.live()
        window = request.query_params.get("window") or None
        context = {"u": await usage_overview(self.views(), window, datetime.now(UTC))}
        return self.render(request, "usage.html", context, refresh=True, live=live)

    async def run_page(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        live = await self.live(run_id)
        # The stream's offset first: a turn that ends after it is read reloads the page.
        streams = await self.store.stream_log_async(run_id)
        seen = await streams.last_offset(run_id) if streams is not None else 0
        run = await self.store.load_async(run_id, history=True)
        if run is None:
            return self.problem(request, 404, "No such run", f"There is no run {run_id}.")
        deliveries = await asyncio.to_thread(read_deliveries, self.store, run_id)
        delivered = request.query_params.get("delivered", "")
        state = run.to_state(await self.store.lease_async(run_id))
        steps = run.step_records()
        context = {
            "run": state,
            "rows": timeline_rows(steps, deliveries),
            "delivered": valid_signal_id(delivered) and delivered,
            "done": _DONE.get(request.query_params.get("done", "")),
            "usage": await self.views().usage(run_id=run_id),
            "priced": self.prices is not None,
            # What its nodes published (ctx.publish), the latest value of each key.
            "published": {key: loads(text) for key, text in run.published.items()},
            "summary": next(iter(await self.views().list_runs(run_id=run_id, limit=1)), None),
            "chat": chat_items(state, steps),
            "drifted": await self.drifted(request, state),
            "resumable": _resumable(state),
            "signal_id": new_signal_id(),
            "turn_id": new_signal_id(),
            "message_id": new_signal_id(),
            # A parent waiting for its child: the child as it stands (what it waits for).
            "child": await self.child_of(state),
            "stream_seen": seen,
            "stream": True,
        }
        return self.render(request, "run.html", context, refresh=True, live=live)

    async def child_of(self, run: RunState) -> RunState | None:
        wait = run.waiting_for
        if run.status != "paused" or wait is None or wait.child_run_id is None:
            return None
        return await self.load(wait.child_run_id)

    async def chat_page(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        live = await self.live(run_id)
        run = await self.store.load_async(run_id, history=True)
        if run is None:
            return self.problem(request, 404, "No such run", f"There is no run {run_id}.")
        state = run.to_state(await self.store.lease_async(run_id))
        chat = chat_items(state, run.step_records())
        context = {
            "run": state,
            "chat": chat,
            # The approval a tool call waits for is shown on its card, in place.
            "wait_in_place": any(card.waiting for item in chat for card in item.calls),
            "done": _DONE.get(request.query_params.get("done", "")),
            "turn_id": new_signal_id(),
        }
        return self.render(request, "chat.html", context, refresh=True, live=live)

    async def drifted(self, request: Request, run: RunState) -> bool:
        """Whether the run's flow changed, as the app's agents define it: asked only
        for an operator, who may settle it (the runtime imports the user's app)."""
        if self.operator(request) is None or run.active_flow is None:
            return False
        try:
            return drifted(await self.runtime(), run)
        except Exception:  # the app does not load: its actions say so when tried
            return False

    async def events(self, request: Request) -> Response:
        """The run events as server-sent events (``live``); 401 where a login is needed."""
        if self.gate.writable and self.operator(request) is None:
            return PlainTextResponse("log in first", status_code=401)
        run_id = request.query_params.get("run") or None
        partitions = len(self.store.partitions)
        after = read_positions(request.query_params.get("after"), partitions)
        after.update(read_positions(request.headers.get("last-event-id"), partitions))
        headers = {"X-Accel-Buffering": "no"}
        stream = run_events(self.store, run_id, after)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    async def live(self, run_id: str | None = None) -> str:
        """The event stream of a page rendered now: after the events it shows."""
        query = {"run": run_id} if run_id else {}
        return "/events?" + urlencode({**query, "after": positions_text(await heads(self.store))})

    def action(self, name: str) -> Handler:
        """POST: one of an operator's ``ACTIONS`` on the run (token, then CSRF)."""

        async def handler(request: Request) -> Response:
            return await self.act(request, name)

        return handler

    async def act(self, request: Request, name: str) -> Response:
        fields = await self.form(request)
        if isinstance(fields, Response):
            return fields
        operator = self.operator(request)
        assert operator is not None
        for minted in ("signal_id", "turn_id", "message_id"):
            if minted in fields and not valid_signal_id(fields[minted]):
                return self.problem(request, 400, "Refused", f"The form has no valid {minted}.")
        run_id = request.path_params["run_id"]
        run = await self.load(run_id)
        if run is None:
            return self.problem(request, 404, "No such run", f"There is no run {run_id}.")
        try:
            runtime = await self.runtime()
        except Exception as error:  # the user's app failed to load: say so, keep serving
            detail = f"The dashboard could not build its runtime: {type(error).__name__}: {error}"
            return self.problem(request, 503, "Cannot act on runs", detail)
        # The journal keeps no actor for some actions (input, resume, drift): the log does.
        logger.info("dashboard %s run=%s operator=%s", name, run_id, operator.name)
        try:
            await perform(runtime, run, name, operator.name, fields)
        except ActionRefused as error:
            return self.problem(request, 422, "Refused", str(error))
        except KuralleError as error:
            now = await self.load(run_id) or run
            context = {"run": now, "error_type": type(error).__name__, "message": str(error)}
            return self.render(request, "refused.html", context, status_of(error))
        back = "chat" if fields.get("back") == "chat" else ""
        path = f"/runs/{run_id}/chat" if back else f"/runs/{run_id}"
        return RedirectResponse(f"{path}?done={name}", status_code=303)

    async def stream(self, request: Request) -> Response:
        """The run's stored stream, then live, as Server-Sent Events (docs/streaming.md)."""
        run_id = request.path_params["run_id"]
        try:
            start = last_event_id(request.headers.get("last-event-id"), 0)
        except InvalidArgumentError as error:
            return PlainTextResponse(str(error), status_code=400)
        run = await self.store.load_async(run_id)
        if run is None:
            return PlainTextResponse(f"There is no run {run_id}.", status_code=404)
        return EventStream(stored_parts(self.store, run_id, run.session_id, start))

    def decision(self, approve: bool) -> Handler:
        """GET: the confirmation step; POST: the delivery."""

        async def handler(request: Request) -> Response:
            if request.method == "POST":
                return await self.decide(request, approve)
            return await self.confirm(request, approve)

        return handler

    async def confirm(self, request: Request, approve: bool) -> Response:
        if self.operator(request) is None:
            target = quote(str(request.url.path), safe="/")
            return RedirectResponse(f"/login?next={target}", status_code=303)
        run_id = request.path_params["run_id"]
        run = await self.load(run_id)
        if run is None:
            return self.problem(request, 404, "No such run", f"There is no run {run_id}.")
        context = {
            "run": run,
            "approve": approve,
            "signal_id": new_signal_id(),
            # Only an approval is decided here; a run on a timer, a signal or
            # input is shown with what it waits for instead of a form.
            "decidable": run.waiting_for is not None and run.waiting_for.kind == "approval",
            # A spent budget is approved with the limits to raise, filled in with
            # the ones it was held to (docs/usage.md).
            "budget": budget_limits(run) if approve else None,
            "raisable": list(RAISABLE),
        }
        return self.render(request, "confirm.html", context)

    async def decide(self, request: Request, approve: bool) -> Response:
        fields = await self.form(request)
        if isinstance(fields, Response):
            return fields
        operator = self.operator(request)
        assert operator is not None
        run_id = request.path_params["run_id"]
        signal_id = fields.get("signal_id", "")
        if not valid_signal_id(signal_id):
            return self.problem(request, 400, "Refused", "The form has no valid signal id.")
        run = await self.load(run_id)
        if run is None:
            return self.problem(request, 404, "No such run", f"There is no run {run_id}.")
        try:
            raise_to = raise_to_of(fields) if approve else None
        except ValueError as error:
            return self.problem(request, 422, "Refused", str(error))
        decision = Decision(
            run_id=run_id,
            approved=approve,
            operator=operator.name,
            signal_id=signal_id,
            request_id=fields.get("request_id") or None,
            reason=(fields.get("reason") or "").strip()[:500] or None,
            raise_to=raise_to,
        )
        try:
            runtime = await self.runtime()
        except Exception as error:  # the user's app failed to load: say so, keep serving
            detail = f"The dashboard could not build its runtime: {type(error).__name__}: {error}"
            return self.problem(request, 503, "Cannot deliver decisions", detail)
        try:
            await deliver(runtime, run.session_id, decision)
        except KuralleError as error:
            now = await self.load(run_id) or run
            context = {"run": now, "error_type": type(error).__name__, "message": str(error)}
            return self.render(request, "refused.html", context, status_of(error))
        return RedirectResponse(f"/runs/{run_id}?delivered={signal_id}", status_code=303)

    # ---------------------------------------------------------------- login
    async def login(self, request: Request) -> Response:
        target = _local_path(request.query_params.get("next"))
        if request.method == "GET":
            return self.render(request, "login.html", {"next": target, "failed": None})
        fields = await self.form(request, needs_operator=False)
        if isinstance(fields, Response):
            return fields
        target = _local_path(fields.get("next"))
        name = fields.get("operator", "").strip()
        if not self.gate.token_matches(fields.get("token", "")):
            await asyncio.sleep(_FAILED_LOGIN_PAUSE)  # slows guessing down
            failed, status = "That is not the dashboard token.", 401
        elif not _valid_name(name):
            failed, status = "Give your name (letters, digits, spaces, . @ + - _).", 400
        else:
            self.gate.log_in(request.session, Operator(name))
            return RedirectResponse(target, status_code=303)
        return self.render(request, "login.html", {"next": target, "failed": failed}, status)

    async def logout(self, request: Request) -> Response:
        fields = await self.form(request, needs_operator=False)
        if isinstance(fields, Response):
            return fields
        request.session.clear()  # the session cookie goes with it
        return RedirectResponse("/", status_code=303)


class _SecurityHeaders:
    """Adds the headers that keep pages out of frames and scripts out of pages."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(_SECURITY_HEADERS)
            await send(message)

        await self.app(scope, receive, send_with_headers)


#: What a run's page says after each action (``?done=ACTION``): never the request's text.
_DONE = {
    "cancel": "The run was cancelled.",
    "input": "Your answer was delivered.",
    "signal": "The signal was delivered.",
    "in-doubt": "Your answer to the step in doubt was delivered.",
    "message": "The message was sent.",
    "resume": "The run was resumed: recorded steps replayed, the rest ran again.",
    "resolve-drift": "The drift was settled.",
}


def _resumable(run: RunState) -> bool:
    """Whether a resume would drive the run: it is in error, or running with no live
    lease (its worker died)."""
    if run.status == "error":
        return True
    expires = run.lease_expires_at
    return run.status == "running" and (expires is None or expires < datetime.now(UTC))


def create_app(
    store: RunStore,
    runtime_factory: RuntimeFactory,
    *,
    host: str | None = None,
    token: str | None = None,
    allowed_hosts: Iterable[str] | None = None,
    refresh_seconds: int = REFRESH_SECONDS,
    prices: Prices | None = None,
    page_size: int = PAGE_SIZE,
) -> Starlette:
    """The dashboard as an ASGI app; refuses a non-loopback ``host`` without a token.

    ``runtime_factory(store)`` builds the ``Runtime`` (with the user's agents)
    that delivers decisions and actions; it is called once, at the first write
    or the first run page a logged-in operator opens.
    ``prices`` (``{"model-name": (input_per_1k, output_per_1k)}``) give the
    usage page its costs; ``page_size`` is how many runs a page of the front
    page's list shows; ``refresh_seconds`` how often a page reloads itself in a
    browser that runs no script (one that does updates in place, live). It
    answers only requests whose ``Host`` is a loopback name (when ``host`` is
    loopback) or one of ``allowed_hosts`` (default:
    ``KURALLE_ALLOWED_HOSTS``); any other is 400. Without ``host`` it is taken
    as served on loopback, and it answers the names in-process test clients
    send too (``testserver``, ``test``).
    """
    hosts = check_bind(host, token, allowed_hosts)
    gate = Gate(token)
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        msg = f"page_size must be a positive integer, got {page_size!r}"
        raise InvalidArgumentError(msg)
    dash = _Dashboard(
        store, runtime_factory, gate, refresh_seconds, validate_prices(prices), page_size
    )
    routes = [
        Route("/", dash.page(dash.index)),
        Route("/tools", dash.page(dash.tools)),
        Route("/usage", dash.page(dash.usage)),
        Route("/runs/{run_id}", dash.page(dash.run_page)),
        Route("/runs/{run_id}/stream", dash.page(dash.stream)),
        Route("/runs/{run_id}/approve", dash.decision(True), methods=["GET", "POST"]),
        Route("/runs/{run_id}/deny", dash.decision(False), methods=["GET", "POST"]),
        Route("/runs/{run_id}/chat", dash.page(dash.chat_page)),
        *(
            Route(f"/runs/{{run_id}}/{name}", dash.action(name), methods=["POST"])
            for name in ACTIONS
        ),
        Route("/events", dash.events),
        Route("/login", dash.login, methods=["GET", "POST"]),
        Route("/logout", dash.logout, methods=["POST"]),
        Mount("/static", StaticFiles(packages=[("kuralle_es.dashboard", "static")])),
    ]
    middleware = [
        Middleware(_SecurityHeaders),
        Middleware(HostGate, hosts=hosts, refuse=_unserved),
        gate.session_middleware(),
    ]
    return Starlette(routes=routes, middleware=middleware)


async def serve(
    store: RunStore,
    runtime_factory: RuntimeFactory,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    *,
    allowed_hosts: Iterable[str] | None = None,
    store_label: str | None = None,
    prices: Prices | None = None,
) -> None:
    """Serve the dashboard until SIGINT/SIGTERM; ``token`` defaults to the environment's,
    ``allowed_hosts`` to ``KURALLE_ALLOWED_HOSTS``. ``store_label`` (no password in it)
    names the store on the start line; ``prices`` default to ``KURALLE_PRICES`` (JSON:
    model -> [input_per_1k, output_per_1k])."""
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    if prices is None and os.environ.get(PRICES_ENV):
        prices = prices_from_json(os.environ[PRICES_ENV])
    app = create_app(
        store, runtime_factory, host=host, token=token, allowed_hosts=allowed_hosts,
        prices=prices,
    )  # fmt: skip
    mode = "approve/deny need a login" if token else f"read-only: {TOKEN_ENV} is unset"
    over = f", store {store_label}" if store_label else ""
    print(f"kuralle-es: dashboard on http://{host}:{port}/ ({mode}{over})", file=sys.stderr)
    # A page's live stream stays open: a stop waits that long for it at most.
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", server_header=False,
        timeout_graceful_shutdown=STOP_SECONDS,
    )  # fmt: skip
    await Server(config).serve()
