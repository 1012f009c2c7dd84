"""Convergence: from `config set` to every agent holding, then having applied, the new plan, against the bus.

Run from the repository root:
    .venv/bin/python bench/convergence_bench.py [--agents 100 1000] [--trials 5] [--procs 2] [--out bench/convergence_results.md]

A real nats-server (the wheel's) and a real planner process; N real agents (the agent code, each
with its own NATS connection) in --procs processes, whose lanes are dry-run: each records the argv
it would launch and reports healthy at once. For each trial the fleet config flips the KV cache type
(q8_0 <-> none); recorded per agent: when its status first holds the new plan ("taken"), and when it
shows its lane relaunched with the new argv ("applied"). In the same run, the bus baseline: a request
to N subscribers (one connection each, in as many processes) and the time until all N replies are
in. Reported as p50/p99/max over agents, median over trials, and as a ratio. The fleet's
max_unavailable is every lane unless --max-unavailable says otherwise (the default, 1, rolls a model's
lanes one at a time across the fleet: n waves).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
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


WORKER_HOSTS = "sim-{:05d}"


async def worker(role: str, url: str, first: int, count: int, models: str, data: str) -> None:
    """One process of the simulated fleet: `count` agents (real agent code, dry-run lanes) or
    `count` fan-out responders, each on its own connection; "ready" on stdout, then until stdin closes."""
    stop = asyncio.Event()
    if role == "agents":
        tasks = [asyncio.create_task(run_agent(
            AgentConfig(host_id=WORKER_HOSTS.format(i), model_dirs=[models], binary="/usr/bin/llama-server",
                        caps=ServerCaps(), data_dir=Path(data) / WORKER_HOSTS.format(i), report_interval=3600,
                        dry_run=True), url, stop)) for i in range(first, first + count)]  # fmt: skip
        conns = []
    else:
        tasks, conns = [], [await nats.connect(url) for _ in range(count)]
        for nc in conns:
            async def answer(msg):
                await msg.respond(b"1")

            await nc.subscribe("bench.fanout", cb=answer)
            await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes it
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    for nc in conns:
        await nc.close()


def start_workers(role: str, url: str, n: int, procs: int, models: Path, data: Path) -> list[subprocess.Popen]:
    """n agents or responders over `procs` processes; returned once each said it is ready."""
    workers, per = [], -(-n // procs)
    for first in range(0, n, per):
        workers.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", role, "--url", url, "--first", str(first),
             "--count", str(min(per, n - first)), "--models", str(models), "--data", str(data)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))  # fmt: skip
    for w in workers:
        if w.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a {role} worker did not start")
    return workers


def stop_workers(workers: list[subprocess.Popen]) -> None:
    for w in workers:
        w.stdin.close()
    for w in workers:
        try:
            w.wait(60)
        except subprocess.TimeoutExpired:
            w.kill()


async def bus_baseline(url: str, n: int, trials: int, procs: int, tmp: Path) -> list[dict]:
    """A request fanned out to n subscribers (one connection each, in `procs` processes); time to every reply."""
    workers = start_workers("responders", url, n, procs, tmp, tmp)
    client = await nats.connect(url)
    results = []
    try:
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
            await asyncio.wait_for(done.wait(), 60)
            await sub.unsubscribe()
            results.append([t - started for t in arrived])
    finally:
        await client.close()
        stop_workers(workers)
    return [summary(r) for r in results[1:]]


def summary(latencies: list[float]) -> dict:
    return {
        "p50": statistics.median(latencies),
        "p99": pct(latencies, 0.99),
        "max": max(latencies),
        "n": len(latencies),
    }


def cpu_seconds(pids: list[int]) -> float:
    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


async def control_plane(url: str, n: int, trials: int, models: Path, data: Path, planner_pid: int,
                        max_unavailable: int | float | None, procs: int) -> list[dict]:  # fmt: skip
    workers = start_workers("agents", url, n, procs, models, data)
    try:
        return await _changes(url, n, trials, planner_pid, max_unavailable, [w.pid for w in workers])
    finally:
        stop_workers(workers)


async def _changes(url: str, n: int, trials: int, planner_pid: int, max_unavailable: int | float | None,
                   agent_pids: list[int]) -> list[dict]:  # fmt: skip
    hosts = [subjects.host_token(WORKER_HOSTS.format(i)) for i in range(n)]
    client = await nats.connect(url)
    for _ in range(200):  # the planner process creates the bucket
        try:
            kv = await kv_bucket(client)
            break
        except Exception:
            await asyncio.sleep(0.05)
    seen: dict[str, tuple[str, float]] = {}  # host -> (cache type in its lane's argv, when seen)
    revision: dict[str, int] = {}  # host -> the plan revision its agent last said it holds
    taken: dict[str, float] = {}  # host -> when its status first held a plan newer than `since`
    since: dict[str, int] = {}

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
            now, host = time.perf_counter(), subjects.host_token(status.host_id)
            revision[host] = status.plan_revision
            if host in since and host not in taken and status.plan_revision > since[host]:
                taken[host] = now
            kind = cache_type(status)
            if kind is not None:
                seen[host] = (kind, now)

    planned: dict[str, float] = {}  # host -> when its plan for this change landed in the bucket

    async def watch_plans() -> None:
        watcher = await kv.watch(subjects.PLAN_KEYS)
        while True:
            entry = await watcher.updates(timeout=None)
            if entry is not None and entry.value is not None and since:
                host = entry.key.partition(".")[2]
                if host not in planned and b"q8_0" in entry.value if kind_now[0] == "q8_0" else b"q8_0" not in entry.value:
                    planned.setdefault(host, time.perf_counter())

    kind_now = [""]
    watcher_task = asyncio.gather(watch(), watch_plans())

    async def all_on(kind: str, timeout: float = 120) -> None:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if len(seen) == n and all(k == kind for k, _ in seen.values()):
                return
            await asyncio.sleep(0.01)
        missing = [h for h in hosts if seen.get(h, ("?",))[0] != kind]
        said = {}
        for h in missing[:5]:
            held = []
            for key in (subjects.report_key(h), subjects.plan_key(h)):
                try:
                    held.append((key, (await kv.get(key)).revision))
                except Exception as exc:
                    held.append((key, type(exc).__name__))
            said[h] = (seen.get(h), revision.get(h), held)
        raise TimeoutError(f"{len(missing)} agents never reached {kind}: {said}")

    await all_on("f16")
    # The rollout's width: every lane of the model at once measures the path itself; the default
    # (one lane of a model at a time, fleet-wide) makes the change n waves, each a round trip.
    reply = await client.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"max_unavailable": max_unavailable or n})),
                                 timeout=10)  # fmt: skip
    assert "Nats-Service-Error" not in (reply.headers or {}), reply.headers
    await asyncio.sleep(1.0)  # its replan changes no lane; let the statuses settle
    results = []
    for trial in range(trials + 1):  # the first is a warm-up
        kind = "q8_0" if trial % 2 == 0 else "f16"
        since.clear()
        since.update(revision)
        taken.clear()
        planned.clear()
        kind_now[0] = kind
        started = time.perf_counter()
        reply = await client.request(
            subjects.CONFIG_SET,
            encode(ConfigSet(changes={"kv_cache_type": None if kind == "f16" else kind})),
            timeout=10,
        )
        assert "Nats-Service-Error" not in (reply.headers or {}), reply.headers
        await all_on(kind)
        took = [t - started for h, t in taken.items()]
        written = [t - started for t in planned.values()]
        own = [taken[h] - planned[h] for h in taken if h in planned]  # plan in the bucket -> the agent's status
        results.append({"applied": summary([t - started for _, t in seen.values()]),
                        "taken": summary(took) if len(took) == n else None,
                        "planned": summary(written) if len(written) == n else None,
                        "agent": summary(own) if len(own) == n else None})  # fmt: skip
        if trial == 0:
            cpu_from = (cpu_seconds(agent_pids), cpu_seconds([planner_pid]))
    cpu_to = (cpu_seconds(agent_pids), cpu_seconds([planner_pid]))
    cpu = {"agents_cpu_s": (cpu_to[0] - cpu_from[0]) / trials, "planner_cpu_s": (cpu_to[1] - cpu_from[1]) / trials}
    watcher_task.cancel()
    await asyncio.gather(watcher_task, return_exceptions=True)
    await client.close()
    return [r | cpu for r in results[1:]]


def median_of(trials: list[dict], stage: str, key: str) -> float | None:
    values = [t[stage][key] for t in trials if t.get(stage) is not None]
    return statistics.median(values) if values else None


async def run(agent_counts: list[int], trials: int, max_unavailable: int | float | None, procs: int) -> list[dict]:
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
                baseline = await bus_baseline(server.url, n, trials, procs, tmp)
                plane = await control_plane(server.url, n, trials, models, tmp / f"agents-{n}", planner.pid,
                                            max_unavailable, procs)  # fmt: skip
            finally:
                planner.terminate()
                planner.wait(10)
                server.stop()
            bus = {k: statistics.median(t[k] for t in baseline) for k in ("p50", "p99", "max")}
            row = {"agents": n, "processes": procs, "bus": bus,
                   "planned": {k: median_of(plane, "planned", k) for k in ("p50", "p99", "max")},
                   "taken": {k: median_of(plane, "taken", k) for k in ("p50", "p99", "max")},
                   "agent": {k: median_of(plane, "agent", k) for k in ("p50", "p99", "max")},
                   "applied": {k: median_of(plane, "applied", k) for k in ("p50", "p99", "max")},
                   "planner_cpu_s": plane[0]["planner_cpu_s"], "agents_cpu_s": plane[0]["agents_cpu_s"]}  # fmt: skip
            for stage in ("taken", "applied"):
                got = row[stage]
                row[f"{stage}_ratio_max"] = got["max"] / bus["max"] if got["max"] is not None else None
            rows.append(row)
            print(f"{n:5d} agents ({procs} processes): bus fan-out all {bus['max'] * 1e3:6.1f} ms | plans written all {_ms(row['planned']['max'])} | plan taken all "
                  f"{_ms(row['taken']['max'])} ({_x(row['taken_ratio_max'])}; an agent's own p50 {_ms(row['agent']['p50'])}) | applied all {_ms(row['applied']['max'])} "
                  f"({_x(row['applied_ratio_max'])}) | CPU per change: agents {row['agents_cpu_s'] * 1e3:.0f} ms, "
                  f"planner {row['planner_cpu_s'] * 1e3:.0f} ms")  # fmt: skip
    return rows


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds is not None else "n/a"


def _x(ratio: float | None) -> str:
    return f"{ratio:.1f}x" if ratio is not None else "n/a"


def write(rows: list[dict], trials: int, out: Path, command: str, max_unavailable) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    lines = [
        "# Convergence: `config set` to every agent, against the bus itself",
        "",
        f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; {platform.platform()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"- lanes commit: {commit.strip()}",
        f"- Command: `{command}`",
        f"- {trials} trials per size (after a warm-up); figures are medians over trials. One nats-server, the",
        "  planner as its own process, the agents (real agent code, dry-run lanes, one NATS connection each)",
        f"  in {rows[0]['processes'] if rows else '?'} processes, the bus's responders likewise; the measuring client in its own.",
        f"  The fleet's max_unavailable: {max_unavailable or 'every lane (the number of agents)'}.",
        "",
        "| agents | bus fan-out p50 / all | plans written p50 / all | plan taken p50 / all | ratio (all) "
        "| an agent's own p50 / p99 | applied p50 / all | ratio (all) | agents' CPU per change | planner CPU per change |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, w, t, a = r["bus"], r["planned"], r["taken"], r["applied"]
        lines.append(
            f"| {r['agents']} | {_ms(b['p50'])} / {_ms(b['max'])} | {_ms(w['p50'])} / {_ms(w['max'])} | "
            f"{_ms(t['p50'])} / {_ms(t['max'])} | {_x(r['taken_ratio_max'])} | "
            f"{_ms(r['agent']['p50'])} / {_ms(r['agent']['p99'])} | "
            f"{_ms(a['p50'])} / {_ms(a['max'])} | {_x(r['applied_ratio_max'])} | "
            f"{_ms(r['agents_cpu_s'])} | {_ms(r['planner_cpu_s'])} |"
        )
    lines += [
        "",
        "`plans written`: from sending `config set` until the host's new plan is in the bucket (the config",
        "write, the planner's replan of every host, its plan writes, in a watch of the bucket's plan keys).",
        "`an agent's own`: from its plan in the bucket to its status saying it holds it (its watch,",
        "validation, status write): on 2 cores shared by every simulated agent, mostly the queue of the others.",
        "`plan taken`: from sending `config set` until an agent's status says it holds the new plan (the",
        "config write, the planner's replan of every host, one plan write per host, each agent's watch,",
        "validation and status write), set against the bus fan-out: one request to as many subscribers,",
        "each on its own connection, until every reply is in. `applied`: until its status shows its lane",
        "relaunched with the new cache type; a serving lane drains first, and its drain waits",
        "`DRAIN_GRACE` (0.5 s) for requests gateways routed before they saw the mark, so `applied` is at",
        "least that whatever the bus does.",
    ]
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"command": command, "commit": commit.strip(), "rows": rows}, indent=1))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--procs", type=int, default=2, help="processes the agents (and the responders) run in")
    parser.add_argument("--max-unavailable", type=float, default=None,
                        help="the fleet's max_unavailable for the change (a count, or a fraction under 1); default: every lane")
    parser.add_argument("--out", default=str(ROOT / "bench" / "convergence_results.md"))
    parser.add_argument("--worker", choices=["agents", "responders"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--models", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    setup_logging(os.environ.get("BENCH_LOG", "error"))
    if args.worker:
        asyncio.run(worker(args.worker, args.url, args.first, args.count, args.models, args.data))
        return
    mu = args.max_unavailable
    mu = int(mu) if mu is not None and mu >= 1 else mu
    rows = asyncio.run(run(args.agents, args.trials, mu, args.procs))
    write(rows, args.trials, Path(args.out), "python bench/convergence_bench.py " + " ".join(sys.argv[1:]), mu)


if __name__ == "__main__":
    main()
