"""The real llama-server, launched by the real agent from the real planner's plan over real NATS.

The KV bytes llama-server reports must equal the plan's prediction; the served context
and slots must be the planned ones; refusals must surface llama-server's own words.
"""

from __future__ import annotations

import asyncio
import json
import stat
import urllib.request

import psutil
import pytest
from fixtures_bus import agent_config, client, fleet_status, host_status, lane_auth, lane_of, services
from waiting import eventually
from tinymodels import write_gemma3, write_llama

from launcher_agent.reconcile import MAX_FAILURES
from shared import subjects
from shared.messages.config import Demand, Persona
from shared.messages.replies import ConfigSet
from shared.messages.wire import encode

MIB = 2**20


async def _planner_with(nc, s, config: dict, demand: Demand) -> None:
    s.start_planner()
    await eventually(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), what="planner up")
    if config:
        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes=config)), timeout=5)
        assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
    reply = await nc.request(subjects.DEMAND_SET, encode(demand), timeout=5)
    assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers


def _healthy(nc, host: str, lane_id: str):
    async def check():
        lane = lane_of(await host_status(nc, host), lane_id)
        assert lane is None or lane.state not in ("failed", "mismatch"), lane
        return lane if lane and lane.state == "healthy" and lane.kv_bytes is not None else None

    return check


CASES = {
    "f16": ("llama", {}, 1),
    "q8_0": ("llama", {"kv_cache_type": "q8_0", "flash_attn": "on"}, 1),
    "q4_0": ("llama", {"kv_cache_type": "q4_0"}, 1),
    "q8_0K-f16V": ("llama", {"kv_cache_type_k": "q8_0"}, 1),
    "3-slots-q8_0": ("llama", {"kv_cache_type": "q8_0"}, 3),
    "gemma3-swa-2-slots": ("gemma3", {}, 2),  # the window at its ceiling: --swa-full by default
    "gemma3-swa-2-slots-not-full": ("gemma3", {}, 2, {"swa_full": False}),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_reported_kv_equals_plan(case, nats_server, tmp_path, llama_server):
    arch, config, slots, *persona = CASES[case]
    models = tmp_path / "models"
    models.mkdir()
    if arch == "llama":
        write_llama(models / "m.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=8, head_dim=64, n_ctx_train=32768)
    else:
        write_gemma3(models / "m.gguf", n_layer=6, n_swa=512, n_ctx_train=32768)
    demand = Demand(personas=(Persona(model="m", parallel=slots, ctx_min=1024, ctx_max=3000, **(persona or [{}])[0]),))
    cfg = agent_config(tmp_path, "real", models, llama_server)
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        await _planner_with(nc, s, config, demand)
        s.start_agent(cfg)
        lane = await eventually(_healthy(nc, "real", "m-0"), timeout=60, what=f"{case} lane healthy")
        spec = (await fleet_status(nc)).plans[0].lanes[0]
        running = psutil.Process(lane.pid).cmdline()  # the argv of the process actually running

    # llama-server prints MiB with two decimals: the prediction matches it to the last digit.
    assert f"{lane.kv_bytes / MIB:.2f}" == f"{spec.memory.kv_bytes / MIB:.2f}"
    assert abs(lane.kv_bytes - spec.memory.kv_bytes) <= 0.005 * MIB + 1
    assert spec.ctx_per_slot == 2816  # ctx_max 3000 rounds down to a multiple of 256
    assert spec.parallel == slots
    argv = list(lane.argv)
    assert running == argv
    assert argv[argv.index("--ctx-size") + 1] == str(2816 * slots)
    assert argv[argv.index("--parallel") + 1] == str(slots)
    # the real binary runs with the planned threads (one lane: every core this agent may use)
    assert spec.threads is not None and spec.threads >= 1
    assert argv[argv.index("--threads") + 1] == argv[argv.index("--threads-batch") + 1] == str(spec.threads)
    if spec.cache_type_v in ("q8_0", "q4_0"):
        assert argv[argv.index("--flash-attn") + 1] == "on"
    for flag, value in (("--cache-type-k", spec.cache_type_k), ("--cache-type-v", spec.cache_type_v)):
        assert (flag in argv) == (value is not None)
        if value:
            assert argv[argv.index(flag) + 1] == value
    if not config:
        assert "--flash-attn" not in argv and "--cache-type-k" not in argv
    assert ("--swa-full" in argv) == spec.swa_full == (arch == "gemma3" and not persona)


async def _props_of_planned_lane(nats_url: str, tmp_path, llama_server: str, n_ctx_train: int, persona: Persona):
    """The real lane the planner plans for `persona` (a model "m" trained at `n_ctx_train`): its
    /props, once healthy, and its spec."""
    models = tmp_path / "models"
    models.mkdir()
    write_llama(models / "m.gguf", n_layer=2, n_ctx_train=n_ctx_train)
    async with services(nats_url) as s, client(nats_url) as nc:
        await _planner_with(nc, s, {}, Demand(personas=(persona,)))
        cfg = agent_config(tmp_path, "props", models, llama_server)
        s.start_agent(cfg)
        lane = await eventually(_healthy(nc, "props", "m-0"), timeout=60, what="lane healthy")
        ask = urllib.request.Request(f"http://127.0.0.1:{lane.port}/props", headers=lane_auth(cfg, "m-0"))
        with urllib.request.urlopen(ask, timeout=5) as r:
            props = json.loads(r.read())
        plan = await fleet_status(nc)
    return props, next(lane for hp in plan.plans for lane in hp.lanes if lane.lane_id == "m-0")


async def test_props_show_planned_context_and_slots(nats_server, tmp_path, llama_server):
    """Checked here from outside the agent too: /props of the running lane."""
    persona = Persona(model="m", parallel=4, ctx_min=512, ctx_max=1000)
    props, _ = await _props_of_planned_lane(nats_server.url, tmp_path, llama_server, 8192, persona)
    assert props["default_generation_settings"]["n_ctx"] == 768
    assert props["total_slots"] == 4


async def test_a_shared_cache_larger_than_the_trained_context_serves_the_planned_slot_window(
    nats_server, tmp_path, llama_server
):
    """--kv-unified with slots x window past the trained context: the binary caps each slot at the
    trained context, whatever the cache holds. The plan said the whole cache per slot, so the
    lane's /props never matched and it stayed 'mismatch' (found by bench/router_bench.py)."""
    persona = Persona(model="m", parallel=4, kv_unified=True, ctx_min=1024, ctx_max=1024)
    props, spec = await _props_of_planned_lane(nats_server.url, tmp_path, llama_server, 1024, persona)
    assert (spec.ctx_total, spec.ctx_per_slot, spec.kv_unified) == (4096, 1024, True)
    assert props["default_generation_settings"]["n_ctx"] == 1024
    assert props["total_slots"] == 4


def _memory_capped(folder, binary: str, kib: int) -> str:
    """llama-server under `ulimit -v`, like a container limit the planner was not told about."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llama-server"
    path.write_text(f"#!/bin/sh\nulimit -v {kib}\nexec '{binary}' \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


async def test_out_of_memory_at_start_is_corrected_by_the_next_plan(nats_server, tmp_path, llama_server):
    models = tmp_path / "models"
    models.mkdir()
    write_llama(models / "m.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=8, head_dim=64, n_ctx_train=32768)
    demand = Demand(personas=(Persona(model="m", ctx_min=256),))
    binary = _memory_capped(tmp_path / "bin", llama_server, 700_000)
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        await _planner_with(nc, s, {}, demand)
        s.start_agent(agent_config(tmp_path, "small", models, binary))

        async def healthy_after_oom():
            status = await host_status(nc, "small")
            lane = lane_of(status, "m-0")
            oom = [f for f in (status.feedback if status else ()) if f.kind == "oom"]
            return (lane, oom) if oom and lane and lane.state == "healthy" else None

        lane, oom = await eventually(healthy_after_oom, timeout=90, what="a smaller lane after the OOM")
        # llama-server's own line: the KV buffer allocation, or (once the KV fits) its threads'
        # stacks, fail under the address-space cap.
        assert "failed to allocate" in oom[0].detail or "Thread creation failed" in oom[0].detail
        assert lane.ctx_total < 32768
        spec = (await fleet_status(nc)).plans[0].lanes[0]
        assert any("ran out of memory" in r for r in spec.reasons)
        assert f"{lane.kv_bytes / MIB:.2f}" == f"{spec.memory.kv_bytes / MIB:.2f}"


async def test_lane_llama_server_refuses_is_reported_and_not_restarted_forever(nats_server, tmp_path, llama_server):
    models = tmp_path / "models"
    models.mkdir()
    write_llama(models / "broken.gguf", n_layer=2, n_ctx_train=4096, omit=("output_norm.weight",))
    events: list[dict] = []
    async with services(nats_server.url) as s, client(nats_server.url) as nc:

        async def on_event(msg):
            events.append(json.loads(msg.data))

        await nc.subscribe(subjects.ALL_EVENTS, cb=on_event)
        await _planner_with(nc, s, {}, Demand(personas=(Persona(model="broken", ctx_min=1024),)))
        s.start_agent(agent_config(tmp_path, "sad", models, llama_server))

        async def unplaced():
            plans = (await fleet_status(nc)).plans
            return plans[0].unplaced if plans and plans[0].unplaced else None

        (entry,) = await eventually(unplaced, timeout=60, what="the planner gives up on the lane")
        assert "keeps failing" in entry.reason and "output_norm.weight" in entry.reason
        failed = [e for e in events if e["event"] == "failed"]
        assert failed and "output_norm.weight" in failed[-1]["detail"]
        starts = [e for e in events if e["event"] == "started"]
        assert len(starts) == MAX_FAILURES
        # No more restarts: nothing happens on purpose, so no signal to wait on (a restart would
        # come after the backoff, well within this).
        await asyncio.sleep(2)
        assert len([e for e in events if e["event"] == "started"]) == MAX_FAILURES
