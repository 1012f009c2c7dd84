"""Where a lane runs on its host: the fastest device layout that fits, and what it costs per device.

Pure. Preference (fastest first): the whole model on one GPU; split over the host's
GPUs (shares chosen here from their free VRAM, never llama-server's load-time default);
for a Mixture-of-Experts model, every layer on the GPUs with the experts of the first N
blocks in RAM (`--n-cpu-moe N`, the smallest N that fits: attention and the dense weights
keep the GPU's speed, only the experts' matmuls of those blocks run on the CPU); partial
offload (as many layers as fit, the rest in RAM); the CPU. A layout's cost is
a vector over the host's resources: RAM ("cpu", 0) and each GPU ("gpu", i), from
shared.memory (layout -> placement -> buffers, each once); on unified memory (Apple
Silicon) the GPU's share is RAM too. `pins_for` turns a layout into llama-server's flags.
"""

from __future__ import annotations

import dataclasses
import functools

import msgspec
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from shared.memory import LaneShape, NglRule, Placement, lane_memory, place
from shared.memory.buffers import with_cpu_experts
from shared.memory.experts import cpu_expert_blocks
from shared.messages.hosts import HostReport, LayerWeights, ModelFacts
from shared.messages.plans import LaneLayout, MemoryBreakdown, NGpuLayers

MIB = 1024 * 1024
Resource = tuple[str, int]
CPU_RESOURCE: Resource = ("cpu", 0)
# What a llama-server process holds on a CUDA/ROCm GPU beyond its buffers (context, cuBLAS
# workspace). Not measurable without a GPU here; bench/gpu_check.sh records the real figure.
GPU_CONTEXT_BYTES = {"cuda": 384 * MIB, "rocm": 384 * MIB}
# The planner's layout is the one the lane spec carries (LaneSpec.layout): one value, no copy.
Layout = LaneLayout
_RANK = {"gpu": 0, "split": 1, "partial": 3, "cpu": 4}
_EXPERTS_RANK = 2


def rank(layout: Layout) -> int:
    """Fastest first: one GPU whole, split, every layer on the GPUs with some experts in RAM,
    partial offload, the CPU."""
    return _EXPERTS_RANK if layout.n_cpu_moe else _RANK[layout.kind]


def describe(layout: Layout, n_layer: int) -> str:
    if layout.kind == "cpu":
        return "on the CPU"
    where = ", ".join(f"GPU{g}" for g in layout.gpus)
    split = f" split {':'.join(map(str, layout.shares))}" if len(layout.gpus) > 1 else ""
    if layout.n_gpu_layers == "all":
        experts = ""
        if layout.n_cpu_moe:
            last = min(layout.n_cpu_moe, n_layer) - 1
            blocks = "block 0" if last == 0 else f"blocks 0-{last}"
            experts = f", the experts of {blocks} in RAM (--n-cpu-moe {layout.n_cpu_moe})"
        return f"all {n_layer + 1} layers on {where}{split}{experts}"
    return f"{layout.n_gpu_layers}/{n_layer + 1} layers on {where}{split}, the rest in RAM"


@dataclass(frozen=True)
class DevicePins:
    """What pins a lane to its devices, as llama-server takes it (LaneSpec's six device fields)."""

    gpu_devices: tuple[int, ...] = ()  # host GPU indices, in order
    device_names: tuple[str, ...] = ()  # --device, when the host named every one
    tensor_split: tuple[int, ...] = ()  # -ts: over the pinned devices, or over every GPU (zero for others)
    split_mode: Literal["layer", "none"] | None = None  # without names: one GPU by --split-mode none
    main_gpu: int | None = None  # ... and --main-gpu
    rpc_servers: tuple[str, ...] = ()  # --rpc, when every device is a ggml-rpc-server


def pins_for(layout: Layout, report: HostReport) -> DevicePins:
    gpus = layout.gpus
    if not gpus:
        return DevicePins()
    names = tuple(report.gpus[g].device for g in gpus)
    rpc = tuple(report.gpus[g].endpoint for g in gpus if report.gpus[g].endpoint)
    all_rpc = len(rpc) == len(gpus)
    if all_rpc:
        # llama-server numbers RPC devices in the order of its --rpc list: the lane's own servers
        names = tuple(f"RPC{k}" for k in range(len(rpc)))
    named = all(names)
    if len(gpus) == 1:
        split = ()
    elif named:
        split = layout.shares
    else:
        shares = dict(zip(gpus, layout.shares))
        split = tuple(shares.get(i, 0) for i in range(len(report.gpus)))
    return DevicePins(
        gpu_devices=gpus,
        device_names=names if named else (),
        tensor_split=split,
        split_mode=None if named else ("none" if len(gpus) == 1 else "layer"),
        main_gpu=gpus[0] if not named and len(gpus) == 1 else None,
        rpc_servers=rpc if all_rpc else (),
    )


def with_layers(facts: ModelFacts) -> ModelFacts:
    """Facts from an agent too old to send per-layer weights: spread the weights evenly."""
    return facts if facts.layer_weights else _spread_layers(facts)


@functools.lru_cache(maxsize=256)
def _spread_layers(facts: ModelFacts) -> ModelFacts:
    embd = min(facts.weight_bytes // 4, facts.n_vocab * facts.n_embd)
    blocks = max(0, facts.weight_bytes - 2 * embd)
    per = blocks // max(1, facts.n_layer)
    layers, offset = [LayerWeights(-1, embd, embd, 0, embd)], embd
    for il in range(facts.n_layer):
        layers.append(LayerWeights(il, per, per, offset, offset + per))
        offset += per
    layers.append(LayerWeights(facts.n_layer, embd, embd, offset, offset + embd))
    return msgspec.structs.replace(facts, layer_weights=tuple(layers))


def layout_placement(n_layer: int, layout: Layout, report: HostReport) -> Placement:
    """The layout's layers on the host's devices, as llama-server will place them."""
    return _layout_placement(n_layer, layout, _backends(layout, report), _ngl_rule(report))


def _backends(layout: Layout, report: HostReport) -> tuple[str, ...]:
    return tuple(report.gpus[g].backend for g in layout.gpus)


def _ngl_rule(report: HostReport) -> NglRule:
    return report.server.ngl_rule if report.server else "output_first"


def _layout_placement(n_layer: int, layout: Layout, backends: tuple[str, ...], rule: NglRule) -> Placement:
    shares = tuple(float(s) for s in layout.shares) if len(layout.gpus) > 1 and layout.shares else ()
    return _placed(n_layer, layout.n_gpu_layers, shares or (1.0,) * len(backends), backends, rule)


@functools.lru_cache(maxsize=4096)
def _placed(n_layer: int, n_gpu_layers: NGpuLayers, shares, backends, rule: NglRule) -> Placement:
    return place(n_layer, n_gpu_layers, shares, rule=rule, backends=backends)


def layout_memory(facts: ModelFacts, layout: Layout, report: HostReport, base: LaneShape) -> MemoryBreakdown:
    """`base` gives the lane's KV and compute shape; the layout places its layers (and experts).
    Of the host's report only its devices' backends, -ngl rule and CPU repack count, so hosts
    with the same hardware and models share one answer (the planner sizes a lane thousands of
    times a replan: a fleet of identical hosts computes each shape once)."""
    return _layout_memory(facts, layout, _backends(layout, report), _ngl_rule(report), report.cpu_repack, base)


@functools.lru_cache(maxsize=1 << 13)
def _layout_memory(
    facts: ModelFacts, layout: Layout, backends: tuple[str, ...], rule: NglRule, cpu_repack, base: LaneShape
) -> MemoryBreakdown:
    placement = _layout_placement(facts.n_layer, layout, backends, rule)
    if layout.n_cpu_moe:
        placement = with_cpu_experts(placement, cpu_expert_blocks(facts, layout.n_cpu_moe))
        base = dataclasses.replace(base, n_cpu_moe=layout.n_cpu_moe)
    return lane_memory(with_layers(facts), base, cpu_repack, placement=placement)


def cost_vector(memory: MemoryBreakdown, layout: Layout, report: HostReport, factor: float = 1.0) -> dict[Resource, int]:
    """Bytes per resource; the process overhead and any GPU context are counted where they land."""
    cost: dict[Resource, int] = {CPU_RESOURCE: memory.overhead_bytes}
    for dev in memory.devices:
        if dev.index < 0:
            cost[CPU_RESOURCE] += dev.total
            continue
        gpu = layout.gpus[dev.index]
        info = report.gpus[gpu]
        used = dev.total + GPU_CONTEXT_BYTES.get(info.backend, 0)
        cost[("gpu", gpu)] = cost.get(("gpu", gpu), 0) + used
        if info.unified:
            cost[CPU_RESOURCE] += used  # Metal's working set is carved out of the same RAM
    return {r: int(b * factor + 0.999) for r, b in cost.items()}


def largest(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with pred(n), pred monotone (true then false); lo if none."""
    if pred(hi):
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def fits(cost: Mapping[Resource, int], remaining: Mapping[Resource, int]) -> bool:
    return all(b <= remaining.get(r, 0) for r, b in cost.items())


def candidates(report: HostReport, remaining: Mapping[Resource, int], use_gpu: bool) -> list[Layout]:
    """Layouts to try, fastest first (partial offload is searched separately)."""
    gpus = [i for i in range(len(report.gpus)) if remaining.get(("gpu", i), 0) > 0] if use_gpu else []
    out = [Layout("gpu", (g,), (), "all") for g in sorted(gpus, key=lambda g: (-remaining[("gpu", g)], g))]
    if len(gpus) > 1:
        out.append(Layout("split", tuple(gpus), _shares(gpus, remaining), "all"))
    return out


def _shares(gpus: list[int], remaining: Mapping[Resource, int]) -> tuple[int, ...]:
    return tuple(max(1, remaining[("gpu", g)] // MIB) for g in gpus)


def partial_layout(
    facts: ModelFacts, report: HostReport, remaining: Mapping[Resource, int], cost: Callable[[Layout], dict],
    use_gpu: bool,
) -> Layout | None:
    """The most layers the GPUs take (the rest in RAM), or None when not even one fits."""
    gpus = [i for i in range(len(report.gpus)) if remaining.get(("gpu", i), 0) > 0] if use_gpu else []
    if not gpus:
        return None
    shares = _shares(gpus, remaining) if len(gpus) > 1 else ()

    def gpu_fits(n: int) -> bool:
        c = cost(Layout("partial", tuple(gpus), shares, n))
        return all(b <= remaining.get(r, 0) for r, b in c.items() if r[0] == "gpu")

    lo = largest(gpu_fits, 0, facts.n_layer)  # n_layer + 1 would be full offload, tried before
    if lo == 0:
        return None
    layout = Layout("partial", tuple(gpus), shares, lo)
    return layout if fits(cost(layout), remaining) else None


def expert_layout(
    facts: ModelFacts, report: HostReport, remaining: Mapping[Resource, int], cost: Callable[[Layout], dict],
    use_gpu: bool,
) -> Layout | None:
    """Every layer on the GPUs, the experts of the first N blocks in RAM: the smallest N that
    fits (GPUs and RAM), over one GPU (the largest first) or a split; None when no N does, the
    model has no experts, or the host's llama-server lacks --n-cpu-moe. The blocks whose experts
    leave are the first ones, which a split puts on its first GPU: a split also tries giving that
    GPU a larger share of the layers, so the GPUs fill evenly."""
    if not facts.expert_weights or (report.server is not None and not report.server.has_n_cpu_moe):
        return None
    best: Layout | None = None
    for base in candidates(report, remaining, use_gpu):
        for shares in _expert_shares(base):
            layout = _fewest_experts_in_ram(facts, msgspec.structs.replace(base, shares=shares), remaining, cost)
            if layout is not None and (best is None or layout.n_cpu_moe < best.n_cpu_moe):
                best = layout
    return best


_FIRST_GPU_WEIGHTS = (1, 2, 3, 4, 6, 8)


def _expert_shares(base: Layout) -> list[tuple[int, ...]]:
    if len(base.gpus) < 2:
        return [base.shares]
    return [(base.shares[0] * w, *base.shares[1:]) for w in _FIRST_GPU_WEIGHTS]


def _fewest_experts_in_ram(facts, base: Layout, remaining, cost) -> Layout | None:
    def gpu_fits(n: int) -> bool:
        c = cost(msgspec.structs.replace(base, n_cpu_moe=n))
        return all(b <= remaining.get(r, 0) for r, b in c.items() if r[0] == "gpu")

    n_blocks = facts.n_layer
    if not gpu_fits(n_blocks):
        return None
    # the smallest n whose GPU side fits: n_blocks - (the largest k with gpu_fits(n_blocks - k))
    n = n_blocks - largest(lambda k: gpu_fits(n_blocks - k), 0, n_blocks - 1)
    layout = msgspec.structs.replace(base, n_cpu_moe=n)
    return layout if fits(cost(layout), remaining) else None
