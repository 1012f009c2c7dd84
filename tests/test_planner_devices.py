"""The planner on GPU hosts: one GPU whole, split, partial offload, pinning, steady layouts over
many report cycles, NVML errors, and Apple Silicon's unified memory. Pure: host reports in, plans out."""

from __future__ import annotations

import msgspec
from test_planner import GIB, check_invariants, device_use, host, llama_8b, only_lane, window

from planner_svc.layouts import GPU_CONTEXT_BYTES, DevicePins, Layout, cost_vector, pins_for
from planner_svc.planner import plan
from shared.lane_key import lane_key
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import GpuInfo, HostReport
from shared.messages.plans import HostPlan, LaneLayout

MIB = 2**20


def gpu(i: int, total: float, free: float, **kw) -> GpuInfo:
    kw.setdefault("device", f"CUDA{i}")
    return GpuInfo(name=f"gpu{i}", vram_total=int(total * GIB), vram_free=int(free * GIB), **kw)


def arg(lane, flag):
    return lane.args[lane.args.index(flag) + 1] if flag in lane.args else None


def test_whole_model_on_the_gpu_with_most_room_pinned_to_it():
    report = host(gpus=(gpu(0, 8, 7), gpu(1, 24, 23)))
    lane = only_lane(plan([report], FleetConfig()))
    check_invariants(plan([report], FleetConfig()), [report])
    assert lane.gpu_devices == (1,) and lane.n_gpu_layers == 33
    assert arg(lane, "--device") == "CUDA1"  # pinned: llama-server never spreads it over every GPU
    assert "--tensor-split" not in lane.args
    assert [d.device for d in lane.memory.devices] == ["CPU", "GPU0"]
    cpu = lane.memory.devices[0]
    assert cpu.model_bytes > 0 and cpu.output_bytes > 0  # token embeddings and logits stay on the host


def test_split_over_two_gpus_with_planner_chosen_shares():
    # 4 GiB of weights fit neither GPU alone (about 3.7 and 3.3 GiB usable), both together
    report = host(gpus=(gpu(0, 5, 4.2), gpu(1, 5, 3.8)))
    fleet = plan([report], FleetConfig())
    check_invariants(fleet, [report])
    lane = only_lane(fleet)
    assert lane.gpu_devices == (0, 1) and lane.n_gpu_layers == 33
    assert arg(lane, "--device") == "CUDA0,CUDA1"
    shares = [int(s) for s in arg(lane, "--tensor-split").split(",")]
    assert shares == list(lane.tensor_split) and shares[0] > shares[1]  # from the free VRAM, never left to llama
    gpu0, gpu1 = lane.memory.devices[1:]
    assert gpu0.layers > gpu1.layers > 0


def test_partial_offload_when_no_gpu_holds_it():
    report = host(gpus=(gpu(0, 3, 2.5),))
    fleet = plan([report], FleetConfig())
    check_invariants(fleet, [report])
    lane = only_lane(fleet)
    assert 0 < lane.n_gpu_layers < 33
    assert arg(lane, "--n-gpu-layers") == str(lane.n_gpu_layers)
    cpu, gpu0 = lane.memory.devices
    assert cpu.layers + gpu0.layers == 33 and cpu.layers > 0
    assert any("layers on GPU0, the rest in RAM" in r for r in lane.reasons)
    # as many layers as fit: one more would not fit the GPU at the floor window
    from planner_svc.lane_windows import PlannedLane
    from planner_svc.policy import Flags

    probe = PlannedLane(report.host_id, Persona(model="llama-8b"), llama_8b(), 0, Flags(None, None, None, ()),
                          Layout("partial", (0,), (), lane.n_gpu_layers + 1), 2048, 131072, 1.0)  # fmt: skip
    more = cost_vector(probe.memory(2048, report, 512), probe.layout, report)
    assert gpu0.total + GPU_CONTEXT_BYTES["cuda"] <= fleet.hosts[0].budget_gpus[0] < more[("gpu", 0)]


def test_cpu_when_gpus_are_off_or_too_small():
    report = host(gpus=(gpu(0, 1, 0.3),))
    lane = only_lane(plan([report], FleetConfig()))
    assert lane.n_gpu_layers == 0 and lane.gpu_devices == () and "--device" not in lane.args
    lane = only_lane(plan([host(gpus=(gpu(0, 24, 23),))], FleetConfig(use_gpu=False)))
    assert lane.n_gpu_layers == 0


def test_unnamed_gpus_are_pinned_with_split_mode_none():
    report = host(gpus=(GpuInfo(name="a", vram_total=8 * GIB, vram_free=7 * GIB),
                        GpuInfo(name="b", vram_total=24 * GIB, vram_free=23 * GIB)))  # fmt: skip
    lane = only_lane(plan([report], FleetConfig()))
    assert arg(lane, "--split-mode") == "none" and arg(lane, "--main-gpu") == "1"


def test_window_is_the_largest_that_fits_every_device():
    report = host(gpus=(gpu(0, 6, 5.5),), ram_available=8 * GIB, ram_total=16 * GIB)
    demand = Demand(personas=(Persona(model="llama-8b", ctx_min=2048),))
    fleet = plan([report], FleetConfig(), demand)
    lane = only_lane(fleet)
    hp = fleet.hosts[0]
    w = window(lane)
    assert w < 131072  # bounded by memory, not the ceiling
    from planner_svc.lane_placing import _previous_layout
    from planner_svc.lane_windows import PlannedLane
    from planner_svc.policy import Flags, host_budgets

    layout = _previous_layout(hp, lane.lane_id)
    facts = llama_8b()
    flags = Flags(lane.cache_type_k, lane.cache_type_v, lane.flash_attn, ())
    probe = PlannedLane(report.host_id, Persona(model="llama-8b", ctx_min=2048), facts, 0, flags, layout, 2048, 131072, 1.0)
    budgets = host_budgets(report, FleetConfig())
    at = cost_vector(probe.memory(w, report, 512), layout, report)
    beyond = cost_vector(probe.memory(w + 256, report, 512), layout, report)
    assert all(b <= budgets[r] for r, b in at.items())
    assert any(b > budgets[r] for r, b in beyond.items())


def _next_report(report: HostReport, fleet, others_vram: int) -> HostReport:
    """What the agent reports once the plan runs: the GPU shows our lanes as used, and says they are ours."""
    ram_held, held = device_use(fleet.hosts[0].lanes, report)
    gpus = tuple(
        msgspec.structs.replace(g, vram_free=g.vram_total - others_vram - held[i], lanes_vram=held[i])
        for i, g in enumerate(report.gpus)
    )
    return msgspec.structs.replace(report, gpus=gpus, lanes_rss=ram_held, ram_available=report.ram_total // 2 - ram_held)


def _as_an_older_planner_wrote_it(hp: HostPlan) -> HostPlan:
    """The plan without the fields added since (the lane's layout, each device's backend and index)."""
    raw = msgspec.to_builtins(hp)
    for lane in raw["lanes"]:
        del lane["layout"]
        for d in lane["memory"]["devices"]:
            del d["backend"], d["index"]
    return msgspec.convert(raw, HostPlan)


def test_the_layout_rides_in_the_spec_and_a_replan_reads_it():
    from planner_svc.lane_placing import _previous_layout

    whole = host(gpus=(gpu(0, 8, 7), gpu(1, 24, 23)))
    split = host(gpus=(gpu(0, 5, 4.2), gpu(1, 5, 3.8)))
    partial = host(gpus=(gpu(0, 3, 2.5),))
    cpu = host(gpus=(gpu(0, 1, 0.3),))
    seen = set()
    for report in (whole, split, partial, cpu):
        hp = plan([report], FleetConfig()).hosts[0]
        lane = hp.lanes[0]
        layout = lane.layout
        assert isinstance(layout, LaneLayout) and layout.gpus == lane.gpu_devices
        assert (layout.n_gpu_layers == "all") == (layout.kind in ("gpu", "split"))
        assert lane.n_gpu_layers == (33 if layout.n_gpu_layers == "all" else layout.n_gpu_layers)  # the wire's int
        seen.add(layout.kind)
        assert _previous_layout(hp, lane.lane_id) == layout
        # a plan from an older planner carries no layout: rebuilt from the device fields, the same one
        old = _as_an_older_planner_wrote_it(hp)
        assert old.lanes[0].layout is None
        assert _previous_layout(old, lane.lane_id) == layout
        # ... and a replan that asks for the same keeps it, revision and all
        again = plan([report], FleetConfig(), previous={hp.host_id: old}).hosts[0]
        assert again.plan_revision == old.plan_revision and lane_key(again.lanes[0]) == lane_key(lane)
    assert seen == {"gpu", "split", "partial", "cpu"}


def test_device_indices_are_read_from_the_buffers_not_their_names():
    report = host(gpus=(gpu(0, 5, 4.2, backend="rocm"), gpu(1, 5, 3.8, backend="rocm")))
    lane = only_lane(plan([report], FleetConfig()))
    assert [(d.index, d.backend) for d in lane.memory.devices] == [(-1, "cpu"), (0, "rocm"), (1, "rocm")]
    old = _as_an_older_planner_wrote_it(plan([report], FleetConfig()).hosts[0]).lanes[0]
    assert [d.index for d in old.memory.devices] == [-1, 0, 1]  # read from an older planner's names


def test_pins_for_each_kind_of_host():
    named = host(gpus=(gpu(0, 8, 7), gpu(1, 8, 7), gpu(2, 8, 7)))
    assert pins_for(Layout("cpu"), named) == DevicePins()
    assert pins_for(Layout("gpu", (1,), (), "all"), named) == DevicePins(gpu_devices=(1,), device_names=("CUDA1",))
    assert pins_for(Layout("split", (0, 2), (3, 1), "all"), named) == DevicePins(
        gpu_devices=(0, 2), device_names=("CUDA0", "CUDA2"), tensor_split=(3, 1)
    )
    unnamed = host(gpus=tuple(gpu(i, 8, 7, device="") for i in range(3)))
    assert pins_for(Layout("gpu", (2,), (), "all"), unnamed) == DevicePins(gpu_devices=(2,), split_mode="none",
                                                                            main_gpu=2)  # fmt: skip
    assert pins_for(Layout("partial", (0, 2), (3, 1), 10), unnamed) == DevicePins(
        gpu_devices=(0, 2), tensor_split=(3, 0, 1), split_mode="layer"
    )  # -ts over every visible GPU, zero for the one not used
    rpc = host(gpus=tuple(gpu(i, 2, 2, backend="rpc", device=f"RPC{i}[h:{i}]", endpoint=f"h:{i}") for i in range(3)))
    assert pins_for(Layout("split", (1, 2), (1, 1), "all"), rpc) == DevicePins(
        gpu_devices=(1, 2), device_names=("RPC0", "RPC1"), tensor_split=(1, 1), rpc_servers=("h:1", "h:2")
    )  # the lane's own --rpc list numbers its devices


def test_steady_inputs_never_alternate_layouts_over_many_cycles():
    others = 1 * GIB
    base = host(gpus=(gpu(0, 6, 5), gpu(1, 4, 3)), ram_available=32 * GIB, ram_total=64 * GIB)
    demand = Demand(personas=(Persona(model="llama-8b", lanes=2, ctx_min=4096),))
    report = msgspec.structs.replace(
        base, gpus=tuple(msgspec.structs.replace(g, vram_free=g.vram_total - others) for g in base.gpus)
    )
    fleet = plan([report], FleetConfig(), demand)
    first = fleet.hosts[0]
    layouts = [(s.gpu_devices, s.n_gpu_layers, s.tensor_split) for s in first.lanes]
    assert any(s.gpu_devices for s in first.lanes)
    previous = {first.host_id: first}
    for _ in range(30):
        report = _next_report(report, fleet, others)
        fleet = plan([report], FleetConfig(), demand, previous=previous)
        check_invariants(fleet, [report])
        hp = fleet.hosts[0]
        assert [(s.gpu_devices, s.n_gpu_layers, s.tensor_split) for s in hp.lanes] == layouts
        assert hp.plan_revision == first.plan_revision, "a steady host must not be replanned"
        previous = {hp.host_id: hp}


def test_an_nvml_error_keeps_the_gpu_host_a_gpu_host():
    stale = host(gpus=(gpu(0, 24, 23, stale=True),))
    lane = only_lane(plan([stale], FleetConfig()))
    assert lane.gpu_devices == (0,)


def test_apple_unified_memory_budget_is_the_working_set_and_counts_as_ram():
    from launcher_agent.hardware import metal_gpu

    mac = metal_gpu(16 * GIB)  # 2/3 of 16 GiB
    assert mac.vram_total == 16 * GIB * 2 // 3 and mac.unified and mac.backend == "metal"
    roomy = host(gpus=(mac,), ram_total=16 * GIB, ram_available=14 * GIB)
    fleet = plan([roomy], FleetConfig())
    check_invariants(fleet, [roomy])
    lane = only_lane(fleet)
    assert lane.gpu_devices == (0,)
    # the same Mac with little free RAM: the working set has room, but the GPU's share is RAM too
    tight = host(gpus=(mac,), ram_total=16 * GIB, ram_available=int(5.5 * GIB))
    fleet = plan([tight], FleetConfig())
    check_invariants(fleet, [tight])
    assert fleet.hosts[0].budget_gpus[0] > 6 * GIB  # the GPU alone would take it at its floor (about 5 GiB)
    assert fleet.hosts[0].lanes == () and [u.model for u in fleet.hosts[0].unplaced] == ["llama-8b"]
    raised = metal_gpu(16 * GIB, wired_limit_mb=14 * 1024)
    assert raised.vram_total == 14 * GIB
