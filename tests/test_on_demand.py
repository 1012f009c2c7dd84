"""Models on demand against real parts: a nats-server, the planner, one agent running the fake
llama-server, and two gateways. The host has RAM for one lane of the three models it holds.

Every model is listed by GET /v1/models with its state; a request for an unloaded model is held,
woken over the bus (once, however many requests and gateways ask), the idle lane is evicted
through the agent's drain and the request served; a model whose load fails answers with
llama-server's reason; an unknown model is a 404 at once; a model past its idle_ttl unloads.
"""

from __future__ import annotations

import asyncio
import shutil
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp
import msgspec
from fixtures_bus import Services, agent_config, client, fake_binary, fleet_status
from test_metrics import samples as all_samples
from waiting import eventually

from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from shared import subjects
from lanes.online import render_status
from shared.messages.config import Demand, Persona
from shared.messages.replies import ConfigSet, FleetStatus
from shared.messages.wire import encode

MIB = 1 << 20
HOST = "od"
CTX = 16384  # one lane of the tiny llama at this window is 340 MiB: the host's budget holds one
MAX_RAM = 1100 * MIB


@asynccontextmanager
async def gateway(url: str, **settings):
    # A request that hangs fails the test in seconds, not after the default 600 s.
    gw = Gateway(GatewaySettings(port=0, activity_interval=0.5, wake_repeat=0.5, request_timeout=30, **settings))
    stop = asyncio.Event()
    task = asyncio.create_task(run_gateway(url, stop, gateway=gw))
    try:
        await asyncio.wait_for(gw.started.wait(), 10)
        await eventually(lambda: gw.view.synced and gw.view.catalogue, what="gateway read the fleet")
        yield gw
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def _chat(http: aiohttp.ClientSession, gw: Gateway, model: str) -> tuple[int, dict, str]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(gw.url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=90)) as resp:
        return resp.status, await resp.json(), resp.headers.get("X-Lanes-Lane", "")


def samples(text: str, name: str, **labels) -> list[float]:
    """The values of one series whose labels include these."""
    return [v for (n, ls), v in all_samples(text).items() if n == name and set(labels.items()) <= ls]


def _planned(nc_status) -> dict[str, list[str]]:
    return {p.host_id: sorted(s.alias for s in p.lanes) for p in nc_status.plans}


async def _models(http: aiohttp.ClientSession, gw: Gateway) -> dict[str, dict]:
    async with http.get(gw.url + "/v1/models") as resp:
        assert resp.status == 200
        return {m["id"]: m for m in (await resp.json())["data"]}


async def test_models_load_on_request_evict_the_idle_and_fail_with_the_reason(tmp_path, tiny_models, nats_server):
    models = tmp_path / "models"
    models.mkdir()
    for name in ("a", "b", "c"):
        shutil.copy(tiny_models["llama8"], models / f"{name}.gguf")
    shutil.copy(tiny_models["mla"], models / "broken.gguf")  # the fake has no figures for it: its load fails
    services = Services(nats_server.url)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(services.stop_all)
        services.start_planner()
        nc = await stack.enter_async_context(client(nats_server.url))
        await eventually(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), what="planner up")
        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"min_residency": 1.0})), timeout=5)
        assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
        demand = Demand(personas=tuple(Persona(model=m, ctx_min=CTX, ctx_max=CTX) for m in ("a", "b", "c")))
        await nc.request(subjects.DEMAND_SET, encode(demand), timeout=5)
        cfg = agent_config(tmp_path, HOST, models, fake_binary(tmp_path / "bin"), max_ram=MAX_RAM)
        services.start_agent(cfg)
        gw1 = await stack.enter_async_context(gateway(nats_server.url, load_timeout=60))
        gw2 = await stack.enter_async_context(gateway(nats_server.url, load_timeout=60))
        http = await stack.enter_async_context(aiohttp.ClientSession())

        # Room for one: a (first by name) runs, b and c are unloaded, and so is the unlisted file.
        await eventually(lambda: gw1.view.routable("a"), timeout=60, what="a's lane ready")
        listed = await _models(http, gw1)
        assert sorted(listed) == ["a", "b", "broken", "c"]
        assert {n: m["state"] for n, m in listed.items()} == {"a": "ready", "b": "unloaded", "broken": "unloaded",
                                                               "c": "unloaded"}  # fmt: skip
        assert listed["a"]["where"] == [{"host": HOST, "lane": "a-0", "state": "ready"}]
        assert listed["b"]["holders"] == [HOST] and listed["b"]["lanes"]["total"] == 0
        assert listed["a"]["object"] == "model" and listed["a"]["owned_by"] == "lanes"

        # An unknown name is a 404, not a wake (no wake goes out for it, so nothing holds it).
        wakes: list[str] = []

        async def heard(msg) -> None:
            wakes.append(msg.subject)

        sub = await nc.subscribe(subjects.ALL_WAKES, cb=heard)
        await nc.flush()
        status, body, _ = await _chat(http, gw1, "no-such-model")
        assert status == 404 and body["error"]["code"] == "model_not_found"
        await gw1.nc.flush()  # whatever the gateway sent has reached the server ...
        await nc.flush()  # ... and been delivered here
        assert wakes == []
        await sub.unsubscribe()

        # Three requests for b over two gateways: held, one wake, a evicted through drain, all served by one lane.
        await asyncio.sleep(1.0)  # a has been loaded longer than the minimum residency
        answers = await asyncio.gather(_chat(http, gw1, "b"), _chat(http, gw1, "b"), _chat(http, gw2, "b"))
        assert [a[0] for a in answers] == [200, 200, 200], answers
        assert {a[2] for a in answers} == {f"{HOST}/b-0"}
        fleet = await fleet_status(nc)
        assert _planned(fleet) == {HOST: ["b"]}
        states = {m.name: m.state for m in fleet.models}
        assert states["a"] == "unloaded" and states["b"] == "loaded"
        listed = await _models(http, gw2)
        assert listed["b"]["state"] == "ready" and listed["a"]["state"] == "unloaded"
        # The load was measured by the agent and predicts the next: published in the models key.
        measured = await eventually(lambda: gw2.view.model_entry("b").measured_load_s, what="b's load measured")
        assert 0 < measured < 30
        assert gw2.view.model_entry("c").predicted_load_s > 0
        async with http.get(gw1.url + "/metrics") as resp:
            text = await resp.text()
        assert samples(text, "lanes_cold_starts_total", model="b") == [1.0]
        assert samples(text, "lanes_cold_start_seconds_count", model="b") == [1.0]
        assert samples(text, "lanes_gateway_queue_wait_seconds_count", model="b") == [2.0]
        assert samples(text, "lanes_evictions_total", reason="wake") == [1.0]

        # A load that fails answers the held request with llama-server's reason, and is not retried.
        await asyncio.sleep(1.0)
        status, body, _ = await _chat(http, gw2, "broken")
        assert status == 502 and body["error"]["code"] == "model_load_failed", body
        assert "no figures recorded" in body["error"]["message"]
        status, again, _ = await _chat(http, gw1, "broken")  # answered as failed at once
        assert status == 502 and "no figures recorded" in again["error"]["message"]
        listed = await _models(http, gw1)
        assert listed["broken"]["state"] == "failed"

        # b still serves (or is loaded back on request): the fleet is not stuck.
        status, _, lane = await _chat(http, gw1, "b")
        assert status == 200


async def test_idle_ttl_unloads_a_model_and_a_request_loads_it_back(tmp_path, tiny_models, nats_server):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_models["llama8"], models / "a.gguf")
    services = Services(nats_server.url)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(services.stop_all)
        services.start_planner()
        nc = await stack.enter_async_context(client(nats_server.url))
        await eventually(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), what="planner up")
        demand = Demand(personas=(Persona(model="a", alias="chat", ctx_min=4096, ctx_max=4096, idle_ttl=3.0),))
        await nc.request(subjects.DEMAND_SET, encode(demand), timeout=5)
        services.start_agent(agent_config(tmp_path, HOST, models, fake_binary(tmp_path / "bin")))
        gw = await stack.enter_async_context(gateway(nats_server.url, load_timeout=60))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        await eventually(lambda: gw.view.routable("chat"), timeout=60, what="chat ready")
        # Health probes (the gateway's and the agent's) go on all the time: they never count as use.
        await eventually(lambda: not gw.view.lanes_for("chat"), timeout=30, what="chat unloaded after its idle_ttl")
        fleet = await fleet_status(nc)
        assert {m.name: m.state for m in fleet.models} == {"chat": "unloaded"}
        row = next(line for line in render_status(fleet).splitlines() if line.startswith("chat "))
        assert row.split() == ["chat", "a", "unloaded", "-", HOST]  # `lanes status` shows it
        status, _, lane = await _chat(http, gw, "chat")
        assert status == 200 and lane == f"{HOST}/a-0"
        async with http.get(gw.url + "/metrics") as resp:
            assert samples(await resp.text(), "lanes_evictions_total", reason="idle") == [1.0]
        fleet = msgspec.json.decode(msgspec.json.encode(await fleet_status(nc)), type=FleetStatus)
        assert {m.name: m.state for m in fleet.models} == {"chat": "loaded"}
        assert "unloaded" not in render_status(fleet)  # nothing waits: no models table


async def test_a_planner_killed_while_requests_are_held_the_stand_by_loads_the_model(tmp_path, tiny_models,
                                                                                      nats_server):
    """Two planners; the active one dies (no handover) while a request for an unloaded model is held:
    the gateway keeps repeating its wake, the stand-by takes the lease, evicts the idle lane and
    serves it. What the first planner had evicted stays unloaded (the models key carries it on)."""
    from planner_svc.service import run_planner
    from shared.bus import kv_bucket
    from shared.messages.activity import PlannerLease

    models = tmp_path / "models"
    models.mkdir()
    for name in ("a", "b", "c"):
        shutil.copy(tiny_models["llama8"], models / f"{name}.gguf")
    planners: dict[str, tuple[asyncio.Task, asyncio.Event]] = {}
    for name in ("p1", "p2"):
        stop = asyncio.Event()
        planners[name] = (asyncio.create_task(run_planner(nats_server.url, stop, lease_ttl=1.0, name=name)), stop)
    services = Services(nats_server.url)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(services.stop_all)

        async def stop_planners() -> None:
            for task, stop in planners.values():
                stop.set()
            await asyncio.wait_for(asyncio.gather(*(t for t, _ in planners.values()), return_exceptions=True), 30)

        stack.push_async_callback(stop_planners)
        nc = await stack.enter_async_context(client(nats_server.url))
        await eventually(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), what="planners up")
        await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"min_residency": 1.0})), timeout=5)
        demand = Demand(personas=tuple(Persona(model=m, ctx_min=CTX, ctx_max=CTX) for m in ("a", "b", "c")))
        await nc.request(subjects.DEMAND_SET, encode(demand), timeout=5)
        services.start_agent(agent_config(tmp_path, HOST, models, fake_binary(tmp_path / "bin"), max_ram=MAX_RAM))
        gw = await stack.enter_async_context(gateway(nats_server.url, load_timeout=60))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        await eventually(lambda: gw.view.routable("a"), timeout=60, what="a's lane ready")
        status, _, lane = await _chat(http, gw, "c")  # the first planner evicts a for c
        assert status == 200 and lane == f"{HOST}/c-0"
        await eventually(lambda: gw.view.model_entry("a").on_demand, what="a unloaded on demand in the models key")
        kv = await kv_bucket(nc)
        active = msgspec.json.decode((await kv.get(subjects.LEASE_KEY)).value, type=PlannerLease).holder
        task, _ = planners.pop(active)
        task.cancel()  # killed: no lease handover
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
        await asyncio.sleep(1.0)  # c has been loaded longer than the minimum residency
        status, body, lane = await _chat(http, gw, "b")
        assert status == 200 and lane == f"{HOST}/b-0", body
        standby = msgspec.json.decode((await kv.get(subjects.LEASE_KEY)).value, type=PlannerLease).holder
        assert standby != active
        fleet = await fleet_status(nc)
        assert _planned(fleet) == {HOST: ["b"]}  # one lane; a did not come back
        assert {m.name: m.state for m in fleet.models} == {"a": "unloaded", "b": "loaded", "c": "unloaded"}
