"""The compute buffer ggml reserves per backend (`compute_bytes`), and what it is built from:
the FFN width, the masks and scores per kind of cache, op offload's weight copy, a quantized
cache's rotation inputs and the CPU's expert matmuls. lane_memory (shared.memory.buffers) calls it."""

from __future__ import annotations

import functools

from shared.llama.builds import fa_mask_is_f16, reserves_logits_per_token
from shared.memory.kv import QUANTIZED, KvSize
from shared.memory.placement import CPU, Placement
from shared.memory.shape import LaneShape
from shared.messages.hosts import ModelFacts


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
    # Several devices in the model's list, whether or not each holds a layer (model.n_devices()):
    # a draft on -devd B,A with every layer on B is pipelined too. Not with tensor overrides
    # (--n-cpu-moe, -ot): llama_context turns pipelining off for them.
    pipeline = (
        not cpu_has_layers and placement.n_devices > 1 and placement.split_mode == "layer" and not shape.no_kv_offload
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
