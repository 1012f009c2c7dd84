"""The planner service: watches the lanes KV bucket, replans on change, writes plans.

Everything it knows comes from KV (config, demand, host reports, host status and
the plans themselves), so a restarted planner picks up exactly where it was.
Plans are written with compare-and-set on the key's revision, and only by the
planner holding the lease (planner_svc/lease.py); any others stand by, follow the
bucket and answer the same endpoints (planner_svc/endpoints.py). Hosts that fall silent are `lost`: their plan
is kept (a partitioned host keeps serving), fleet-wide lanes are placed elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from contextlib import AsyncExitStack

import msgspec
import structlog
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError, KeyValueError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from planner_svc import endpoints, plan_writes, rollout
from planner_svc.fleet_pages import hosts_value, models_value
from planner_svc.lease import DEFAULT_TTL, Lease
from planner_svc.metrics import PlannerMetrics
from planner_svc.state import PlannerState
from shared import defaults, subjects
from shared.bus import (
    connect,
    kv_bucket,
    leader_view,
    quietly,
    run_until,
    secrets_bucket,
    slots_stream,
    until_made,
    watch_forever,
)
from shared.llama.flags import cache_pair
from shared.messages.activity import GatewayActivity, ModelWake
from shared.messages.plans import HostPlan
from shared.messages.status import PlanRejected
from shared.messages.wire import encode
from shared.metrics_http import serve_metrics
from shared.nats_auth import NatsAuth
from shared.supervise import Loops, running

log = structlog.get_logger("lanes.planner")

SETTLE_SECONDS = 0.005  # a burst of changes (a config set, many reports) becomes one replan
WRITE_CONCURRENCY = 64


def same_plan(stored: HostPlan | None, new: HostPlan) -> bool:
    """Whether a new plan says what the stored one says, whoever planned it: a restarted planner
    (another process, another id) rewrote every plan of the fleet under a new revision, the same
    lanes (test_compose_live's planner restart, when the container's planner came up under
    another pid)."""
    return stored is not None and stored == msgspec.structs.replace(new, planned_by=stored.planned_by)


def settle_for(last_replan: float, since_last_end: float) -> float:
    """Seconds a change waits before its replan: a burst settles into one replan, and a big fleet
    rests as long as its last replan took, so the planner never spends more than half its time
    planning; counted from when that replan ended, so a change after a quiet spell (an operator's
    `config set`) starts at once. Counted from the change, a 10,000-host config change waited
    1.4 s for nothing (bench/fleet_scale.py)."""
    return max(SETTLE_SECONDS, last_replan - since_last_end)
SLOTS_STREAM_TRIES_FOR = 30.0  # seconds: a cluster still electing its leader; past that, a lasting refusal
LOGGED_WRITES = 100  # a replan writing more plans logs one line for them all (each host's at debug)


def planner_id() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"



class PlannerService:
    def __init__(self, nc: Client, kv: KeyValue, lease_ttl: float = DEFAULT_TTL, name: str | None = None) -> None:
        self.nc, self.kv = nc, kv
        self.leader_kv = leader_view(kv)  # reads that no replica still catching up answers
        self.state = PlannerState()
        self.state.following = True  # until the lease is ours
        self.dirty = asyncio.Event()
        self.resync = asyncio.Event()
        self.ready = asyncio.Event()
        self.last_replan_seconds = 0.0
        self.last_replan_end = 0.0  # monotonic, when the last replan's writes were done
        self.id = name or planner_id()
        self.lease = Lease(kv, self.id, ttl=lease_ttl, on_change=self._on_lease)
        self.state.planner_id = self.id
        self.lease.on_holder = lambda holder: setattr(self.state, "leader", holder)
        self.replans = 0
        self._models_written: bytes | None = None
        self.loops = Loops("planner")
        self.desired: dict[str, HostPlan] = {}  # plans with changes that wait for their turn (rollout.py)
        self.failed_at: dict[tuple[str, str, float], tuple[str, int]] = {}  # lanes a change broke, at which config
        self.metrics = PlannerMetrics(self)
        self.metrics.registry.register(self.loops)

    async def _on_lease(self, active: bool) -> None:
        self.state.following = not active
        if active:  # plan everything once: the last holder may have died mid-change
            self.state.replan_all = True
            self.dirty.set()

    async def on_rejected(self, rejection: PlanRejected) -> None:
        log.warning("agent rejected its plan", host=rejection.host_id, reason=rejection.reason)
        if self.state.apply_rejection(rejection):
            self.dirty.set()

    async def on_wake(self, wake: ModelWake) -> None:
        self.state.demand_state, woke = self.state.note_wake(wake.name)
        if woke:
            log.info("model woken", model=wake.name, gateway=wake.gateway)
            self.dirty.set()

    async def on_activity(self, activity: GatewayActivity) -> None:
        self.state.demand_state, replan = self.state.note_activity(activity)
        if replan:
            self.dirty.set()

    async def publish_models(self) -> None:
        """Put the `models` key (every servable model's load state) when it changed."""
        if not (self.ready.is_set() and self.lease.holds()):
            return
        states, self.state.demand_state = self.state.model_states()
        data = encode(models_value(states))
        if data == self._models_written:
            return
        try:
            await self.kv.put(subjects.MODELS_KEY, data)
            self._models_written = data
        except Exception as exc:
            log.info("models not published", error=str(exc) or type(exc).__name__)

    async def liveness_loop(self, stop: asyncio.Event, every: float = 1.0) -> None:
        written: bytes | None = None
        while running(stop):
            if self.state.check_liveness():
                self.dirty.set()
            self.state.demand_state, due = self.state.demand_due()
            if due:
                self.dirty.set()
            await self.publish_models()
            hosts = encode(hosts_value(self.state.liveness()))
            if hosts != written and self.ready.is_set() and self.lease.holds():
                try:
                    await self.kv.put(subjects.HOSTS_KEY, hosts)
                    written = hosts
                except Exception as exc:
                    log.info("hosts not published", error=str(exc) or type(exc).__name__)
            try:
                await asyncio.wait_for(stop.wait(), every)
            except TimeoutError:
                pass

    # ------------------------------------------------------------ watch + replan

    async def _on_entry(self, key: str, value: bytes | None, revision: int) -> None:
        if self.state.apply(key, value, revision):
            self.dirty.set()

    async def _on_caught_up(self) -> None:
        self.state.caught_up = True
        self.state.replan_all = True
        self.ready.set()
        self.dirty.set()

    async def replan_loop(self, stop: asyncio.Event) -> None:
        while running(stop):
            await self.dirty.wait()
            await asyncio.sleep(settle_for(self.last_replan_seconds, time.monotonic() - self.last_replan_end))
            self.dirty.clear()
            if not self.ready.is_set() or not self.lease.holds():
                continue  # a stand-by plans nothing; taking the lease over sets dirty again
            try:
                await self.write_plans()
            except Exception as exc:  # NATS down: plan everything again once it is back
                log.warning("replan failed; will retry", error=str(exc) or type(exc).__name__)
                self.state.replan_all = True
                await asyncio.sleep(1.0)
                self.dirty.set()

    async def write_plans(self) -> None:
        started = time.monotonic()
        try:
            plans, outcome, buddies = await asyncio.to_thread(self.state.planning_job())
        except BaseException:
            self.state.replan_all = True  # the job's hosts were taken off the list: plan all again
            raise
        planned = time.monotonic()
        self.state.demand_state = self.state.settle_demand(outcome)
        plans = self._paced(plans)
        plans.update({h: p for h, p in buddies.items() if h not in self.desired and h not in plans})
        self.last_replan_seconds = time.monotonic() - started
        self.replans += 1
        self.metrics.replan_seconds.observe(self.last_replan_seconds)
        todo = [(h, p) for h, p in plans.items() if not (self.state.plan_stored.get(h) and same_plan(self.state.plans.get(h), p))]
        limit = asyncio.Semaphore(WRITE_CONCURRENCY)

        quiet = len(todo) > LOGGED_WRITES  # one line for a fleet-wide change, not one per host

        async def write(host: str, new: HostPlan) -> None:
            async with limit:
                await self._write_plan(host, new, quiet)

        # Hosts' plans are independent keys: write them side by side, not one round trip each.
        paced = time.monotonic()
        await asyncio.gather(*(write(h, p) for h, p in todo))
        written = time.monotonic()
        await self.publish_models()
        self.last_replan_end = time.monotonic()
        if quiet:
            log.info("plans written", hosts=len(todo), planned=len(plans), planning_s=round(planned - started, 3),
                     pacing_s=round(paced - planned, 3), writing_s=round(written - paced, 3),
                     models_s=round(time.monotonic() - written, 3))  # fmt: skip

    def _paced(self, plans: dict[str, HostPlan]) -> dict[str, HostPlan]:
        """Fleet-wide changes paced per model (planner_svc/rollout.py). Hosts whose change waits for
        its turn are kept and looked at again at every replan (a lane's status coming healthy
        replans its host): their turn may come when another host's lane serves again."""
        s = self.state
        self.desired.update(plans)
        for host in [h for h in self.desired if h not in s.reports]:
            del self.desired[host]
        wanted = {h: p for h, p in self.desired.items() if h not in s.lost}
        broken = rollout.failures(s.statuses)
        self.failed_at = {key: self.failed_at.get(key, (model, s.config_revision)) for key, model in broken.items()}
        out = rollout.paced(wanted, s.plans, s.statuses, s.config.max_unavailable, s.lost, s.rejected, self.failed_at)
        for host, plan in out.items():
            if plan is wanted[host]:
                del self.desired[host]  # nothing of it waits
        return out

    async def _write_plan(self, host: str, new: HostPlan, quiet: bool = False) -> None:
        """Compare-and-set one host's plan; a lost race replans. quiet: logged at debug (one of many)."""
        key = subjects.plan_key(host)
        if not self.lease.holds():
            return  # the lease passed on while planning: the new holder plans
        new, before, expected = plan_writes.begin(self.state, host, new)
        written = False
        try:
            if expected:
                rev = await self.kv.update(key, encode(new), last=expected)
            else:
                rev = await self.kv.create(key, encode(new))
            written = True
        except (KeyWrongLastSequenceError, KeyValueError) as exc:
            log.info("plan write lost compare-and-set; replanning", host=host, error=str(exc))
        finally:
            if not written:
                plan_writes.lost(self.state, host, before)
                self.dirty.set()
        if not written:
            await self.read_latest(key)
            return
        plan_writes.won(self.state, host, new, rev)
        (log.debug if quiet else log.info)(
            "plan written",
            host=host,
            plan_revision=new.plan_revision,
            lanes=[f"{s.lane_id}:{s.ctx_per_slot}x{s.parallel}:{cache_pair(s.cache_type_k, s.cache_type_v)}" for s in new.lanes],
        )

    async def read_latest(self, key: str) -> None:
        """After a lost compare-and-set, fold in the key's latest entry as the stream's leader
        holds it: the watch may be served by a replica still catching up (it may never have
        shown this planner the entry it lost to), and the replan (or the config set) must start
        from that entry."""
        try:
            entry = await self.leader_kv.get(key)
            await self._on_entry(key, entry.value, entry.revision)
        except KeyNotFoundError as exc:  # deleted (its marker's revision) or never written
            await self._on_entry(key, None, exc.entry.revision if exc.entry else 0)
        except Exception as exc:  # NATS away: the watch brings the entry once it is back
            log.info("latest entry not read", key=key, error=str(exc) or type(exc).__name__)


async def run_planner(
    servers: str,
    stop: asyncio.Event,
    auth: NatsAuth = NatsAuth(),
    replicas: int = 1,
    lease_ttl: float = DEFAULT_TTL,
    name: str | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
) -> None:
    async with AsyncExitStack() as stack:
        service: PlannerService | None = None

        async def on_reconnect() -> None:
            if service is not None:
                service.resync.set()

        nc = await connect(servers, name="lanes-planner", auth=auth, on_reconnect=on_reconnect)
        stack.push_async_callback(quietly(nc.drain))
        # Lanes' keys first: the planner makes their bucket (and never reads it) before the lanes
        # bucket, which agents wait for, so an agent finds both and never tries to make the
        # first itself (auth.conf refuses it that: a permissions violation in its log). Each is
        # tried until it is there: without the first, no gateway ever reaches a lane.
        if await until_made(lambda: secrets_bucket(nc, create=True, replicas=replicas), "secrets bucket", stop) is None:
            return
        kv = await until_made(lambda: kv_bucket(nc, create=True, replicas=replicas), "lanes bucket", stop)
        if kv is None:
            return
        # Where saved slots move between lanes: bounded by the default budget until the config is read.
        # No JetStream room, or an older server: slots then stay on their host.
        await until_made(lambda: slots_stream(nc, max_bytes=defaults.SLOT_CACHE_BYTES, replicas=replicas),
                         "slots stream", stop, give_up_after=SLOTS_STREAM_TRIES_FOR)  # fmt: skip
        service = PlannerService(nc, kv, lease_ttl=lease_ttl, name=name)
        await endpoints.ensure_config(service)
        await endpoints.add_endpoints(service, stack)
        await endpoints.subscribe(service, stack)
        loops = service.loops
        tasks = [
            loops.task("watch", lambda: watch_forever(kv, ">", service._on_entry, resync=service.resync, stop=stop,
                                                      on_caught_up=service._on_caught_up), stop),  # fmt: skip
            loops.task("replan", lambda: service.replan_loop(stop), stop),
            loops.task("liveness", lambda: service.liveness_loop(stop), stop),
            loops.task("lease", lambda: service.lease.run(stop), stop),
        ]
        if metrics_port is not None:
            serving = lambda: serve_metrics(service.metrics.registry, metrics_host, metrics_port, stop)  # noqa: E731
            tasks.append(loops.task("metrics", serving, stop))
        log.info("planner running", nats=servers, planner_id=service.id)
        await run_until(stop, tasks)
