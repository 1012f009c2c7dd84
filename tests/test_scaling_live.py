"""Lanes that follow demand against real parts: a nats-server, the planner, one agent running the
fake llama-server (each answer takes a second), one gateway. Held load on one model makes its
queue wait grow, a second lane appears, and it goes away (through drain, one client still
served) once the load drops; no request fails."""

from __future__ import annotations

import asyncio
import shutil
from contextlib import AsyncExitStack

import aiohttp
from fixtures_bus import Services, agent_config, client, fake_binary, fleet_status
from test_on_demand import HOST, _chat, _planned, gateway
from waiting import eventually

from shared import subjects
from shared.messages.config import Demand, Persona
from shared.messages.replies import ConfigSet
from shared.messages.wire import encode

# Gateway activity reports the planner gets while the test checks that nothing changes: enough
# for the scaling rule (scale_up_reports in a row) to have fired twice over had it been going to.
CALM_REPORTS = 6


class Reports:
    """Counts the gateways' activity reports: the planner's scaling rule runs on each."""

    def __init__(self) -> None:
        self.count = 0

    async def heard(self, msg) -> None:
        self.count += 1

    async def pass_(self, n: int) -> None:
        start = self.count
        await eventually(lambda: self.count >= start + n, what=f"{n} more gateway activity reports")


async def test_queued_load_adds_a_lane_and_it_goes_when_the_load_stops(tmp_path, tiny_models, nats_server):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_models["llama8"], models / "a.gguf")
    services = Services(nats_server.url)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(services.stop_all)
        services.start_planner()
        nc = await stack.enter_async_context(client(nats_server.url))
        await eventually(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), what="planner up")
        changes = {"scale_up_wait": 0.5, "scale_up_reports": 2, "scale_down_idle": 3.0}
        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes=changes)), timeout=5)
        assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
        persona = Persona(model="a", alias="chat", ctx_min=4096, ctx_max=4096, parallel=1, max_lanes=2)
        await nc.request(subjects.DEMAND_SET, encode(Demand(personas=(persona,))), timeout=5)
        binary = fake_binary(tmp_path / "bin", env={"FAKE_LLAMA_REPLY_SECONDS": "1.0"})
        services.start_agent(agent_config(tmp_path, HOST, models, binary))
        gw = await stack.enter_async_context(gateway(nats_server.url))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        reports = Reports()
        await nc.subscribe(subjects.ALL_ACTIVITY, cb=reports.heard)
        await eventually(lambda: gw.view.routable("chat"), timeout=60, what="chat's lane ready")
        assert len(gw.view.lanes_for("chat")) == 1
        await reports.pass_(CALM_REPORTS)  # nothing queues: one lane stays
        assert _planned(await fleet_status(nc)) == {HOST: ["chat"]}

        # Four clients on one slot of one second each: waits of seconds, report after report.
        results: list[tuple[int, str]] = []
        stop = asyncio.Event()

        async def client_loop() -> None:
            while not stop.is_set():
                status, body, lane = await _chat(http, gw, "chat")
                results.append((status, lane))

        clients = [asyncio.create_task(client_loop()) for _ in range(4)]
        await eventually(lambda: len([x for x in gw.view.lanes_for("chat") if x.routable]) == 2, timeout=40,
                         what="a second lane for chat")  # fmt: skip
        both = {f"{HOST}/a-0", f"{HOST}/a-1"}
        await eventually(lambda: {lane for _, lane in results} >= both, timeout=40, what="both lanes serve")
        assert _planned(await fleet_status(nc)) == {HOST: ["chat", "chat"]}
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 30)
        served = len(results)

        # The load drops to one client (one lane carries it): after scale_down_idle of calm the
        # added lane drains and goes while that client goes on.
        stop = asyncio.Event()
        light = asyncio.create_task(client_loop())
        await eventually(lambda: len(gw.view.lanes_for("chat")) == 1, timeout=40, what="back to one lane")
        after = len(results)
        await eventually(lambda: len(results) >= after + 2, timeout=40, what="the light client served on one lane")
        stop.set()
        await asyncio.wait_for(light, 30)
        assert len(results) > served + 3, results  # the light client was served all along
        assert [s for s, _ in results if s != 200] == [], results
        assert {lane for _, lane in results[:served]} == both  # both served
        await reports.pass_(CALM_REPORTS)  # no flapping: it stays at one lane with no load
        assert _planned(await fleet_status(nc)) == {HOST: ["chat"]}
        # Counted in the models key, so gateways show lanes_evictions_total{reason="scaled_down"} too.
        await eventually(lambda: gw.view.catalogue.evictions == {"scaled_down": 1}, what="the removal counted")
