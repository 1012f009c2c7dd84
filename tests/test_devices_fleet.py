"""The whole path on GPU-type devices without a GPU: a real agent with two ggml-rpc-servers, the real
planner over real NATS, the real llama-server (RPC build). Each lane is pinned to its own device;
what llama-server prints per device equals the plan; the agent reports the VRAM its lanes hold,
and steady reports never move a lane."""

from __future__ import annotations


import pytest
from fixtures_bus import agent_config, client, fleet_status, host_status, lane_of, services
from waiting import eventually
from rpc_harness import rpc_servers
from test_real_llama import _planner_with
from tinymodels import write_llama

from shared import subjects
from shared.bus import kv_bucket
from shared.llama.printed import COMPUTE_TOLERANCE
from shared.messages.config import Demand, Persona

MIB = 2**20


def _loaded(nc, host: str, lane_id: str):
    async def check():
        lane = lane_of(await host_status(nc, host), lane_id)
        assert lane is None or lane.state not in ("failed", "mismatch"), lane
        return lane if lane and lane.state == "healthy" and lane.devices else None

    return check


async def test_lanes_pinned_to_rpc_devices_print_what_was_planned(nats_server, tmp_path, rpc_bin, gemma_model):  # noqa: F811
    models = tmp_path / "models"
    models.mkdir()
    (models / gemma_model.name).symlink_to(gemma_model)
    write_llama(models / "big.gguf", n_layer=6, n_embd=128, n_head=2, n_head_kv=1, head_dim=64, n_ff=256,
                n_vocab=131072, n_ctx_train=16384)  # fmt: skip
    gemma = gemma_model.stem
    demand = Demand(personas=(Persona(model=gemma, ctx_min=2048, ctx_max=8192),
                              Persona(model="big", parallel=2, ctx_min=2048, ctx_max=4096)))  # fmt: skip
    with rpc_servers(rpc_bin, 2) as endpoints:
        cfg = agent_config(tmp_path, "rpc", models, str(rpc_bin / "llama-server"), rpc_servers=tuple(endpoints),
                           report_interval=1.0)  # fmt: skip
        async with services(nats_server.url) as s, client(nats_server.url) as nc:
            await _planner_with(nc, s, {}, demand)
            s.start_agent(cfg)
            lanes = {}
            for lane_id in (f"{gemma}-0", "big-0"):
                lanes[lane_id] = await eventually(_loaded(nc, "rpc", lane_id), timeout=90, what=f"{lane_id} loaded")
            fleet = await fleet_status(nc)
            plan = fleet.plans[0]
            revision = plan.plan_revision
            # the agent reports what its lanes hold per device; several report cycles later the
            # plan is the same: no layout alternates
            held = {}
            for lane_id, lane in lanes.items():
                gpu = next(sp for sp in plan.lanes if sp.lane_id == lane_id).gpu_devices[0]
                held[gpu] = sum(d.total for d in lane.devices if d.device == "GPU0")

            async def held_reported():
                r = (await fleet_status(nc)).reports[0]
                return r if [g.lanes_vram for g in r.gpus] == [held[0], held[1]] else None

            report = await eventually(held_reported, timeout=30, interval=1.0, what="lanes_vram reported")
            kv = await kv_bucket(nc)
            seen = (await kv.get(subjects.report_key("rpc"))).revision

            async def reports_later() -> bool:  # each report is a chance to replan
                return (await kv.get(subjects.report_key("rpc"))).revision >= seen + 3

            await eventually(reports_later, timeout=30, what="three more reports")
            fleet = await fleet_status(nc)
            assert fleet.plans[0].plan_revision == revision, fleet.plans[0].lanes

    assert [g.backend for g in report.gpus] == ["rpc", "rpc"]
    specs = {sp.lane_id: sp for sp in plan.lanes}
    used = sorted(sp.gpu_devices for sp in specs.values())
    assert used == [(0,), (1,)], "two lanes, one per device, each pinned"
    for lane_id, spec in specs.items():
        argv = list(lanes[lane_id].argv)
        gpu = spec.gpu_devices[0]
        assert argv[argv.index("--rpc") + 1] == endpoints[gpu]
        assert argv[argv.index("--device") + 1] == "RPC0"
        assert spec.n_gpu_layers == next(m.n_layer for m in report.models if m.name == spec.model) + 1
        printed = {d.device: d for d in lanes[lane_id].devices}
        for d in spec.memory.devices:
            p = printed[d.device]
            for field in ("model_bytes", "kv_bytes", "output_bytes"):
                assert round(getattr(d, field) / MIB, 2) == pytest.approx(round(getattr(p, field) / MIB, 2), abs=0.011), (
                    lane_id, d.device, field)  # fmt: skip
            share, floor = COMPUTE_TOLERANCE
            assert abs(d.compute_bytes - p.compute_bytes) / MIB <= max(floor, share * p.compute_bytes / MIB)
        # the agent told the planner what its lanes hold on each device (their printed buffers)
        assert report.gpus[gpu].lanes_vram == held[gpu] > spec.memory.devices[1].model_bytes
