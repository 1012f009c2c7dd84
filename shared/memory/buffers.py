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
from dataclasses import dataclass

from shared.llama.builds import fa_mask_is_f16, reserves_logits_per_token
from shared.memory.cpu_repack import repack_rule
from shared.memory.experts import cpu_expert_blocks
from shared.memory.kv import DEFAULT_N_UBATCH, MIB, QUANTIZED, KvSize, MemoryModelError, kv_size
from shared.memory.projector import projector_bytes
from shared.memory.placement import (
    CPU,
    NglRule,
    Placement,
    PlacementError,
    SplitMode,
    place,
)
from shared.memory.pooled import pooled_compute
from shared.messages import (
    OUTPUT_LAYER,
    AdapterFacts,
    DeviceMemory,
    KvLayout,
    LayerWeights,
    MemoryBreakdown,
    ModelFacts,
    NGpuLayers,
)

# What a llama-server process holds beyond its buffers (runtime, libraries, HTTP server):
# measured 20-23 MiB of RSS above weights + KV on CPU builds (bench/results.md).
PROCESS_OVERHEAD = 32 * MIB
# The tokenizer's host memory, per vocabulary token (src/llama-vocab.cpp, llama_vocab::impl):
# id_to_token's token_data (std::string text, float score, attr: 40 B), token_to_id's hash node
# (std::string key, id, cached hash, next pointer: a 64 B malloc chunk) and its bucket (8 B),
# cache_token_to_piece's std::string (32 B), plus heap text for the pieces longer than the 15 bytes
# a std::string holds inline: 160 B. Measured: RSS grows 157 B a token from 259 to 262,144 tokens.
VOCAB_BYTES_PER_TOKEN = 160
PINNED_HOST_BACKENDS = frozenset({"cuda", "rocm"})  # their host buffer type comes first for CPU weights


@dataclass(frozen=True)
class LaneShape:
    """What a lane's memory depends on, apart from the model. The device fields (n_gpu_layers
    to ngl_rule) place the layers when the caller gives lane_memory no placement of its own."""

    ctx: int
    parallel: int = 1
    kv_unified: bool = False
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    layout: KvLayout = "streams"
    n_ubatch: int = DEFAULT_N_UBATCH
    n_gpu_layers: NGpuLayers = 0
    tensor_split: tuple[float, ...] = ()  # one share per device; () with devices: equal shares
    devices: tuple[str, ...] = ()  # backend of each GPU-type device in llama-server's order: cuda, rpc, metal
    split_mode: SplitMode = "layer"
    main_gpu: int = 0
    no_kv_offload: bool = False
    ngl_rule: NglRule = "output_first"
    n_cpu_moe: int = 0  # --n-cpu-moe: the expert tensors of the first N blocks in RAM
    tensor_overrides: tuple[tuple[str, str], ...] = ()  # -ot PATTERN=BUFFER pairs (only =CPU on experts)
    cache_ram: int = 0  # bytes: the prompt cache's limit (--cache-ram), see prompt_cache_bytes
    llama_build: int = 0  # the build whose graph rules apply (shared.llama.builds); 0: the current rules
    adapters: tuple[AdapterFacts, ...] = ()  # LoRA adapters loaded with --lora
    pooled: bool = False  # --embeddings or --reranking: every ubatch token is an output (shared.memory.pooled)
    mmproj: bool = False  # --mmproj: the model's projector (facts.mmproj) is loaded
    mmproj_offload: bool = False  # --mmproj-offload: on the lane's first device (else host RAM)
    n_outputs: int = 0  # outputs the context reserves (speculative decoding: every drafted token); 0: one per slot


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


def ffn_width(facts: ModelFacts) -> int:
    """The FFN activations' width per token: n_ff, or for a Mixture of Experts the routed experts'
    outputs ([n_ff_exp, n_expert_used, n_tokens]) plus the shared expert's, when wider."""
    return max(facts.n_ff, facts.n_ff_exp * facts.n_expert_used + facts.n_ff_shexp)


# Backends whose offload_op runs an op with host-held weights on the GPU (batches of 32 tokens
# or more): the scheduler copies the weight into that GPU's compute buffer (ggml-backend.cpp).
OP_OFFLOAD_BACKENDS = frozenset({"cuda", "rocm"})
OP_OFFLOAD_MIN_BATCH = 32


def op_offload_device(placement: Placement) -> int:
    """The GPU that runs ops whose weights are in RAM: the first one with op offload (CPU: none)."""
    return next((d for d in range(placement.n_devices) if placement.backend(d) in OP_OFFLOAD_BACKENDS), CPU)


def op_offload_bytes(facts: ModelFacts, placement: Placement, n_tokens: int) -> int:
    """Experts in RAM on a CUDA/ROCm lane: prompt batches run their matmuls on the first GPU, which
    holds a copy of one expert tensor at a time (a weight from another backend starts a new split,
    so the copies reuse one slot): the largest, taken as a third of its block's gate/up/down.
    An estimate read off the scheduler's source, not measured (no GPU here); 0 on CPU and RPC."""
    if not placement.cpu_experts or n_tokens < OP_OFFLOAD_MIN_BATCH or op_offload_device(placement) == CPU:
        return 0
    groups = {ew.layer: ew for ew in facts.expert_weights}
    return max((-(-groups[il].cuda_bytes // 3) for il in placement.cpu_experts if il in groups), default=0)


@functools.lru_cache(maxsize=1024)
def _kv_layers(facts: ModelFacts) -> frozenset[int]:
    """The blocks with a KV cache (KV heads)."""
    return frozenset(il for il in range(facts.n_layer) if facts.n_head_kv[il])


@functools.lru_cache(maxsize=4096)
def _cache_kinds(facts: ModelFacts, layers: tuple[int, ...]) -> frozenset[bool]:
    """Which caches these layers use, as sliding-window flags (for a lane that has an SWA cache)."""
    swa = tuple(facts.swa_layers) + (False,) * (facts.n_layer + 1)
    kv_layers = _kv_layers(facts)
    return frozenset(swa[il] for il in layers if il in kv_layers)


def compute_bytes(facts: ModelFacts, placement: Placement, shape: LaneShape, kv: KvSize) -> list[int]:
    """The compute buffer ggml reserves per backend for the worst-case prompt-processing graph.

    No closed form exists (ggml-alloc packs the graph); this follows the tensors that are
    alive at the graph's peaks, fitted to llama-server's own lines (CPU and RPC backends,
    b11434): the attention masks (one per KV cache, f16 with flash attention, f32 without,
    n_kv x n_ubatch), without flash attention the f32 scores of every head (n_kv x n_ubatch
    x n_head), FFN activations (3 x n_ff x n_ubatch f32), residual stream (5 x n_embd x
    n_ubatch f32), and the logits of `parallel` outputs (llama-server reserves
    n_outputs = slots; llama-fit-params reserves all n_ubatch, hence its larger figure). Builds
    before ~b9400 (shape.llama_build, PR 23861) reserve logits for every ubatch token and, before
    ~b9380 (PR 23764), an f32 flash-attention mask: both checked on public CUDA logs.
    """
    n_tokens = min(shape.n_ubatch, kv.cells * kv.streams)
    f32 = 4
    mask_width = 2 if shape.flash_attn and fa_mask_is_f16(shape.llama_build) else 4
    embd = facts.n_embd * n_tokens * f32
    ffn = ffn_width(facts) * n_tokens * f32
    # Builds before PR 23861 reserve logits for every ubatch token; their output peak is those logits
    # and the normed hidden state they are computed from (public CUDA logs, tests/cuda_logs.py).
    per_token_logits = reserves_logits_per_token(shape.llama_build)
    logits = facts.n_vocab * (n_tokens if per_token_logits else min(n_tokens, shape.n_outputs) if shape.n_outputs
                              else shape.parallel) * f32
    kv_layers = _kv_layers(facts)

    def attention(layers) -> tuple[int, int]:
        """(masks, scores) on a device holding these layers: one mask per kind of cache it uses."""
        kinds = _cache_kinds(facts, tuple(layers))
        if not kv.swa_cells:
            kinds = {False} if kinds else set()
        masks = sum((kv.swa_cells if k else kv.cells) * n_tokens * mask_width for k in kinds)
        widest = max(((kv.swa_cells if k else kv.cells) for k in kinds), default=0)
        scores = 0 if shape.flash_attn else widest * n_tokens * facts.n_head * f32
        return masks, scores

    all_masks, _ = attention(range(facts.n_layer))
    out = [0] * (1 + placement.n_devices)
    holders = sorted(set(placement.layer_device))
    cpu_has_layers = CPU in holders
    # llama_context: several devices, full offload, split by layer -> pipeline parallelism,
    # and ggml's scheduler keeps GGML_SCHED_MAX_COPIES (4) copies of each split's inputs.
    # Not with tensor overrides (--n-cpu-moe, -ot): llama_context turns pipelining off for them.
    pipeline = (
        not cpu_has_layers and len(holders) > 1 and placement.split_mode == "layer" and not shape.no_kv_offload
        and not (shape.n_cpu_moe or shape.tensor_overrides)
    )  # fmt: skip
    copies = 4 if pipeline else 1
    first_gpu = min((d for d in holders if d != CPU), default=None)
    for dev in holders:
        is_output = dev == placement.output_device
        layers = placement.layers_on(dev)
        if dev != CPU and kv_layers.isdisjoint(layers):
            out[1 + dev] = logits if is_output else 0  # the output layer alone: its logits
            continue
        masks, scores = attention(layers)
        if dev == CPU:
            masks = all_masks  # graph inputs are built in host memory
            resid, attn_extra = 5 * embd, 4 * ffn - embd
        elif cpu_has_layers:  # partial offload: the CPU side computes the first layers
            resid, attn_extra = 2 * embd, 4 * ffn - (7 if dev == first_gpu else 12) * embd // 2
        else:
            resid, attn_extra = 4 * embd, 4 * ffn - 2 * embd
        if per_token_logits:
            peak_ffn = masks + resid + 3 * ffn
            peak_out = logits + embd if is_output else 0
        else:
            peak_ffn = masks + resid + max(3 * ffn, logits if is_output else 0)
            peak_out = 0
        peak_attn = masks + scores + attn_extra if scores else 0
        out[1 + dev] = max(peak_ffn, peak_attn, peak_out)
        if pipeline:
            out[1 + dev] += (copies - 1) * masks + (12 if dev == first_gpu else 4) * embd
    offload_to = op_offload_device(placement)
    if offload_to != CPU:
        out[1 + offload_to] += op_offload_bytes(facts, placement, n_tokens)
    if not cpu_has_layers:
        # Full offload: the CPU still builds the graph inputs (masks) and gathers token embeddings.
        out[0] = copies * (all_masks + rotation_inputs(facts, shape, kv)) + 4 * embd
        if pipeline:
            out[0] += (6 if shape.flash_attn else 10) * embd
        out[0] = max(out[0], cpu_expert_peak(facts, placement, n_tokens, all_masks))
    return out


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


def rotation_inputs(facts: ModelFacts, shape: LaneShape, kv: KvSize) -> int:
    """The Hadamard matrices a quantized cache rotates K (and V) with, graph inputs built on the CPU
    (src/llama-kv-cache.cpp: attn_rot_k when type_k is quantized and the head size a multiple of
    64, n_rot_k doubled from 64 while it divides the head size; attn_rot_v: 64; build_input_k_rot,
    build_input_v_rot): one f32 n_rot x n_rot input per KV cache (a sliding-window model has two),
    and like the masks one per pipeline copy. 2 MiB on Gemma 3 over two devices (K q8_0)."""
    total = 0
    if shape.type_k in QUANTIZED and facts.head_dim_k % 64 == 0:
        n_rot = 64
        while facts.head_dim_k % (2 * n_rot) == 0:
            n_rot *= 2
        total += n_rot * n_rot * 4
    if shape.type_v in QUANTIZED and facts.head_dim_v % 64 == 0:
        total += 64 * 64 * 4
    return total * (2 if kv.swa_cells else 1)


def cpu_expert_peak(facts: ModelFacts, placement: Placement, n_tokens: int, masks: int) -> int:
    """The CPU's compute buffer while it runs the expert matmuls of blocks whose experts stay in RAM
    on a lane whose layers are all on devices (--n-cpu-moe, -ot exps=CPU). A backend without op
    offload (RPC, Metal) leaves them to the CPU: ggml-backend.cpp's scheduler, pass 1, puts an op
    with a weight on that weight's backend.

    build_moe_ffn (src/llama-graph.cpp) then runs on the CPU, from a copy of the normed input
    ([n_embd, n_tokens] f32) and of the chosen experts' ids: up and gate (mul_mat_id, [n_ff_exp,
    n_expert_used, n_tokens] f32 each), swiglu into a third such tensor (GLU is not done in place,
    ggml-alloc.c ggml_op_can_inplace), down ([n_embd, n_expert_used, n_tokens]); the weighting
    and the sum go back to the device. Measured on RPC devices (b11434, four expert shapes):
    with one device the buffer spans twice the input, three FFN tensors and down (ggml-alloc
    does not fit down into the freed up/gate); with a later device whose first split copies the
    masks after a CPU-expert block, the masks stay alive, and under them the input, the three FFN
    tensors and what of down outgrows the freed up and gate."""
    if not placement.cpu_experts or not facts.n_ff_exp or not facts.n_expert_used:
        return 0
    f32 = 4
    used = facts.n_expert_used
    inp = facts.n_embd * n_tokens * f32
    ff = facts.n_ff_exp * used * n_tokens * f32
    down = facts.n_embd * used * n_tokens * f32
    ids = used * n_tokens * 4
    peak = 2 * inp + ids + 3 * ff + down
    devices = [d for d in sorted(set(placement.layer_device[: placement.n_layer])) if d != CPU]
    last_start = placement.layer_device.index(devices[-1]) if devices else 0
    if min(placement.cpu_experts) < last_start:  # the masks wait for the last device's first split
        peak = max(peak, masks + inp + ids + 3 * ff + max(0, down - 2 * ff))
    return peak


def overhead_bytes(facts: ModelFacts) -> int:
    """What the process holds in RAM beyond its buffers: the runtime (PROCESS_OVERHEAD) and the
    tokenizer's tables, n_vocab x VOCAB_BYTES_PER_TOKEN (40 MiB for a 262k vocabulary: without it a
    Gemma 3 lane's RSS at load passed its plan once its slots' KV, all touched, replaced compute)."""
    return PROCESS_OVERHEAD + facts.n_vocab * VOCAB_BYTES_PER_TOKEN


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
        type_v=shape.type_v, layout=shape.layout, n_ubatch=shape.n_ubatch,
    )  # fmt: skip
    kv_dev = kv_bytes(kv, placement, shape.no_kv_offload)
    recurrent = recurrent_per_device(facts, placement, shape.parallel)
    compute = pooled_compute(facts, placement, shape, kv, compute_bytes(facts, placement, shape, kv))
    output = output_bytes(facts, placement, shape.parallel)
    prompt_cache = prompt_cache_bytes(shape, placement)
    adapters = adapter_bytes(shape.adapters, placement)
    projector = projector_bytes(facts.mmproj if shape.mmproj else None, placement, shape.mmproj_offload,
                                shape.flash_attn)  # fmt: skip
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
