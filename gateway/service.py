"""Running a gateway: the fleet read from NATS, lanes probed, the HTTP app served.

Stateless: everything it knows comes from the lanes bucket (plans, status, reports,
config), so any number of gateways can run behind one load balancer. It writes nothing
to the bucket. The one message it sends is the dashboard's fleet config change, a
`config.set` request to the planner, and only when started with --admin-key; the
read-only `gateway` user of docker/nats/auth.conf may not send even that, so a gateway
with an admin key needs a NATS user that may.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import aiohttp
import msgspec
import structlog
from aiohttp import web
from nats.js.errors import KeyWrongLastSequenceError

from gateway import fleet
from gateway.admission import Admission, Waker, activity, persona_of
from gateway.dashboard import DashboardHub, add_dashboard
from gateway.edge import COOKIE_SECRET, KEYS, METRICS, USAGE, admission_for, build_app
from gateway.fleet import FleetView, LaneKey, LaneRoute
from gateway.settings import GatewaySettings
from gateway.sync import HotSpots, SharedView, SlotsFeed, share_usage
from shared import defaults, subjects
from shared.bus import connect, kv_bucket, quietly, run_until, secrets_bucket, watch_forever
from shared.heap import give_back_freed
from shared.nats_auth import NatsAuth
from shared.lane_secrets import fingerprint
from shared.llama.endpoints import connect_host
from shared.messages.activity import GatewayActivity, ModelWake, TenantActivity
from shared.messages.status import LaneEvent, SessionSecret
from shared.messages.wire import decode, encode
from shared.supervise import Loops, running

log = structlog.get_logger("lanes.gateway")

WATCHED_KEYS = ">"


def instance_name() -> str:
    """This gateway process among its replicas: host (a container's is its own) and pid."""
    return subjects.host_token(f"{socket.gethostname().split('.')[0]}-{os.getpid()}")
SHUTDOWN_GRACE = 10.0  # plans, status, reports and config: one watch, dispatched by key


@dataclass
class Gateway:
    settings: GatewaySettings = GatewaySettings()
    view: FleetView = field(default_factory=FleetView)
    app: web.Application = field(init=False)
    admission: Admission = field(init=False)  # its counts are the gateway's load
    url: str = ""  # http://host:port once serving
    started: asyncio.Event = field(default_factory=asyncio.Event)
    dashboard: DashboardHub = field(init=False)
    nc: object | None = None  # the NATS connection once made (the dashboard's admin changes use it)
    waker: Waker = field(init=False)  # requests held while their model loads
    slots: SlotsFeed = field(init=False)  # each lane's /slots as its agent read it: its load, whether its loop answers
    gateway_id: str = ""
    shared: SharedView | None = None  # the prefix index shared with the other gateways (settings.shared_prefix)
    loops: Loops = field(default_factory=lambda: Loops("gateway"))  # its supervised loops (shared.supervise)
    probe_misses: dict[LaneKey, int] = field(default_factory=dict)  # its /health misses in a row (gateway/fleet/probe.py)
    probe_next: int = 0  # where the next probe round starts, in a fleet of more lanes than one round probes
    secrets_kv: object | None = None  # bucket lanes-secrets once open (a missing lane key is read at once)

    def __post_init__(self) -> None:
        self.admission = admission_for(self.view, self.settings)
        self.waker = Waker(self.view, max_held=self.settings.queue_depth, publish=self.publish_wake)
        self.instance = f"{instance_name()}-{id(self) % 10000}"  # this gateway among its replicas
        self.gateway_id = subjects.gateway_tokens(self.settings.gateway_id or self.instance)
        self.app = build_app(self.view, self.settings, admission=self.admission, waker=self.waker)
        self.app[METRICS].registry.register(self.loops)
        self.dashboard = DashboardHub(self.view, self.admission.counts)
        if self.settings.shared_prefix and self.settings.affinity:
            self.shared = SharedView(self.admission, self.gateway_id, kv_events=self.settings.kv_events)
        self.slots = SlotsFeed(self.admission, self.settings.slots_stall_after)
        add_dashboard(self.app, self.dashboard, nc_getter=lambda: self.nc, admin_key=self.settings.admin_key)

    async def publish_wake(self, name: str) -> None:
        """Ask the planner to load `name` (one wake per model; repeated while requests are held)."""
        if self.nc is None or not self.nc.is_connected:
            return
        await self.nc.publish(subjects.wake_subject(name), encode(ModelWake(name=name, gateway=self.gateway_id)))

    async def publish_activity(self) -> None:
        if self.nc is None or not self.nc.is_connected:
            return
        now = time.monotonic()  # the loop's clock too: queue waits are measured on it
        models = activity(self.view, self.admission.counts, self.waker.counts(), self.waker.last_request,
                                 now, self.admission.take_queue_waits(now))  # fmt: skip
        models = tuple(msgspec.structs.replace(m, tenants=self._tenants_of(m.name)) for m in models)
        msg = GatewayActivity(gateway=self.gateway_id, interval=self.settings.activity_interval, models=models)
        await self.nc.publish(subjects.activity_subject(self.gateway_id), encode(msg))

    def _tenants_of(self, name: str) -> tuple[TenantActivity, ...]:
        """Whose requests a model's activity is (in flight, queued), so the planner sees whose demand it is."""
        counts, keys = self.admission.counts, self.app[KEYS]
        known = keys.table.tenants() if keys is not None else {}
        flying: dict[str, int] = {}
        queued: dict[str, int] = {}
        for table, into in ((counts.tenant_in_flight, flying), (counts.tenant_queued, queued)):
            for (asked, t), n in table.items():
                if persona_of(self.view, asked) == name:
                    into[t] = into.get(t, 0) + n
        return tuple(TenantActivity(tenant=t, priority=known[t].priority if t in known else 0,
                                    in_flight=flying.get(t, 0), queued=queued.get(t, 0))
                     for t in sorted(set(flying) | set(queued)))  # fmt: skip

    async def on_entry(self, key: str, value: bytes | None, revision: int) -> None:
        problem = self.view.apply_entry(key, value)
        if problem:
            log.warning("bad entry dropped", reason=problem)
        elif key.startswith("status.") and self.secrets_kv is not None:
            await self._fetch_missing_keys(key)

    async def _fetch_missing_keys(self, status_key: str) -> None:
        """A lane of the host whose status just came that names a key this gateway does not hold yet
        (restarted just now): read it from the bucket at once rather than wait for the secrets watch.
        That host's lanes only: a walk of the fleet for each status read made a gateway reading
        10,000 hosts spin for minutes (bench/gateway_idle.py)."""
        for lane in self.view.host_lanes(status_key.partition(".")[2]):
            held = fingerprint(lane.api_key) if lane.api_key else ""
            if lane.key_id and lane.state == "healthy" and held != lane.key_id:
                key = subjects.lane_secret_key(lane.host_id, lane.lane_id)
                try:
                    entry = await asyncio.wait_for(self.secrets_kv.get(key), 2.0)
                except Exception as exc:
                    log.info("lane key not read yet", lane=lane.lane_id, error=str(exc) or type(exc).__name__)
                    continue
                await self.on_secret(key, entry.value, entry.revision or 0)

    async def on_secret(self, key: str, value: bytes | None, revision: int) -> None:
        if key == subjects.SESSION_SECRET_KEY:
            self._session_secret(value)
            return
        problem = self.view.apply_secret(key, value)
        if problem:
            log.warning("bad lane key dropped", reason=problem)

    def _session_secret(self, value: bytes | None) -> None:
        """The fleet's cookie secret: from now on this gateway signs and checks with it."""
        if value is None:
            return  # deleted (a NATS server that lost it): keep ours; the next gateway to catch up puts one
        try:
            secret = msgspec.json.decode(value, type=SessionSecret)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("bad session secret dropped", reason=str(exc))
            return
        if self.app[COOKIE_SECRET].adopt(secret.secret):
            log.info("dashboard sessions signed with the fleet's secret")

    async def share_session_secret(self, bucket) -> None:
        """Once the secrets are read: where no gateway has put one, ours becomes the fleet's
        (create: the first gateway wins; the others take it from the watch)."""
        if self.app[COOKIE_SECRET].shared:
            return
        try:
            await bucket.create(subjects.SESSION_SECRET_KEY, encode(SessionSecret(secret=self.app[COOKIE_SECRET].text())))
        except KeyWrongLastSequenceError:
            pass  # another gateway's came first: the watch brings it
        except Exception as exc:
            log.info("session secret not shared", error=str(exc) or type(exc).__name__)

    def slots_moved(self, data: bytes) -> None:
        """A lane took another's saved slots (launcher_agent/slot_moves.py): route those
        conversations to it. A bad event is logged and dropped."""
        try:
            event = decode(data, LaneEvent)
        except ValueError as exc:
            log.warning("lane event dropped", reason=str(exc)[:200])
            return
        if event.event != "slots_received" or event.from_host is None or event.from_lane is None:
            return
        source, target, index = (event.from_host, event.from_lane), (event.host_id, event.lane_id), self.admission.index
        # A hot lane's spread: just the conversations moved (by their slots' tokens); a lane that left: all.
        copied = index.spread(source, target, event.moved_tokens) if event.moved_tokens else index.copy(source, target)
        log.info("conversations follow their slots", source=f"{event.from_host}/{event.from_lane}",
                 target=f"{event.host_id}/{event.lane_id}", chunks=copied, spread=bool(event.moved_tokens))  # fmt: skip

    async def on_caught_up(self) -> None:
        give_back_freed()  # the read's raw entries, decoded now (a whole bucket after each resync)
        if not self.view.synced:
            log.info("fleet read from NATS", lanes=len(self.view.lanes()))
            if self.nc is not None:  # the lanes are known now: every agent says their load again
                await quietly(lambda: self.nc.publish(subjects.LOAD_ASK, b""))()
        self.view.mark_synced()

    async def probe_once(self, session: aiohttp.ClientSession) -> None:
        targets, self.probe_next = fleet.this_round(*self.view.probe_groups(), self.probe_next,
                                                    self.settings.probe_budget)  # fmt: skip
        if targets:
            await asyncio.gather(*(self._probe(session, lane) for lane in targets))

    async def _probe(self, session: aiohttp.ClientSession, lane: LaneRoute) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.probe_timeout)
        outcome: fleet.Outcome = "ok"
        try:
            async with session.get(lane.url + "/health", timeout=timeout) as resp:
                if resp.status != 200:
                    outcome, reason = "slow", f"/health answered {resp.status}"
        except asyncio.TimeoutError:
            outcome, reason = "slow", f"/health: no answer within {self.settings.probe_timeout:g} s"
        except aiohttp.ClientConnectorError as exc:  # not connected at all: out at once
            outcome, reason = "unreachable", f"/health: {type(exc).__name__} {exc}".strip()
        except aiohttp.ClientError as exc:  # connected, then cut (a pooled connection the lane closed): a miss
            outcome, reason = "slow", f"/health: {type(exc).__name__} {exc}".strip()
        verdict = fleet.judge(outcome, self.probe_misses.get(lane.key, 0))
        self.probe_misses[lane.key] = verdict.misses
        if verdict.back:
            self.view.mark_reachable(lane.key)
        elif verdict.out:
            self.view.mark_unreachable(lane.key, reason)


async def _probe_loop(gw: Gateway, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while running(stop):
            await gw.probe_once(session)  # a failure ends the loop: its supervisor logs, counts, restarts it
            try:
                await asyncio.wait_for(stop.wait(), gw.settings.probe_interval)
            except asyncio.TimeoutError:
                pass


async def _demand_loop(gw: Gateway, stop: asyncio.Event) -> None:
    """Repeat wakes for held requests, and tell the planner what each model is doing."""
    next_activity = 0.0
    while running(stop):
        # A failure ends the loop: its supervisor (shared.supervise) logs, counts and restarts it.
        for name in gw.waker.wanted():
            await gw.waker.wake(name)
        if time.monotonic() >= next_activity:
            await gw.publish_activity()
            next_activity = time.monotonic() + gw.settings.activity_interval
        try:
            await asyncio.wait_for(stop.wait(), min(gw.settings.wake_repeat, gw.settings.activity_interval))
        except asyncio.TimeoutError:
            pass


async def _keys_loop(gw: Gateway, stop: asyncio.Event) -> None:
    """Reread the keys file when it changes; a malformed one keeps the last good keys (one log line)."""
    keys = gw.app[KEYS]
    while running(stop):
        said = keys.check() if keys is not None else None  # no keys file: nothing to reread
        if said:
            (log.warning if keys.error else log.info)("keys file", detail=said)
        try:
            await asyncio.wait_for(stop.wait(), defaults.KEYS_REREAD)
        except asyncio.TimeoutError:
            pass


OPEN_WARNING_EVERY = 3600.0  # seconds between the warnings of a gateway serving anyone without a key


async def _open_warning(gw: Gateway, stop: asyncio.Event) -> None:
    """A gateway started with --no-auth beyond loopback says so at start and every hour, so
    nobody forgets that anyone who reaches it is served."""
    while running(stop):
        log.warning("serving without keys: anyone who reaches this gateway is served (--no-auth)",
                    host=gw.settings.host, url=gw.url)  # fmt: skip
        try:
            await asyncio.wait_for(stop.wait(), OPEN_WARNING_EVERY)
        except asyncio.TimeoutError:
            pass


async def _bus_side(gw: Gateway, servers: str, auth: NatsAuth, stop: asyncio.Event, stack: AsyncExitStack) -> None:
    resync, secrets_resync = asyncio.Event(), asyncio.Event()

    async def on_reconnect() -> None:
        resync.set()
        secrets_resync.set()
        await quietly(lambda: nc.publish(subjects.LOAD_ASK, b""))()  # loads sent meanwhile are lost

    while running(stop):
        try:
            nc = await connect(servers, name="lanes-gateway", auth=auth, on_reconnect=on_reconnect,
                               inbox_prefix=subjects.gateway_inbox(gw.gateway_id))  # fmt: skip
            break
        except Exception as exc:
            log.warning("nats not reachable; retrying", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(1.0)
    else:
        return
    stack.push_async_callback(quietly(nc.close))
    gw.nc = nc
    gw.admission.on_hot = HotSpots(nc, gw.view).overflowed

    async def on_event(msg) -> None:  # nats-py takes coroutine callbacks only
        gw.dashboard.on_event(msg.data, msg.subject)
        if msg.subject.endswith(".slots_received"):
            gw.slots_moved(msg.data)

    async def on_load(msg) -> None:
        gw.slots.take(msg.data)

    await nc.subscribe(subjects.ALL_EVENTS, cb=on_event)
    await nc.subscribe(subjects.ALL_LOAD, cb=on_load)
    await nc.publish(subjects.LOAD_ASK, b"")  # every agent says its lanes' load at its next read
    replicas = gw.settings.kv_replicas or await _replicas(nc)
    loops = gw.loops
    # Every loop supervised, and awaited here: one that gives up ends the service (exit 1), so
    # none stops for good while the gateway runs on without it.
    tasks = [
        loops.task("watch", lambda: _watch_fleet(gw, nc, resync, stop), stop),
        loops.task("secrets", lambda: _follow_secrets(gw, nc, secrets_resync, stop), stop),
        loops.task("usage", lambda: share_usage(nc, gw.app[USAGE], gw.admission, gw.gateway_id, stop,
                                                replicas=replicas), stop),  # fmt: skip
    ]
    if gw.shared is not None:
        gw.shared.gateway_id = gw.gateway_id
        tasks.append(loops.task("prefix", lambda: gw.shared.start(nc, replicas), stop))
    await run_until(stop, tasks)


async def _watch_fleet(gw: Gateway, nc, resync: asyncio.Event, stop: asyncio.Event) -> None:
    """Plans, status, reports and config (bucket lanes, one watch) into the view."""
    kv = await _bucket(lambda: kv_bucket(nc), "lanes", stop)
    if kv is not None:
        await watch_forever(kv, WATCHED_KEYS, gw.on_entry, resync=resync, stop=stop, on_caught_up=gw.on_caught_up)


async def _replicas(nc) -> int:
    """The cluster's replica count, as the planner made the lanes bucket (--kv-replicas): the
    gateways' usage bucket and prefix stream follow it (1 where the planner has not made it yet)."""
    try:
        info = await nc.jetstream(timeout=5).stream_info(f"KV_{subjects.BUCKET}")
        return max(1, info.config.num_replicas or 1)
    except Exception as exc:
        log.info("replicas of the lanes bucket not read; 1", error=str(exc) or type(exc).__name__)
        return 1


async def _follow_secrets(gw: Gateway, nc, resync: asyncio.Event, stop: asyncio.Event) -> None:
    """Every lane's key (bucket lanes-secrets, which only gateways may read), into the view."""
    bucket = await _bucket(lambda: secrets_bucket(nc), subjects.SECRETS_BUCKET, stop)
    gw.secrets_kv = bucket
    if bucket is not None:
        await watch_forever(bucket, subjects.ALL_SECRETS, gw.on_secret, resync=resync, stop=stop,
                            on_caught_up=lambda: gw.share_session_secret(bucket))  # fmt: skip


async def _bucket(open_bucket, name: str, stop: asyncio.Event):
    """A bucket the planner makes, once it has (None: stopped first)."""
    while running(stop):
        try:
            return await open_bucket()
        except Exception as exc:
            log.info(f"waiting for the {name} bucket (is the planner up?)", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(1.0)
    return None


async def run_gateway(
    servers: str,
    stop: asyncio.Event,
    auth: NatsAuth = NatsAuth(),
    settings: GatewaySettings = GatewaySettings(),
    gateway: Gateway | None = None,
) -> None:
    """Serve until `stop` is set. Pass a Gateway to reach its view and app (tests, dashboard)."""
    gw = gateway or Gateway(settings)
    if auth.user and not gw.settings.gateway_id:
        # Its NATS user, then this instance (replicas share a user: `--scale gateway=3`): auth.conf
        # lets user G publish activity and usage under G.* only, so a user cannot report as another.
        gw.gateway_id = f"{subjects.host_token(auth.user)}.{gw.instance}"
    # On stop: no new connections, and requests in flight get SHUTDOWN_GRACE seconds to finish.
    # handler_cancellation: a client that hangs up cancels its handler, so it leaves the queue
    # (admission), stops being held for a loading model (waking) and closes its connection to
    # the lane, which then stops generating and frees the slot (gateway/edge/forward.py, gateway/edge/relay.py).
    # keepalive_timeout: aiohttp closes a connection still without a whole request head this long
    # after it opened or after its last answer (its default is an hour): the header deadline.
    runner = web.AppRunner(gw.app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE, handler_cancellation=True,
                           keepalive_timeout=gw.settings.client_timeout)  # fmt: skip
    await runner.setup()
    tls = gw.settings.tls_context()
    site = web.TCPSite(runner, gw.settings.host, gw.settings.port, ssl_context=tls)
    await site.start()
    port = runner.addresses[0][1]
    gw.url = f"{'https' if tls else 'http'}://{connect_host(gw.settings.host)}:{port}"
    gw.started.set()
    log.info("gateway serving", url=gw.url)
    try:
        async with AsyncExitStack() as stack:
            loops = gw.loops
            tasks = [
                asyncio.create_task(_bus_side(gw, servers, auth, stop, stack)),  # its loops are supervised
                loops.task("probe", lambda: _probe_loop(gw, stop), stop),
                loops.task("demand", lambda: _demand_loop(gw, stop), stop),
                loops.task("slots", lambda: gw.slots.forever(stop), stop),
                loops.task("dashboard", lambda: gw.dashboard.run(stop), stop),
                loops.task("keys", lambda: _keys_loop(gw, stop), stop),
            ]
            if gw.settings.open_beyond_loopback():
                tasks.append(loops.task("open", lambda: _open_warning(gw, stop), stop))
            await run_until(stop, tasks)
    finally:
        await runner.cleanup()
