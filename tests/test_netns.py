"""Real separate hosts on one machine: network namespaces for NATS, the planner and two agents.

    root namespace (this test, 10.A.B.254) ── bridge ──┬── veth ── ns nats     10.A.B.1  nats-server -js
                                                      ├── veth ── ns planner  10.A.B.2  lanes planner
                                                      ├── veth ── ns agent1   10.A.B.3  lanes agent host1
                                                      └── veth ── ns agent2   10.A.B.4  lanes agent host2

Every service is the real command line (`ip netns exec NS lanes ...`) as a subprocess;
each agent has its own model folder, data folder and fake llama-server, and its lanes
listen on 127.0.0.1 inside its own namespace (so only that "host" can reach them).
Cutting agent2's link (`ip link set <veth> down`) must leave its lane serving, and a
config change made meanwhile must reach it once the link is back.

Skipped only when a network namespace cannot be created (not root, no iproute2).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import psutil
import pytest
from fixtures_bus import fake_binary
from waiting import eventually, eventually_blocking

from shared import subjects
from shared.bus import connect, kv_bucket
from shared.messages.status import HostStatus, LaneStatus
from shared.natsserver import nats_server_binary

LANES = str(Path(sys.executable).parent / "lanes")
ROLES = ("nats", "planner", "agent1", "agent2")


def _run(*argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _free_subnet() -> str:
    used = _run("ip", "-4", "addr").stdout + _run("ip", "-4", "route").stdout
    for _ in range(200):
        net = f"10.{secrets.choice(range(200, 250))}.{secrets.choice(range(1, 255))}"
        if f"{net}." not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet")


class Topology:
    """Namespaces, veth pairs and a bridge; every piece is recorded so teardown removes it."""

    def __init__(self, tmp: Path, roles: tuple[str, ...] = ROLES):
        self.tmp, self.roles = tmp, roles
        self.sfx = secrets.token_hex(3)
        self.net = _free_subnet()
        self.bridge = f"lbr{self.sfx}"
        self.ns: dict[str, str] = {}  # role -> namespace
        self.ip: dict[str, str] = {}  # role -> address
        self.veth: dict[str, str] = {}  # role -> root-side veth
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self._bridge_made = False

    def build(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        _run("ip", "addr", "add", f"{self.net}.254/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, role in enumerate(self.roles, start=1):
            ns, outside, inside = f"lanes-{self.sfx}-{role}", f"l{self.sfx}h{i}", f"l{self.sfx}n{i}"
            _run("ip", "netns", "add", ns)
            self.ns[role] = ns
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            self.veth[role] = outside
            _run("ip", "link", "set", inside, "netns", ns)
            _run("ip", "link", "set", outside, "master", self.bridge)
            _run("ip", "link", "set", outside, "up")
            self.ip[role] = f"{self.net}.{i}"
            _run("ip", "-n", ns, "addr", "add", f"{self.ip[role]}/24", "dev", inside)
            _run("ip", "-n", ns, "link", "set", inside, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def spawn(self, role: str, name: str, argv: list[str]) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns[role], *argv], stdout=out, stderr=out,
                                    stdin=subprocess.DEVNULL)  # fmt: skip
        self.procs.append((name, proc, log))
        return proc

    def in_ns(self, role: str, code: str, timeout: float = 10) -> subprocess.CompletedProcess:
        """Run a snippet of Python inside a namespace (as a program on that host would)."""
        return _run("ip", "netns", "exec", self.ns[role], sys.executable, "-c", code, check=False, timeout=timeout)

    def link(self, role: str, up: bool) -> None:
        _run("ip", "link", "set", self.veth[role], "up" if up else "down")

    def logs(self) -> str:
        out = []
        for name, proc, log in self.procs:
            lines = log.read_text(errors="replace").splitlines()[-25:] if log.exists() else []
            out.append(f"----- {name} (exit {proc.poll()}) -----\n" + "\n".join(lines))
        return "\n".join(out)

    def stop(self, name: str, timeout: float = 15) -> int:
        """SIGTERM (agents stop their lanes), SIGKILL if that does not end it; the exit code."""
        proc = next(p for n, p, _ in self.procs if n == name)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        return proc.returncode

    def teardown(self) -> None:
        for name, _, _ in reversed(self.procs):  # agents and planner first, nats-server last
            self.stop(name)
        for ns in self.ns.values():
            # Whatever still runs in our namespaces was started by this test (lanes of a killed agent).
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", ns, check=False)
        for veth in self.veth.values():  # normally gone with its peer's namespace
            _run("ip", "link", "del", veth, check=False)
        if self._bridge_made:
            _run("ip", "link", "del", self.bridge, check=False)


@pytest.fixture
def topo(request, tmp_path):
    if shutil.which("ip") is None:
        pytest.skip("cannot create network namespaces: the `ip` command (iproute2) is not installed")
    probe = f"lanes-probe-{secrets.token_hex(3)}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot create network namespaces: `ip netns add` failed: {result.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    t = Topology(tmp_path, getattr(request, "param", ROLES))
    try:
        t.build()
        yield t
    finally:
        t.teardown()
        leftovers = [ns for ns in _run("ip", "netns", "list").stdout.split() if ns.startswith(f"lanes-{t.sfx}-")]
        assert not leftovers, f"namespaces left behind: {leftovers}"


def _wait_http(url: str, timeout: float = 15) -> None:
    def ready() -> bool:
        with urllib.request.urlopen(url, timeout=1) as r:
            return json.loads(r.read()).get("status") == "ok"

    eventually_blocking(ready, timeout=timeout, interval=0.1, what=f"{url} to be ready")


def _lane_cache_k(lane: LaneStatus) -> str | None:
    argv = list(lane.argv)
    return argv[argv.index("--cache-type-k") + 1] if "--cache-type-k" in argv else None


def start_fleet(topo: Topology, tmp_path: Path, tiny_models, *, serve_network: bool = False,
                llama_server: str | None = None, model: Path | None = None) -> str:  # fmt: skip
    """nats-server, the planner and every agentN role of the topology; the NATS URL.

    serve_network: lanes listen on 0.0.0.0 and each agent advertises its host's address
    (for a gateway on another host); llama_server: that binary instead of the fake; model:
    that file (copied to every agent's folder under its own name) instead of tiny llama8."""
    store = tmp_path / "nats-store"
    store.mkdir()
    # The server pings every client each second and drops one after two missed pongs: so a link
    # cut for a few seconds really ends that agent's connection (as a long outage would with the
    # default 2 minutes), and the agent must reconnect and re-create its plan watch.
    conf = tmp_path / "nats.conf"
    conf.write_text('ping_interval: "1s"\nping_max: 2\n')
    topo.spawn("nats", "nats-server", [nats_server_binary(), "-c", str(conf), "-a", "0.0.0.0", "-p", "4222",
                                       "-m", "8222", "-js", "-sd", str(store), "-n", "lanes-netns"])  # fmt: skip
    url = f"nats://{topo.ip['nats']}:4222"
    _wait_http(f"http://{topo.ip['nats']}:8222/healthz?js-enabled-only=true")
    topo.spawn("planner", "planner", [LANES, "planner", "--nats", url])
    for role in topo.roles:
        if not role.startswith("agent"):
            continue
        folder = tmp_path / role
        models = folder / "models"
        models.mkdir(parents=True)
        shutil.copy(model or tiny_models["llama8"], models / (model.name if model else "llama8.gguf"))
        network = ["--bind", "0.0.0.0", "--advertise", topo.ip[role]] if serve_network else []
        topo.spawn(role, role, [LANES, "agent", "--nats", url, "--host-id", role.replace("agent", "host"),
                                "--models", str(models), "--llama-server", llama_server or fake_binary(folder / "bin"),
                                "--data", str(folder / "data"), "--report-interval", "1", *network])  # fmt: skip
    return url


async def one_lane(kv, host: str, cache_k: str | None = None, not_pid: int | None = None) -> LaneStatus | None:
    """host's one lane once it is healthy (with that K cache type, as a process other than not_pid)."""
    try:
        status = msgspec.json.decode((await kv.get(subjects.status_key(host))).value, type=HostStatus)
    except Exception:
        return None
    if len(status.lanes) != 1:
        return None
    found = status.lanes[0]
    if found.state != "healthy" or _lane_cache_k(found) != cache_k or found.pid == not_pid:
        return None
    return found


def nats_client_ids(topo: Topology) -> dict[str, int]:
    """Connection name -> the server's connection id (a new id means the client reconnected)."""
    with urllib.request.urlopen(f"http://{topo.ip['nats']}:8222/connz", timeout=3) as r:
        return {c.get("name", ""): c["cid"] for c in json.loads(r.read())["connections"]}


async def test_hosts_in_network_namespaces(topo, tmp_path, tiny_models):
    started = time.monotonic()
    url = start_fleet(topo, tmp_path, tiny_models)
    nc = await connect(url, name="netns-test", retry_forever=False)
    try:
        kv = await eventually(lambda: kv_bucket(nc), what="the planner created the lanes bucket")

        def lane(host: str, cache_k: str | None = None, not_pid: int | None = None):
            return one_lane(kv, host, cache_k, not_pid)

        def health_inside(role: str, port: int) -> subprocess.CompletedProcess:
            code = (f"import urllib.request; r = urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=3); "
                    f"print(r.status, r.read().decode())")  # fmt: skip
            return topo.in_ns(role, code)

        def lanes_cli(*args: str) -> subprocess.CompletedProcess:
            """The operator's `lanes` command, run from this (root) namespace."""
            return _run(LANES, *args, "--nats", url, check=False, timeout=30)

        try:
            # ---- both lanes come up, each on its own host
            first = {h: await eventually(lambda h=h: lane(h), timeout=60, what=f"{h} lane healthy") for h in ("host1", "host2")}
            for n, host in ((1, "host1"), (2, "host2")):
                inside = health_inside(f"agent{n}", first[host].port)
                assert inside.returncode == 0 and inside.stdout.startswith("200"), inside.stderr
            # Lanes listen on 127.0.0.1 inside their host: from here (another host) nothing answers.
            with pytest.raises(OSError):
                urllib.request.urlopen(f"http://{topo.ip['agent1']}:{first['host1'].port}/health", timeout=2)
            status = lanes_cli("status")
            assert status.returncode == 0 and "host1" in status.stdout and "host2" in status.stdout, status.stderr

            # ---- a fleet-wide config change reaches both hosts
            changed = lanes_cli("config", "set", "kv_cache_type=q8_0")
            assert changed.returncode == 0, changed.stderr
            q8 = {h: await eventually(lambda h=h: lane(h, "q8_0"), timeout=40, what=f"{h} relaunched with q8_0")
                  for h in ("host1", "host2")}  # fmt: skip
            for h in q8:
                assert q8[h].pid != first[h].pid
                assert list(q8[h].argv)[list(q8[h].argv).index("--cache-type-v") + 1] == "q8_0"

            # ---- cut agent2's link: its lane keeps serving on its host
            cid = nats_client_ids(topo)["lanes-agent-host2"]
            topo.link("agent2", up=False)
            cut_at = time.monotonic()
            unreachable = topo.in_ns(
                "agent2", f"import socket; socket.create_connection(('{topo.ip['nats']}', 4222), timeout=2)"
            )
            assert unreachable.returncode != 0, "agent2 still reaches NATS: the link is not cut"
            changed = lanes_cli("config", "set", "kv_cache_type=q4_0")
            assert changed.returncode == 0, changed.stderr
            q4_host1 = await eventually(lambda: lane("host1", "q4_0"), timeout=40, what="host1 relaunched with q4_0")
            assert q4_host1.pid != q8["host1"].pid
            await asyncio.sleep(max(0.0, 4.0 - (time.monotonic() - cut_at)))  # cut for a few seconds at least
            inside = health_inside("agent2", q8["host2"].port)
            assert inside.returncode == 0 and inside.stdout.startswith("200"), inside.stderr
            old = psutil.Process(q8["host2"].pid)
            assert old.is_running() and "q8_0" in old.cmdline(), "host2's lane changed while it was cut off"

            # ---- the link comes back: agent2 catches up with the change it missed
            topo.link("agent2", up=True)
            q4_host2 = await eventually(
                lambda: lane("host2", "q4_0", not_pid=q8["host2"].pid), timeout=60, what="host2 converged to q4_0"
            )
            assert not psutil.pid_exists(q8["host2"].pid) or psutil.Process(q8["host2"].pid).status() == "zombie"
            inside = health_inside("agent2", q4_host2.port)
            assert inside.returncode == 0 and inside.stdout.startswith("200"), inside.stderr
            assert "q4_0" in psutil.Process(q4_host2.pid).cmdline()
            # It got there through a new connection: the server had dropped the silent one.
            assert nats_client_ids(topo)["lanes-agent-host2"] != cid
            for name, proc, _ in topo.procs:
                assert proc.poll() is None, f"{name} exited with {proc.returncode}"

            # ---- a clean stop: agents end their lanes and exit 0
            for role, host_lane in (("agent1", q4_host1), ("agent2", q4_host2)):
                assert topo.stop(role) == 0, topo.logs()
                assert not psutil.pid_exists(host_lane.pid) or psutil.Process(host_lane.pid).status() == "zombie"
            assert topo.stop("planner") == 0, topo.logs()
        except BaseException:
            print(topo.logs())
            raise
    finally:
        await nc.close()
    print(f"netns test body took {time.monotonic() - started:.1f}s")


@pytest.mark.parametrize("topo", [("nats", "planner", "agent1")], indirect=True)
async def test_agent_stops_promptly_while_cut_off(topo, tmp_path, tiny_models):
    url = start_fleet(topo, tmp_path, tiny_models)
    nc = await connect(url, name="netns-test", retry_forever=False)
    try:
        kv = await eventually(lambda: kv_bucket(nc), what="the planner created the lanes bucket")
        lane = await eventually(lambda: one_lane(kv, "host1"), timeout=60, what="host1 lane healthy")
    finally:
        await nc.close()
    topo.link("agent1", up=False)
    await asyncio.sleep(0.5)
    began = time.monotonic()
    # Within the grace docker stop and systemd give by default: past it, stop() kills (code -9).
    code = topo.stop("agent1", timeout=10)
    took = time.monotonic() - began
    assert not psutil.pid_exists(lane.pid) or psutil.Process(lane.pid).status() == "zombie", "lane left running"
    assert code == 0, f"agent exited {code} after {took:.1f}s\n{topo.logs()}"


GATEWAY_KEY = "netns-gateway-key"  # an --api-key-file key: the operator's (ops), so /metrics too
GATEWAY_ROLES = ("nats", "planner", "agent1", "agent2", "gateway")


@pytest.mark.parametrize("topo", [GATEWAY_ROLES], indirect=True)
async def test_gateway_on_one_host_serves_lanes_of_two_others(topo, tmp_path, tiny_models):
    """A client here, the gateway on its own host, real llama-server lanes on two more; a cut link
    takes host2's lane out of rotation (no request fails) until the link is back."""
    import openai

    from launcher_agent.probe import find_llama_server

    llama = find_llama_server()
    assert llama, "no llama-server: run `lanes install-llama`"
    url = start_fleet(topo, tmp_path, tiny_models, serve_network=True, llama_server=llama)
    keys = tmp_path / "gateway-keys"
    keys.write_text(GATEWAY_KEY + "\n")
    topo.spawn("gateway", "gateway", [LANES, "gateway", "--nats", url, "--host", "0.0.0.0", "--port", "8000",
                                      "--connect-timeout", "1", "--api-key-file", str(keys)])  # fmt: skip
    base = f"http://{topo.ip['gateway']}:8000"
    ai = openai.AsyncOpenAI(base_url=base + "/v1", api_key=GATEWAY_KEY, max_retries=0, timeout=30)

    def routable() -> dict[str, float]:
        ask = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {GATEWAY_KEY}"})
        with urllib.request.urlopen(ask, timeout=3) as r:
            text = r.read().decode()
        return {line.split('host="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("lanes_lane_routable{")}  # fmt: skip

    async def served_by(n: int) -> list[str]:
        hosts = []
        for _ in range(n):
            raw = await ai.chat.completions.with_raw_response.create(
                model="llama8", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            hosts.append(raw.headers["x-lanes-lane"].split("/")[0])
        return hosts

    try:
        await eventually(lambda: routable() == {"host1": 1.0, "host2": 1.0}, timeout=90, what="both lanes routable")
        # Lanes listen on every interface and are reached at the addresses their agents advertise.
        assert set(await served_by(6)) == {"host1", "host2"}
        # ... by their gateways only: this client reaches host1's lane port, and the lane refuses
        # it everything but /health (it has no key: the agent's, which only gateways read).
        nc = await connect(url, name="netns-test", retry_forever=False)
        try:
            lane = await one_lane(await kv_bucket(nc), "host1")
        finally:
            await nc.close()
        direct = f"http://{topo.ip['agent1']}:{lane.port}"
        with urllib.request.urlopen(direct + "/health", timeout=3) as r:
            assert r.status == 200
        chat = json.dumps({"model": "llama8", "messages": [{"role": "user", "content": "hi"}]}).encode()
        for path, data in (("/v1/chat/completions", chat), ("/slots", None), ("/slots/0?action=erase", b"{}"),
                           ("/slots/0?action=save", b'{"filename": "x.bin"}'), ("/props", None)):  # fmt: skip
            ask = urllib.request.Request(direct + path, data=data, headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(ask, timeout=3)
            assert refused.value.code == 401, path

        topo.link("agent2", up=False)
        during = await served_by(6)  # the first may find host2 gone: it is retried on host1
        assert set(during[1:]) == {"host1"}, during
        await eventually(lambda: routable() == {"host1": 1.0, "host2": 0.0}, timeout=10, what="host2 out of rotation")
        assert set(await served_by(4)) == {"host1"}

        topo.link("agent2", up=True)
        await eventually(lambda: routable() == {"host1": 1.0, "host2": 1.0}, timeout=30, what="host2 back in rotation")
        assert "host2" in await served_by(6)
        for name, proc, _ in topo.procs:
            assert proc.poll() is None, f"{name} exited with {proc.returncode}"
    except BaseException:
        print(topo.logs())
        raise
