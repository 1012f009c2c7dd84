"""The operator's paths at 100, 1,000 and 10,000 hosts, on one 3-node NATS cluster (issue 37 point 5).

Run from the repository root:
    .venv/bin/python bench/fleet_scale.py [--hosts 100 1000 10000] [--out bench/fleet_scale.json]

Per size, everything as deployed, each its own process: a 3-node JetStream cluster (the wheel's
nats-server), a real `lanes planner` (--kv-replicas 3), a real `lanes gateway` (its dashboard
included) and the `lanes status` CLI. The hosts are simulated: their reports (bench/planner_bench.py's
fleet: 3 models a host) go into the bucket as agents would put them, and once the planner has
planned them, a status per host says every planned lane healthy, on a few local ports where the
bench answers `/health` as llama-server does.

Measured, one table:
- planned: the last report put -> every host's plan in the bucket;
- largest value: the largest entry the bucket holds (plans, statuses, reports, hosts, models);
- `lanes status`: the CLI's wall time and output for the first page and the summary;
- config -> every plan: a `config set` (the KV cache type) until every host's plan holds it
  (the planner's part of a change; bench/convergence_bench.py adds the agents' part with real agents);
- the gateway: its read of the bucket, RSS (and peak), CPU idle;
- the dashboard's state: the first page (50 hosts and the summary) and one host searched by name.
Routing decisions a second and the dashboard in a browser are bench/gateway_scale.py's and
bench/dashboard_scale.py's (in process: they need no cluster).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import aiohttp  # noqa: E402
import msgspec  # noqa: E402
import nats  # noqa: E402
import psutil  # noqa: E402
from fixtures_bus import free_port_base, start_nats_cluster  # noqa: E402
from gateway_idle import answer_health, cpu_percent, hosts_seen, peak_rss_mib, ready  # noqa: E402
from planner_bench import fleet as simulated_fleet  # noqa: E402

from shared import subjects  # noqa: E402
from shared.bus import kv_bucket, read_all  # noqa: E402
from shared.lane_key import lane_key  # noqa: E402
from shared.messages.config import FleetConfig  # noqa: E402
from shared.messages.plans import HostPlan  # noqa: E402
from shared.messages.replies import ConfigSet  # noqa: E402
from shared.messages.status import HostStatus, LaneStatus  # noqa: E402
from shared.messages.wire import encode  # noqa: E402

LANES = str(ROOT / ".venv" / "bin" / "lanes")
HEALTH_PORTS = 8  # the simulated lanes answer /health on this many local ports


async def put_all(kv, items: list[tuple[str, bytes]]) -> None:
    for i in range(0, len(items), 256):
        await asyncio.gather(*(kv.put(key, value) for key, value in items[i:i + 256]))


async def plans_where(kv, hosts: set[str], good, timeout: float) -> tuple[float, dict[str, HostPlan]]:
    """Seconds until every host's plan passes `good`, and the plans then (a watch of the plan keys)."""
    began, found = time.perf_counter(), {}
    watcher = await kv.watch(subjects.PLAN_KEYS)
    try:
        while time.perf_counter() - began < timeout:
            try:
                entry = await watcher.updates(timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            if entry is None or entry.value is None:
                continue
            plan = msgspec.json.decode(entry.value, type=HostPlan)
            host = subjects.host_token(plan.host_id)
            if host in hosts and good(plan):
                found[host] = plan
                if len(found) == len(hosts):
                    return round(time.perf_counter() - began, 2), found
    finally:
        await watcher.stop()
    raise TimeoutError(f"{len(hosts) - len(found)} of {len(hosts)} hosts' plans not seen in {timeout:g} s")


def healthy_status(plan: HostPlan, ports: list[int], i: int) -> HostStatus:
    lanes = tuple(LaneStatus(lane_id=s.lane_id, state="healthy", port=ports[(i + k) % len(ports)], pid=10_000 + i,
                             plan_revision=plan.plan_revision, ctx_total=s.ctx_total, lane_key=lane_key(s),
                             planned_bytes=s.memory.total_bytes, rss_bytes=s.memory.total_bytes // 2)
                  for k, s in enumerate(plan.lanes))  # fmt: skip
    return HostStatus(host_id=plan.host_id, plan_revision=plan.plan_revision, lanes=lanes)


async def largest_value(kv) -> tuple[int, str]:
    """The bucket's largest entry, and its key (every key's last value)."""
    values = await read_all(kv)
    which = max(values, key=lambda k: len(values[k]), default="")
    return (len(values[which]) if which else 0), which


def cli(urls: str, *args: str) -> tuple[float, int]:
    began = time.perf_counter()
    out = subprocess.run([LANES, "status", "--nats", urls, *args], capture_output=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"lanes status {' '.join(args)}: {out.stderr.decode()[-400:]}")
    return round(time.perf_counter() - began, 2), len(out.stdout)


async def timed_get(http: aiohttp.ClientSession, url: str) -> tuple[float, int, dict]:
    began = time.perf_counter()
    async with http.get(url) as resp:
        body = await resp.read()
    return round((time.perf_counter() - began) * 1e3, 1), len(body), json.loads(body)


async def measure(n: int, work: Path, idle_seconds: float, logs: Path) -> dict:
    row: dict = {"hosts": n}
    nodes = start_nats_cluster(work / f"size-{n}")
    urls = ",".join(node.url for node in nodes)
    procs: list[subprocess.Popen] = []
    lanes_answer = []
    try:
        procs.append(subprocess.Popen([LANES, "planner", "--nats", urls, "--kv-replicas", "3"], stdout=subprocess.DEVNULL,
                                      stderr=open(logs / f"planner-{n}.log", "wb")))  # fmt: skip
        nc = await nats.connect(urls.split(","))
        for _ in range(600):  # the planner makes the bucket
            try:
                kv = await kv_bucket(nc)
                break
            except Exception:
                await asyncio.sleep(0.1)
        reports = simulated_fleet(n)
        hosts = {subjects.host_token(r.host_id) for r in reports}
        began = time.perf_counter()
        await put_all(kv, [(subjects.report_key(r.host_id), encode(r)) for r in reports])
        row["reports_put_s"] = round(time.perf_counter() - began, 2)
        row["planned_s"], plans = await plans_where(kv, hosts, lambda p: bool(p.lanes), timeout=900)
        row["lanes"] = sum(len(p.lanes) for p in plans.values())
        ports = free_port_base(HEALTH_PORTS)
        ports = list(range(ports, ports + HEALTH_PORTS))
        lanes_answer = await answer_health(set(ports))
        await put_all(kv, [(subjects.status_key(p.host_id), encode(healthy_status(p, ports, i)))
                           for i, p in enumerate(plans.values())])  # fmt: skip
        await asyncio.sleep(2.0)  # the planner folds the statuses in
        row["largest_value_bytes"], row["largest_value_key"] = await largest_value(kv)
        row["status_page_s"], row["status_page_bytes"] = cli(urls)
        row["status_json_s"], row["status_json_bytes"] = cli(urls, "--json")
        # A change every lane takes at once (the default max_unavailable rolls one lane of a model at a
        # time), and hosts that stay known while the bench runs (they report once; 90 s of silence: lost).
        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"max_unavailable": min(n, 10_000),
                                                                                "host_lost_after": 86_400})), timeout=30)
        revision = msgspec.json.decode(reply.data, type=FleetConfig).revision
        await plans_where(kv, hosts, lambda p: p.config_revision >= revision, timeout=900)  # that replan is done
        await asyncio.sleep(1.0)
        began = time.perf_counter()
        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q4_0"})), timeout=60)
        assert "Nats-Service-Error" not in (reply.headers or {}), reply.headers
        _, _ = await plans_where(kv, hosts, lambda p: all(s.cache_type_k == "q4_0" for s in p.lanes), timeout=900)
        row["config_to_every_plan_s"] = round(time.perf_counter() - began, 2)
        # The gateway, as a process, and its dashboard's state.
        port = free_port_base(1)
        url = f"http://127.0.0.1:{port}"
        began = time.perf_counter()
        gw = subprocess.Popen([LANES, "gateway", "--nats", urls, "--port", str(port)], stdout=subprocess.DEVNULL,
                              stderr=open(logs / f"gateway-{n}.log", "wb"))  # fmt: skip
        procs.append(gw)
        async with aiohttp.ClientSession() as http:
            while not await ready(http, url) or await hosts_seen(http, url) < n:
                if time.perf_counter() - began > 600:
                    raise RuntimeError(f"the gateway did not read {n} hosts in 600 s")
                await asyncio.sleep(0.25)
            row["gateway_read_s"] = round(time.perf_counter() - began, 2)
            await asyncio.sleep(3.0)
            proc = psutil.Process(gw.pid)
            row["gateway_idle_cpu_percent"] = cpu_percent(proc, lambda: time.sleep(idle_seconds))
            row["gateway_rss_mib"] = round(proc.memory_info().rss / 2**20, 1)
            row["gateway_rss_peak_mib"] = peak_rss_mib(gw.pid)
            row["dashboard_page_ms"], row["dashboard_page_bytes"], state = await timed_get(
                http, url + "/dashboard/api/state?limit=50")
            assert state["summary"]["hosts"] == n and len(state["hosts"]) == min(50, n)
            some = sorted(hosts)[n // 2]
            row["dashboard_search_ms"], _, found = await timed_get(http, url + f"/dashboard/api/state?host={some}")
            assert [h["host_id"] for h in found["hosts"]] == [plans[some].host_id], found["page"]
        await nc.close()
        return row
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for runner in lanes_answer:
            await runner.cleanup()
        for node in nodes:
            node.stop()


COLUMNS = [("hosts", "hosts"), ("lanes", "lanes"), ("planned_s", "planned (s)"),
           ("largest_value_bytes", "largest KV value (bytes)"), ("status_page_s", "`lanes status` (s)"),
           ("status_json_bytes", "`--json` (bytes)"), ("config_to_every_plan_s", "config -> every plan (s)"),
           ("gateway_read_s", "gateway read (s)"), ("gateway_rss_mib", "gateway RSS (MiB)"),
           ("gateway_rss_peak_mib", "peak"), ("gateway_idle_cpu_percent", "gateway idle (% of a core)"),
           ("dashboard_page_ms", "dashboard page (ms)"), ("dashboard_page_bytes", "(bytes)"),
           ("dashboard_search_ms", "host searched (ms)")]  # fmt: skip


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(label for _, label in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r.get(key, '')}" for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, nargs="+", default=[100, 1000, 10_000])
    ap.add_argument("--idle-seconds", type=float, default=15.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--logs", type=Path, default=None, help="keep the planner's and gateway's logs here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.hosts:
            logs = args.logs or Path(tmp)
            logs.mkdir(parents=True, exist_ok=True)
            rows.append(await measure(n, Path(tmp), args.idle_seconds, logs))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps({"machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs",
                                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "command": "bench/fleet_scale.py " + " ".join(sys.argv[1:]),
                                        "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
