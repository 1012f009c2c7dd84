"""The live dashboard, served by the gateway on its own port under /dashboard/.

Why this shape: one static HTML page, one stylesheet and one small script that renders
the JSON view model (gateway/dashboard/model.py) into the DOM, with no build step and no
npm library. The numbers are computed and tested in Python; the script only draws them,
so changing the page means editing one readable file, and the package ships every asset
(nothing is fetched from the network at run time). Updates are pushed with server-sent
events: a page gets the fleet's summary and one page of hosts by its filter (host, model,
state), whole at first, then only what changed (model.PageFeed), so a page never needs a reload,
no message grows with the fleet, and a reconnecting EventSource gets the whole state again
(level-triggered, like the agent).

With API keys, the page asks for one and trades it for a session cookie (gateway/edge/access.py);
its data, stream and assets need it. Read-only; with `--admin-key`, a viewer who enters that key may change the
fleet config from the page, and the change goes through the planner's validated
`config.set` endpoint, exactly as `lanes config set` does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from pathlib import Path

import msgspec
import structlog
from aiohttp import web

from gateway.admission import LaneCounts
from gateway.dashboard.model import EventFeed, HostFilter, PageFeed, dashboard_snapshot, fleet_summary
from gateway.edge import (
    COOKIE, COOKIE_PATH, COOKIE_SECRET, KEY_ID, SESSION_PATH, SESSION_SECONDS, has_keys, key_ids_of, openai_error,
    session_token,
)
from gateway.tenants import digest
from gateway.fleet import FleetView, LaneKey
from shared import subjects
from shared.messages.replies import ConfigSet
from shared.messages.status import LaneEvent
from shared.messages.wire import encode
from shared.supervise import running

log = structlog.get_logger("lanes.dashboard")
STATIC = Path(__file__).with_name("static")
PUSH_SETTLE_SECONDS = 0.1  # a burst of bus changes becomes one push
PUSH_EVERY_SECONDS = 0.5  # pushes at most this often (a large fleet changes all the time)
RATE_SECONDS = 5.0  # requests per second are measured over this


class DashboardHub:
    """Pushes the gateway's FleetView and load, plus lane events and request rates, to every open page."""

    def __init__(self, view: FleetView, counts: LaneCounts) -> None:
        self.view, self.counts = view, counts
        self.events = EventFeed()
        self._rates: dict[LaneKey, float] = {}
        self._last_count: tuple[float, dict[LaneKey, int]] = (time.monotonic(), {})
        self._pages: set[asyncio.Queue[None]] = set()
        self._changed = asyncio.Event()
        self._summary: dict | None = None  # the fleet's summary, until the next change or push (None: make it)
        view.listeners.append(self.changed)

    def snapshot(self, page: HostFilter = HostFilter()) -> dict:
        if self._summary is None:
            self._summary = fleet_summary(self.view, self.counts)
        return dashboard_snapshot(self.view, self.events, self._rates, self.counts, page, self._summary)

    def changed(self, host: str | None = None) -> None:
        self._summary = None
        self._changed.set()

    def on_event(self, data: bytes, subject: str) -> None:
        try:
            event = msgspec.json.decode(data, type=LaneEvent)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("dropped malformed lane event", subject=subject, reason=str(exc))
            return
        self.events.add(event, time.time())
        self.changed()

    async def run(self, stop: asyncio.Event) -> None:
        """Push on every change (settled), and at least every RATE_SECONDS for the request rates."""
        while running(stop):
            try:
                await asyncio.wait_for(self._changed.wait(), RATE_SECONDS)
                await asyncio.sleep(PUSH_SETTLE_SECONDS)
            except asyncio.TimeoutError:
                pass
            self._changed.clear()
            self._update_rates()
            self._broadcast()
            await asyncio.sleep(PUSH_EVERY_SECONDS)

    def _update_rates(self) -> None:
        now = time.monotonic()
        then, before = self._last_count
        if now - then < RATE_SECONDS / 2:
            return
        counts = dict(self.counts.served)  # requests each lane finished, counted by the admission
        self._rates = {key: (n - before.get(key, 0)) / (now - then) for key, n in counts.items()}
        self._last_count = (now, counts)

    def _broadcast(self) -> None:
        """Tell every open page to look again (each renders its own filter's page)."""
        self._summary = None  # its busy slots move without a fleet change
        for queue in list(self._pages):
            if not queue.full():  # a stalled page gets the newest state, not a backlog
                queue.put_nowait(None)

    def subscribe(self) -> asyncio.Queue[None]:
        queue: asyncio.Queue[None] = asyncio.Queue(maxsize=1)
        queue.put_nowait(None)
        self._pages.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[None]) -> None:
        self._pages.discard(queue)


def add_dashboard(app: web.Application, hub: DashboardHub, *, nc_getter, admin_key: str | None = None) -> None:
    """Mount the page, its assets, the state API and the SSE stream under /dashboard/."""

    async def index(_: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def root_redirect(_: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/dashboard/")

    def admins(app: web.Application) -> frozenset[str]:
        return key_ids_of(app, frozenset({"admin"}))  # keys of role admin, beside --admin-key

    async def state(request: web.Request) -> web.Response:
        snap = hub.snapshot(HostFilter.from_query(request.query))
        return web.json_response({**snap, "admin": admin_key is not None or bool(admins(request.app))})

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        page, feed = HostFilter.from_query(request.query), PageFeed()
        queue = hub.subscribe()
        try:
            while True:
                try:
                    await asyncio.wait_for(queue.get(), timeout=15)
                except asyncio.TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                frame = feed.frame(hub.snapshot(page))
                if frame is not None:
                    event, data = frame
                    await response.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
        except ConnectionResetError:
            pass  # the page left (or, with handler cancellation, the handler is cancelled: finally)
        finally:
            hub.unsubscribe(queue)
        return response

    async def session(request: web.Request) -> web.Response:
        """Trade the bearer key (checked by the middleware) for a session cookie: the stream and
        the page's assets are then fetched without the key in any URL (gateway/edge/access.py)."""
        keyed = has_keys(request.app)
        response = web.json_response({"expires_in": SESSION_SECONDS if keyed else None})
        if keyed:
            token = session_token(request.app[COOKIE_SECRET].value, time.time(), request[KEY_ID])
            response.set_cookie(COOKIE, token, max_age=SESSION_SECONDS, path=COOKIE_PATH,
                                httponly=True, samesite="Strict", secure=request.secure)  # fmt: skip
        return response

    async def set_config(request: web.Request) -> web.Response:
        allowed = admins(request.app)
        if admin_key is None and not allowed:
            return openai_error(403, "the dashboard is read-only: start the gateway with --admin-key (or give a key "
                                "role admin in the keys file) to allow changes")  # fmt: skip
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        by_flag = admin_key is not None and hmac.compare_digest(given.encode(), admin_key.encode())
        if not (by_flag or (given and digest(given) in allowed)):
            return openai_error(401, "admin key required")
        try:
            changes = await request.json()
            payload = encode(ConfigSet(changes=changes))
        except (ValueError, TypeError, msgspec.ValidationError) as exc:
            return openai_error(400, f"config change must be a JSON object of key: value ({exc})")
        try:
            reply = await nc_getter().request(subjects.CONFIG_SET, payload, timeout=5)
        except Exception as exc:
            return openai_error(503, f"planner did not answer: {type(exc).__name__}")
        code = (reply.headers or {}).get("Nats-Service-Error-Code")
        if code:  # the planner refused it: its reason, its status
            status = int(code) if code.isdigit() and 400 <= int(code) < 600 else 400
            return openai_error(status, reply.headers.get("Nats-Service-Error", "refused by the planner"))
        return web.json_response({"config": json.loads(reply.data)})

    app.router.add_get("/dashboard", root_redirect)
    app.router.add_get("/dashboard/", index)
    app.router.add_get("/dashboard/api/state", state)
    app.router.add_get("/dashboard/api/stream", stream)
    app.router.add_post("/dashboard/api/config", set_config)
    app.router.add_post(SESSION_PATH, session)
    app.router.add_static("/dashboard/static/", STATIC)

