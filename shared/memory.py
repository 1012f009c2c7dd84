"""The exact memory model of llama-server's KV cache, plus weights and a compute estimate.

Pure functions over ModelFacts. The KV figures are byte-exact against what
llama-server prints (`llama_kv_cache: size = ...`): ggml stores a row of n values
of a quantized type as n/32 blocks, and a block of q8_0 is 34 bytes, of q4_0 18.
Nothing here divides by "2 for q8_0".
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

from shared.messages import Device, KvLayout, MemoryBreakdown, ModelFacts

CTX_PAD = 256
BLOCK_VALUES = 32
# Bytes per block of 32 values (ggml type traits: type_size / blck_size * 32).
BLOCK_BYTES: dict[str, int] = {
    "f32": 128,
    "f16": 64,
    "bf16": 64,
    "q8_0": 34,
    "q4_0": 18,
    "q4_1": 20,
    "q5_0": 22,
    "q5_1": 24,
    "iq4_nl": 18,
}
QUANTIZED = frozenset(t for t in BLOCK_BYTES if t not in {"f32", "f16", "bf16"})
DEFAULT_N_UBATCH = 512
MIB = 1024 * 1024
# What a llama-server process holds beyond its buffers (runtime, libraries, HTTP server):
# measured 20-23 MiB of RSS above weights + KV on CPU builds (bench/results.md).
PROCESS_OVERHEAD = 32 * MIB


class MemoryModelError(ValueError):
    pass


def pad(n: int, to: int = CTX_PAD) -> int:
    return -(-n // to) * to


def row_bytes(cache_type: str, n_values: int) -> int:
    """ggml_row_size: bytes of one row of n values."""
    if cache_type not in BLOCK_BYTES:
        raise MemoryModelError(f"unknown cache type {cache_type!r}; known: {', '.join(BLOCK_BYTES)}")
    if cache_type in QUANTIZED and n_values % BLOCK_VALUES:
        raise MemoryModelError(f"{cache_type} needs rows of a multiple of 32 values, got {n_values}")
    return n_values * BLOCK_BYTES[cache_type] // BLOCK_VALUES


@dataclass(frozen=True)
class KvSize:
    cells: int  # per stream, full-attention layers
    streams: int
    swa_cells: int  # per stream, sliding-window layers (0: none)
    k_bytes: int
    v_bytes: int
    ctx_per_slot: int

    @property
    def total(self) -> int:
        return self.k_bytes + self.v_bytes


def kv_cells(ctx: int, parallel: int, kv_unified: bool, layout: KvLayout = "streams") -> tuple[int, int, int]:
    """(cells per stream, streams, per-slot context) as llama_context sets them up."""
    if ctx < CTX_PAD:
        raise MemoryModelError(f"context {ctx} is below the minimum of {CTX_PAD}")
    if parallel < 1:
        raise MemoryModelError(f"parallel must be at least 1, got {parallel}")
    n_ctx = pad(ctx)
    if layout == "shared":
        return n_ctx, 1, n_ctx // parallel
    if kv_unified:
        return n_ctx, 1, n_ctx
    cells = pad(n_ctx // parallel)
    if cells == 0:
        raise MemoryModelError(f"context {ctx} cannot be split over {parallel} slots")
    return cells, parallel, cells


def kv_size(
    facts: ModelFacts,
    *,
    ctx: int,
    parallel: int = 1,
    kv_unified: bool = False,
    type_k: str = "f16",
    type_v: str = "f16",
    layout: KvLayout = "streams",
    n_ubatch: int = DEFAULT_N_UBATCH,
    swa_full: bool = False,
) -> KvSize:
    cells, streams, ctx_per_slot = kv_cells(ctx, parallel, kv_unified, layout)
    has_swa_cache = layout == "streams" and facts.n_swa > 0 and any(facts.swa_layers)
    swa_cells = 0
    if has_swa_cache:
        n_seq_in_stream = parallel if kv_unified else 1
        swa_cells = cells if swa_full else pad(min(cells, facts.n_swa * n_seq_in_stream + n_ubatch))
    k_bytes = v_bytes = 0
    for n_kv, is_swa, count in _kv_layer_groups(facts):
        layer_cells = swa_cells if has_swa_cache and is_swa else cells
        k_bytes += row_bytes(type_k, facts.head_dim_k * n_kv) * layer_cells * streams * count
        if not facts.is_mla:
            v_bytes += row_bytes(type_v, facts.head_dim_v * n_kv) * layer_cells * streams * count
    return KvSize(cells, streams, swa_cells, k_bytes, v_bytes, ctx_per_slot)


@functools.lru_cache(maxsize=4096)
def _kv_layer_groups(facts: ModelFacts) -> tuple[tuple[int, bool, int], ...]:
    """Layers with a KV cache, grouped by (KV heads, sliding window): the planner sizes a
    model thousands of times, and a model has only a few distinct layer kinds."""
    recurrent = tuple(facts.recurrent_layers) + (False,) * facts.n_layer
    swa = tuple(facts.swa_layers) + (False,) * facts.n_layer
    groups = collections.Counter(
        (facts.n_head_kv[layer], swa[layer]) for layer in range(facts.n_layer)
        if facts.n_head_kv[layer] and not recurrent[layer]
    )  # fmt: skip
    return tuple((n_kv, is_swa, count) for (n_kv, is_swa), count in sorted(groups.items()))


def recurrent_bytes(facts: ModelFacts, parallel: int) -> int:
    """Recurrent state is per sequence and does not grow with context."""
    return facts.recurrent_bytes_per_seq * max(1, parallel)


def compute_bytes(facts: ModelFacts, *, cells: int, n_ubatch: int, flash_attn: bool) -> int:
    """An upper estimate of the compute buffer ggml reserves for the worst-case ubatch.

    Logits and activations scale with the ubatch. Attention scales with the cells
    of one stream: with flash attention only the f16 KQ mask (2 bytes per cell and
    token); without it the f32 KQ scores of every head plus an f32 mask. Fitted to
    llama-server's own `compute buffer size` (b11434, CPU): it stays above it.
    """
    activations = n_ubatch * 4 * (facts.n_vocab + 8 * facts.n_embd + 3 * facts.n_ff)
    per_cell_token = 2 if flash_attn else facts.n_head * 4 + 4
    return pad(activations + cells * n_ubatch * per_cell_token, MIB)


def estimate(
    facts: ModelFacts,
    *,
    ctx: int,
    parallel: int = 1,
    kv_unified: bool = False,
    type_k: str = "f16",
    type_v: str = "f16",
    flash_attn: bool = False,
    layout: KvLayout = "streams",
    n_ubatch: int = DEFAULT_N_UBATCH,
    device: Device = "cpu",
) -> MemoryBreakdown:
    kv = kv_size(
        facts,
        ctx=ctx,
        parallel=parallel,
        kv_unified=kv_unified,
        type_k=type_k,
        type_v=type_v,
        layout=layout,
        n_ubatch=n_ubatch,
    )
    recurrent = recurrent_bytes(facts, parallel)
    compute = compute_bytes(facts, cells=kv.cells, n_ubatch=n_ubatch, flash_attn=flash_attn)
    return MemoryBreakdown(
        device=device,
        weights_bytes=facts.weight_bytes,
        kv_bytes=kv.total,
        kv_k_bytes=kv.k_bytes,
        kv_v_bytes=kv.v_bytes,
        kv_cells=kv.cells,
        kv_streams=kv.streams,
        swa_cells=kv.swa_cells,
        recurrent_bytes=recurrent,
        compute_bytes=compute,
        overhead_bytes=PROCESS_OVERHEAD,
        total_bytes=facts.weight_bytes + kv.total + recurrent + compute + PROCESS_OVERHEAD,
    )
