"""The launcher agent's NATS side: reports this host, watches its plan, publishes
status and events, and runs the Supervisor that keeps the host's lanes as planned.

Nothing that blocks runs on the event loop: the host report (NVML, the GGUF scan, llama-server
probes) is built in a worker thread, one at a time, and ggml-rpc-servers are waited for
asynchronously. Lanes keep serving while NATS is away. The plan is followed without a JetStream
consumer (shared.bus.follow_key: a subscription on the key's subject plus a direct
get), so the agent's NATS user needs no consumer rights; the key is read again after
every reconnect and every report interval.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import msgspec
import structlog
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.request import Request

from launcher_agent import cores as host_cores
from launcher_agent.config import AgentConfig
from launcher_agent.lane import Lane
from launcher_agent.load_feed import LoadFeed
from launcher_agent.metrics import AgentMetrics
from launcher_agent.report import host_report
from shared.version import VERSION
from launcher_agent.rpc_worker import RpcWorkers, WorkerSettings
from launcher_agent import slot_moves
from launcher_agent.supervisor import Supervisor
from shared import subjects
from shared.bus import connect, follow_key, kv_bucket, logged_endpoint, quietly, run_until, secrets_bucket
from shared.gguf_facts import FactsCache
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan
from shared.messages.slots import SlotsAsk, SlotsOffer
from shared.messages.status import LaneEvent, LaneSecret, PlanRejected
from shared.messages.wire import decode, encode
from shared.metrics_http import serve_metrics
from shared.nats_auth import NatsAuth
from shared.supervise import Loops, running

log = structlog.get_logger("lanes.agent")
SECRETS_LOOK_EVERY = 5.0  # seconds between looks for a lanes-secrets bucket still missing
REPORT_RETRY = 1.0  # seconds before a report that failed is tried again (doubling up to the report interval)


@dataclass
class Agent:
    """The NATS side of one host: report, plan watch, events and status around a Supervisor."""

    cfg: AgentConfig
    sup: Supervisor = field(init=False)
    nc: Client | None = None
    kv: object | None = None
    resync: asyncio.Event = field(default_factory=asyncio.Event)
    _last_status: bytes = b""
    _facts_cache: dict = field(default_factory=dict)
    _plan_seen: bytes | None = None  # the plan entry last acted on: a re-read of it changes nothing
    secrets: object | None = None  # bucket lanes-secrets: its lanes' keys, for the gateways
    _secrets_put: dict[str, bytes] = field(default_factory=dict)  # KV key -> what was put there
    _secrets_looked: float = 0.0  # when the bucket was last looked for (monotonic)
    _reporting: threading.Lock = field(default_factory=threading.Lock)  # one report (GGUF scan) at a time
    report_sent: bool = False  # the last report reached the bucket (else it is tried again soon)

    workers: RpcWorkers | None = None  # ggml-rpc-servers for other hosts' span lanes (--rpc-worker)
    loops: Loops = field(default_factory=lambda: Loops("agent"))  # its supervised loops (shared.supervise)
    load: LoadFeed = field(init=False)  # its lanes' load, published for the gateways

    def __post_init__(self) -> None:
        self.sup = Supervisor(self.cfg, emit=self._event)
        self.load = LoadFeed(self.cfg.host_id, self.cfg.load_refresh)
        if self.cfg.rpc_worker:
            # ggml-rpc-server computes its layers with the CPU backend: one thread per physical core
            settings = WorkerSettings(self.cfg.rpc_server_binary, self.cfg.advertise, self.cfg.rpc_worker_port_base,
                                      self.cfg.rpc_worker_port_count, self.cfg.data_dir / "rpc-cache",
                                      threads=host_cores.host_cores().physical or 1,
                                      env_names=self.cfg.lane_env)  # fmt: skip
            self.workers = RpcWorkers(settings, self.cfg.data_dir / "rpc-workers.json")
        # Model facts survive a restart: an unchanged GGUF is never read again.
        self._facts_cache = FactsCache(self.cfg.data_dir / "model-facts.json")

    @property
    def host(self) -> str:
        return subjects.host_token(self.cfg.host_id)

    async def report(self) -> HostReport:
        """The lanes' figures are read here, on the loop (the lanes change on it); the rest blocks
        (NVML, a GGUF scan, subprocesses) and runs in a worker thread, one report at a time."""
        lanes = (self.sup.lanes_rss(), self.sup.lane_pids(), self.sup.lanes_gpu_bytes(), self.sup.serving_keys())
        workers_rss = self.workers.rss() if self.workers else 0
        return await asyncio.to_thread(self._build_report, *lanes, workers_rss)

    def _build_report(self, rss: int, pids: list[int], gpu: dict[int, int], serving: tuple[str, ...],
                      workers_rss: int) -> HostReport:  # fmt: skip
        with self._reporting:
            return host_report(self.cfg, rss, self._facts_cache, pids, gpu, workers_rss=workers_rss, serving=serving)

    # ------------------------------------------------------------ plans in

    async def on_plan(self, key: str, value: bytes | None) -> None:
        if value is None or value == self._plan_seen:
            return
        self._plan_seen = value
        try:
            plan = msgspec.json.decode(value, type=HostPlan)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            await self._reject(0, f"malformed plan: {exc}")
            return
        reason = self.sup.accept_plan(plan)
        if reason:
            await self._reject(plan.plan_revision, reason)

    async def _reject(self, revision: int, reason: str) -> None:
        log.warning("plan rejected", plan_revision=revision, reason=reason)
        if self.nc is not None and self.nc.is_connected:
            applied = self.sup.plan.plan_revision if self.sup.plan else 0
            msg = PlanRejected(host_id=self.cfg.host_id, plan_revision=revision, reason=reason, applied_revision=applied)
            try:
                await self.nc.publish(subjects.rejected_subject(self.host), encode(msg))
            except Exception:
                pass

    async def _event(self, lane: Lane, event: str, detail: str = "") -> None:
        if self.nc is None or not self.nc.is_connected:
            return
        msg = LaneEvent(
            host_id=self.cfg.host_id,
            lane_id=lane.spec.lane_id,
            event=event,
            detail=detail[:2000],
            pid=lane.process.pid if lane.process else None,
        )
        try:
            await self.nc.publish(subjects.event_subject(self.host, lane.spec.lane_id, event), encode(msg))
        except Exception:
            pass

    async def publish_status(self, force: bool = False) -> None:
        if self.kv is None or self.nc is None or not self.nc.is_connected:
            return
        await self.publish_secrets()  # before the status: a gateway knows a lane's key before it is healthy
        status = self.sup.status(nats_connected=True)
        if self.workers is not None:
            status = msgspec.structs.replace(status, rpc_workers=self.workers.status())
        data = encode(status)
        comparable = encode(
            msgspec.structs.replace(
                status, lanes=tuple(msgspec.structs.replace(lane, rss_bytes=None) for lane in status.lanes)
            )
        )
        if not force and comparable == self._last_status:
            return
        try:
            # The plain publish first: it leaves in the same write as the KV put's request.
            await self.nc.publish(subjects.telemetry_subject(self.host), data)
            await self.kv.put(subjects.status_key(self.host), data)
            self._last_status = comparable
        except Exception as exc:
            log.info("status not published", error=str(exc) or type(exc).__name__)

    async def open_secrets(self) -> None:
        """The bucket of lanes' keys, made by the planner (or by this agent where it may). Looked for
        again at the next status while missing: a planner that made it late must not leave this
        host's lanes unreachable for good."""
        self._secrets_looked = time.monotonic()
        try:
            self.secrets = await secrets_bucket(self.nc)
        except Exception:  # an older planner did not make it, or has not yet
            try:
                self.secrets = await secrets_bucket(self.nc, create=True)
            except Exception as exc:
                log.warning("lanes-secrets bucket not reachable yet: gateways cannot reach this host's lanes",
                            error=str(exc) or type(exc).__name__)  # fmt: skip

    async def publish_secrets(self) -> None:
        """Each running lane's key where gateways read it, and none of a lane that is gone:
        level-triggered against what was put (the report loop forgets that now and then, so a
        bucket lost with its NATS server is filled again)."""
        if self.nc is None or not self.nc.is_connected:
            return
        if self.secrets is None and time.monotonic() - self._secrets_looked >= SECRETS_LOOK_EVERY:
            await self.open_secrets()
        if self.secrets is None:
            return
        wanted = {
            subjects.lane_secret_key(self.host, lane.spec.lane_id): encode(LaneSecret(
                host_id=self.cfg.host_id, lane_id=lane.spec.lane_id, port=lane.spec.port, key=lane.api_key))
            for lane in self.sup.lanes.values() if lane.api_key and lane.process is not None
        }  # fmt: skip
        try:
            for key, data in wanted.items():
                if self._secrets_put.get(key) != data:
                    await self.secrets.put(key, data)
                    self._secrets_put[key] = data
            for key in [k for k in self._secrets_put if k not in wanted]:
                await self.secrets.delete(key)
                del self._secrets_put[key]
        except Exception as exc:
            log.info("lane keys not published", error=str(exc) or type(exc).__name__)

    async def publish_load(self) -> None:
        """Read each serving lane's /slots once; tell the gateways what changed (launcher_agent/load_feed.py)."""
        if self.nc is None or not self.nc.is_connected:
            return
        msg = self.load.fold(await self.sup.read_loads(self.cfg.probe_timeout), time.monotonic())
        if msg is None:
            return
        try:
            await self.nc.publish(subjects.load_subject(self.host), encode(msg))
        except Exception as exc:
            self.load.ask()  # the next round goes whole
            log.info("load not published", error=str(exc) or type(exc).__name__)

    async def publish_report(self) -> None:
        if self.kv is None:
            return
        self.report_sent = False
        try:
            report = await self.report()
            data = encode(report)
            msgspec.json.decode(data, type=HostReport)  # its bounds: the planner would drop it, unseen here
            await self.kv.put(subjects.report_key(self.host), data)
            self.report_sent = True
        except msgspec.ValidationError as exc:
            log.error("report out of range; not published (check this agent's options)", reason=str(exc))
        except Exception as exc:
            log.info("report not published; trying again soon", error=str(exc) or type(exc).__name__)


# ------------------------------------------------------------------ running it


async def _nats_side(agent: Agent, servers: str, auth: NatsAuth, stop: asyncio.Event, stack: AsyncExitStack) -> None:
    async def on_reconnect() -> None:
        agent._plan_seen = None  # a rejection sent meanwhile may be lost: say it again
        agent.load.ask()  # load messages sent meanwhile are lost: say it whole
        agent.resync.set()

    while running(stop):
        try:
            agent.nc = await connect(
                servers,
                name=f"lanes-agent-{agent.host}",
                auth=auth,
                on_reconnect=on_reconnect,
                inbox_prefix=subjects.agent_inbox(agent.host),
            )
            break
        except Exception as exc:
            log.warning("nats not reachable; lanes keep running, retrying", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(1.0)
    if stop.is_set():
        return
    stack.push_async_callback(quietly(agent.nc.close))
    await agent.loops.run("bus", lambda: _serve_bus(agent, stop), stop)


async def _serve_bus(agent: Agent, stop: asyncio.Event) -> None:
    """The bucket, the micro endpoints and the plan watch on the connection made (restartable)."""
    while running(stop):
        try:
            agent.kv = await kv_bucket(agent.nc)
            break
        except Exception as exc:
            log.info("waiting for the lanes bucket (is the planner up?)", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(1.0)
    await agent.open_secrets()
    offers = None  # the subscriptions to slot asks and offers (launcher_agent/slot_moves.py)
    load_asks = None  # gateways' asks for this host's load
    svc = await add_service(
        agent.nc,
        name=subjects.AGENT_SERVICE,
        version=VERSION,
        description=f"lanes launcher agent on {agent.cfg.host_id}",
        metadata={"host": agent.cfg.host_id},
    )
    try:
        group = svc.add_group(name=subjects.agent_group(agent.host))

        async def status_handler(req: Request) -> None:
            await req.respond(encode(agent.sup.status(nats_connected=True)))

        async def info_handler(req: Request) -> None:
            await req.respond(encode(await agent.report()))

        where = subjects.agent_group(agent.host)
        for name, subject, handler in (("status", subjects.agent_status(agent.host), status_handler),
                                       ("info", subjects.agent_info(agent.host), info_handler)):  # fmt: skip
            await group.add_endpoint(name=name, subject=subjects.endpoint_tail(subject, where),
                                     handler=logged_endpoint(handler, name))  # fmt: skip
        offers = await _follow_slot_offers(agent)

        async def on_load_ask(msg) -> None:
            agent.load.ask()

        load_asks = await agent.nc.subscribe(subjects.LOAD_ASK, cb=on_load_ask)
        await agent.publish_report()
        await follow_key(
            agent.nc,
            agent.kv,
            subjects.plan_key(agent.host),
            agent.on_plan,
            resync=agent.resync,
            stop=stop,
            every=agent.cfg.report_interval,
        )
    finally:
        for sub in (*(offers or ()), load_asks):
            if sub is not None:
                await quietly(sub.unsubscribe)()
        await quietly(svc.stop)()


async def _follow_slot_offers(agent: Agent):
    """Send going lanes' slots to their buddies, spread a hot lane's idle conversations where a
    gateway asks, and take those offered to this host's lanes. An offer or ask is handled in its
    subscription's order, one at a time (a bound: saves and restores are serial)."""
    store = agent.sup.procs.slots
    if store is None:
        return None

    async def send(lane, saved, leaving: bool) -> None:
        await slot_moves.send(agent.nc, agent.cfg.host_id, store, lane, saved, leaving)

    async def publish(event: LaneEvent) -> None:
        await agent.nc.publish(subjects.event_subject(agent.host, event.lane_id, event.event), encode(event))

    async def on_offer(msg) -> None:
        try:
            offer = decode(msg.data, SlotsOffer)
        except ValueError as exc:
            log.warning("slot offer dropped", subject=msg.subject, reason=str(exc)[:200])
            return
        if offer.to_host != agent.cfg.host_id:
            return
        try:
            await slot_moves.take(agent.nc, agent.cfg.host_id, store, agent.sup.lanes, offer, publish)
        except Exception as exc:  # a lane gone meanwhile, NATS away: the conversations start cold
            log.warning("offered slots not taken", source=f"{offer.from_host}/{offer.from_lane}",
                        error=str(exc) or type(exc).__name__)  # fmt: skip

    spreads: dict[str, float] = {}  # lane -> when it last spread (slot_moves.SPREAD_EVERY)

    async def on_ask(msg) -> None:
        try:
            ask = decode(msg.data, SlotsAsk)
        except ValueError as exc:
            log.warning("slot ask dropped", subject=msg.subject, reason=str(exc)[:200])
            return
        try:
            await slot_moves.spread(agent.nc, agent.cfg.host_id, store, agent.sup.lanes, ask, spreads)
        except Exception as exc:  # the lane stopped meanwhile, NATS away: nothing moves
            log.warning("hot lane not spread", lane=ask.lane, error=str(exc) or type(exc).__name__)

    agent.sup.procs.send_slots = send
    asks = await agent.nc.subscribe(subjects.slot_ask_subject(agent.cfg.host_id), cb=on_ask)
    return asks, await agent.nc.subscribe(subjects.ALL_SLOT_OFFERS, cb=on_offer)


async def _report_loop(agent: Agent, stop: asyncio.Event) -> None:
    retry = REPORT_RETRY
    while running(stop):
        # A report that did not reach the bucket (a put that timed out while a thousand agents
        # started at once) is tried again within seconds, not a report interval later: until
        # the planner has it, the host has no plan (bench/convergence_bench.py, 4 of 1,000 agents).
        due = agent.cfg.report_interval if agent.report_sent else retry
        try:
            await asyncio.wait_for(stop.wait(), due)
        except asyncio.TimeoutError:
            if not agent.report_sent:
                retry = min(2 * retry, agent.cfg.report_interval)
                await agent.publish_report()  # nothing yet while the bucket is not open
                continue
            retry = REPORT_RETRY
            await agent.publish_report()
            agent._secrets_put.clear()  # put them all again: a NATS server that lost them has them back
            await agent.publish_status(force=True)


async def _load_loop(agent: Agent, stop: asyncio.Event) -> None:
    while running(stop):
        await agent.publish_load()  # a failure ends the loop: its supervisor logs, counts, restarts it
        try:
            await asyncio.wait_for(stop.wait(), agent.cfg.load_interval)
        except asyncio.TimeoutError:
            pass


async def _control_loop(agent: Agent, stop: asyncio.Event) -> None:
    while running(stop):
        agent.sup.wake.clear()  # before the pass: a wake-up set during it starts the next at once
        now = time.monotonic()
        # A pass that raises ends the loop: its supervisor (shared.supervise) logs, counts and restarts it.
        await agent.sup.supervise(now)
        await agent.publish_status()  # a lane that came up is told before the next one restarts
        await agent.sup.reconcile(now)
        if agent.workers is not None and agent.sup.plan is not None:
            await agent.workers.apply(agent.sup.plan.rpc_workers, now)
        await agent.publish_status()
        # A lane coming up is polled often, so it is reported healthy soon after it is.
        tick = agent.sup.next_look(time.monotonic(), agent.cfg.tick)
        try:
            await asyncio.wait_for(agent.sup.wake.wait(), tick)
        except asyncio.TimeoutError:
            pass


async def run_agent(cfg: AgentConfig, servers: str, stop: asyncio.Event, auth: NatsAuth = NatsAuth()) -> None:
    agent = Agent(cfg)
    agent.sup.load_saved()
    if agent.workers is not None:
        agent.workers.adopt()
    async with AsyncExitStack() as stack:
        loops = agent.loops
        tasks = [
            loops.task("control", lambda: _control_loop(agent, stop), stop),
            asyncio.create_task(_nats_side(agent, servers, auth, stop, stack)),  # its "bus" part is supervised
            loops.task("report", lambda: _report_loop(agent, stop), stop),
            loops.task("load", lambda: _load_loop(agent, stop), stop),
        ]
        if cfg.metrics_port is not None:
            metrics = AgentMetrics(agent.sup)
            metrics.registry.register(loops)
            serving = lambda: serve_metrics(metrics.registry, cfg.metrics_host, cfg.metrics_port, stop,  # noqa: E731
                                            before_scrape=metrics.refresh)  # fmt: skip
            tasks.append(loops.task("metrics", serving, stop))
        log.info("agent running", host=cfg.host_id, binary=cfg.binary, models=cfg.model_dirs)
        # Cancelled from outside (like a SIGKILL), this leaves the lanes running for adoption.
        await run_until(stop, tasks)
        await agent.sup.stop_all()
        if agent.workers is not None:
            await agent.workers.stop_all()
        await quietly(lambda: agent.publish_status(force=True))()
