"""Operations at fleet scale, with real processes killed -9 and a real nats-server:
two planners (one plans, the stand-by takes over), a host that dies (lost, its
fleet-wide lanes placed elsewhere, back when it returns), and revisions that count."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import msgspec
import pytest
from fixtures_bus import agent_config, client, fake_binary, fleet_status, free_port_base, host_status, lane_of, pid_alive, services
from waiting import eventually
from ops_helpers import REPO, Procs, kill_lanes_under, lease_holder, plans

from shared import subjects
from shared.bus import connect, kv_bucket
from shared.messages.config import Demand, Persona
from shared.messages.replies import ConfigSet, FleetHosts
from shared.messages.status import HostStatus, LaneEvent
from shared.messages.wire import encode

QUIET_SECONDS = 60.0


async def _config_set(nc, **changes):
    reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes=changes)), timeout=5)
    assert "Nats-Service-Error" not in (reply.headers or {}), reply.headers
    return json.loads(reply.data)


async def test_two_planners_one_plans_and_the_stand_by_takes_over(nats_server, tmp_path, models):
    procs = Procs(tmp_path / "procs")
    host = socket.gethostname().split(".")[0]
    try:
        a = procs.start("planner-a", "planner", "--nats", nats_server.url, "--lease-ttl", "2")
        b = procs.start("planner-b", "planner", "--nats", nats_server.url, "--lease-ttl", "2")
        ids = {f"{host}-{a.pid}": "planner-a", f"{host}-{b.pid}": "planner-b"}
        async with client(nats_server.url) as nc, services(nats_server.url) as svc:
            svc.start_agent(agent_config(tmp_path, "h1", models, fake_binary(tmp_path / "bin")))
            active = await eventually(lambda: lease_holder(nc), timeout=30, what="a planner holds the lease")
            assert active in ids
            kv = await eventually(lambda: kv_bucket(nc), what="bucket")

            async def healthy():
                entry = await kv.get(subjects.status_key("h1"))
                lane = lane_of(msgspec.json.decode(entry.value, type=HostStatus), "llama8-0")
                return lane if lane and lane.state == "healthy" else None

            first = await eventually(healthy, timeout=40, what="lane healthy")
            # A quiet minute: reports and lease renewals go on; no plan is written by anyone.
            watcher = await kv.watch("plan.*")
            async for entry in watcher:  # noqa: B007 - drain the snapshot
                if entry is None:
                    break
            writes = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + QUIET_SECONDS
            while loop.time() < deadline:
                try:
                    entry = await watcher.updates(timeout=max(0.1, deadline - loop.time()))
                except Exception:
                    continue
                if entry is not None:
                    writes.append((entry.key, entry.revision))
            await watcher.stop()
            assert writes == [], f"plan churn in a quiet minute: {writes}"
            assert await lease_holder(nc) == active
            for name in ids.values():
                assert "plan written" not in procs.log(name) or ids[active] == name, procs.log(name)[-2000:]
            # Both answer the endpoints; only the active one says it plans.
            answers = {}
            for _ in range(20):
                status = await fleet_status(nc)
                answers[status.planner_id] = status.planner_active
            assert answers.get(active) is not False

            # kill -9 the active planner: the stand-by takes the lease within a few seconds.
            procs.kill9(ids[active])
            standby = next(i for i in ids if i != active)
            started = loop.time()
            await eventually(lambda: _holds(nc, standby), timeout=15, what="the stand-by took over the lease")
            took = loop.time() - started
            assert took < 10, took
            await _config_set(nc, kv_cache_type="q8_0", flash_attn="on")

            async def relaunched():
                lane = await healthy()
                return lane if lane and "q8_0" in lane.argv else None

            again = await eventually(relaunched, timeout=40, what="the config change reached the agent")
            assert again.pid != first.pid
            assert "planner is active" in procs.log(ids[standby])
    finally:
        procs.close()


async def _holds(nc, planner: str) -> bool:
    return await lease_holder(nc) == planner


async def _cli(*args: str) -> str:
    """A `lanes` command as a user runs it (asynchronously: the services share this loop)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "lanes.cli", *args, cwd=REPO,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def _status_json(url: str) -> dict:
    return json.loads(await _cli("status", "--json", "--nats", url))


async def test_a_dead_host_is_lost_its_lanes_move_and_it_comes_back(nats_server, tmp_path, tiny_models):
    procs = Procs(tmp_path / "procs")
    binary = fake_binary(tmp_path / "bin")
    folders = {}
    for host in ("ha", "hb"):
        folders[host] = tmp_path / f"models-{host}"
        folders[host].mkdir()
        shutil.copy(tiny_models["llama8"], folders[host] / "llama8.gguf")

    def start_agent(host: str) -> None:
        procs.start(f"agent-{host}", "agent", "--nats", nats_server.url, "--models", str(folders[host]),
                    "--llama-server", binary, "--host-id", host, "--port-base", str(ports[host]),
                    "--report-interval", "0.5", "--tick", "0.2", "--data", str(tmp_path / f"agent-{host}"))  # fmt: skip

    ports = {"ha": free_port_base(), "hb": free_port_base()}
    try:
        async with client(nats_server.url) as nc, services(nats_server.url) as svc:
            svc.start_planner()
            await eventually(lambda: fleet_status(nc), what="planner up")
            await _config_set(nc, host_lost_after=3.0)
            reply = await nc.request(subjects.DEMAND_SET, encode(Demand(personas=(Persona(model="llama8", lanes=1),))), timeout=5)
            assert "Nats-Service-Error" not in (reply.headers or {})
            for host in ("ha", "hb"):
                start_agent(host)

            async def placed_on():
                status = await fleet_status(nc)
                live = {h.host_id for h in status.hosts if h.state == "live"}
                holders = [p.host_id for p in status.plans if p.lanes]
                healthy = [s.host_id for s in status.statuses for lane in s.lanes if lane.state == "healthy"]
                return holders[0] if live == {"ha", "hb"} and len(holders) == 1 and healthy == holders else None

            victim = await eventually(placed_on, timeout=40, what="one lane placed and healthy, both hosts live")
            other = "hb" if victim == "ha" else "ha"
            victim_plan = (await plans(nc))[victim]
            procs.kill9(f"agent-{victim}")

            async def moved():
                status = await fleet_status(nc)
                state = {h.host_id: h.state for h in status.hosts}
                lanes = {s.host_id: [lane.state for lane in s.lanes] for s in status.statuses}
                planned = {p.host_id: len(p.lanes) for p in status.plans}
                if state.get(victim) == "lost" and planned.get(other) == 1 and lanes.get(other) == ["healthy"]:
                    return status
                return None

            await eventually(moved, timeout=30, what=f"{victim} lost, its lane re-placed on {other}")
            # The lost host's plan is kept as it was: a partitioned host keeps serving.
            assert (await plans(nc))[victim] == victim_plan
            # ... and on the bus, for gateways and dashboards (KV key `hosts`, put by the active planner).
            # The key lists the hosts that are not live; the others are counted.
            await eventually(lambda: _hosts_key(nc, {victim: "lost"}, total=2), timeout=10, what="hosts key")
            shown = await _status_json(nats_server.url)
            assert {h["host_id"]: h["state"] for h in shown["hosts"]} == {victim: "lost", other: "live"}
            human = await _cli("status", "--nats", nats_server.url)
            assert any(line.startswith(victim) and " lost" in line for line in human.splitlines()), human

            start_agent(victim)  # the host returns (and adopts the lane it left running)

            async def back():
                status = await fleet_status(nc)
                state = {h.host_id: h.state for h in status.hosts}
                planned = sum(len(p.lanes) for p in status.plans)
                return status if state == {"ha": "live", "hb": "live"} and planned == 1 else None

            await eventually(back, timeout=30, what=f"{victim} live again, the persona's one lane planned once")
    finally:
        procs.close()
        kill_lanes_under(tmp_path)


async def test_config_and_plan_revisions_count_changes(nats_server, tmp_path, models):
    async with client(nats_server.url) as nc, services(nats_server.url) as svc:
        svc.start_planner()
        svc.start_agent(agent_config(tmp_path, "h1", models, fake_binary(tmp_path / "bin")))
        await eventually(lambda: _plan_rev(nc), timeout=30, what="first plan")
        first = await fleet_status(nc)
        assert first.config_revision == 0 and first.config.revision == 0
        assert (await _config_set(nc, kv_cache_type="q8_0", flash_attn="on"))["revision"] == 1
        await eventually(lambda: _plan_rev(nc, 2), timeout=30, what="plan r2")
        assert (await _config_set(nc, kv_cache_type="q4_0"))["revision"] == 2
        assert (await _config_set(nc, kv_cache_type="q4_0"))["revision"] == 2  # no change, no new revision

        async def counted():
            status = await fleet_status(nc)
            ok = status.config_revision == 2 and all(p.config_revision == 2 for p in status.plans)
            return status if ok and status.plans else None

        status = await eventually(counted, timeout=30, what="config r2 everywhere")
        assert [p.plan_revision for p in status.plans] == [3]  # 1: first plan, 2: q8_0, 3: q4_0
        shown = await _status_json(nats_server.url)
        assert shown["config_revision"] == 2 and shown["config"]["revision"] == 2
        human = await _cli("status", "--nats", nats_server.url)
        assert human.startswith("config r2:"), human


async def _hosts_key(nc, expected: dict[str, str], total: int) -> bool:
    entry = await (await kv_bucket(nc)).get(subjects.HOSTS_KEY)
    hosts = msgspec.json.decode(entry.value, type=FleetHosts)
    return {h.host_id: h.state for h in hosts.hosts} == expected and hosts.total == total


async def _plan_rev(nc, at_least: int = 1) -> bool:
    found = await plans(nc)
    return "h1" in found and found["h1"].plan_revision >= at_least


@pytest.mark.parametrize("noticed_by", ["first-byte", "agent"])
async def test_a_lane_whose_inference_loop_stalls_leaves_rotation_and_is_restarted(nats_server, tmp_path, models,
                                                                                   noticed_by):  # fmt: skip
    """The fake's recorded stall: a request that never finishes stops the loop; /health and /slots still
    answer (as the binary's did while its loop was busy), the busy slot's counters never move. The
    gateway takes the lane out of rotation at once for a streamed request with no first token in
    time; in any case the agent reports it unresponsive (stalled) and restarts it like a wedged
    lane, and it comes back."""
    import aiohttp

    from gateway.service import Gateway, run_gateway
    from gateway.settings import GatewaySettings

    binary = fake_binary(tmp_path / "bin", env={"FAKE_LLAMA_STALL": "1"})
    # The agent is slower than the gateway here (stall_seconds), so the gateway's own notice is seen.
    cfg = agent_config(tmp_path, "h1", models, binary, probe_interval=0.3, probe_timeout=0.5, stall_seconds=4.0)
    events: list[LaneEvent] = []

    async def on_event(msg):
        events.append(msgspec.json.decode(msg.data, type=LaneEvent))

    first_byte = noticed_by == "first-byte"
    gw = Gateway(GatewaySettings(port=0, probe_timeout=0.3, first_byte_timeout=1.0))
    stop = asyncio.Event()
    async with client(nats_server.url) as nc, services(nats_server.url) as svc, aiohttp.ClientSession() as http:
        await nc.subscribe(subjects.ALL_EVENTS, cb=on_event)
        svc.start_planner()
        svc.start_agent(cfg)
        gateway = asyncio.create_task(run_gateway(nats_server.url, stop, gateway=gw))
        try:

            async def healthy():
                lane = lane_of(await host_status(nc, "h1"), "llama8-0")
                return lane if lane and lane.state == "healthy" else None

            first = await eventually(healthy, timeout=40, what="lane healthy")
            # routable, with the key its agent put in lanes-secrets
            route = await eventually(lambda: next((r for r in gw.view.routable("llama8") if r.api_key), None),
                                     timeout=20, what="routable")  # fmt: skip
            chat = {"model": "llama8", "messages": [{"role": "user", "content": "hi"}], "stream": first_byte}

            async def never_answered() -> None:
                try:
                    await http.post(route.url + "/v1/chat/completions", json=chat, headers=route.auth)
                except aiohttp.ClientError:
                    pass  # its lane was killed and restarted

            if first_byte:  # through the gateway: no first token within 1 s, and no other lane to try
                async with http.post(gw.url + "/v1/chat/completions", json=chat) as resp:
                    assert resp.status == 504 and resp.headers["Retry-After"]
                    assert (await resp.json())["error"]["code"] == "lane_stalled"
            else:  # straight to the lane, as another client would: the agent notices
                stuck = asyncio.create_task(never_answered())
            # Out of the gateway's rotation while its /health still answers.
            await eventually(lambda: not gw.view.routable("llama8"), timeout=10, what="out of rotation")
            async with http.get(route.url + "/health") as resp:
                assert resp.status == 200
            if first_byte:
                assert "stalled: no first token within 1 s" in gw.view.stalled.get(route.key, ""), gw.view.stalled
            # The agent reports it; until then its /slots kept answering (frozen counters): the gateway's
            # stalled mark held, since an answer without progress does not bring a lane back.
            await eventually(lambda: any(e.event == "unresponsive" for e in events), timeout=20, what="reported")
            assert (route.key in gw.view.stalled) == first_byte

            async def restarted():
                lane = lane_of(await host_status(nc, "h1"), "llama8-0")
                assert lane is None or lane.state != "failed", f"the lane failed for good: {lane.last_error}"
                return lane if lane and lane.state == "healthy" and lane.pid != first.pid else None

            again = await eventually(restarted, timeout=30, what="the stalled lane restarted")
            if not first_byte:
                stuck.cancel()
            seen = [(e.event, e.detail) for e in events if e.lane_id == "llama8-0" and e.pid == first.pid]
            assert [e for e, _ in seen][-2:] == ["unresponsive", "crashed"], seen
            assert seen[-2][1].startswith("stalled: ") and "no prompt batch and no token" in seen[-2][1]
            assert again.restarts == 1 and not pid_alive(first.pid)
            # Back in the gateway's rotation once its new process answers /slots.
            await eventually(lambda: gw.view.routable("llama8"), timeout=20, what="back in rotation")
        finally:
            stop.set()
            await asyncio.wait_for(gateway, 15)


async def test_a_wedged_lane_is_marked_unresponsive_then_restarted_like_a_crash(nats_server, tmp_path, models):
    cfg = agent_config(tmp_path, "h1", models, fake_binary(tmp_path / "bin"), probe_interval=0.3, probe_failures=2,
                       probe_timeout=0.5)  # fmt: skip
    events: list[LaneEvent] = []
    states: list[str] = []

    async def on_event(msg):
        events.append(msgspec.json.decode(msg.data, type=LaneEvent))

    async def on_telemetry(msg):
        status = msgspec.json.decode(msg.data, type=HostStatus)
        states.extend(lane.state for lane in status.lanes)

    async with client(nats_server.url) as nc, services(nats_server.url) as svc:
        await nc.subscribe(subjects.ALL_EVENTS, cb=on_event)
        await nc.subscribe(subjects.telemetry_subject("h1"), cb=on_telemetry)
        svc.start_planner()
        svc.start_agent(cfg)

        async def healthy():
            lane = lane_of(await host_status(nc, "h1"), "llama8-0")
            return lane if lane and lane.state == "healthy" else None

        first = await eventually(healthy, timeout=40, what="lane healthy")
        os.kill(first.pid, signal.SIGSTOP)  # alive, holding its port, answering nothing
        try:

            async def restarted():
                lane = lane_of(await host_status(nc, "h1"), "llama8-0")
                assert lane is None or lane.state != "failed", f"the lane failed for good: {lane.last_error}"
                return lane if lane and lane.state == "healthy" and lane.pid != first.pid else None

            again = await eventually(restarted, timeout=30, what="the wedged lane restarted")
        finally:
            if pid_alive(first.pid):
                os.kill(first.pid, signal.SIGKILL)
        assert not pid_alive(first.pid)
        assert again.restarts == 1
        seen = [e.event for e in events if e.lane_id == "llama8-0" and e.pid == first.pid]
        assert seen[-2:] == ["unresponsive", "crashed"], seen
        crash = [e for e in events if e.event == "crashed" and e.pid == first.pid][0]
        assert "unresponsive" in crash.detail and "/health" in crash.detail
        assert "unresponsive" in states  # what a gateway reading status saw before the restart


def _nats_pid(data) -> int | None:
    files = list((data / "nats" / "ports").glob("*.ports"))
    return int(files[0].stem.rsplit("_", 1)[1]) if files else None


async def test_lanes_up_restarts_its_nats_server_and_exits_in_one_line_when_it_cannot(tmp_path, models):
    procs = Procs(tmp_path / "procs")
    data = tmp_path / "data"
    nats_port = free_port_base(1)
    url = f"nats://127.0.0.1:{nats_port}"
    up = procs.start("up", "up", "--models", str(models), "--data", str(data), "--llama-server",
                     fake_binary(tmp_path / "bin"), "--nats-port", str(nats_port), "--port-base",
                     str(free_port_base()), "--gateway-port", "0", "--host-id", "up1")  # fmt: skip
    try:
        nc = await eventually(lambda: connect(url, name="test", retry_forever=True), timeout=30, what="nats up")
        try:

            async def healthy():
                lane = lane_of(await host_status(nc, "up1"), "llama8-0")
                return lane if lane and lane.state == "healthy" else None

            lane = await eventually(healthy, timeout=60, what="lane healthy under lanes up")
            first = _nats_pid(data)
            os.kill(first, signal.SIGKILL)
            assert pid_alive(lane.pid)  # the lane serves on while NATS is away
            await eventually(lambda: (_nats_pid(data) or first) != first, timeout=20, what="nats-server restarted")
            # Same store: the plan and the lane are the ones from before, nothing relaunched.
            again = await eventually(healthy, timeout=30, what="status back after the restart")
            assert again.pid == lane.pid and up.poll() is None
            assert (await plans(nc))["up1"].plan_revision == 1
        finally:
            await nc.close()

        # Now it cannot come back: another program takes its port the moment it dies.
        blocker = socket.socket()
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        os.kill(_nats_pid(data), signal.SIGKILL)
        for _ in range(2000):  # the port frees as the kernel reaps it: take it at once
            try:
                blocker.bind(("127.0.0.1", nats_port))
                break
            except OSError:
                await asyncio.sleep(0.001)
        blocker.listen()
        try:
            code = await asyncio.to_thread(up.wait, 90)
        finally:
            blocker.close()
        errors = [line for line in procs.log("up").splitlines() if line.startswith("lanes: error:")]
        assert code == 2 and len(errors) == 1, procs.log("up")[-3000:]
        assert "nats-server died" in errors[0] and "could not be restarted" in errors[0]
        assert not pid_alive(lane.pid)  # it stopped its lanes before it left
    finally:
        procs.close()
        kill_lanes_under(tmp_path)


async def test_a_busy_port_moves_the_lane_with_a_reason(nats_server, tmp_path, models):
    base = free_port_base()
    squatter = socket.socket()  # another program listening on the first port of the range
    squatter.bind(("127.0.0.1", base))
    squatter.listen()
    try:
        async with client(nats_server.url) as nc, services(nats_server.url) as svc:
            svc.start_planner()
            svc.start_agent(agent_config(tmp_path, "h1", models, fake_binary(tmp_path / "bin"), port_base=base))

            async def healthy():
                lane = lane_of(await host_status(nc, "h1"), "llama8-0")
                return lane if lane and lane.state == "healthy" else None

            lane = await eventually(healthy, timeout=40, what="lane healthy on another port")
            assert lane.port == base + 1
            host_plan = (await plans(nc))["h1"]
            assert host_plan.lanes[0].port == base + 1
            assert any(f"port {base} is given to no lane: taken by another program" in r for r in host_plan.reasons)
            status = await host_status(nc, "h1")
            assert [(fb.kind, fb.port) for fb in status.feedback] == [("port_busy", base)]
    finally:
        squatter.close()


async def test_a_rejected_plan_is_fed_back_and_rewritten_newer(nats_server, tmp_path, models):
    """The bucket loses the plan (wiped, restored from an old backup): the new plan is older
    than what the agent runs; the agent says so and the planner writes one it accepts."""
    async with client(nats_server.url) as nc, services(nats_server.url) as svc:
        svc.start_planner()
        svc.start_agent(agent_config(tmp_path, "h1", models, fake_binary(tmp_path / "bin")))
        await eventually(lambda: _plan_rev(nc, 1), timeout=30, what="first plan")
        for n, kv_type in enumerate(("q8_0", "q4_0"), 2):
            await _config_set(nc, kv_cache_type=kv_type, flash_attn="on")
            await eventually(lambda: _plan_rev(nc, n), timeout=30, what=f"plan r{n}")

        async def applied(rev: int):
            status = await host_status(nc, "h1")
            return status is not None and status.plan_revision == rev

        await eventually(lambda: applied(3), timeout=30, what="agent runs r3")
        await svc.stop("planner")
        kv = await kv_bucket(nc)
        await kv.purge(subjects.plan_key("h1"))
        rejections = []

        async def on_rejected(msg):
            rejections.append(msg.data)

        await nc.subscribe(subjects.rejected_subject("h1"), cb=on_rejected)
        svc.start_planner()
        await eventually(lambda: rejections, timeout=30, what="the agent refuses the older plan")
        assert b"older than the applied r3" in rejections[0]
        found = await eventually(lambda: _plan_rev(nc, 3), timeout=30, what="the planner rewrote it newer")
        assert found

        async def runs_the_rewrite() -> bool:  # r3 again, or r4 where the lane's draining changed the plan
            rewritten = (await plans(nc))["h1"].plan_revision
            return rewritten >= 3 and await applied(rewritten)

        await eventually(runs_the_rewrite, timeout=30, what="agent accepts it")

        async def cleared():
            status = await fleet_status(nc)
            return status if all(not h.rejected for h in status.hosts) else None

        await eventually(cleared, timeout=30, what="the rejection is cleared once the agent runs the plan")


async def test_eventually_fails_at_once_on_a_final_wrong_value():
    calls = []

    def final_wrong():
        calls.append(1)
        assert False, "failed for good"

    with pytest.raises(AssertionError, match="failed for good"):
        await eventually(final_wrong, timeout=3600)
    assert len(calls) == 1  # not polled until the timeout
    flaky = iter([None, ConnectionError("bus restarting"), "value"])

    def not_yet_then_value():
        item = next(flaky)
        if isinstance(item, Exception):
            raise item
        return item

    assert await eventually(not_yet_then_value, interval=0.01) == "value"
