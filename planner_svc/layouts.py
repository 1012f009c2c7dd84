"""Where a lane runs on its host: the fastest device layout that fits, and what it costs per device.

Pure. Preference (fastest first): the whole model on one GPU; split over the host's
GPUs (shares chosen here from their free VRAM, never llama-server's load-time default);
partial offload (as many layers as fit, the rest in RAM); the CPU. A layout's cost is
a vector over the host's resources: RAM ("cpu", 0) and each GPU ("gpu", i), from
shared.device_memory; on unified memory (Apple Silicon) the GPU's share is RAM too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from shared.device_memory import LaneShape, lane_memory
from shared.messages import HostReport, LayerWeights, MemoryBreakdown, ModelFacts

MIB = 1024 * 1024
Resource = tuple[str, int]
CPU_RESOURCE: Resource = ("cpu", 0)
# What a llama-server process holds on a CUDA/ROCm GPU beyond its buffers (context, cuBLAS
# workspace). Not measurable without a GPU here; bench/gpu_check.sh records the real figure.
GPU_CONTEXT_BYTES = {"cuda": 384 * MIB, "rocm": 384 * MIB}
LayoutKind = Literal["gpu", "split", "partial", "cpu"]
_RANK = {"gpu": 0, "split": 1, "partial": 2, "cpu": 3}


@dataclass(frozen=True)
class Layout:
    kind: LayoutKind
    gpus: tuple[int, ...] = ()  # host GPU indices, llama-server order
    shares: tuple[int, ...] = ()  # tensor split (MiB of free VRAM) when more than one GPU
    n_gpu_layers: int | None = 0  # None: all layers and the output

    @property
    def rank(self) -> int:
        return _RANK[self.kind]

    def describe(self, n_layer: int) -> str:
        if self.kind == "cpu":
            return "on the CPU"
        where = ", ".join(f"GPU{g}" for g in self.gpus)
        split = f" split {':'.join(map(str, self.shares))}" if len(self.gpus) > 1 else ""
        if self.n_gpu_layers is None:
            return f"all {n_layer + 1} layers on {where}{split}"
        return f"{self.n_gpu_layers}/{n_layer + 1} layers on {where}{split}, the rest in RAM"


def with_layers(facts: ModelFacts) -> ModelFacts:
    """Facts from an agent too old to send per-layer weights: spread the weights evenly."""
    if facts.layer_weights:
        return facts
    import msgspec

    embd = min(facts.weight_bytes // 4, facts.n_vocab * facts.n_embd)
    blocks = max(0, facts.weight_bytes - 2 * embd)
    per = blocks // max(1, facts.n_layer)
    layers, offset = [LayerWeights(-1, embd, embd, 0, embd)], embd
    for il in range(facts.n_layer):
        layers.append(LayerWeights(il, per, per, offset, offset + per))
        offset += per
    layers.append(LayerWeights(facts.n_layer, embd, embd, offset, offset + embd))
    return msgspec.structs.replace(facts, layer_weights=tuple(layers))


def shape_for(layout: Layout, report: HostReport, base: LaneShape) -> LaneShape:
    return LaneShape(
        ctx=base.ctx, parallel=base.parallel, kv_unified=base.kv_unified, type_k=base.type_k, type_v=base.type_v,
        flash_attn=base.flash_attn, layout=base.layout, n_ubatch=base.n_ubatch, n_gpu_layers=layout.n_gpu_layers,
        tensor_split=tuple(float(s) for s in layout.shares) if len(layout.gpus) > 1 else (),
        devices=tuple(report.gpus[g].backend for g in layout.gpus),
        ngl_rule=report.server.ngl_rule if report.server else "output_first",
    )  # fmt: skip


def layout_memory(facts: ModelFacts, layout: Layout, report: HostReport, base: LaneShape) -> MemoryBreakdown:
    return lane_memory(with_layers(facts), shape_for(layout, report, base), report.cpu_repack)


def cost_vector(memory: MemoryBreakdown, layout: Layout, report: HostReport, factor: float = 1.0) -> dict[Resource, int]:
    """Bytes per resource; the process overhead and any GPU context are counted where they land."""
    cost: dict[Resource, int] = {CPU_RESOURCE: memory.overhead_bytes}
    for dev in memory.devices:
        if dev.device == "CPU":
            cost[CPU_RESOURCE] += dev.total
            continue
        gpu = layout.gpus[int(dev.device[3:])]
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
    out = [Layout("gpu", (g,), (), None) for g in sorted(gpus, key=lambda g: (-remaining[("gpu", g)], g))]
    if len(gpus) > 1:
        out.append(Layout("split", tuple(gpus), _shares(gpus, remaining), None))
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
