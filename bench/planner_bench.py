"""How long one full replan takes as the fleet grows (the planner replans on every change),
one host's change at the largest size, and the published plans' fan-out to as many agents.

Run from the repository root:  .venv/bin/python bench/planner_bench.py [--out bench/planner_results.md]

Each fleet size is planned 5 times; the median is reported (wall and CPU time: on a shared
machine the CPU time is the planner's own work), with the time per lane and the ratio to the
smallest fleet measured in the same run (compare ratios, not absolute times, across runs).
The fan-out writes every host's plan into the KV bucket of one nats-server as the planner
service does (compare-and-set, WRITE_CONCURRENCY at a time) while simulated agents, a
subscription on each host's plan key as shared.bus.follow_key makes, spread over a few
connections, wait for theirs; then each agent reads its plan back with a direct get.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from planner_svc.planner import plan  # noqa: E402
from planner_svc.service import WRITE_CONCURRENCY  # noqa: E402
from planner_svc.state import PlannerState  # noqa: E402
from shared import subjects  # noqa: E402
from shared.bus import connect, kv_bucket  # noqa: E402
from shared.messages.activity import ModelStates  # noqa: E402
from shared.messages.config import FleetConfig  # noqa: E402
from shared.messages.hosts import HostReport, ModelFacts, ServerCaps  # noqa: E402
from planner_svc.fleet_pages import Fleet, hosts_value, models_value, page  # noqa: E402
from shared.messages.replies import FleetQuery, FleetStatus  # noqa: E402
from shared.messages.wire import encode  # noqa: E402
from shared.natsserver import NatsServer  # noqa: E402
from shared.subjects import kv_subject  # noqa: E402

GIB = 2**30
SIZES = (10, 100, 1000, 5000, 10000)
RUNS = 5
AGENT_CONNECTIONS = 8  # the simulated agents' subscriptions are spread over this many connections


def facts(name: str, layers: int, kv: int, weights: int, swa: int = 0) -> ModelFacts:
    swa_layers = tuple(i % 6 < 5 for i in range(layers)) if swa else ()
    return ModelFacts(path=f"/models/{name}.gguf", name=name, architecture="gemma3" if swa else "llama",
                      n_layer=layers, n_embd=4096, n_head=32, n_head_kv=(kv,) * layers, head_dim_k=128,
                      head_dim_v=128, n_ctx_train=131072, n_vocab=128256, n_ff=14336, n_swa=swa,
                      swa_layers=swa_layers, weight_bytes=weights)  # fmt: skip


MODELS = (
    facts("llama-8b", 32, 8, 5 * GIB),
    facts("qwen-14b", 48, 8, 9 * GIB),
    facts("gemma-12b", 48, 8, 7 * GIB, swa=1024),
)


def fleet(n: int, distinct: bool = False) -> list[HostReport]:
    """`distinct`: every host a different free RAM (no two budgets alike), not nine figures."""
    return [
        HostReport(
            host_id=f"host-{i:05d}",
            cpu_cores=16,
            ram_total=64 * GIB,
            ram_available=36 * GIB + i * 2**20 if distinct else (36 + i % 9) * GIB,
            server=ServerCaps(),
            models=MODELS,
            renders_argv=True,  # today's agents render argv from the lane spec themselves
        )  # fmt: skip
        for i in range(n)
    ]


def per_event_cost(n: int) -> tuple[float, float]:
    """The planner service's path for one changed report in a fleet of n: fold the KV entry
    in, then plan (only that host is replanned). Median seconds over RUNS events, wall and CPU."""
    state = PlannerState()
    for i, report in enumerate(fleet(n)):
        state.apply(subjects.report_key(report.host_id), encode(report), i + 1)
    state.caught_up = True
    state.plans.update(state.planning_job()().plans)  # the first replan covers every host
    times, cpu = [], []
    for k in range(RUNS):
        changed = msgspec.structs.replace(fleet(1)[0], ram_available=(30 + k) * GIB)
        started, started_cpu = time.perf_counter(), time.process_time()
        state.apply(subjects.report_key(changed.host_id), encode(changed), n + k + 1)
        planned = state.planning_job()().plans
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
        assert list(planned) == [subjects.host_token(changed.host_id)]
        state.plans.update(planned)  # as the service keeps what it wrote
    return statistics.median(times), statistics.median(cpu)


async def fanout(n: int, connections: int = AGENT_CONNECTIONS) -> dict[str, float]:
    """Seconds from the first plan write to every simulated agent notified, and to every agent
    having read its plan back (direct get); sizes of what the bucket holds."""
    reports = fleet(n)
    plans = plan(reports, FleetConfig(kv_cache_type="q8_0")).hosts
    with tempfile.TemporaryDirectory() as folder:
        server = NatsServer(folder).start()
        try:
            figures = await _fanout(server.url, plans, connections)
        finally:
            server.stop()
    return figures | whole_fleet_values(reports, plans)


def whole_fleet_values(reports, plans) -> dict[str, int]:
    """Bytes of the values that hold every host at once: the `hosts` and `models` keys and the
    planner's fleet.status reply (lanes status)."""
    state = PlannerState()
    for i, report in enumerate(reports):
        state.apply(subjects.report_key(report.host_id), encode(report), i + 1)
    state.plans.update({subjects.host_token(p.host_id): p for p in plans})
    models = state.model_states()[0].models
    whole = FleetStatus(reports=tuple(reports), plans=tuple(plans), hosts=state.liveness(), models=models)
    fleet = Fleet(reports={r.host_id: r for r in reports}, plans={p.host_id: p for p in plans}, statuses={},
                  liveness=state.liveness(), models=models)  # fmt: skip
    return {
        "hosts_key_bytes": len(encode(hosts_value(state.liveness()))),
        "models_key_bytes": len(encode(models_value(ModelStates(models=models)))),
        "status_page_bytes": len(encode(page(fleet, FleetQuery(limit=1000), FleetStatus()))),
        "status_whole_bytes": len(encode(whole)),  # the one reply of before: not sent any more
        "report_bytes": len(encode(reports[0])),
    }


async def _fanout(url: str, plans, connections: int) -> dict[str, float]:
    planner = await connect(url, name="bench-planner")
    agents = [await connect(url, name=f"bench-agents-{k}") for k in range(connections)]
    try:
        kv = await kv_bucket(planner, create=True)
        agent_kvs = [await kv_bucket(nc) for nc in agents]
        values = {p.host_id: encode(p) for p in plans}
        heard: dict[str, float] = {}
        everyone = asyncio.Event()

        def on_plan(host: str):
            async def cb(msg) -> None:
                heard.setdefault(host, time.perf_counter())
                if len(heard) == len(values):
                    everyone.set()

            return cb

        for k, host in enumerate(values):
            await agents[k % connections].subscribe(kv_subject(subjects.plan_key(host)), cb=on_plan(host))
        for nc in agents:
            await nc.flush()
        limit = asyncio.Semaphore(WRITE_CONCURRENCY)

        async def write(host: str, data: bytes) -> None:
            async with limit:
                await kv.create(subjects.plan_key(host), data)

        started = time.perf_counter()
        await asyncio.gather(*(write(h, v) for h, v in values.items()))
        written = time.perf_counter()
        await asyncio.wait_for(everyone.wait(), 120)
        notified = max(heard.values())
        read_limit = asyncio.Semaphore(WRITE_CONCURRENCY)

        async def read(k: int, host: str) -> None:
            async with read_limit:
                entry = await agent_kvs[k % connections].get(subjects.plan_key(host))
                assert entry.value == values[host]

        await asyncio.gather(*(read(k, h) for k, h in enumerate(values)))
        read_back = time.perf_counter()
        sizes = sorted(len(v) for v in values.values())
        return {
            "hosts": len(values),
            "written": written - started,
            "notified": notified - started,
            "read_back": read_back - started,
            "plan_bytes_median": statistics.median(sizes),
            "plan_bytes_max": sizes[-1],
            "plans_bytes": sum(sizes),
            "max_payload": planner.max_payload,
        }
    finally:
        for nc in (planner, *agents):
            await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "bench" / "planner_results.md"))
    parser.add_argument("--small", action="store_true", help="10 and 100 hosts only (a smoke run)")
    args = parser.parse_args()
    sizes = SIZES[:2] if args.small else SIZES
    config = FleetConfig(kv_cache_type="q8_0")
    rows = []
    for n in sizes:
        reports = fleet(n)
        times, cpu, lanes = [], [], 0
        for _ in range(RUNS):
            started, started_cpu = time.perf_counter(), time.process_time()
            result = plan(reports, config)
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - started_cpu)
            lanes = sum(len(h.lanes) for h in result.hosts)
        tracemalloc.start()
        plan(reports, config)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rows.append((n, lanes, statistics.median(times), statistics.median(cpu), peak))
        print(
            f"{n:5d} hosts {lanes:6d} lanes: median {statistics.median(times) * 1000:8.1f} ms"
            f" (CPU {statistics.median(cpu) * 1000:.1f} ms), peak {peak / 2**20:.1f} MiB"
        )
    reports = fleet(sizes[-1], distinct=True)
    distinct = []
    for _ in range(RUNS):
        started, started_cpu = time.perf_counter(), time.process_time()
        plan(reports, config)
        distinct.append((time.perf_counter() - started, time.process_time() - started_cpu))
    distinct_wall, distinct_cpu = (statistics.median(x) for x in zip(*distinct))
    print(f"{sizes[-1]} hosts, each a different free RAM: median {distinct_wall * 1000:.1f} ms (CPU {distinct_cpu * 1000:.1f} ms)")
    event_hosts = sizes[-1]
    event, event_cpu = per_event_cost(event_hosts)
    full = rows[-1][2]
    print(
        f"one report changed in {event_hosts} hosts: {event * 1000:.2f} ms (CPU {event_cpu * 1000:.2f} ms),"
        f" {full / event:.0f}x less than a full replan"
    )
    fan = asyncio.run(fanout(event_hosts))
    print(
        f"fan-out to {event_hosts} agents: written {fan['written'] * 1000:.0f} ms, all notified"
        f" {fan['notified'] * 1000:.0f} ms, all read back {fan['read_back'] * 1000:.0f} ms"
    )
    base = rows[0][2] / rows[0][1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    lines = [
        "# Planner: time of one full replan by fleet size",
        "",
        f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; {platform.platform()}, Python {platform.python_version()}",
        f"- lanes commit: {commit.strip()}",
        "- Command: `.venv/bin/python bench/planner_bench.py`",
        f"- Each host: 64 GiB RAM, 36-44 GiB free, three models (8B, 14B, a 12B with sliding window); "
        f"kv_cache_type=q8_0; each host's agent renders argv itself (renders_argv, as today's agents do: "
        f"plans carry no argv). Median of {RUNS} runs (the first, with the planner's memory-model caches cold, "
        "is among them).",
        "",
        "| hosts | lanes | median ms | CPU ms | ms per lane | per-lane ratio to the smallest fleet | peak MiB (tracemalloc) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, lanes, t, c, peak in rows:
        lines.append(
            f"| {n} | {lanes} | {t * 1000:.1f} | {c * 1000:.1f} | {t * 1000 / lanes:.3f} | {t / lanes / base:.2f}"
            f" | {peak / 2**20:.1f} |"
        )
    lines += [
        "",
        f"The same {sizes[-1]} hosts with every host's free RAM different (36 GiB + i MiB: no two budgets alike,",
        f"so no window search is shared): median {distinct_wall * 1000:.1f} ms, CPU {distinct_cpu * 1000:.1f} ms.",
        "",
        f"One host's report changing in a fleet of {event_hosts}: {event * 1000:.2f} ms, CPU {event_cpu * 1000:.2f} ms"
        f" (medians of {RUNS}) from the",
        f"KV entry to that host's new plan, {full / event:.0f}x less than a full replan: only the changed host is",
        "replanned unless the config or demand changed, or the demand spreads a persona's lanes over hosts.",
        "",
        "The planner runs off the event loop (a thread) and waits at least as long as the last",
        "replan took before the next, so a large fleet replans at most every other such interval.",
        "",
        f"## Fan-out of the published plans to {fan['hosts']} agents (one nats-server)",
        "",
        f"Every host's plan written to the KV bucket ({WRITE_CONCURRENCY} compare-and-set writes in flight, as the",
        f"planner service writes them); {fan['hosts']} simulated agents, one subscription on its plan key each",
        f"(shared.bus.follow_key), over {AGENT_CONNECTIONS} connections, all in this one process.",
        "",
        "| step | from the first write |",
        "|---|---|",
        f"| every plan written (acknowledged) | {fan['written'] * 1000:.0f} ms |",
        f"| every agent notified | {fan['notified'] * 1000:.0f} ms |",
        f"| every agent read its plan back (direct get) | {fan['read_back'] * 1000:.0f} ms |",
        "",
        f"A host plan is {fan['plan_bytes_median'] / 1024:.1f} KiB (median; largest {fan['plan_bytes_max'] / 1024:.1f} KiB);",
        f"all {fan['hosts']} plans {fan['plans_bytes'] / 2**20:.1f} MiB per revision; a host report"
        f" {fan['report_bytes'] / 1024:.1f} KiB (these facts carry no per-layer weights, real ones do).",
        f"Values every gateway or `lanes status` reads, against the server's max payload of {fan['max_payload'] / 2**20:.0f} MiB:",
        f"the `hosts` key {fan['hosts_key_bytes'] / 1024:.1f} KiB, the `models` key {fan['models_key_bytes'] / 1024:.1f} KiB,",
        f"a page of the planner's fleet.status reply (`lanes status`) {fan['status_page_bytes'] / 1024:.0f} KiB",
        f"(the whole fleet in one reply, as before paging: {fan['status_whole_bytes'] / 2**20:.1f} MiB).",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
