"""Convergence: from `config set` to every agent having applied the new plan, against the bus.

Run from the repository root:
    .venv/bin/python bench/convergence_bench.py [--agents 50 200] [--trials 5] [--out bench/convergence_results.md]

A real nats-server (the wheel's) and a real planner process; N real agents (the agent code,
each with its own NATS connection, in one process) whose lanes are dry-run: each records
the argv it would launch and reports healthy at once. For each trial the fleet config flips
the KV cache type (q8_0 <-> none) and the time until each agent's status shows its lane
relaunched with the new argv is recorded. In the same run, the bus baseline: a request to
N subscribers (one connection each) and the time until all N replies are in. Both are
reported as p50/p99/max over agents, median over trials, and as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import msgspec  # noqa: E402
import nats  # noqa: E402
import psutil  # noqa: E402
from tinymodels import write_llama  # noqa: E402

from launcher_agent.config import AgentConfig  # noqa: E402
from launcher_agent.service import run_agent  # noqa: E402
from shared import subjects  # noqa: E402
from shared.bus import kv_bucket  # noqa: E402
from shared.logs import setup_logging  # noqa: E402
from shared.messages.hosts import ServerCaps  # noqa: E402
from shared.messages.replies import ConfigSet  # noqa: E402
from shared.messages.status import HostStatus  # noqa: E402
from shared.messages.wire import encode  # noqa: E402
from shared.natsserver import NatsServer  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def bus_baseline(url: str, n: int, trials: int) -> list[dict]:
    """Request fanned out to n subscribers on n connections; time to every reply."""
    subs = [await nats.connect(url) for _ in range(n)]
    for i, nc in enumerate(subs):

        async def answer(msg, i=i):
            await msg.respond(str(i).encode())

        await nc.subscribe("bench.fanout", cb=answer)
    for nc in subs:
        await nc.flush()
    client = await nats.connect(url)
    results = []
    for _ in range(trials + 1):  # the first is a warm-up
        inbox = client.new_inbox()
        arrived: list[float] = []
        done = asyncio.Event()

        async def collect(msg):
            arrived.append(time.perf_counter())
            if len(arrived) == n:
                done.set()

        sub = await client.subscribe(inbox, cb=collect)
        started = time.perf_counter()
        await client.publish("bench.fanout", b"ping", reply=inbox)
        await asyncio.wait_for(done.wait(), 30)
        await sub.unsubscribe()
        results.append([t - started for t in arrived])
    for nc in [client, *subs]:
        await nc.close()
    return [summary(r) for r in results[1:]]


def summary(latencies: list[float]) -> dict:
    return {
        "p50": statistics.median(latencies),
        "p99": pct(latencies, 0.99),
        "max": max(latencies),
        "n": len(latencies),
    }


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def control_plane(url: str, n: int, trials: int, models: Path, data: Path, planner_pid: int) -> list[dict]:
    caps = ServerCaps()
    stop = asyncio.Event()
    hosts = [f"sim-{i:04d}" for i in range(n)]
    tasks = [
        asyncio.create_task(
            run_agent(
                AgentConfig(host_id=h, model_dirs=[str(models)], binary="/usr/bin/llama-server", caps=caps,
                            data_dir=data / h, report_interval=3600, dry_run=True),
                url,
                stop,
            )
        )
        for h in hosts
    ]  # fmt: skip
    client = await nats.connect(url)
    for _ in range(200):  # the planner process creates the bucket
        try:
            kv = await kv_bucket(client)
            break
        except Exception:
            await asyncio.sleep(0.05)
    seen: dict[str, tuple[str, float]] = {}  # host -> (cache type in its lane's argv, when seen)

    def cache_type(status: HostStatus) -> str | None:
        if not status.lanes or status.lanes[0].state != "healthy":
            return None
        argv = list(status.lanes[0].argv)
        return argv[argv.index("--cache-type-k") + 1] if "--cache-type-k" in argv else "f16"

    async def watch() -> None:
        watcher = await kv.watch(subjects.STATUS_KEYS)
        while True:
            entry = await watcher.updates(timeout=None)
            if entry is None or entry.value is None:
                continue
            try:
                status = msgspec.json.decode(entry.value, type=HostStatus)
            except msgspec.DecodeError:
                continue
            kind = cache_type(status)
            if kind is not None:
                seen[subjects.host_token(status.host_id)] = (kind, time.perf_counter())

    watcher_task = asyncio.create_task(watch())

    async def all_on(kind: str, timeout: float = 120) -> None:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if len(seen) == n and all(k == kind for k, _ in seen.values()):
                return
            await asyncio.sleep(0.01)
        missing = [h for h in hosts if seen.get(h, ("?",))[0] != kind]
        raise TimeoutError(f"{len(missing)} agents never reached {kind}: {missing[:5]}")

    await all_on("f16")
    results = []
    for trial in range(trials + 1):  # the first is a warm-up
        kind = "q8_0" if trial % 2 == 0 else "f16"
        started = time.perf_counter()
        reply = await client.request(
            subjects.CONFIG_SET,
            encode(ConfigSet(changes={"kv_cache_type": None if kind == "f16" else kind})),
            timeout=10,
        )
        assert "Nats-Service-Error" not in (reply.headers or {}), reply.headers
        await all_on(kind)
        results.append([t - started for _, t in seen.values()])
        if trial == 0:
            cpu_from = (cpu_seconds(os.getpid()), cpu_seconds(planner_pid))
    cpu_to = (cpu_seconds(os.getpid()), cpu_seconds(planner_pid))
    cpu = {"agents_cpu_s": (cpu_to[0] - cpu_from[0]) / trials, "planner_cpu_s": (cpu_to[1] - cpu_from[1]) / trials}
    watcher_task.cancel()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    return [summary(r) | cpu for r in results[1:]]


def median_of(trials: list[dict], key: str) -> float:
    return statistics.median(t[key] for t in trials)


async def run(agent_counts: list[int], trials: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = tmp / "models"
        models.mkdir()
        write_llama(models / "m.gguf", n_layer=2, n_ctx_train=4096)
        for n in agent_counts:
            server = NatsServer(tmp / f"nats-{n}").start()
            planner = subprocess.Popen(
                [str(ROOT / ".venv" / "bin" / "lanes"), "planner", "--nats", server.url],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                baseline = await bus_baseline(server.url, n, trials)
                plane = await control_plane(server.url, n, trials, models, tmp / f"agents-{n}", planner.pid)
            finally:
                planner.terminate()
                planner.wait(10)
                server.stop()
            row = {
                "agents": n,
                "plane": {k: median_of(plane, k) for k in ("p50", "p99", "max")},
                "bus": {k: median_of(baseline, k) for k in ("p50", "p99", "max")},
                "planner_cpu_s": plane[0]["planner_cpu_s"],
                "agents_cpu_s": plane[0]["agents_cpu_s"],
            }
            row["ratio_max"] = row["plane"]["max"] / row["bus"]["max"]
            row["ratio_p50"] = row["plane"]["p50"] / row["bus"]["p50"]
            rows.append(row)
            print(
                f"{n:4d} agents: config set -> applied p50 {row['plane']['p50'] * 1000:7.1f} ms"
                f" p99 {row['plane']['p99'] * 1000:7.1f} ms all {row['plane']['max'] * 1000:7.1f} ms | bus fan-out"
                f" p50 {row['bus']['p50'] * 1000:6.1f} ms all {row['bus']['max'] * 1000:6.1f} ms"
                f" | ratio all {row['ratio_max']:.1f}x"
            )
    return rows


def write(rows: list[dict], trials: int, out: Path, command: str) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    lines = [
        "# Convergence: `config set` to every agent applied, against the bus itself",
        "",
        f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; {platform.platform()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"- lanes commit: {commit.strip()}",
        f"- Command: `{command}`",
        f"- {trials} trials per size (after a warm-up); figures are medians over trials. One nats-server, the",
        "  planner as its own process, all agents in one process (real agent code, dry-run lanes), the",
        "  measuring client in the agents' process: on 2 cores they compete for the CPU.",
        "",
        "| agents | applied p50 ms | p99 ms | all ms | bus fan-out p50 ms | p99 ms | all ms | ratio (all) | ratio (p50) "
        "| agents' CPU ms per change | planner CPU ms per change |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, b = r["plane"], r["bus"]
        lines.append(
            f"| {r['agents']} | {p['p50'] * 1000:.1f} | {p['p99'] * 1000:.1f} | {p['max'] * 1000:.1f} | "
            f"{b['p50'] * 1000:.1f} | {b['p99'] * 1000:.1f} | {b['max'] * 1000:.1f} | {r['ratio_max']:.1f}x | "
            f"{r['ratio_p50']:.1f}x | {r['agents_cpu_s'] * 1000:.0f} | {r['planner_cpu_s'] * 1000:.0f} |"
        )
    lines += [
        "",
        "`applied` is the time from sending `config set` until an agent's status shows its lane",
        "relaunched with the new cache type: the planner's replan of every host, one plan write per",
        "host, each agent's watch, validation, reconcile and status write. The bus fan-out is one",
        "request to as many subscribers, each on its own connection, until every reply is in.",
    ]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "convergence_results.md"))
    args = parser.parse_args()
    setup_logging("error")
    rows = asyncio.run(run(args.agents, args.trials))
    write(rows, args.trials, Path(args.out), "python bench/convergence_bench.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
