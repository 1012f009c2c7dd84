"""A fleet-wide change paced per model against real parts: a nats-server, the planner, three
agents (one process) each holding one lane of the same model (the fake llama-server, a second
to load, each answer a tenth of a second), one gateway with clients streaming through it.
`config set kv_cache_type=q8_0` restarts every lane, one at a time across the hosts: at least
two of the three serve at every moment, and no request fails."""

from __future__ import annotations

import asyncio
import shutil
from contextlib import AsyncExitStack

import aiohttp
from fixtures_bus import Services, agent_config, client, fake_binary, fleet_status
from test_on_demand import _chat, gateway
from waiting import eventually

from shared import subjects
from shared.messages.replies import ConfigSet
from shared.messages.wire import encode

HOSTS = ("r1", "r2", "r3")


async def _fleet(stack: AsyncExitStack, tmp_path, tiny_models, url: str, env: dict[str, dict]) -> None:
    """The planner and three agents, each holding model a (its fake binary with `env[host]`)."""
    services = Services(url)
    stack.push_async_callback(services.stop_all)
    services.start_planner()
    for host in HOSTS:
        models = tmp_path / f"models-{host}"
        models.mkdir()
        shutil.copy(tiny_models["llama8"], models / "a.gguf")
        binary = fake_binary(tmp_path / f"bin-{host}", env=env.get(host, {}))
        services.start_agent(agent_config(tmp_path, host, models, binary))


async def test_a_config_change_restarts_one_lane_of_a_model_at_a_time_across_the_hosts(tmp_path, tiny_models, nats_server):
    env = {"FAKE_LLAMA_REPLY_SECONDS": "0.1", "FAKE_LLAMA_LOAD_SECONDS": "1.0"}
    async with AsyncExitStack() as stack:
        await _fleet(stack, tmp_path, tiny_models, nats_server.url, {host: env for host in HOSTS})
        nc = await stack.enter_async_context(client(nats_server.url))
        gw = await stack.enter_async_context(gateway(nats_server.url))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        await eventually(lambda: len(gw.view.routable("a")) == 3, timeout=60, what="a lane of a on each host")

        results: list[int] = []
        serving: list[int] = []
        stop = asyncio.Event()

        async def client_loop() -> None:
            while not stop.is_set():
                results.append((await _chat(http, gw, "a"))[0])

        dips: list[list[tuple]] = []  # why the lanes out of rotation were out, at each sample with fewer than two

        async def sampler() -> None:
            while not stop.is_set():
                serving.append(len(gw.view.routable("a")))
                if serving[-1] < 2:
                    dips.append([(x.lane_id, x.host_id, x.state, x.draining, x.unreachable, x.key_id,
                                  bool(x.api_key)) for x in gw.view.lanes_for("a") if not x.routable])  # fmt: skip
                await asyncio.sleep(0.02)

        tasks = [asyncio.create_task(client_loop()) for _ in range(3)] + [asyncio.create_task(sampler())]
        await asyncio.sleep(1.0)
        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q8_0"})), timeout=5)
        assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers

        async def all_changed() -> bool:
            lanes = [lane for s in (await fleet_status(nc)).statuses for lane in s.lanes]
            return len(lanes) == 3 and all(x.state == "healthy" and "q8_0" in x.argv for x in lanes)

        await eventually(all_changed, timeout=90, what="every lane restarted with q8_0")
        await eventually(lambda: len(gw.view.routable("a")) == 3, timeout=30, what="all three routable again")
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        print(f"requests: {len(results)}, lanes serving per sample: min {min(serving)} of {len(serving)} samples")
        assert [s for s in results if s != 200] == [], results
        assert min(serving) >= 2, f"fewer than two lanes served at some moment: {sorted(set(serving))}; out: {dips[:3]}"
        assert serving.count(2) > 0, "no lane was ever out of service: the change restarted nothing?"


async def test_a_lane_its_change_breaks_halts_the_models_rollout_on_every_host(tmp_path, tiny_models, nats_server):
    """r1's binary refuses q4_0 at start: r1 (first in turn) fails with the change and is reverted;
    r2's and r3's lanes never take it (same processes, no q4_0). A new config rolls again."""
    async with AsyncExitStack() as stack:
        await _fleet(stack, tmp_path, tiny_models, nats_server.url, {"r1": {"FAKE_LLAMA_REFUSE_TYPES": "q4_0"}})
        nc = await stack.enter_async_context(client(nats_server.url))

        async def lanes(needle: str | None = None) -> dict | None:
            found = {s.host_id: s.lanes[0] for s in (await fleet_status(nc)).statuses if s.lanes}
            ok = len(found) == 3 and all(x.state == "healthy" and (needle is None or needle in x.argv) for x in found.values())
            return found if ok else None

        before = await eventually(lanes, timeout=60, what="a healthy lane on each host")
        await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q4_0"})), timeout=5)

        async def r1_reverted():
            status = await fleet_status(nc)
            plan = next(p for p in status.plans if p.host_id == "r1")
            lane = next((x for s in status.statuses if s.host_id == "r1" for x in s.lanes), None)
            done = lane and lane.state == "healthy" and any("reverted" in r for r in plan.lanes[0].reasons)
            return status if done else None

        status = await eventually(r1_reverted, timeout=60, what="r1's broken lane reverted")
        await asyncio.sleep(2.0)  # time for a wrongly released change to reach r2 or r3
        now = await lanes()
        assert now is not None, "a lane is down"
        for host in ("r2", "r3"):
            assert now[host].pid == before[host].pid and "q4_0" not in now[host].argv, now[host]
            plan = next(p for p in (await fleet_status(nc)).plans if p.host_id == host)
            assert plan.lanes[0].cache_type_k is None, plan.lanes[0]  # its plan keeps the previous spec

        await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q8_0"})), timeout=5)
        await eventually(lambda: lanes("q8_0"), timeout=90, what="every lane on q8_0, one host at a time")
