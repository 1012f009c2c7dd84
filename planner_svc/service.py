"""The planner service: watches the lanes KV bucket, replans on change, writes plans.

Everything it knows comes from KV (config, demand, host reports, host status and
the plans themselves), so a restarted planner picks up exactly where it was.
Plans are written with compare-and-set on the key's revision, and only by the
planner holding the lease (planner_svc/lease.py); any others stand by, follow the
bucket and answer the same endpoints. Hosts that fall silent are `lost`: their plan
is kept (a partitioned host keeps serving), fleet-wide lanes are placed elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from contextlib import AsyncExitStack

import msgspec
import structlog
from nats.aio.client import Client
from nats.js.errors import KeyValueError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.request import Request, ServiceError

from planner_svc.lease import DEFAULT_TTL, Lease
from planner_svc.metrics import PlannerMetrics
from planner_svc.planner import plan
from shared import subjects
from shared.bus import NatsAuth, connect, kv_bucket, quietly, run_until, watch_forever
from shared.llama.printed import device_lines
from shared.messages import (
    ConfigSet,
    Demand,
    FleetConfig,
    FleetHosts,
    FleetStatus,
    HostLiveness,
    HostPlan,
    HostQuery,
    HostReport,
    HostStatus,
    PlanRejected,
    encode,
    schema_problem,
)
from shared.metrics_http import serve_metrics

log = structlog.get_logger("lanes.planner")
VERSION = "0.1.0"
SETTLE_SECONDS = 0.005  # a burst of changes (a config set, many reports) becomes one replan
WRITE_CONCURRENCY = 64
LOST_AFTER_INTERVALS = 3  # a host is lost after this many report intervals of silence


class PlannerState:
    """The planner's view of the bucket, rebuilt from the watch."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.config = FleetConfig()
        self.config_revision = 0  # counts config changes (FleetConfig.revision)
        self.config_kv_rev = 0  # the config entry's KV revision, for compare-and-set
        self._config_raw: bytes | None = None
        self.demand: Demand | None = None
        self.reports: dict[str, HostReport] = {}
        self.statuses: dict[str, HostStatus] = {}
        # The planner's own previous plan per host (adopted from the start-up snapshot, or written).
        self.plans: dict[str, HostPlan] = {}
        self.plan_revs: dict[str, int] = {}  # KV revision of the latest entry, for compare-and-set
        self.plan_seen: dict[str, int] = {}  # highest plan_revision seen on the key
        self.plan_stored: dict[str, bool] = {}  # does the key hold self.plans[host]?
        self.caught_up = False
        # A stand-by planner follows the active one: every plan on a key becomes its own.
        self.following = False
        self.leader = ""  # the lease holder a stand-by follows (whose plans it adopts)
        self.planner_id = ""  # written into every plan this planner writes
        self.seen: dict[str, float] = {}  # host -> when its last report or status came (clock)
        self.lost: set[str] = set()
        self.rejected: dict[str, str] = {}  # host -> why its agent refused the latest plan
        # What the next replan must cover: every host, or only the hosts whose inputs changed.
        self.replan_all = True
        self.replan_hosts: set[str] = set()

    def apply(self, key: str, value: bytes | None, revision: int) -> bool:
        """Fold one KV entry in. True when the planner must replan (or rewrite a plan)."""
        kind, _, host = key.partition(".")
        try:
            if key == subjects.CONFIG_KEY:
                self.config_kv_rev = revision  # even a bad value: the next config.set replaces it
                self._apply_config(value)
                self.replan_all = True
            elif key == subjects.DEMAND_KEY:
                self.demand = None if value is None else msgspec.json.decode(value, type=Demand)
                self.replan_all = True
            elif kind == "report":
                self._put(self.reports, host, value, HostReport)
                self._heard_from(host, value)
                self.replan_hosts.add(host)
            elif kind == "status":
                self._put(self.statuses, host, value, HostStatus)
                self._heard_from(host, value)
                applied, planned = self.statuses.get(host), self.plans.get(host)
                if applied and planned and applied.plan_revision >= planned.plan_revision:
                    self.rejected.pop(host, None)  # the agent runs the latest plan
                self.replan_hosts.add(host)
            elif kind == "plan":
                if self._apply_plan(host, value, revision):
                    self.replan_hosts.add(host)
                    return True
                return False
            else:
                return False
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("dropped malformed kv entry", key=key, reason=str(exc))
            return False
        return True

    def _apply_config(self, value: bytes | None) -> None:
        config = FleetConfig() if value is None else msgspec.json.decode(value, type=FleetConfig)
        if (problem := schema_problem(config)) is not None:
            raise msgspec.ValidationError(problem)
        if config.revision:
            self.config_revision = config.revision
        elif value != self._config_raw and self._config_raw is not None:
            self.config_revision += 1  # written around the planner (nats kv put): still one change
        self.config, self._config_raw = config, value

    def _heard_from(self, host: str, value: bytes | None) -> None:
        if value is None:
            self.seen.pop(host, None)
            self.lost.discard(host)
            return
        self.seen[host] = self.clock()
        if host in self.lost:
            self.lost.discard(host)
            log.info("host is back", host=host)
            self.replan_all = True

    def lost_after(self, host: str) -> float:
        if self.config.host_lost_after:
            return self.config.host_lost_after
        report = self.reports.get(host)
        return LOST_AFTER_INTERVALS * (report.report_interval if report else 30.0)

    def check_liveness(self) -> bool:
        """Mark hosts silent for too long as lost. True when that calls for a replan."""
        now = self.clock()
        newly = [h for h, t in self.seen.items() if h not in self.lost and now - t > self.lost_after(h)]
        for host in newly:
            self.lost.add(host)
            log.warning(
                "host lost: its plan is kept, fleet-wide lanes move",
                host=host,
                silent_s=round(now - self.seen[host], 1),
            )
        if newly:
            self.replan_all = True
        return bool(newly)

    def liveness(self) -> tuple[HostLiveness, ...]:
        now = self.clock()
        hosts = sorted(set(self.reports) | set(self.statuses))
        return tuple(
            HostLiveness(
                host_id=(self.reports.get(h) or self.statuses[h]).host_id,
                state="lost" if h in self.lost else "live",
                seen_ago_s=round(max(0.0, now - self.seen.get(h, now)), 1),
                rejected=self.rejected.get(h, ""),
            )
            for h in hosts
        )

    def apply_rejection(self, rejection: PlanRejected) -> bool:
        """An agent refused its plan. True when a rewrite can help: its applied plan is newer."""
        host = subjects.host_token(rejection.host_id)
        if host not in self.reports and host not in self.statuses:
            return False  # no such host: nothing to record or rewrite
        self.rejected[host] = f"plan r{rejection.plan_revision}: {rejection.reason[:300]}"
        if rejection.applied_revision > self.plan_seen.get(host, 0):
            self.plan_seen[host] = rejection.applied_revision
            self.plan_stored[host] = False
            self.replan_hosts.add(host)
            return True
        return False

    def _apply_plan(self, host: str, value: bytes | None, revision: int) -> bool:
        """Plans are the planner's own output: anything else on the key is overwritten."""
        self.plan_revs[host] = revision if value is not None else 0
        try:
            found = None if value is None else msgspec.json.decode(value, type=HostPlan)
            if found is not None and subjects.host_token(found.host_id) != host:
                raise msgspec.ValidationError(f"host_id {found.host_id!r} does not match key {host!r}")
            if found is not None and (problem := schema_problem(found)) is not None:
                raise msgspec.ValidationError(problem)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("dropped malformed kv entry", key=f"plan.{host}", reason=str(exc), action="rewrite the plan")
            self.plan_stored[host] = False
            return True
        if found is not None:
            self.plan_seen[host] = max(self.plan_seen.get(host, 0), found.plan_revision)
            if not self.caught_up or (self.following and found.planned_by and found.planned_by == self.leader):
                self.plans[host] = found  # a previous (or the active) planner's plan: carry on from it
        self.plan_stored[host] = found is not None and found == self.plans.get(host)
        if not self.plan_stored[host] and self.caught_up and not self.following:
            log.warning("plan entry not written by this planner; rewriting it", key=f"plan.{host}")
        return not self.plan_stored[host]

    @staticmethod
    def _put(table: dict, host: str, value: bytes | None, kind: type) -> None:
        if value is None:
            table.pop(host, None)
            return
        msg = msgspec.json.decode(value, type=kind)
        if subjects.host_token(msg.host_id) != host:
            raise msgspec.ValidationError(f"host_id {msg.host_id!r} does not match key {host!r}")
        if (problem := schema_problem(msg)) is not None:
            raise msgspec.ValidationError(problem)
        table[host] = msg

    def planning_job(self) -> Callable[[], dict[str, HostPlan]]:
        """A snapshot of the inputs, planned later off the event loop (the watch keeps
        changing the live dicts meanwhile).

        Only the hosts whose inputs changed are planned, unless the config or demand
        changed or the demand places lanes across hosts (`lanes` set on a persona): a
        host's plan then depends on its own report, status and previous plan alone.
        """
        fleet_wide = self.demand is not None and any(p.lanes is not None for p in self.demand.personas)
        # A lost host's plan is left as it is; its fleet-wide lanes are placed on the live ones.
        if self.replan_all or fleet_wide:
            reports = [r for h, r in self.reports.items() if h not in self.lost]
        else:
            reports = [self.reports[h] for h in sorted(self.replan_hosts) if h in self.reports and h not in self.lost]
        self.replan_all, self.replan_hosts = False, set()
        feedback = {subjects.host_token(s.host_id): s.feedback for s in self.statuses.values()}
        # A newer revision seen on the key (a foreign write the agent may have applied) is
        # passed over, so the plan that replaces it is not refused as older.
        wanted = {subjects.host_token(r.host_id) for r in reports}
        previous = {
            p.host_id: msgspec.structs.replace(p, plan_revision=max(p.plan_revision, self.plan_seen.get(host, 0)))
            for host, p in self.plans.items()
            if host in wanted
        }
        config, demand, config_revision, me = self.config, self.demand, self.config_revision, self.planner_id
        per_host = {r.host_id: feedback.get(subjects.host_token(r.host_id), ()) for r in reports}

        def job() -> dict[str, HostPlan]:
            fleet = plan(reports, config, demand, previous=previous, feedback=per_host, config_revision=config_revision)
            return {subjects.host_token(h.host_id): msgspec.structs.replace(h, planned_by=me) for h in fleet.hosts}

        return job


def planner_id() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


class PlannerService:
    def __init__(self, nc: Client, kv: KeyValue, lease_ttl: float = DEFAULT_TTL, name: str | None = None) -> None:
        self.nc, self.kv = nc, kv
        self.state = PlannerState()
        self.state.following = True  # until the lease is ours
        self.dirty = asyncio.Event()
        self.resync = asyncio.Event()
        self.ready = asyncio.Event()
        self.last_replan_seconds = 0.0
        self.id = name or planner_id()
        self.lease = Lease(kv, self.id, ttl=lease_ttl, on_change=self._on_lease)
        self.state.planner_id = self.id
        self.lease.on_holder = lambda holder: setattr(self.state, "leader", holder)
        self.replans = 0
        self.metrics = PlannerMetrics(self)

    async def _on_lease(self, active: bool) -> None:
        self.state.following = not active
        if active:  # plan everything once: the last holder may have died mid-change
            self.state.replan_all = True
            self.dirty.set()

    async def _on_rejected(self, msg) -> None:
        try:
            rejection = msgspec.json.decode(msg.data, type=PlanRejected)
            if subjects.rejected_subject(rejection.host_id) != msg.subject:
                raise msgspec.ValidationError(f"host_id {rejection.host_id!r} does not match {msg.subject!r}")
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("dropped malformed rejection", subject=msg.subject, reason=str(exc))
            return
        log.warning("agent rejected its plan", host=rejection.host_id, reason=rejection.reason)
        if self.state.apply_rejection(rejection):
            self.dirty.set()

    async def liveness_loop(self, stop: asyncio.Event, every: float = 1.0) -> None:
        written: bytes | None = None
        while not stop.is_set():
            if self.state.check_liveness():
                self.dirty.set()
            hosts = encode(
                FleetHosts(hosts=tuple(msgspec.structs.replace(h, seen_ago_s=0.0) for h in self.state.liveness()))
            )
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
        while not stop.is_set():
            await self.dirty.wait()
            # Let a burst of changes settle into one replan; a big fleet waits as long as a
            # replan takes, so the planner never spends more than half its time planning.
            await asyncio.sleep(max(SETTLE_SECONDS, self.last_replan_seconds))
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
            plans = await asyncio.to_thread(self.state.planning_job())
        except BaseException:
            self.state.replan_all = True  # the job's hosts were taken off the list: plan all again
            raise
        self.last_replan_seconds = time.monotonic() - started
        self.replans += 1
        self.metrics.replan_seconds.observe(self.last_replan_seconds)
        todo = [
            (h, p) for h, p in plans.items() if not (self.state.plans.get(h) == p and self.state.plan_stored.get(h))
        ]
        limit = asyncio.Semaphore(WRITE_CONCURRENCY)

        async def write(host: str, new: HostPlan) -> None:
            async with limit:
                await self._write_plan(host, new)

        # Hosts' plans are independent keys: write them side by side, not one round trip each.
        await asyncio.gather(*(write(h, p) for h, p in todo))

    async def _write_plan(self, host: str, new: HostPlan) -> None:
        """Compare-and-set one host's plan; a lost race replans."""
        key = subjects.plan_key(host)
        if not self.lease.holds():
            return  # the lease passed on while planning: the new holder plans
        before = self.state.plans.get(host)
        self.state.plans[host] = new  # the watch may echo the write before update() returns
        written = False
        try:
            if self.state.plan_revs.get(host):
                rev = await self.kv.update(key, encode(new), last=self.state.plan_revs[host])
            else:
                rev = await self.kv.create(key, encode(new))
            written = True
        except (KeyWrongLastSequenceError, KeyValueError) as exc:
            log.info("plan write lost compare-and-set; replanning", host=host, error=str(exc))
            self.state.replan_hosts.add(host)
            self.dirty.set()
        finally:
            if not written:
                if before is None:
                    self.state.plans.pop(host, None)
                else:
                    self.state.plans[host] = before
        if not written:
            return
        self.state.plans[host] = new
        self.state.plan_revs[host] = max(rev, self.state.plan_revs.get(host, 0))  # the echo may be newer
        self.state.plan_stored[host] = True
        self.state.plan_seen[host] = max(self.state.plan_seen.get(host, 0), new.plan_revision)
        log.info(
            "plan written",
            host=host,
            plan_revision=new.plan_revision,
            lanes=[f"{s.lane_id}:{s.ctx_per_slot}x{s.parallel}:{s.cache_type_k or 'f16'}" for s in new.lanes],
        )

    async def ensure_config(self) -> None:
        try:
            await self.kv.get(subjects.CONFIG_KEY)
        except NotFoundError:
            try:
                await self.kv.create(subjects.CONFIG_KEY, encode(FleetConfig()))
            except Exception:
                pass  # another planner created it first

    # ------------------------------------------------------------ request/reply

    async def _config_get(self, req: Request) -> None:
        await req.respond(encode(self.state.config))

    async def _config_set(self, req: Request) -> None:
        try:
            change = msgspec.json.decode(req.data, type=ConfigSet)
            merged = msgspec.structs.asdict(self.state.config) | dict(change.changes)
            for own in ("kind", "schema", "revision"):
                merged.pop(own, None)
            if "revision" in change.changes or "schema" in change.changes:
                raise msgspec.ValidationError("revision and schema are set by the planner")
            new = msgspec.convert(merged, FleetConfig, strict=False)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ServiceError("400", f"invalid config: {exc}") from None
        if new == msgspec.structs.replace(self.state.config, revision=0, schema=new.schema):
            await req.respond(encode(self.state.config))  # nothing changes: no new revision
            return
        try:
            new = msgspec.structs.replace(new, revision=self.state.config_revision + 1)
            await self.kv.update(subjects.CONFIG_KEY, encode(new), last=self.state.config_kv_rev or None)
        except KeyWrongLastSequenceError:
            raise ServiceError("409", "config changed meanwhile; retry") from None
        log.info("config set", changes=change.changes)
        await req.respond(encode(new))

    async def _demand_set(self, req: Request) -> None:
        try:
            demand = msgspec.json.decode(req.data, type=Demand)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ServiceError("400", f"invalid demand: {exc}") from None
        await self.kv.put(subjects.DEMAND_KEY, encode(demand))
        await req.respond(encode(demand))

    def _host_plan(self, req: Request) -> HostPlan:
        try:
            query = msgspec.json.decode(req.data, type=HostQuery)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ServiceError("400", f"invalid query: {exc}") from None
        found = self.state.plans.get(subjects.host_token(query.host_id))
        if found is None:
            raise ServiceError("404", f"no plan for host {query.host_id!r}")
        return found

    async def _plan_get(self, req: Request) -> None:
        await req.respond(encode(self._host_plan(req)))

    async def _plan_explain(self, req: Request) -> None:
        found = self._host_plan(req)
        lines = [f"host {found.host_id} plan r{found.plan_revision} (config r{found.config_revision})"]
        lines += [f"{s.lane_id}: " + "; ".join(s.reasons) for s in found.lanes]
        status = self.state.statuses.get(found.host_id)
        printed = {lane.lane_id: lane.devices for lane in status.lanes} if status else {}
        for s in found.lanes:
            lines += device_lines(s, printed.get(s.lane_id, ()))
        lines += [f"unplaced {u.model}: {u.reason}" for u in found.unplaced]
        lines += [f"note: {r}" for r in found.reasons]
        await req.respond("\n".join(lines).encode())

    async def _fleet_status(self, req: Request) -> None:
        s = self.state
        await req.respond(
            encode(
                FleetStatus(
                    config_revision=s.config_revision,
                    config=s.config,
                    reports=tuple(sorted(s.reports.values(), key=lambda r: r.host_id)),
                    plans=tuple(sorted(s.plans.values(), key=lambda p: p.host_id)),
                    statuses=tuple(sorted(s.statuses.values(), key=lambda p: p.host_id)),
                    hosts=s.liveness(),
                    planner_id=self.id,
                    planner_active=self.lease.holds(),
                )
            )
        )

    async def _info(self, req: Request) -> None:
        s = self.state
        info = {
            "version": VERSION,
            "config_revision": s.config_revision,
            "hosts": sorted(s.reports),
            "plans": {host: p.plan_revision for host, p in sorted(s.plans.items())},
            "ready": self.ready.is_set(),
            "planner_id": self.id,
            "active": self.lease.holds(),
            "lost": sorted(s.lost),
        }
        await req.respond(msgspec.json.encode(info))

    async def add_endpoints(self, stack: AsyncExitStack) -> None:
        svc = await add_service(
            self.nc,
            name=subjects.PLANNER_SERVICE,
            version=VERSION,
            description="lanes planner: lane plans for every host",
            metadata={"bucket": subjects.BUCKET},
        )
        stack.push_async_callback(quietly(svc.stop))
        group = svc.add_group(name=subjects.PLANNER_GROUP)
        for name, subject, handler in (
            ("config_get", subjects.CONFIG_GET, self._config_get),
            ("config_set", subjects.CONFIG_SET, self._config_set),
            ("demand_set", subjects.DEMAND_SET, self._demand_set),
            ("plan_get", subjects.PLAN_GET, self._plan_get),
            ("plan_explain", subjects.PLAN_EXPLAIN, self._plan_explain),
            ("fleet_status", subjects.FLEET_STATUS, self._fleet_status),
            ("status", subjects.PLANNER_STATUS, self._fleet_status),
            ("info", subjects.PLANNER_INFO, self._info),
        ):
            tail = subjects.endpoint_tail(subject, subjects.PLANNER_GROUP)
            await group.add_endpoint(name=name, subject=tail, handler=handler)


async def run_planner(
    servers: str,
    stop: asyncio.Event,
    auth: NatsAuth = NatsAuth(),
    replicas: int = 1,
    lease_ttl: float = DEFAULT_TTL,
    name: str | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "0.0.0.0",
) -> None:
    async with AsyncExitStack() as stack:
        service: PlannerService | None = None

        async def on_reconnect() -> None:
            if service is not None:
                service.resync.set()

        nc = await connect(servers, name="lanes-planner", auth=auth, on_reconnect=on_reconnect)
        stack.push_async_callback(quietly(nc.drain))
        kv = await kv_bucket(nc, create=True, replicas=replicas)
        service = PlannerService(nc, kv, lease_ttl=lease_ttl, name=name)
        await service.ensure_config()
        await service.add_endpoints(stack)
        rejections = await nc.subscribe(subjects.ALL_REJECTED, cb=service._on_rejected)
        stack.push_async_callback(quietly(rejections.unsubscribe))
        tasks = [
            asyncio.create_task(
                watch_forever(
                    kv,
                    ">",
                    service._on_entry,
                    resync=service.resync,
                    stop=stop,
                    on_caught_up=service._on_caught_up,
                )
            ),
            asyncio.create_task(service.replan_loop(stop)),
            asyncio.create_task(service.liveness_loop(stop)),
            asyncio.create_task(service.lease.run(stop)),
        ]
        if metrics_port is not None:
            tasks.append(asyncio.create_task(serve_metrics(service.metrics.registry, metrics_host, metrics_port, stop)))
        log.info("planner running", nats=servers, planner_id=service.id)
        await run_until(stop, tasks)
