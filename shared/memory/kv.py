"""The exact size of llama-server's KV cache: cells per stream, and K and V of each layer.

Pure functions over ModelFacts. The figures are byte-exact against what llama-server
prints (`llama_kv_cache: size = ...`): ggml stores a row of n values of a quantized type
as n/32 blocks, and a block of q8_0 is 34 bytes, of q4_0 18. Nothing here divides by
"2 for q8_0". `layer_kv` is the one per-layer figure; every KV total is a sum of it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from shared import defaults
from shared.messages.hosts import KvLayout, ModelFacts

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
DEFAULT_N_UBATCH = defaults.N_UBATCH
MIB = 1024 * 1024


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


class LayerKv(NamedTuple):
    """One layer's share of the KV cache (all zero for a layer without one)."""

    k_bytes: int
    v_bytes: int
    cells: int  # per stream
    swa: bool  # held in the sliding-window cache


@dataclass(frozen=True)
class KvSize:
    cells: int  # per stream, full-attention layers
    streams: int
    swa_cells: int  # per stream, sliding-window layers (0: none)
    k_bytes: int
    v_bytes: int
    ctx_per_slot: int
    layers: tuple[LayerKv, ...] = ()  # n_layer entries: the sums above are theirs

    @property
    def total(self) -> int:
        return self.k_bytes + self.v_bytes


@dataclass(frozen=True)
class KvCache:
    """One of llama-server's KV caches (the full one, the SWA one), as it prints its size line."""

    swa: bool
    cells: int
    layers: int
    k_bytes: int
    v_bytes: int

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


def swa_cells_for(
    facts: ModelFacts, cells: int, parallel: int, kv_unified: bool, layout: KvLayout, n_ubatch: int, swa_full: bool
) -> int:
    """Cells per stream of the sliding-window cache; 0 when the lane has none."""
    if layout != "streams" or facts.n_swa <= 0 or not any(facts.swa_layers):
        return 0
    if swa_full:
        return cells
    n_seq_in_stream = parallel if kv_unified else 1
    return pad(min(cells, facts.n_swa * n_seq_in_stream + n_ubatch))


def layer_kv(
    facts: ModelFacts, *, cells: int, streams: int, swa_cells: int, type_k: str = "f16", type_v: str = "f16"
) -> tuple[LayerKv, ...]:
    """K and V bytes of each layer's cache: rows per cell x cells x streams."""
    sized, of_layer, _ = _sized_kinds(facts, cells, streams, swa_cells, type_k, type_v)
    return tuple(map(sized.__getitem__, of_layer))


def _sized_kinds(
    facts: ModelFacts, cells: int, streams: int, swa_cells: int, type_k: str, type_v: str
) -> tuple[list[LayerKv], tuple[int, ...], tuple[int, ...]]:
    """Each kind of layer's cache (a model's layers come in a few kinds: each is sized once),
    each layer's kind, and how many layers each kind has."""
    kinds, of_layer, counts = _layer_kinds(facts, type_k, type_v)
    sized = []
    for rows in kinds:
        if rows is None:
            sized.append(_NO_CACHE)
            continue
        k_row, v_row, is_swa = rows
        in_swa = is_swa and swa_cells > 0
        n = (swa_cells if in_swa else cells) * streams
        sized.append(LayerKv(k_row * n, v_row * n, swa_cells if in_swa else cells, in_swa))
    return sized, of_layer, counts


_NO_CACHE = LayerKv(0, 0, 0, False)


@functools.lru_cache(maxsize=4096)
def _layer_kinds(facts: ModelFacts, type_k: str, type_v: str) -> tuple[tuple, tuple[int, ...], tuple[int, ...]]:
    """The distinct rows per cell of the model's layers, each layer's index among them, and
    the number of layers of each."""
    kinds: dict = {}
    of_layer = tuple(kinds.setdefault(rows, len(kinds)) for rows in _rows_per_cell(facts, type_k, type_v))
    return tuple(kinds), of_layer, tuple(of_layer.count(k) for k in range(len(kinds)))


@functools.lru_cache(maxsize=4096)
def _rows_per_cell(facts: ModelFacts, type_k: str, type_v: str) -> tuple[tuple[int, int, bool] | None, ...]:
    """(K row, V row, sliding-window) bytes of each layer per cell, None for a layer without a
    cache (no KV heads, or recurrent): the planner sizes a model thousands of times."""
    recurrent = tuple(facts.recurrent_layers) + (False,) * facts.n_layer
    swa = tuple(facts.swa_layers) + (False,) * facts.n_layer
    rows: list[tuple[int, int, bool] | None] = []
    for layer in range(facts.n_layer):
        n_kv = facts.n_head_kv[layer]
        if not n_kv or recurrent[layer]:
            rows.append(None)
            continue
        v_row = 0 if facts.is_mla else row_bytes(type_v, facts.head_dim_v * n_kv)
        rows.append((row_bytes(type_k, facts.head_dim_k * n_kv), v_row, swa[layer]))
    return tuple(rows)


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
    swa_cells = swa_cells_for(facts, cells, parallel, kv_unified, layout, n_ubatch, swa_full)
    sized, of_layer, counts = _sized_kinds(facts, cells, streams, swa_cells, type_k, type_v)
    # The sums of layer_kv's figures, taken per kind of layer.
    k_bytes = sum(lk.k_bytes * n for lk, n in zip(sized, counts))
    v_bytes = sum(lk.v_bytes * n for lk, n in zip(sized, counts))
    layers = tuple(map(sized.__getitem__, of_layer))
    return KvSize(cells, streams, swa_cells, k_bytes, v_bytes, ctx_per_slot, layers)


def kv_caches(kv: KvSize) -> list[KvCache]:
    """The caches llama-server prints a size line for: the full one, then the sliding-window one."""
    out = []
    for swa in (False, True):
        mine = [lk for lk in kv.layers if lk.cells and lk.swa == swa]
        if mine:
            cells = kv.swa_cells if swa else kv.cells
            out.append(KvCache(swa, cells, len(mine), sum(lk.k_bytes for lk in mine), sum(lk.v_bytes for lk in mine)))
    return out
