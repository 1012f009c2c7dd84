"""The commands that talk to NATS: up, planner, agent, status, config, demand, explain."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import ssl
import sys
import time
from pathlib import Path

import msgspec
import structlog

from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from lanes.agent_setup import agent_config
from lanes.demo_model import ensure_demo_model
from lanes.errors import UserError
from lanes.files import load_file
from lanes.tables import gib, mib, table
from launcher_agent.service import run_agent
from planner_svc.service import run_planner
from planner_svc.threads import cpu_ranges
from shared import subjects
from shared.bus import connect, read_all
from shared.llama.flags import cache_pair
from shared.llama.printed import device_lines
from shared.logs import setup_logging
from shared.messages.config import Demand, FleetConfig
from shared.messages.plans import LaneSpec
from shared.messages.replies import ConfigSet, FleetQuery, FleetStatus, FleetSummary, HostQuery
from shared.messages.wire import encode
from shared.nats_auth import NatsAuth, auth_from_args
from shared.natsserver import NatsServer, NatsServerError
from shared.supervise import LoopGaveUp, running

log = structlog.get_logger("lanes.up")


def threads_text(spec: LaneSpec) -> str:
    """A lane's planned threads and pinned CPUs ("2 @ 0-1"), or "default" (every core)."""
    if spec.threads is None:
        return "default"
    return f"{spec.threads} @ {cpu_ranges(spec.cpus)}" if spec.cpus else str(spec.threads)


async def _agent_until_signal(agent) -> int:
    """SIGTERM/SIGINT stop the agent and its lanes; SIGUSR1 makes it exit and leave its lanes serving
    for the next agent to adopt (a restart or upgrade: deploy/systemd's unit sends it on restart)."""
    task = asyncio.ensure_future(agent)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        print("lanes agent: exiting on SIGUSR1; its lanes keep serving for the next agent", file=sys.stderr, flush=True)
    return 0


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def gateway_settings(args: argparse.Namespace) -> GatewaySettings:
    keys = list(getattr(args, "api_key", None) or [])
    keys += [k.strip() for k in os.environ.get("LANES_GATEWAY_API_KEYS", "").split(",") if k.strip()]
    if getattr(args, "api_key_file", None):
        try:
            keys += [line.strip() for line in Path(args.api_key_file).read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise UserError(f"--api-key-file: {exc.strerror}: {args.api_key_file}") from None
    base = GatewaySettings()
    settings = GatewaySettings(
        host=getattr(args, "host", base.host) if args.command == "gateway" else base.host,
        port=args.port if args.command == "gateway" else args.gateway_port,
        api_keys=tuple(keys),
        max_body_bytes=getattr(args, "max_body", base.max_body_bytes),
        queue_depth=getattr(args, "queue_depth", base.queue_depth),
        queue_wait=getattr(args, "queue_wait", base.queue_wait),
        request_timeout=getattr(args, "request_timeout", base.request_timeout),
        client_timeout=getattr(args, "client_timeout", base.client_timeout),
        connect_timeout=getattr(args, "connect_timeout", base.connect_timeout),
        lane_spares=getattr(args, "lane_spares", base.lane_spares),
        first_byte_timeout=getattr(args, "first_byte_timeout", base.first_byte_timeout),
        stream_idle_timeout=getattr(args, "stream_idle_timeout", base.stream_idle_timeout),
        admin_key=getattr(args, "admin_key", None) or None,
        load_timeout=getattr(args, "load_timeout", base.load_timeout),
        affinity=not getattr(args, "no_affinity", False),
        fair=not getattr(args, "no_fair", False),
        shared_prefix=not getattr(args, "no_shared_prefix", False),
        kv_events=getattr(args, "kv_events", False),
        gateway_id=getattr(args, "gateway_id", None) or base.gateway_id,
        keys_file=_keys_file(getattr(args, "keys_file", None)),
        no_auth=getattr(args, "no_auth", False),
        cors_origins=getattr(args, "cors_origins", None) or base.cors_origins,
        kv_replicas=getattr(args, "kv_replicas", None) if args.command == "gateway" else None,
        **_https(getattr(args, "https_cert", None), getattr(args, "https_key", None)),
    )
    if settings.open_beyond_loopback() and not settings.no_auth:
        raise UserError(
            f"--host {settings.host} serves every machine that reaches it, and no key is set: give keys "
            "(LANES_GATEWAY_API_KEYS, --api-key-file, or --keys-file made with `lanes keys add`), "
            "listen on 127.0.0.1, or say --no-auth to serve anyone without a key"
        )
    return settings


def _https(cert: str | None, key: str | None) -> dict:
    """--https-cert and --https-key, checked now (both or neither, files that load as a pair)."""
    if not cert and not key:
        return {}
    if not (cert and key):
        raise UserError("give --https-cert and --https-key together (the certificate chain and its private key)")
    settings = GatewaySettings(tls_cert=cert, tls_key=key)
    try:
        settings.tls_context()
    except ssl.SSLError as exc:  # (an OSError too: first)
        raise UserError(f"--https-cert {cert} / --https-key {key}: not a certificate and its key "
                        f"({exc.reason})") from None
    except OSError as exc:
        raise UserError(f"--https-cert/--https-key: {exc.strerror or exc}: {exc.filename or cert}") from None
    return {"tls_cert": cert, "tls_key": key}


def _keys_file(path: str | None) -> str | None:
    """The keys file, checked now: at start there is no last good one to keep."""
    if path:
        from gateway.tenants import parse

        try:
            parse(Path(path).read_text())
        except OSError as exc:
            raise UserError(f"--keys-file: {exc.strerror}: {path}") from None
        except ValueError as exc:
            raise UserError(f"--keys-file {path}: {exc}") from None
    return path or None


async def run(args: argparse.Namespace) -> int:
    setup_logging("info" if args.command in ("up", "planner", "agent", "gateway") else "error")
    try:
        return await _run(args)
    except LoopGaveUp as exc:  # exit 1: systemd or compose restarts the service whole
        print(f"lanes {args.command}: {exc}; exiting", file=sys.stderr, flush=True)
        return 1


async def _run(args: argparse.Namespace) -> int:
    if args.command == "up":
        return await cmd_up(args)
    auth = auth_from_args(args)
    if args.command == "planner":
        await run_planner(
            args.nats, _stop_event(), auth, replicas=args.kv_replicas, lease_ttl=args.lease_ttl,
            metrics_port=args.metrics_port, metrics_host=args.metrics_bind,
        )  # fmt: skip
        return 0
    if args.command == "gateway":
        settings = gateway_settings(args)
        raise_open_files()
        await run_gateway(args.nats, _stop_event(), auth, settings)
        return 0
    if args.command == "agent":
        cfg = agent_config(args, Path(args.data) if args.data else Path.home() / ".lanes" / "agent")
        return await _agent_until_signal(run_agent(cfg, args.nats, _stop_event(), auth))
    return await _request_command(args, auth)


OPEN_FILES = 65536


def raise_open_files(want: int = OPEN_FILES) -> None:
    """A gateway holds a socket per client and per lane request: its soft limit of open files
    is raised to the hard one (up to `want`), so 1,000 idle clients cannot starve it at 1,024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(hard, want)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def cmd_up(args: argparse.Namespace) -> int:
    data = Path(args.data).resolve()
    if not args.models:
        demo = ensure_demo_model(data / "models")
        print(f"lanes up: no --models folder; serving the demo model {demo}")
        args.models = [str(demo.parent)]
    cfg = agent_config(args, data / "agent")
    server = NatsServer(data / "nats", port=args.nats_port)
    try:
        server.start()
    except NatsServerError as exc:
        raise UserError(str(exc)) from None
    stop = _stop_event()
    print(f"lanes up: nats {server.url} (monitor {server.monitor}), data in {data}")
    print(f"  lanes status --nats {server.url}")
    print(f"  lanes config set --nats {server.url} kv_cache_type=q8_0")
    print(f"  nats --server {server.url} kv watch {subjects.BUCKET}      # with the NATS CLI")
    gateway = Gateway(gateway_settings(args))
    try:
        serving = asyncio.create_task(run_gateway(server.url, stop, gateway=gateway))
        started = asyncio.create_task(gateway.started.wait())
        await asyncio.wait([serving, started], return_when=asyncio.FIRST_COMPLETED)
        if serving.done():  # it could not listen
            started.cancel()
            exc = serving.exception()
            raise UserError(f"gateway: cannot listen on port {args.gateway_port}: {getattr(exc, 'strerror', exc)}")
        print(f"gateway: {gateway.url}", flush=True)
        print(f"dashboard: {gateway.url}/dashboard/", flush=True)
        print(_first_request(gateway.url, cfg.model_dirs), flush=True)
        print("  Ctrl-C stops everything, lanes included", flush=True)
        guard = asyncio.create_task(supervise_nats(server, stop))

        async def stopping_all(service) -> None:  # a service that fails stops the others, lanes included
            try:
                await service
            finally:
                stop.set()

        done = await asyncio.gather(stopping_all(run_planner(server.url, stop)),
                                    stopping_all(run_agent(cfg, server.url, stop)), stopping_all(serving), guard,
                                    return_exceptions=True)  # fmt: skip
        for result in done:
            if isinstance(result, BaseException):
                raise result
        if guard.result():  # everything has stopped, lanes included: now say why
            raise UserError(guard.result())
    finally:
        server.stop()
    return 0


NATS_RESTART_TRIES = 5


async def supervise_nats(server: NatsServer, stop: asyncio.Event, every: float = 0.5) -> str | None:
    """Restart `lanes up`'s nats-server on the same port and store if it dies; lanes keep serving
    meanwhile (the services reconnect). If it cannot come back, stop everything and say why."""
    failures = 0
    while running(stop):
        try:
            await asyncio.wait_for(stop.wait(), every)
            return None
        except TimeoutError:
            pass
        if server.proc is None or server.proc.poll() is None:
            failures = 0
            continue
        code = server.proc.returncode
        log.warning("nats-server exited; restarting it on the same store", code=code, port=server.port)
        try:
            await asyncio.to_thread(server.start)
            log.info("nats-server restarted", url=server.url)
            failures = 0
        except NatsServerError as exc:
            failures += 1
            if failures >= NATS_RESTART_TRIES:
                stop.set()
                return f"nats-server died (exit {code}) and could not be restarted: {exc}"
            await asyncio.sleep(min(5.0, every * 2**failures))
    return None


FIRST_PROMPT = "The three primary colors are"


def _first_request(url: str, model_dirs: list[str]) -> str:
    """One copy-paste request for the first model the folders hold: a text completion, which
    any GGUF does well (the demo model is pretrained, not instruction-tuned: it continues text
    and does not chat)."""
    names = sorted(p.stem for d in model_dirs for p in Path(d).glob("*.gguf"))
    model = names[0] if names else "MODEL"
    body = msgspec.json.encode({"model": model, "prompt": FIRST_PROMPT, "max_tokens": 24}).decode()
    return f"  try: curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"


async def _request(nc, subject: str, payload: bytes, timeout: float = 5.0) -> bytes:
    try:
        reply = await nc.request(subject, payload, timeout=timeout)
    except Exception as exc:
        raise UserError(f"no answer on {subject} (is the planner running?): {type(exc).__name__}") from None
    error = (reply.headers or {}).get("Nats-Service-Error")
    if error:
        raise UserError(error)
    return reply.data


def _parse_pairs(pairs: list[str]) -> dict:
    changes: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"{pair!r}: expected key=value")
        changes[key] = None if value.lower() in ("none", "null", "") else value
    return changes


async def _request_command(args: argparse.Namespace, auth: NatsAuth) -> int:
    try:
        nc = await connect(args.nats, name="lanes-cli", auth=auth, retry_forever=False)
    except Exception as exc:
        raise UserError(f"cannot connect to {args.nats}: {exc or type(exc).__name__}") from None
    try:
        if args.command == "config" and args.action == "get":
            print(msgspec.json.format(await _request(nc, subjects.CONFIG_GET, b"")).decode())
        elif args.command == "config":
            body = encode(ConfigSet(changes=_parse_pairs(args.pairs)))
            print(msgspec.json.format(await _request(nc, subjects.CONFIG_SET, body)).decode())
        elif args.command == "demand":
            demand = load_file(args.file, Demand)
            await _request(nc, subjects.DEMAND_SET, encode(demand))
            print(f"demand set: {len(demand.personas)} persona(s)")
        elif args.command == "explain":
            print((await _request(nc, subjects.PLAN_EXPLAIN, encode(HostQuery(host_id=args.host_id)))).decode())
        elif args.command == "status":
            query = FleetQuery(host=args.host, model=args.model, state=args.state, limit=min(args.limit, 1000),
                               after=args.after)  # fmt: skip
            while True:
                raw = await _request(nc, subjects.FLEET_STATUS, encode(query))
                fleet = msgspec.json.decode(raw, type=FleetStatus)
                if args.json:
                    print(raw.decode())
                else:
                    print(render_status(fleet, summary=query.after == args.after, more=not args.all))
                if not (args.all and fleet.next_after):
                    break
                query = msgspec.structs.replace(query, after=fleet.next_after)
            if not args.json:
                try:
                    lines = await tenant_lines(nc)
                except Exception as exc:  # the fleet was shown: say why the tenants' lines are not
                    lines = [f"tenants: usage not read ({type(exc).__name__}: {exc})"]
                for line in lines:
                    print(line)
    finally:
        await nc.close()
    return 0


USAGE_READ_TIMEOUT = 15.0  # seconds for each JetStream call reading the usage bucket (a loaded machine is slow)


async def tenant_lines(nc) -> list[str]:
    """One line per tenant: its tokens this minute and today over every gateway (KV bucket lanes-usage)."""
    from gateway.tenants import UsageBook
    from shared.messages.activity import TenantUsage
    from shared.messages.wire import decode

    from nats.js.errors import BucketNotFoundError

    try:
        kv = await nc.jetstream(timeout=USAGE_READ_TIMEOUT).key_value(subjects.USAGE_BUCKET)
        values = await read_all(kv, timeout=USAGE_READ_TIMEOUT)
    except BucketNotFoundError:  # no gateway counted anything yet
        return []
    book = UsageBook("")
    for value in values.values():
        try:
            book.merge(decode(value, TenantUsage))
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue  # not a usage entry: nothing to add up
    wall = time.time()
    out = []
    for tenant in sorted({t for t, _ in book.others}):
        minute, day = book.used(tenant, wall)
        gateways = sum(1 for t, _ in book.others if t == tenant)
        out.append(f"tenant {tenant}: {minute:.0f} tokens this minute, {day:.0f} today ({gateways} gateway(s))")
    return out


def summary_lines(s: FleetSummary) -> list[str]:
    """The whole fleet in a few lines, whatever its size."""
    out = [f"fleet: {s.hosts} host(s), {s.hosts_lost} lost, {s.hosts_rejecting} refusing their plan; "
           f"memory planned {gib(s.planned_bytes)}, used {gib(s.used_bytes)}; lane errors {s.lane_errors}, "
           f"feedback {s.feedback}, unplaced {s.unplaced}"]  # fmt: skip
    by_model: dict[str, list[str]] = {}
    for x in s.lanes:
        by_model.setdefault(x.model, []).append(f"{x.lanes} {x.state}")
    out += [f"  {model}: {', '.join(states)}" for model, states in sorted(by_model.items())]
    return out


def render_status(fleet: FleetStatus, summary: bool = True, more: bool = True) -> str:
    """One page of the fleet (`summary`: with the fleet-wide lines first; `more`: say how to ask
    for the next page)."""
    c: FleetConfig = fleet.config
    # The K/V types the plans give (a host whose llama-server lacks the configured type runs another).
    planned = sorted({cache_pair(s.cache_type_k, s.cache_type_v) for p in fleet.plans for s in p.lanes})
    out = []
    if summary:
        out.append(f"config r{fleet.config_revision}: kv {', '.join(planned) or '-'} as planned,"
                   f" flash_attn {c.flash_attn or 'unset'}")  # fmt: skip
        if fleet.planner_id:
            out.append(f"planner {fleet.planner_id} ({'active' if fleet.planner_active else 'stand-by'})")
        if fleet.summary is not None:
            out += summary_lines(fleet.summary)
    statuses = {s.host_id: s for s in fleet.statuses}
    plans = {p.host_id: p for p in fleet.plans}
    liveness = {h.host_id: h for h in fleet.hosts}
    host_rows = []
    for r in fleet.reports:
        plan = plans.get(r.host_id)
        status = statuses.get(r.host_id)
        live = liveness.get(r.host_id)
        state = live.state if live else "-"
        if live and live.state == "lost":
            state += f" ({live.seen_ago_s:.0f}s ago)"
        host_rows.append([r.host_id, state, r.cpu_cores, gib(r.ram_total), gib(r.ram_available),
                          f"r{plan.plan_revision}" if plan else "-", f"r{status.plan_revision}" if status else "-",
                          len(r.models)])  # fmt: skip
    out.append(table(["host", "state", "cores", "ram", "free", "plan", "applied", "models"], host_rows))
    for h in fleet.hosts:
        if h.rejected:
            out.append(f"{h.host_id} rejected its plan: {h.rejected}")
    rows = []
    for p in fleet.plans:
        status = statuses.get(p.host_id)
        live = {lane.lane_id: lane for lane in status.lanes} if status else {}
        for s in p.lanes:
            lane = live.get(s.lane_id)
            rows.append([
                p.host_id, s.lane_id, s.port, f"{s.ctx_per_slot}x{s.parallel}", threads_text(s),
                cache_pair(s.cache_type_k, s.cache_type_v), s.flash_attn or "-",
                mib(s.memory.kv_bytes), mib(lane.kv_bytes) if lane else "-",
                gib(s.memory.total_bytes), gib(lane.rss_bytes) if lane else "-",
                lane.state if lane else "pending", (lane.last_error[:60] if lane else ""),
            ])  # fmt: skip
    out.append(
        table(
            [
                "host",
                "lane",
                "port",
                "window",
                "threads",
                "kv k/v",
                "fa",
                "kv plan",
                "kv real",
                "mem plan",
                "rss",
                "state",
                "error",
            ],
            rows,
        )
    )
    for p in fleet.plans:
        status = statuses.get(p.host_id)
        printed = {lane.lane_id: lane.devices for lane in status.lanes} if status else {}
        for s in p.lanes:
            if len(s.memory.devices) > 1 or printed.get(s.lane_id):
                out.extend(device_lines(s, printed.get(s.lane_id, ())))
    for p in fleet.plans:  # span lanes: the ggml-rpc-servers each worker runs for them
        running = {w.port: w for w in statuses[p.host_id].rpc_workers} if p.host_id in statuses else {}
        for w in p.rpc_workers:
            seen = running.get(w.port)
            state = ("running" if seen.running else "exited") + (f", {seen.restarts} restarts" if seen.restarts else "") \
                if seen else "pending"  # fmt: skip
            out.append(f"ggml-rpc-server on {p.host_id} {w.bind}:{w.port} for {w.serving_host}'s {w.lane_id}:"
                       f" {gib(w.reserved_bytes)} reserved, {state}")
    for p in fleet.plans:
        for u in p.unplaced:
            out.append(f"unplaced on {p.host_id}: {u.model}: {u.reason}")
    if any(m.state != "loaded" for m in fleet.models):  # models on demand: what is not loaded, and why
        rows = [[m.name, m.model, m.state, ",".join(m.hosts) or "-", ",".join(m.holders) or "-", m.reason[:80]]
                for m in fleet.models]  # fmt: skip
        out.append(table(["model", "file", "state", "lanes on", "held by", "reason"], rows))
    if fleet.next_after and more:
        out.append(f"{len(fleet.hosts)} of {fleet.matched} host(s) shown; the next page: lanes status "
                   f"--after {fleet.next_after} (or --all, or --host/--model/--state to narrow)")  # fmt: skip
    return "\n".join(out)
