"""The agent's load feed on a real NATS server (launcher_agent/load_feed.py, launcher_agent/service.py):
a serving lane's load is published on lanes.load.<host>, whole when a gateway asks, and a
gateway's view counts the busy slots of a request that reached the lane without it."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
from fixtures_bus import agent_config, client, fake_binary, host_status, lane_auth, lane_of, services
from waiting import eventually

from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from shared import subjects
from shared.messages.status import HostLoad


async def test_an_agent_publishes_its_lanes_load_and_says_it_whole_when_asked(nats_server, tmp_path, models):
    loads: list[HostLoad] = []

    async def on_load(msg):
        loads.append(msgspec.json.decode(msg.data, type=HostLoad))

    cfg = agent_config(tmp_path, "h1", models, fake_binary(tmp_path / "bin"), load_refresh=3600.0)
    async with client(nats_server.url) as nc, services(nats_server.url) as svc:
        await nc.subscribe(subjects.load_subject("h1"), cb=on_load)
        svc.start_planner()
        svc.start_agent(cfg)

        async def serving():
            lane = lane_of(await host_status(nc, "h1"), "llama8-0")
            return lane if lane and lane.state == "healthy" else None

        lane = await eventually(serving, timeout=40, what="lane healthy")
        first = await eventually(lambda: next((m for m in loads if m.lanes), None), timeout=10, what="its load")
        (said,) = first.lanes
        assert (said.lane_id, said.pid, said.busy, said.answered) == ("llama8-0", lane.pid, 0, True)
        await asyncio.sleep(1.5)  # three reads with nothing changed: nothing sent
        seen = len(loads)
        await asyncio.sleep(1.5)
        assert len(loads) == seen
        await nc.publish(subjects.LOAD_ASK, b"")  # a gateway that just started
        await eventually(lambda: len(loads) > seen, timeout=5, what="the whole load again")
        assert loads[-1].lanes[0].lane_id == "llama8-0"


async def test_a_gateway_counts_busy_slots_it_did_not_fill_from_the_agents_reads(nats_server, tmp_path, models):
    binary = fake_binary(tmp_path / "bin", env={"FAKE_LLAMA_STALL": "1"})  # a request that never ends
    cfg = agent_config(tmp_path, "h1", models, binary)
    gw = Gateway(GatewaySettings(port=0))
    stop = asyncio.Event()
    async with services(nats_server.url) as svc, aiohttp.ClientSession() as http:
        svc.start_planner()
        svc.start_agent(cfg)
        gateway = asyncio.create_task(run_gateway(nats_server.url, stop, gateway=gw))
        try:
            route = await eventually(lambda: next((r for r in gw.view.routable("llama8") if r.api_key), None),
                                     timeout=40, what="routable")  # fmt: skip
            await eventually(lambda: gw.admission.counts.reported.get(route.key) == 0, timeout=10, what="idle load")
            chat = {"model": "llama8", "messages": [{"role": "user", "content": "hi"}]}
            straight = asyncio.create_task(http.post(route.url + "/v1/chat/completions", json=chat,
                                                     headers=lane_auth(cfg, "llama8-0")))  # fmt: skip
            await eventually(lambda: gw.admission.counts.reported.get(route.key) == 1, timeout=10,
                             what="the lane's busy slot, as its agent read it")  # fmt: skip
            assert not gw.admission.counts.in_flight  # none of this gateway's own
            straight.cancel()
        finally:
            stop.set()
            await asyncio.wait_for(gateway, 15)
