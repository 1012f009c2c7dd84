"""Fixtures for tests against real parts: a nats-server from the wheel, the fake llama-server,
and the planner and agents running as asyncio tasks in the test's own loop."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import stat
import sys
import threading
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest

from launcher_agent.config import AgentConfig
from launcher_agent.probe import probe
from launcher_agent.service import run_agent
from planner_svc.service import run_planner
from shared import subjects
from shared.bus import connect, kv_bucket
from shared.messages.replies import FleetStatus
from shared.messages.status import HostStatus
from shared.natsserver import NatsServer

FAKE = Path(__file__).parent / "fake_llama_server.py"


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


def start_nats_cluster(work: Path, size: int = 3) -> list[NatsServer]:
    """Nodes routed to each other, started side by side (each waits for JetStream's quorum)."""
    base = free_port_base(2 * size)
    routes, clients = [base + i for i in range(size)], [base + size + i for i in range(size)]
    nodes = []
    for i in range(size):
        others = ",".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(routes) if j != i)
        extra = ["--server_name", f"n{i + 1}", "--cluster_name", "lanes", "--cluster",
                 f"nats://127.0.0.1:{routes[i]}", "--routes", others]  # fmt: skip
        nodes.append(NatsServer(work / f"nats-{i + 1}", port=clients[i], extra=extra))
    threads = [threading.Thread(target=node.start, kwargs={"timeout": 90}) for node in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not all(node.url for node in nodes):
        for node in nodes:
            node.stop()
        raise RuntimeError("a node of the cluster did not start")
    return nodes


def fake_binary(folder: Path, env: dict[str, str] | None = None) -> str:
    """An executable `llama-server` that runs the suite's fake with this interpreter."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llama-server"
    # Lanes get only an allow-listed environment: the fake's knobs travel in the script itself.
    knobs = {k: v for k, v in os.environ.items() if k == "FAKE_LLAMA_RECORD_TO"} | (env or {})
    exports = "".join(f"export {k}='{v}'\n" for k, v in knobs.items())
    path.write_text(f"#!/bin/sh\n{exports}exec '{sys.executable}' '{FAKE}' \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port_base(count: int = 16) -> int:
    """A run of free ports, so tests (and test runs side by side) never share a lane port.

    Below the kernel's ephemeral range: a port found free there could be taken as the source
    port of any outgoing connection before the lane or worker binds it."""
    rng = random.Random()
    low = _ephemeral_low()
    for _ in range(200):
        base = rng.randrange(10000, low - count, count)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def agent_config(tmp: Path, host_id: str, models: Path, binary: str, **kw) -> AgentConfig:
    kw.setdefault("port_base", free_port_base())
    return AgentConfig(
        host_id=host_id,
        model_dirs=[str(models)],
        binary=binary,
        caps=probe(binary),
        data_dir=tmp / f"agent-{host_id}",
        report_interval=kw.pop("report_interval", 2.0),
        tick=kw.pop("tick", 0.2),
        backoff_base=kw.pop("backoff_base", 0.2),
        **kw,
    )


class Services:
    """Planner and agents as tasks, each stoppable on its own (to test restarts)."""

    def __init__(self, url: str):
        self.url = url
        self.tasks: dict[str, tuple[asyncio.Task, asyncio.Event]] = {}

    def start_planner(self, name: str = "planner", planner_id: str | None = None) -> None:
        """planner_id: the id it plans under (default: host-pid, the same for every planner of a test)."""
        stop = asyncio.Event()
        self.tasks[name] = (asyncio.create_task(run_planner(self.url, stop, name=planner_id)), stop)

    def start_agent(self, cfg: AgentConfig, name: str | None = None, url: str | None = None) -> None:
        stop = asyncio.Event()
        self.tasks[name or cfg.host_id] = (asyncio.create_task(run_agent(cfg, url or self.url, stop)), stop)

    async def stop(self, name: str) -> None:
        task, stop = self.tasks.pop(name)
        stop.set()
        await asyncio.wait_for(task, 30)

    async def kill(self, name: str) -> None:
        """Cancel without the graceful path: lanes keep running, like a SIGKILLed agent."""
        task, _ = self.tasks.pop(name)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def stop_all(self) -> None:
        for name in list(self.tasks):
            await self.stop(name)


@asynccontextmanager
async def services(url: str):
    s = Services(url)
    try:
        yield s
    finally:
        await s.stop_all()


@asynccontextmanager
async def client(url: str):
    nc = await connect(url, name="test-client", retry_forever=False)
    try:
        yield nc
    finally:
        await nc.close()


async def fleet_status(nc) -> FleetStatus:
    reply = await nc.request(subjects.FLEET_STATUS, b"", timeout=5)
    return msgspec.json.decode(reply.data, type=FleetStatus)


async def host_status(nc, host_id: str) -> HostStatus | None:
    kv = await kv_bucket(nc)
    try:
        entry = await kv.get(subjects.status_key(host_id))
    except Exception:
        return None
    return msgspec.json.decode(entry.value, type=HostStatus)


def lane_of(status: HostStatus | None, lane_id: str):
    if status is None:
        return None
    return next((lane for lane in status.lanes if lane.lane_id == lane_id), None)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def lane_auth(cfg, lane_id: str) -> dict[str, str]:
    """The header that opens a lane its agent (cfg) started: its key, from the agent's key file
    (a test reaching a lane straight, as its gateway would)."""
    key = (cfg.data_dir / "lanes" / f"{lane_id}.key").read_text().strip()
    return {"Authorization": f"Bearer {key}"}


def healthy_lane(nc, host: str, lane_id: str):
    """A check for eventually(): the lane once its agent reports it healthy; a lane that failed
    or serves another shape than planned fails the wait at once."""

    async def check():
        lane = lane_of(await host_status(nc, host), lane_id)
        assert lane is None or lane.state not in ("failed", "mismatch"), lane
        return lane if lane and lane.state == "healthy" else None

    return check
