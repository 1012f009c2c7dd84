"""Every buffer llama-server allocates for a lane, on the device where it lands. Pure.

The last room of a lane's memory: layout -> placement (shared.memory.placement) ->
buffers (here); `lane_memory` is the one function that builds a MemoryBreakdown. What
each buffer is, from the b11434 source and checked against the binary's -lv 4 lines:

- model: the CPU maps the file range of its layers (token embeddings always among them:
  `CPU_Mapped`), plus a `CPU_REPACK` copy of the matrices its kernels repack. A GPU holds
  its layers' tensors (CUDA pads each quantized tensor by one row to 512 values, aligns
  to 128) and, for tied embeddings, a duplicate of token_embd when it holds the output
  layer. With a CUDA device the CPU's weights sit in pinned `CUDA_Host` memory: a copy,
  not a mapping, and no repacking.
- KV: each layer's K and V (shared.memory.kv.layer_kv) on its layer's device (all on the
  CPU with -nkvo).
- output: logits for n_vocab x parallel floats, in host memory.
- compute: see compute_bytes.
- recurrent: each recurrent layer's share of the per-sequence state, on its layer's device.
- prompt cache: the --cache-ram limit the plan gives the lane, in host RAM (prompt_cache_bytes).
- adapters: each LoRA pair in the buffer type of the base tensor it modifies (adapter_bytes).

Each per-device list has the host's RAM at index 0, then each GPU-type device of the lane.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from shared.memory.compute import compute_bytes
from shared.memory.cpu_repack import repack_rule
from shared.memory.experts import cpu_expert_blocks
from shared.memory.kv import KvSize, MemoryModelError, kv_size
from shared.memory.projector import projector_bytes
from shared.memory.placement import CPU, Placement, PlacementError, place
from shared.memory.overhead import overhead_bytes
from shared.memory.pooled import pooled_compute
from shared.memory.shape import LaneShape
from shared.messages.hosts import OUTPUT_LAYER, AdapterFacts, LayerWeights, ModelFacts
from shared.messages.plans import DeviceMemory, MemoryBreakdown

PINNED_HOST_BACKENDS = frozenset({"cuda", "rocm"})  # their host buffer type comes first for CPU weights


def placement_for(facts: ModelFacts, shape: LaneShape) -> Placement:
    n = len(shape.devices)
    if shape.tensor_split and len(shape.tensor_split) != n:
        raise PlacementError(f"tensor split has {len(shape.tensor_split)} shares for {n} device(s)")
    shares = shape.tensor_split or (1.0,) * n
    placement = place(
        facts.n_layer, shape.n_gpu_layers, shares, split_mode=shape.split_mode, main_gpu=shape.main_gpu,
        rule=shape.ngl_rule, backends=shape.devices,
    )  # fmt: skip
    return with_cpu_experts(placement, cpu_expert_blocks(facts, shape.n_cpu_moe, shape.tensor_overrides))


def with_cpu_experts(placement: Placement, blocks: frozenset[int]) -> Placement:
    """The placement with these blocks' expert tensors in RAM (only those on a device change)."""
    blocks = frozenset(il for il in blocks if placement.layer_device[il] != CPU)
    return placement if blocks == placement.cpu_experts else dataclasses.replace(placement, cpu_experts=blocks)


def _layers(facts: ModelFacts) -> dict[int, LayerWeights]:
    if not facts.layer_weights:
        raise MemoryModelError(f"{facts.name}: no per-layer weights in its facts (read by an older lanes)")
    return {lw.layer: lw for lw in facts.layer_weights}


def _repacked(lw: LayerWeights, rule: dict[str, int]) -> int:
    return sum(b for t, rows, b in lw.repack if t in rule and rows % rule[t] == 0)


def _mapped(groups: Sequence[LayerWeights], rule: dict[str, int]) -> int:
    """The file range the CPU maps: from the first to the last tensor it does not repack
    (llama_model_loader::get_mapping_range over the CPU buffer's tensors)."""
    ranges = []
    for lw in groups:
        if not lw.spans:  # facts from an older lanes: the whole group's range
            ranges.append((lw.first, lw.end))
            continue
        for t, rows, first, end in lw.spans:
            if lw.layer < 0 or not (t in rule and rows % rule[t] == 0):
                ranges.append((first, end))
    return max(e for _, e in ranges) - min(f for f, _ in ranges) if ranges else 0


def model_bytes(facts: ModelFacts, placement: Placement, cpu_repack: Sequence[str] | None = None) -> list[int]:
    """Weights per device."""
    return list(_model_bytes(facts, placement, None if cpu_repack is None else tuple(cpu_repack)))


@functools.lru_cache(maxsize=4096)
def _model_bytes(facts: ModelFacts, placement: Placement, cpu_repack: tuple[str, ...] | None) -> tuple[int, ...]:
    """model_bytes, once per model, placement and CPU: it does not depend on the context, which
    the planner's window search varies thousands of times a replan."""
    layers = _layers(facts)
    out = [0] * (1 + placement.n_devices)
    pinned = any(b in PINNED_HOST_BACKENDS for b in placement.backends)
    rule = {} if pinned else repack_rule(cpu_repack)
    cpu_groups = [layers[-1]] if -1 in layers else []
    experts = {ew.layer: ew for ew in facts.expert_weights} if placement.cpu_experts else {}
    for il, dev in enumerate(placement.layer_device):
        lw = layers.get(il)
        if lw is None:
            continue
        if dev == CPU:
            cpu_groups.append(lw)
            continue
        cuda = placement.backend(dev) in PINNED_HOST_BACKENDS
        out[1 + dev] += lw.cuda_bytes if cuda else lw.bytes
        ew = experts.get(il) if il in placement.cpu_experts else None
        if ew is not None:  # its expert tensors are in RAM instead
            out[1 + dev] -= ew.cuda_bytes if cuda else ew.bytes
            cpu_groups.append(ew)
    if cpu_groups:
        if pinned:
            out[0] = sum(lw.bytes for lw in cpu_groups)
        else:
            out[0] = _mapped(cpu_groups, rule) + sum(_repacked(lw, rule) for lw in cpu_groups if lw.layer >= 0)
    if facts.tied_output_bytes and placement.output_device != CPU:
        dev = placement.output_device
        pinned_dev = placement.backend(dev) in PINNED_HOST_BACKENDS
        out[1 + dev] += facts.tied_output_cuda_bytes if pinned_dev else facts.tied_output_bytes
    return tuple(out)


def kv_bytes(kv: KvSize, placement: Placement, no_kv_offload: bool = False) -> list[int]:
    """KV per device: each layer's K and V where its layer is (on the CPU with -nkvo)."""
    out = [0] * (1 + placement.n_devices)
    devices = placement.layer_device[: len(kv.layers)]
    if devices and (no_kv_offload or devices.count(devices[0]) == len(devices)):
        out[1 + (CPU if no_kv_offload else devices[0])] = kv.total  # one device holds every layer's
        return out
    for il, lk in enumerate(kv.layers):
        dev = CPU if no_kv_offload else devices[il]
        out[1 + dev] += lk.k_bytes + lk.v_bytes
    return out


def recurrent_per_device(facts: ModelFacts, placement: Placement, parallel: int) -> list[int]:
    """Recurrent state per device: per sequence, whatever the context."""
    out = [0] * (1 + placement.n_devices)
    layers = [il for il, r in enumerate(facts.recurrent_layers) if r]
    if layers:
        per_layer = facts.recurrent_bytes_per_seq * max(1, parallel) // len(layers)
        for il in layers:
            out[1 + placement.layer_device[il]] += per_layer
    return out


def output_bytes(facts: ModelFacts, placement: Placement, parallel: int) -> list[int]:
    """The logits buffer: n_vocab floats per slot, in host memory."""
    return [facts.n_vocab * parallel * 4] + [0] * placement.n_devices


def adapter_bytes(adapters: Sequence[AdapterFacts], placement: Placement) -> list[int]:
    """LoRA tensors per device (llama_adapter_lora_init_impl): a pair lands in its base tensor's
    buffer type, so token_embd's in host memory, a block's on its block's device, output's on the
    output device; a repacked CPU tensor's pair in the plain CPU buffer (host memory all the same).
    CUDA sizes tensors as it does weights (128-byte alignment); host buffers pad each to 32."""
    out = [0] * (1 + placement.n_devices)
    for adapter in adapters:
        for lw in adapter.layer_weights:
            if lw.layer == OUTPUT_LAYER:
                dev = placement.output_device
            elif 0 <= lw.layer < placement.n_layer:
                dev = placement.layer_device[lw.layer]
            else:
                dev = CPU
            cuda = dev != CPU and placement.backend(dev) in PINNED_HOST_BACKENDS
            out[1 + dev] += lw.cuda_bytes if cuda else lw.bytes
    return out


def prompt_cache_bytes(shape: LaneShape, placement: Placement) -> list[int]:
    """llama-server's prompt cache (--cache-ram): past prompts' states, copied to host RAM as
    slots move on, up to the limit. Counted at its limit, in host memory whatever the layout:
    it fills with use, so a plan that left it out would be exceeded by a lane that served long
    enough (the issue's 8 GiB per process by default)."""
    return [shape.cache_ram] + [0] * placement.n_devices


def lane_memory(
    facts: ModelFacts, shape: LaneShape, cpu_repack: Sequence[str] | None = None, *, placement: Placement | None = None
) -> MemoryBreakdown:
    """A lane's buffers per device. `placement`: the layers as the caller placed them (the
    planner places its layouts); without one, the shape's device fields place them."""
    if placement is None:
        placement = placement_for(facts, shape)
    elif placement.n_layer != facts.n_layer:
        raise PlacementError(f"a placement of {placement.n_layer} layers for {facts.name} of {facts.n_layer}")
    model = model_bytes(facts, placement, cpu_repack)
    kv = kv_size(
        facts, ctx=shape.ctx, parallel=shape.parallel, kv_unified=shape.kv_unified, type_k=shape.type_k,
        type_v=shape.type_v, layout=shape.layout, n_ubatch=shape.n_ubatch, swa_full=shape.swa_full,
    )  # fmt: skip
    kv_dev = kv_bytes(kv, placement, shape.no_kv_offload)
    recurrent = recurrent_per_device(facts, placement, shape.parallel)
    compute = pooled_compute(facts, placement, shape, kv, compute_bytes(facts, placement, shape, kv))
    output = output_bytes(facts, placement, shape.parallel)
    prompt_cache = prompt_cache_bytes(shape, placement)
    adapters = adapter_bytes(shape.adapters, placement)
    projector = projector_bytes(facts.mmproj if shape.mmproj else None, placement, shape.mmproj_offload,
                                shape.flash_attn, shape.image_max_tokens, shape.mmproj_device)  # fmt: skip
    devices = []
    for i in range(1 + placement.n_devices):
        dev = CPU if i == 0 else i - 1
        devices.append(
            DeviceMemory(
                device="CPU" if i == 0 else f"GPU{i - 1}",
                model_bytes=model[i],
                kv_bytes=kv_dev[i],
                compute_bytes=compute[i],
                output_bytes=output[i],
                recurrent_bytes=recurrent[i],
                prompt_cache_bytes=prompt_cache[i],
                adapter_bytes=adapters[i],
                layers=len(placement.layers_on(dev)),
                index=dev,
                backend=placement.backend(dev),
                projector_bytes=projector[i],
            )
        )
    overhead = overhead_bytes(facts)
    total = sum(d.total for d in devices) + overhead
    return MemoryBreakdown(
        device="gpu" if placement.offloaded > 0 else "cpu",
        weights_bytes=sum(model),
        kv_bytes=kv.total,
        kv_k_bytes=kv.k_bytes,
        kv_v_bytes=kv.v_bytes,
        kv_cells=kv.cells,
        kv_streams=kv.streams,
        swa_cells=kv.swa_cells,
        recurrent_bytes=sum(recurrent),
        compute_bytes=sum(compute),
        overhead_bytes=overhead,
        prompt_cache_bytes=sum(prompt_cache),
        total_bytes=total,
        devices=tuple(devices),
        adapter_bytes=sum(adapters),
        projector_bytes=sum(projector),
    )
