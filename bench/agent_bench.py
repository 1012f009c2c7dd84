"""What the launcher agent costs at idle, and how long a lane change takes through lanes
compared with starting the same llama-server by hand.

Run from the repository root:  .venv/bin/python bench/agent_bench.py [--small] [--out bench/agent_results.md]

Everything is real and runs as separate OS processes: a nats-server (the wheel's, free
ports, temp dir), `lanes planner`, `lanes agent` and llama-server lanes serving a tiny
generated llama GGUF (tests/tinymodels.py).

1. Idle: 4 healthy lanes (one persona, lanes=4); the agent process alone (not its lanes)
   is sampled with psutil over 60 s (--small: 5 s): CPU seconds, % of one core, RSS.
   The planner and nats-server over the same window for comparison.
2. Launch: (a) by hand: the lane's own argv on another free port, spawn -> /health 200
   (polled every 10 ms); (b) through lanes: a fleet config change (kv_cache_type q8_0 <->
   unset), from the config.set reply to the agent's status (KV watch) showing the lane
   healthy with the new argv. Once with 4 lanes (first lane back, all 4 back; the agent
   rolls one lane at a time), then N times with a single lane. N = 5 (--small: 2).
   The bus and the process table are watched in between, so each change is split into
   planner, stop, spawn and health-detection time.

Every process the bench starts is stopped at the end, on failure and on Ctrl-C/SIGTERM too.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import datetime as dt
import http.client
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))

import msgspec  # noqa: E402
import nats  # noqa: E402
import psutil  # noqa: E402
from fixtures_bus import free_port_base  # noqa: E402
from tinymodels import write_llama  # noqa: E402

from launcher_agent import service as agent_service  # noqa: E402
from launcher_agent import supervisor as agent_supervisor  # noqa: E402
from launcher_agent.config import AgentConfig  # noqa: E402
from launcher_agent.lane_http import http_get  # noqa: E402
from launcher_agent.probe import find_llama_server  # noqa: E402
from launcher_agent.process import lane_environment  # noqa: E402
from shared import subjects  # noqa: E402
from shared.lane_key import lane_key  # noqa: E402
from shared.messages.config import Demand, Persona  # noqa: E402
from shared.messages.plans import HostPlan  # noqa: E402
from shared.messages.replies import ConfigSet  # noqa: E402
from shared.messages.status import HostStatus, LaneEvent  # noqa: E402
from shared.messages.wire import encode  # noqa: E402
from shared.natsserver import NatsServer  # noqa: E402

HOST = "bench"
MODEL = "m"
MIB = 2**20
POLL = 0.010  # by-hand /health poll and the old-pid poll


# ------------------------------------------------------------------ processes we started


class Cleanup:
    """Everything the bench started, stopped in reverse order exactly once."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.lane_pids: set[int] = set()
        self.models_dir = ""
        self.nats: NatsServer | None = None
        self.done = False

    def add(self, name: str, proc: subprocess.Popen) -> subprocess.Popen:
        self.procs.append((name, proc))
        return proc

    def run(self) -> None:
        if self.done:
            return
        self.done = True
        # The agent first, with SIGTERM: it stops its own lanes.
        for name, proc in reversed(self.procs):
            _terminate(proc, 30.0 if name == "agent" else 10.0)
        for pid in self.lane_pids:  # lanes an agent left behind (it was killed, or hung)
            try:
                p = psutil.Process(pid)
                if self.models_dir and any(self.models_dir in a for a in p.cmdline()):
                    p.kill()
                    p.wait(5)
            except (psutil.Error, OSError):
                pass
        if self.nats is not None:
            self.nats.stop()


def _terminate(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.terminate()
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    except OSError:
        pass


CLEANUP = Cleanup()
atexit.register(CLEANUP.run)


def free_port(avoid: range) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port


def lanes_cli() -> str:
    for candidate in (Path(sys.executable).parent / "lanes", ROOT / ".venv" / "bin" / "lanes"):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("lanes")
    if not found:
        raise SystemExit("no `lanes` command: run .venv/bin/pip install -e .")
    return found


# ------------------------------------------------------------------ the bus, as the bench sees it


@dataclass
class Bus:
    """KV watches on this host's status and plan, and its lane events, each with receipt times."""

    nc: object
    status: list[tuple[float, HostStatus]] = field(default_factory=list)
    plans: list[tuple[float, HostPlan]] = field(default_factory=list)
    events: list[tuple[float, LaneEvent]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    async def open(cls, url: str) -> Bus:
        nc = await nats.connect(url, name="lanes-bench", max_reconnect_attempts=3)
        bus = cls(nc)

        async def on_event(msg) -> None:
            t = time.monotonic()
            try:
                bus.events.append((t, msgspec.json.decode(msg.data, type=LaneEvent)))
            except msgspec.MsgspecError:
                return
            bus.changed.set()

        await nc.subscribe(f"{subjects.PREFIX}.event.{HOST}.>", cb=on_event)
        return bus

    async def start_watches(self) -> None:
        kv = await self.nc.jetstream().key_value(subjects.BUCKET)
        for key, into, kind in ((subjects.status_key(HOST), self.status, HostStatus),
                                (subjects.plan_key(HOST), self.plans, HostPlan)):  # fmt: skip
            self.tasks.append(asyncio.create_task(self._watch(kv, key, into, kind)))

    async def _watch(self, kv, key: str, into: list, kind: type) -> None:
        watcher = await kv.watch(key)
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=1.0)
                except nats.errors.TimeoutError:
                    continue
                t = time.monotonic()
                if entry is None or entry.value is None or entry.operation in ("DEL", "PURGE"):
                    continue
                try:
                    into.append((t, msgspec.json.decode(entry.value, type=kind)))
                except msgspec.MsgspecError:
                    continue
                self.changed.set()
        finally:
            await watcher.stop()

    async def request(self, subject: str, payload: bytes, timeout: float = 10.0) -> bytes:
        reply = await self.nc.request(subject, payload, timeout=timeout)
        error = (reply.headers or {}).get("Nats-Service-Error")
        if error:
            raise RuntimeError(f"{subject}: {error}")
        return reply.data

    async def wait(self, find, timeout: float, what: str, on_idle=None):
        """Wait until find() returns something; find scans the recorded history (so the
        receipt time of the first matching entry is exact however late we wake)."""
        deadline = time.monotonic() + timeout
        while True:
            self.changed.clear()
            found = find()
            if found is not None:
                return found
            if on_idle is not None:
                on_idle()
            left = deadline - time.monotonic()
            if left <= 0:
                last = self.status[-1][1] if self.status else None
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; last status: {last}")
            try:
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))
            except TimeoutError:
                pass

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.nc.close()


def lane_keys(status: HostStatus) -> dict[str, str]:
    """What each lane runs (shared.lane_key), as its agent says."""
    return {lane.lane_id: lane.lane_key for lane in status.lanes}


def check_not_failed(bus: Bus) -> None:
    if not bus.status:
        return
    for lane in bus.status[-1][1].lanes:
        if lane.state in ("failed", "mismatch"):
            raise RuntimeError(f"lane {lane.lane_id} {lane.state}: {lane.last_error} {list(lane.stderr_tail)}")


# ------------------------------------------------------------------ measurements


@dataclass
class Change:
    """One config change through lanes, every time relative to the config.set reply."""

    request: float = 0.0  # config.set round trip (planner writes the config to KV)
    plan: float = 0.0  # the new plan seen on the plan key
    first_healthy: float = 0.0
    all_healthy: float = 0.0
    per_lane: dict[str, dict[str, float]] = field(
        default_factory=dict
    )  # old_exit, started, served, healthy_event, status


async def change_config(bus: Bus, changes: dict, timeout: float) -> Change:
    before = bus.status[-1][1]
    old = lane_keys(before)
    old_pids = {lane.lane_id: lane.pid for lane in before.lanes if lane.pid}
    si, pi, ei = len(bus.status), len(bus.plans), len(bus.events)
    exits: dict[str, float] = {}

    async def watch_pids() -> None:  # the old lane processes, every 10 ms
        procs = {}
        for lane_id, pid in old_pids.items():
            try:
                procs[lane_id] = psutil.Process(pid)
            except psutil.Error:
                exits[lane_id] = time.monotonic()
        while len(exits) < len(old_pids):
            now = time.monotonic()
            for lane_id, p in procs.items():
                if lane_id in exits:
                    continue
                try:
                    gone = p.status() == psutil.STATUS_ZOMBIE
                except psutil.Error:
                    gone = True
                if gone:
                    exits[lane_id] = now
            await asyncio.sleep(POLL)

    ports = {lane.lane_id: lane.port for lane in before.lanes}
    served: dict[str, float] = {}

    async def watch_health() -> None:  # a new lane's own /health, every 10 ms once it is spawned
        while len(served) < len(ports):
            spawned = {
                ev.lane_id for _, ev in bus.events[ei:] if ev.event == "started" and ev.pid not in old_pids.values()
            }
            for lane_id in spawned - set(served):
                status, _ = await http_get("127.0.0.1", ports[lane_id], "/health", None, timeout=1.0)
                if status == 200:
                    served[lane_id] = time.monotonic()
            await asyncio.sleep(POLL)

    poller = asyncio.create_task(watch_pids())
    health_poller = asyncio.create_task(watch_health())
    try:
        sent = time.monotonic()
        await bus.request(subjects.CONFIG_SET, encode(ConfigSet(changes=changes)))
        t0 = time.monotonic()

        def find_plan():
            for t, p in bus.plans[pi:]:
                target = {s.lane_id: lane_key(s) for s in p.lanes}
                if set(target) == set(old) and all(target[k] != old[k] for k in old):
                    return t, target
            return None

        t_plan, target = await bus.wait(find_plan, timeout, "the changed plan")

        def find_all():
            seen: dict[str, float] = {}
            for t, st in bus.status[si:]:
                for lane in st.lanes:
                    if (
                        lane.lane_id not in seen
                        and lane.state == "healthy"
                        and lane.lane_key == target[lane.lane_id]
                    ):
                        seen[lane.lane_id] = t
            return seen if len(seen) == len(target) else None

        status_t = await bus.wait(find_all, timeout, "every lane healthy with its new spec",
                                  on_idle=lambda: check_not_failed(bus))  # fmt: skip
        await asyncio.wait_for(poller, 15)
        await asyncio.wait_for(health_poller, 15)
    finally:
        poller.cancel()
        health_poller.cancel()
    c = Change(request=t0 - sent, plan=t_plan - t0)
    for lane_id in target:
        started = healthy = None
        for t, ev in bus.events[ei:]:
            if ev.lane_id != lane_id:
                continue
            if ev.event == "started" and started is None and ev.pid not in old_pids.values():
                started = t
            elif ev.event == "healthy" and started is not None and healthy is None:
                healthy = t
        c.per_lane[lane_id] = {
            "old_exit": exits.get(lane_id, float("nan")) - t0,
            "started": (started or float("nan")) - t0,
            "served": served.get(lane_id, float("nan")) - t0,
            "healthy_event": (healthy or float("nan")) - t0,
            "status": status_t[lane_id] - t0,
        }
    c.first_healthy = min(v["status"] for v in c.per_lane.values())
    c.all_healthy = max(v["status"] for v in c.per_lane.values())
    return c


def by_hand(argv: tuple[str, ...], port: int, log_path: Path) -> tuple[float, float]:
    """Spawn the lane's argv on another port; (spawn -> /health 200, SIGTERM -> exit) in seconds."""
    argv = list(argv)
    argv[argv.index("--port") + 1] = str(port)
    with open(log_path, "wb") as log:
        started = time.perf_counter()
        proc = CLEANUP.add("by-hand llama-server", subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=lane_environment()
        ))  # fmt: skip
    try:
        deadline = started + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"by-hand llama-server exited {proc.returncode}; see {log_path}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"by-hand llama-server not healthy in 60 s; see {log_path}")
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    healthy = time.perf_counter() - started
                    break
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(POLL)
    finally:
        t = time.perf_counter()
        _terminate(proc, 15.0)
        stopped = time.perf_counter() - t
    return healthy, stopped


class SystemBusy:
    """Machine-wide CPU busy % (all cores) from now until percent(): other work skews timings."""

    def __init__(self) -> None:
        self.start = psutil.cpu_times()

    def percent(self) -> float:
        end = psutil.cpu_times()
        total = sum(end) - sum(self.start)
        idle = (end.idle + getattr(end, "iowait", 0.0)) - (self.start.idle + getattr(self.start, "iowait", 0.0))
        return 100 * (total - idle) / total if total > 0 else float("nan")


@dataclass
class Usage:
    cpu_seconds: float
    cpu_percent: float
    rss_median: float
    rss_max: float


async def sample_idle(procs: dict[str, list[psutil.Process]], window: float) -> tuple[dict[str, Usage], float]:
    """CPU (user+system) and RSS of each group of processes, not their children, over `window`."""

    def cpu(group: list[psutil.Process]) -> float:
        total = 0.0
        for p in group:
            t = p.cpu_times()
            total += t.user + t.system
        return total

    interval = min(1.0, window / 20)
    rss: dict[str, list[int]] = {name: [] for name in procs}
    start_cpu = {name: cpu(group) for name, group in procs.items()}
    start = time.monotonic()
    while True:
        for name, group in procs.items():
            rss[name].append(sum(p.memory_info().rss for p in group))
        if time.monotonic() - start >= window:
            break
        await asyncio.sleep(min(interval, max(0.0, window - (time.monotonic() - start))))
    wall = time.monotonic() - start
    out = {}
    for name, group in procs.items():
        used = cpu(group) - start_cpu[name]
        out[name] = Usage(used, 100 * used / wall, statistics.median(rss[name]), max(rss[name]))
    return out, wall


# ------------------------------------------------------------------ the run


def spawn(name: str, argv: list[str], log_dir: Path) -> subprocess.Popen:
    with open(log_dir / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    return CLEANUP.add(name, proc)


async def run_cli(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(lanes_cli(), *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"lanes {' '.join(args)} exited {proc.returncode}: {err.decode().strip()}")
    return out.decode()


def write_demand(path: Path, lanes: int) -> Path:
    demand = Demand(personas=(Persona(model=MODEL, lanes=lanes, parallel=1, ctx_min=2048, ctx_max=4096),))
    path.write_bytes(msgspec.json.format(encode(demand)))
    return path


async def bench(args: argparse.Namespace, work: Path) -> dict:
    binary = find_llama_server()
    if binary is None:
        raise SystemExit("no llama-server: run `.venv/bin/lanes install-llama` or set LLAMA_SERVER_BIN")
    window = 5.0 if args.small else 60.0
    n = 2 if args.small else 5
    models, logs = work / "models", work / "logs"
    models.mkdir()
    logs.mkdir()
    CLEANUP.models_dir = str(models)
    write_llama(models / f"{MODEL}.gguf", n_layer=2, n_ctx_train=4096)

    nats_srv = NatsServer(work / "nats").start()
    CLEANUP.nats = nats_srv
    url = nats_srv.url
    lanes = lanes_cli()
    planner = spawn("planner", [lanes, "planner", "--nats", url], logs)
    bus = await Bus.open(url)
    try:
        await ping_planner(bus, 30)
        await bus.start_watches()
        await run_cli("demand", "set", "--nats", url, str(write_demand(work / "demand4.json", 4)))
        port_base = free_port_base()
        agent_started = time.monotonic()
        agent = spawn("agent", [lanes, "agent", "--nats", url, "--models", str(models), "--llama-server", binary,
                                "--host-id", HOST, "--data", str(work / "agent"), "--port-base", str(port_base)],
                      logs)  # fmt: skip

        def watch_agent() -> None:
            check_not_failed(bus)
            if agent.poll() is not None:
                raise RuntimeError(f"lanes agent exited {agent.returncode}; see {logs}/agent.log")
            for _, st in bus.status[-1:]:
                CLEANUP.lane_pids.update(lane.pid for lane in st.lanes if lane.pid)

        t_up, _ = await bus.wait(lambda: _steady(bus, 4), 120, "4 healthy lanes", on_idle=watch_agent)
        cold_start = t_up - agent_started
        print(f"4 lanes healthy {cold_start:.1f} s after the agent process started")

        # ---- 1. idle
        await asyncio.sleep(2.0)  # let the first report and feedback settle
        _, st = bus.status[-1]
        CLEANUP.lane_pids.update(lane.pid for lane in st.lanes if lane.pid)
        groups = {
            "agent": [psutil.Process(agent.pid)],
            "planner": [psutil.Process(planner.pid)],
            "nats-server": [psutil.Process(nats_srv.proc.pid)],
            "4 lanes (llama-server, sum)": [psutil.Process(lane.pid) for lane in st.lanes],
        }
        si = len(bus.status)
        print(f"sampling the idle agent for {window:.0f} s ...")
        busy = SystemBusy()
        idle, wall = await sample_idle(groups, window)
        busy_idle = busy.percent()
        idle_status_writes = len(bus.status) - si
        for name, u in idle.items():
            print(f"  {name}: {u.cpu_seconds:.3f} CPU s = {u.cpu_percent:.2f}% of a core, "
                  f"RSS median {u.rss_median / MIB:.1f} MiB, max {u.rss_max / MIB:.1f} MiB")  # fmt: skip

        # ---- 2a. a fleet-wide change over 4 lanes (rolled one lane at a time)
        print("config kv_cache_type=q8_0 over 4 lanes ...")
        four = await change_config(bus, {"kv_cache_type": "q8_0"}, 120)
        print(f"  first lane healthy {four.first_healthy:.2f} s, all 4 {four.all_healthy:.2f} s after the reply")
        CLEANUP.lane_pids.update(lane.pid for lane in bus.status[-1][1].lanes if lane.pid)

        # ---- 2b. one lane, N config toggles
        await run_cli("demand", "set", "--nats", url, str(write_demand(work / "demand1.json", 1)))
        await bus.wait(lambda: _steady(bus, 1), 60, "1 healthy lane", on_idle=watch_agent)
        await asyncio.sleep(1.0)
        single: list[Change] = []
        hand: list[tuple[float, float]] = []
        avoid = range(port_base, port_base + 16)
        busy_launch = SystemBusy()
        for i in range(n):
            # Through lanes, then by hand with the argv the lane runs now: each pair sees the
            # same machine (another process's burst hits both, not only one side).
            value = None if i % 2 == 0 else "q8_0"  # it runs q8_0 now: unset, q8_0, unset ...
            c = await change_config(bus, {"kv_cache_type": value}, 60)
            single.append(c)
            argv = tuple(bus.status[-1][1].lanes[0].argv)
            CLEANUP.lane_pids.update(lane.pid for lane in bus.status[-1][1].lanes if lane.pid)
            await asyncio.sleep(0.3)
            h = await asyncio.to_thread(by_hand, argv, free_port(avoid), logs / f"by-hand-{i}.log")
            hand.append(h)
            print(f"  {i + 1}/{n} kv_cache_type={value or 'unset'}: through lanes {c.all_healthy * 1000:.0f} ms, "
                  f"by hand {h[0] * 1000:.0f} ms (stop {h[1] * 1000:.0f} ms)")  # fmt: skip
            await asyncio.sleep(0.3)
        busy_launch = busy_launch.percent()
    finally:
        await bus.close()

    return {
        "binary": binary,
        "window": wall,
        "n": n,
        "idle": idle,
        "idle_status_writes": idle_status_writes,
        "cold_start": cold_start,
        "four": four,
        "single": single,
        "hand": hand,
        "busy_idle": busy_idle,
        "busy_launch": busy_launch,
    }


def _steady(bus: Bus, n_lanes: int):
    plan = bus.plans[-1][1] if bus.plans else None
    if plan is None or len(plan.lanes) != n_lanes or not bus.status:
        return None
    want = {s.lane_id: lane_key(s) for s in plan.lanes}
    t, st = bus.status[-1]
    if len(st.lanes) == n_lanes and all(
        lane.state == "healthy" and want.get(lane.lane_id) == lane.lane_key for lane in st.lanes
    ):
        return t, st
    return None


async def ping_planner(bus: Bus, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            await bus.request(subjects.CONFIG_GET, b"", timeout=1)
            return
        except Exception:  # noqa: BLE001 - no responders or a timeout until it is up
            if time.monotonic() > deadline:
                raise RuntimeError("the planner did not answer config.get") from None
            await asyncio.sleep(0.2)


# ------------------------------------------------------------------ report


def med(values) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else float("nan")


def ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def machine() -> list[str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    vm = psutil.virtual_memory()
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"- {platform.platform()}; Python {platform.python_version()}",
        f"- CPU: {cpu}; {psutil.cpu_count(logical=True)} logical / {psutil.cpu_count(logical=False)} physical cores",
        f"- RAM: {vm.total / 2**30:.1f} GiB total, {vm.available / 2**30:.1f} GiB available at the end",
        f"- Load average (1/5/15 min) at the end: {load} (other work on the machine skews the timings)",
    ]


def llama_version(binary: str) -> str:
    try:
        run = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else (run.stdout + run.stderr).strip().splitlines()[0]


def git_state() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT, check=False).stdout

    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line.strip()]
    return commit + (f" with uncommitted changes to {', '.join(sorted(dirty))}" if dirty else " (clean tree)")


def spread(values) -> str:
    values = [v for v in values if not math.isnan(v)]
    return f"{ms(min(values))} | {ms(max(values))}" if values else "n/a | n/a"


def render(r: dict, args: argparse.Namespace, command: str) -> str:
    idle, four, single, hand = r["idle"], r["four"], r["single"], r["hand"]
    hand_up = med(h[0] for h in hand)
    hand_stop = med(h[1] for h in hand)
    lanes_up = med(c.all_healthy for c in single)
    ratio = lanes_up / hand_up if hand_up else float("nan")
    lane = [next(iter(c.per_lane.values())) for c in single]
    starting_tick = getattr(agent_supervisor, "STARTING_TICK", None) or getattr(agent_service, "STARTING_TICK", None)
    tick_line = f"`AgentConfig.tick` = {AgentConfig.tick} s (the CLI has no flag for it)" + (
        f"; while a lane starts the loop polls every `STARTING_TICK` = {starting_tick} s" if starting_tick else ""
    )
    lines = [
        "# Agent overhead and launch latency",
        "",
        f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        f"- lanes commit: {r['git']}",
        f"- llama-server: `{r['binary']}`, {llama_version(r['binary'])}",
        f"- Agent control loop: {tick_line}",
        f"- Mode: {'--small' if args.small else 'full'}: idle window {r['window']:.1f} s, N = {r['n']}",
        "",
        "## Machine",
        "",
        *machine(),
        "",
        "## Setup",
        "",
        "A nats-server (the wheel's), `lanes planner`, `lanes agent` as separate processes; the agent",
        "serves a tiny generated llama GGUF (2 layers, n_embd 256, trained 4096) through real llama-server",
        "lanes: demand one persona, 1 slot, ctx 2048..4096. The bench watches the agent's status and",
        "plan keys (KV watch) and its lane events, with the receipt time of each entry.",
        "",
        f"Cold start: 4 lanes healthy {r['cold_start']:.2f} s after the `lanes agent` process was spawned",
        "(Python start-up, probing the binary, report, plan, 4 llama-server starts).",
        "",
        "## Idle agent",
        "",
        f"4 healthy lanes, nothing changing, {r['window']:.1f} s. CPU is user+system of the process itself",
        "(children not included); % is of one core.",
        "",
        "| process | CPU s | CPU % of one core | RSS median MiB | RSS max MiB |",
        "|---|---|---|---|---|",
    ]
    for name, u in idle.items():
        lines.append(
            f"| {name} | {u.cpu_seconds:.3f} | {u.cpu_percent:.2f} | {u.rss_median / MIB:.1f} | {u.rss_max / MIB:.1f} |"
        )
    lines += [
        "",
        f"The agent wrote its status to KV {r['idle_status_writes']} time(s) in the window (it writes only on a",
        "change, plus the forced write every `--report-interval`, default 30 s).",
        "",
        "## Launch: by hand vs through lanes",
        "",
        "By hand: the argv the lane runs after each change below, on another free port; time from",
        "spawn to the first `/health` 200, polled every 10 ms; then SIGTERM to exit. Each by-hand run",
        "follows its change through lanes, so both sides of a pair see the same machine.",
        "Through lanes: `config.set` (the request `lanes config set` sends) toggling `kv_cache_type`",
        "between q8_0 and unset (f16); time from the reply to the agent's status in KV showing the lane",
        "healthy with the new argv. A restart also stops the old process first, which by hand does not.",
        "",
        f"| measure ({r['n']} runs) | median ms | min ms | max ms |",
        "|---|---|---|---|",
        f"| by hand: spawn -> /health 200 | {ms(hand_up)} | {spread(h[0] for h in hand)} |",
        f"| by hand: SIGTERM -> exit | {ms(hand_stop)} | {spread(h[1] for h in hand)} |",
        (
            f"| through lanes, 1 lane: config.set reply -> lane healthy in status | {ms(lanes_up)} "
            f"| {spread(c.all_healthy for c in single)} |"
        ),
        f"| **ratio lanes / by hand (spawn -> healthy), medians** | **{ratio:.2f}x** | | |",
        f"| ratio lanes / by hand (stop + spawn -> healthy), medians | {lanes_up / (hand_up + hand_stop):.2f}x | | |",
        "",
        "A single slow llama-server start (the bench's own `/health` poll sees it too, so it is the",
        "server or the machine, not the agent) shows up as the max; compare medians.",
        "",
        (
            f"Machine-wide CPU busy (all {psutil.cpu_count()} cores): {r['busy_idle']:.1f}% during the idle window, "
            f"{r['busy_launch']:.0f}% during these launches (their own llama-server start-ups included). The"
        ),
        "bench's own processes account for about 1% in the idle window: more means other work was running,",
        "and llama-server's start-up slows down sharply (tens of ms become hundreds) when it shares the cores.",
        "",
        "Every 1-lane change, ms after the config.set reply, and its by-hand twin:",
        "",
        (
            "| # | config | request round trip | plan in KV | old lane exited | new lane spawned (event) "
            "| /health 200 (bench poll) | healthy (event) | healthy in status | by hand |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, (c, pl, h) in enumerate(zip(single, lane, hand, strict=True)):
        cfg = "unset (f16)" if i % 2 == 0 else "q8_0"
        lines.append(f"| {i + 1} | {cfg} | {ms(c.request)} | {ms(c.plan)} | {ms(pl['old_exit'])} | {ms(pl['started'])} "
                     f"| {ms(pl['served'])} | {ms(pl['healthy_event'])} | {ms(pl['status'])} | {ms(h[0])} |")  # fmt: skip
    four_rows = sorted(four.per_lane.items(), key=lambda kv: kv[1]["status"])
    lines += [
        "",
        "Four lanes, one change (`kv_cache_type=q8_0`); the agent restarts changed lanes one at a time",
        "(`max_restarts_per_host` = 1), the next once the last is healthy:",
        "",
        f"- first lane healthy: {ms(four.first_healthy)} ms; all 4 healthy: {ms(four.all_healthy)} ms after the reply",
        "",
        "| lane | old exited | spawned | /health 200 (bench poll) | healthy (event) | healthy in status |",
        "|---|---|---|---|---|---|",
    ]
    for lane_id, pl in four_rows:
        lines.append(f"| {lane_id} | {ms(pl['old_exit'])} | {ms(pl['started'])} | {ms(pl['served'])} | {ms(pl['healthy_event'])} "
                     f"| {ms(pl['status'])} |")  # fmt: skip
    # where the time goes (1-lane medians, as successive intervals)
    plan_m = med(c.plan for c in single)
    exit_m = med(p["old_exit"] - c.plan for c, p in zip(single, lane, strict=True))
    spawn_m = med(p["started"] - p["old_exit"] for p in lane)
    served_m = med(p["served"] - p["started"] for p in lane)
    detect_m = med(p["healthy_event"] - p["served"] for p in lane)
    publish_m = med(p["status"] - p["healthy_event"] for p in lane)
    lines += [
        "",
        "## Where the time goes",
        "",
        "Medians of the 1-lane changes, as successive intervals (they add up to about the total):",
        "",
        "| interval | ms | who |",
        "|---|---|---|",
        f"| config.set reply -> new plan in KV | {ms(plan_m)} | planner: watch, settle delay, plan, write |",
        f"| plan in KV -> old lane exited | {ms(exit_m)} | agent: plan watch, reconcile, SIGTERM, llama-server exit |",
        f"| old lane exited -> new lane spawned | {ms(spawn_m)} | agent: reap, spawn |",
        f"| spawned -> /health 200 | {ms(served_m)} | llama-server start-up (by hand: {ms(hand_up)}), seen by the bench's 10 ms poll |",
        f"| /health 200 -> healthy event | {ms(detect_m)} | agent: its next health probe (`/health` + `/props`) on its control-loop tick |",
        f"| healthy event -> status in KV | {ms(publish_m)} | agent: status write, KV watch delivery |",
        f"| total | {ms(lanes_up)} | |",
        "",
        "Times are receipt times in the bench (KV watch, event subscription, a 10 ms poll of the old",
        "pid and of the new lane's `/health`), so a step may show as a few ms early or late; the",
        f"old lane's stop costs {ms(exit_m)} ms (by hand, SIGTERM -> exit: {ms(hand_stop)} ms).",
        "",
        "## Rerun",
        "",
        "```sh",
        command,
        "```",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="5 s idle window, 2 launches each (a smoke run)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "agent_results.md"))
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs) after a successful run")
    args = parser.parse_args()
    command = ".venv/bin/python bench/agent_bench.py" + (" --small" if args.small else "")
    if Path(args.out).resolve() != (ROOT / "bench" / "agent_results.md").resolve():
        command += f" --out {args.out}"

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="lanes-agent-bench-"))
    ok = False
    try:
        git_before = git_state()
        result = asyncio.run(bench(args, work))
        git_after = git_state()
        result["git"] = git_before if git_after == git_before else f"{git_before}; at the end of the run: {git_after}"
        ok = True
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - report it, clean up, exit 1
        print(f"agent bench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        for name in ("agent", "planner"):
            log = work / "logs" / f"{name}.log"
            if log.exists():
                tail = log.read_text(errors="replace").splitlines()[-15:]
                print(f"--- last lines of {log}:", *tail, sep="\n", file=sys.stderr)
        return 1
    finally:
        CLEANUP.run()
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            sys.stdout.flush()
            print(f"logs kept in {work}", file=sys.stderr)
    text = render(result, args, command)
    Path(args.out).write_text(text)
    hand_up = med(h[0] for h in result["hand"])
    lanes_up = med(c.all_healthy for c in result["single"])
    a = result["idle"]["agent"]
    print()
    print(f"idle agent: {a.cpu_percent:.2f}% of a core ({a.cpu_seconds:.3f} CPU s in {result['window']:.0f} s), "
          f"RSS median {a.rss_median / MIB:.1f} MiB, max {a.rss_max / MIB:.1f} MiB")  # fmt: skip
    print(f"launch: by hand {hand_up * 1000:.0f} ms, through lanes {lanes_up * 1000:.0f} ms "
          f"(median), ratio {lanes_up / hand_up:.2f}x; 4-lane change: first {result['four'].first_healthy * 1000:.0f} ms, "
          f"all {result['four'].all_healthy * 1000:.0f} ms")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
