"""Fault injection with real processes and a real nats-server: two hosts, one fault after another.

After every fault: no planned lane lost (each is healthy again), no plan lost (every
host's plan is in KV, its revision never goes back), never two lanes on one port.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal

import msgspec
import psutil
import pytest
from fixtures_bus import agent_config, client, fake_binary, free_port_base, host_status, lane_of, services
from test_reconcile import respelled
from waiting import eventually

from launcher_agent import lifecycle
from shared import subjects
from shared.bus import kv_bucket
from shared.lane_key import lane_key
from shared.llama.flags import lane_args
from shared.messages.plans import HostPlan
from shared.messages.replies import ConfigSet
from shared.messages.status import LaneEvent
from shared.messages.wire import encode

HOSTS = ("h1", "h2")


@pytest.fixture
def fleet_dirs(tmp_path, tiny_models):
    out = {}
    for host in HOSTS:
        folder = tmp_path / f"models-{host}"
        folder.mkdir()
        shutil.copy(tiny_models["llama8"], folder / "llama8.gguf")
        shutil.copy(tiny_models["llama_gqa"], folder / "llama_gqa.gguf")
        out[host] = folder
    return out


def lane_processes(tmp_path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if any("fake_llama_server" in c for c in cmd) and any(str(tmp_path) in c for c in cmd):
            found.append(p)
    return found


async def invariants(nc, tmp_path, plan_revisions: dict[str, int]) -> dict[str, int]:
    """Every planned lane healthy, plans present and not older, one process per port."""
    async def all_healthy():
        kv = await kv_bucket(nc)
        revisions = {}
        for host in HOSTS:
            plan = msgspec.json.decode((await kv.get(subjects.plan_key(host))).value, type=HostPlan)
            revisions[host] = plan.plan_revision
            status = await host_status(nc, host)
            for spec in plan.lanes:
                lane = lane_of(status, spec.lane_id)
                if lane is None or lane.state != "healthy" or lane.port != spec.port or lane.lane_key != lane_key(spec):
                    return None
        return revisions

    revisions = await eventually(all_healthy, timeout=45, what="every planned lane healthy")
    for host, rev in plan_revisions.items():
        assert revisions[host] >= rev, f"plan of {host} went back from r{rev} to r{revisions[host]}"
    ports: dict[int, int] = {}
    for proc in lane_processes(tmp_path):
        cmd = proc.cmdline()
        port = int(cmd[cmd.index("--port") + 1])
        ports[port] = ports.get(port, 0) + 1
    assert all(n == 1 for n in ports.values()), f"two lanes on one port: {ports}"
    assert len(ports) == 4  # two models on each of two hosts
    return revisions


async def test_fleet_survives_one_fault_after_another(nats_server, tmp_path, fleet_dirs):
    binary = fake_binary(tmp_path / "bin")
    configs = {
        host: agent_config(tmp_path, host, fleet_dirs[host], binary) for host in HOSTS
    }
    async with services(nats_server.url) as s:
        s.start_planner()
        for cfg in configs.values():
            s.start_agent(cfg)
        async with client(nats_server.url) as nc:
            revs = await invariants(nc, tmp_path, {})

        # 1. nats-server SIGKILLed, restarted with its JetStream state on the same port.
        nats_server.stop(kill=True)
        await asyncio.sleep(1.0)
        nats_server.start()
        async with client(nats_server.url) as nc:
            revs = await invariants(nc, tmp_path, revs)

            # 2. planner killed mid-flight, a new one started.
            await s.kill("planner")
            s.start_planner("planner-2")
            revs = await invariants(nc, tmp_path, revs)

            # 3. agent killed: its lanes keep running and the new agent adopts them.
            before = {p.pid for p in lane_processes(tmp_path)}
            await s.kill("h1")
            s.start_agent(configs["h1"])
            revs = await invariants(nc, tmp_path, revs)
            assert {p.pid for p in lane_processes(tmp_path)} == before

            # 4. a lane SIGKILLed: restarted (with backoff), nothing else touched.
            victim = lane_of(await host_status(nc, "h2"), "llama8-0")
            os.kill(victim.pid, signal.SIGKILL)
            await eventually(
                lambda: _restarted(nc, "h2", "llama8-0", victim.pid), what="killed lane restarted"
            )
            revs = await invariants(nc, tmp_path, revs)


async def test_lanes_racing_for_one_port_each_come_up_with_their_own_key(nats_server, tmp_path, fleet_dirs):
    """Two agents whose lanes race for the same ports (one port range, one machine): each
    loser fails to bind, is fed back and moved, and every lane comes up. The agents' requests
    carry each lane's own key: when a lane's key was looked up by its address, the loser's
    start and stop overwrote and then erased the winner's, whose /props then answered 401
    for ever ("loading"; the fault test above failed so when its two hosts drew one range)."""
    binary = fake_binary(tmp_path / "bin")
    base = free_port_base()
    async with services(nats_server.url) as s:
        s.start_planner()
        for host in HOSTS:
            s.start_agent(agent_config(tmp_path, host, fleet_dirs[host], binary, port_base=base))
        async with client(nats_server.url) as nc:
            await invariants(nc, tmp_path, {})


async def test_an_agent_upgraded_to_another_renderer_adopts_every_lane_and_restarts_none(
    nats_server, tmp_path, fleet_dirs, monkeypatch
):
    """The new agent version spells argv otherwise (flags reversed, some short): its lanes are
    known by their lane key, so it adopts them all, restarts none, and takes the next plan as is."""
    cfg = agent_config(tmp_path, "h1", fleet_dirs["h1"], fake_binary(tmp_path / "bin"))
    events: list[LaneEvent] = []
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        s.start_agent(cfg)
        first = await eventually(lambda: _all_healthy(nc, "h1", 2), what="both lanes healthy")
        await s.kill("h1")

        async def on_event(msg):
            events.append(msgspec.json.decode(msg.data, type=LaneEvent))

        await nc.subscribe(subjects.ALL_EVENTS, cb=on_event)
        monkeypatch.setattr(lifecycle, "lane_args", lambda spec, caps, *rest, **kw: respelled(lane_args(spec, caps, *rest, **kw)))
        s.start_agent(cfg)  # the "new version"
        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"drain_timeout": 12})), timeout=5)
        assert "Nats-Service-Error" not in (reply.headers or {})
        kv = await kv_bucket(nc)

        async def next_plan_applied():
            plan = msgspec.json.decode((await kv.get(subjects.plan_key("h1"))).value, type=HostPlan)
            status = await host_status(nc, "h1")
            new = plan.drain_timeout == 12 and status.plan_revision == plan.plan_revision
            return status if new and status.agent_session != first.agent_session and _healthy(status, 2) else None

        after = await eventually(next_plan_applied, what="the new agent applied the next plan")
        assert {(x.lane_id, x.pid, x.restarts) for x in after.lanes} == {(x.lane_id, x.pid, 0) for x in first.lanes}
        assert [e.event for e in events if e.event in ("started", "stopped", "crashed")] == []
        # The new version does render its own way: a lane it starts from now on runs its spelling.
        victim = after.lanes[0]
        os.kill(victim.pid, signal.SIGKILL)
        again = await eventually(lambda: _restarted(nc, "h1", victim.lane_id, victim.pid), what="lane restarted")
        assert "-c" in again.argv and "--ctx-size" not in again.argv and again.lane_key == victim.lane_key


async def _all_healthy(nc, host, n):
    status = await host_status(nc, host)
    return status if _healthy(status, n) else None


def _healthy(status, n) -> bool:
    return status is not None and len(status.lanes) == n and all(x.state == "healthy" for x in status.lanes)


async def _restarted(nc, host, lane_id, old_pid):
    lane = lane_of(await host_status(nc, host), lane_id)
    return lane if lane and lane.pid != old_pid and lane.state == "healthy" and lane.restarts >= 1 else None


async def test_lane_that_never_stays_up_is_reported_and_planner_told(nats_server, tmp_path, fleet_dirs):
    """The fake dies 0.2 s after every start: crash loop after five tries, then the planner drops it."""
    binary = fake_binary(tmp_path / "bin", {"FAKE_LLAMA_CRASH_AFTER": "0.2"})
    shutil.rmtree(fleet_dirs["h1"] / "llama_gqa.gguf", ignore_errors=True)
    (fleet_dirs["h1"] / "llama_gqa.gguf").unlink(missing_ok=True)
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        s.start_agent(agent_config(tmp_path, "h1", fleet_dirs["h1"], binary))

        async def given_up():
            status = await host_status(nc, "h1")
            loops = [f for f in (status.feedback if status else ()) if f.kind == "crash_loop"]
            kv = await kv_bucket(nc)
            plan = msgspec.json.decode((await kv.get(subjects.plan_key("h1"))).value, type=HostPlan)
            return (loops, plan) if loops and not plan.lanes else None

        loops, plan = await eventually(given_up, timeout=60, what="crash loop reported and lane unplanned")
        assert "Segmentation fault" in loops[0].detail or "exit" in loops[0].detail
        assert any("keeps failing" in u.reason for u in plan.unplaced)
        await asyncio.sleep(1.0)
        assert lane_processes(tmp_path) == []  # nothing left restarting
