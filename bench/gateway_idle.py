"""A `lanes gateway` process with a large fleet in its view (issue 37 point 4): how long it takes to
read the fleet, its memory, and its CPU idle and while agents report as they do.

Run from the repository root:  .venv/bin/python bench/gateway_idle.py [--hosts 1000 10000] [--seconds 20] [--out F]

A real nats-server (the wheel's) holds the lanes bucket filled as a planner and agents would: a
plan, a status and a report for each simulated host (the fleet of tests/test_fleet_pages.py, 3
lanes a host, every lane healthy). The lanes' addresses share a few ports on 127.0.0.1, where the
bench answers `/health` as llama-server does, so the gateway's probes find them up. A real
`lanes gateway` process reads it. Then, for `--seconds` each:
- idle: no request, no bus traffic;
- agents reporting: each host's status put again every 30 s (the agents' report interval, with a
  new RSS) and each host's load refreshed every 10 s (HostLoad, defaults.LOAD_REFRESH), spread evenly.
Measured: seconds from the gateway's start to its view holding every host and the bucket read
(its `/ready`), its RSS, and its CPU (percent of one core) in each phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web
import nats
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from fixtures_bus import free_port_base  # noqa: E402
from shared import defaults, subjects  # noqa: E402
from shared.bus import kv_bucket, secrets_bucket  # noqa: E402
from shared.messages.status import HostLoad, LaneLoad  # noqa: E402
from shared.messages.wire import encode  # noqa: E402
from shared.natsserver import NatsServer  # noqa: E402
from test_fleet_pages import _fleet  # noqa: E402


async def fill(url: str, fleet) -> None:
    nc = await nats.connect(url)
    kv = await kv_bucket(nc, create=True)
    await secrets_bucket(nc, create=True)
    for table, key in ((fleet.plans, subjects.plan_key), (fleet.statuses, subjects.status_key),
                       (fleet.reports, subjects.report_key)):  # fmt: skip
        pending = []
        for host, msg in table.items():
            pending.append(kv.put(key(host), encode(msg)))
            if len(pending) >= 256:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
    await nc.close()


async def report_like_agents(url: str, fleet, seconds: float) -> int:
    """Statuses every 30 s and loads every 10 s per host, evenly spread; the messages sent."""
    nc = await nats.connect(url)
    kv = await kv_bucket(nc)
    hosts = list(fleet.statuses)
    rate_status, rate_load = len(hosts) / defaults.REPORT_INTERVAL, len(hosts) / defaults.LOAD_REFRESH
    sent, began, i, j = 0, time.perf_counter(), 0, 0
    while (elapsed := time.perf_counter() - began) < seconds:
        due_status, due_load = int(elapsed * rate_status), int(elapsed * rate_load)
        puts = []
        while i < due_status:
            status = fleet.statuses[hosts[i % len(hosts)]]
            status = msgspec.structs.replace(status, lanes=tuple(
                msgspec.structs.replace(lane, rss_bytes=(lane.rss_bytes or 0) + i) for lane in status.lanes))
            puts.append(kv.put(subjects.status_key(status.host_id), encode(status)))
            i += 1
        while j < due_load:
            status = fleet.statuses[hosts[j % len(hosts)]]
            load = HostLoad(host_id=status.host_id, lanes=tuple(
                LaneLoad(lane_id=lane.lane_id, pid=lane.pid, busy=0, progressing=True) for lane in status.lanes))
            await nc.publish(subjects.load_subject(status.host_id), encode(load))
            j += 1
        await asyncio.gather(*puts)
        sent += len(puts)
        await asyncio.sleep(0.05)
    await nc.flush()
    await nc.close()
    return sent + j


async def answer_health(ports: set[int]) -> list[web.AppRunner]:
    """/health answered 200 on the lanes' ports, as a serving llama-server answers it."""
    app = web.Application()
    app.router.add_get("/health", lambda _: web.json_response({"status": "ok"}))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in sorted(ports):
        await web.TCPSite(runner, "127.0.0.1", port).start()
    return [runner]


async def ready(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url + "/ready") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def hosts_seen(http: aiohttp.ClientSession, url: str) -> int:
    try:
        async with http.get(url + "/dashboard/api/state?limit=1") as resp:
            return (await resp.json())["summary"]["hosts"] if resp.status == 200 else 0
    except (aiohttp.ClientError, KeyError, ValueError):
        return 0


def peak_rss_mib(pid: int) -> float | None:
    """The process's high-water RSS (Linux: VmHWM), the read's peak before the freed heap went back."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def cpu_percent(proc: psutil.Process, work) -> float:
    before, began = sum(proc.cpu_times()[:2]), time.perf_counter()
    work()
    return round(100 * (sum(proc.cpu_times()[:2]) - before) / (time.perf_counter() - began), 2)


def on_free_ports(fleet):
    """The simulated lanes moved to free ports (the planner gave them 8080 and on), so the bench's
    `/health` answers never meet another program's port."""
    used = sorted({s.port for p in fleet.plans.values() for s in p.lanes})
    base = free_port_base(len(used))
    moved = {port: base + i for i, port in enumerate(used)}
    for host, plan in fleet.plans.items():
        fleet.plans[host] = msgspec.structs.replace(plan, lanes=tuple(
            msgspec.structs.replace(s, port=moved[s.port]) for s in plan.lanes))
    for host, status in fleet.statuses.items():
        fleet.statuses[host] = msgspec.structs.replace(status, lanes=tuple(
            msgspec.structs.replace(lane, port=moved.get(lane.port, lane.port)) for lane in status.lanes))
    return fleet


async def measure(hosts: int, seconds: float, tmp: Path) -> dict:
    fleet = on_free_ports(_fleet(hosts))
    server = NatsServer(tmp / f"nats-{hosts}").start()
    try:
        await fill(server.url, fleet)
        lanes_answer = await answer_health({s.port for p in fleet.plans.values() for s in p.lanes})
        port = free_port_base(1)
        url = f"http://127.0.0.1:{port}"
        began = time.perf_counter()
        gw = subprocess.Popen([str(ROOT / ".venv" / "bin" / "lanes"), "gateway", "--nats", server.url, "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=open(tmp / f"gateway-{hosts}.log", "wb"))  # fmt: skip
        try:
            proc = psutil.Process(gw.pid)
            async with aiohttp.ClientSession() as http:
                while not await ready(http, url) or await hosts_seen(http, url) < hosts:
                    if time.perf_counter() - began > 600:
                        raise RuntimeError(f"the gateway did not read {hosts} hosts in 600 s")
                    await asyncio.sleep(0.5)
            read_s = round(time.perf_counter() - began, 2)
            await asyncio.sleep(3.0)  # settle after the read
            idle = cpu_percent(proc, lambda: time.sleep(seconds))
            rss_idle = proc.memory_info().rss
            before, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
            sent = await report_like_agents(server.url, fleet, seconds)
            busy = round(100 * (sum(proc.cpu_times()[:2]) - before) / (time.perf_counter() - t0), 2)
            return {"hosts": hosts, "lanes": sum(len(p.lanes) for p in fleet.plans.values()), "read_s": read_s,
                    "rss_mib": round(rss_idle / 2**20, 1), "rss_peak_mib": peak_rss_mib(gw.pid), "idle_cpu_percent": idle,
                    "reporting_cpu_percent": busy, "agent_messages_per_s": round(sent / seconds, 1),
                    "rss_after_mib": round(proc.memory_info().rss / 2**20, 1)}  # fmt: skip
        finally:
            gw.terminate()
            gw.wait(30)
            for runner in lanes_answer:
                await runner.cleanup()
    finally:
        server.stop()


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, nargs="+", default=[1000, 10_000])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.hosts:
            row = await measure(n, args.seconds, Path(tmp))
            rows.append(row)
            print(f"{n:6d} hosts ({row['lanes']} lanes): read in {row['read_s']} s, RSS {row['rss_mib']} MiB (peak {row['rss_peak_mib']}), "
                  f"idle {row['idle_cpu_percent']}% of a core, {row['reporting_cpu_percent']}% with agents reporting "
                  f"({row['agent_messages_per_s']} messages/s), RSS after {row['rss_after_mib']} MiB")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs",
                                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "command": "bench/gateway_idle.py " + " ".join(sys.argv[1:]),
                                        "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
