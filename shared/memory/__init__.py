"""One memory model of a llama-server lane, in three rooms walked once, in order:

- kv: the KV cache, K and V of each layer for a shape (every KV total is their sum);
- placement: which device each layer lands on (load_tensors' rule);
- buffers: every buffer on every device (`lane_memory`, the one builder of a MemoryBreakdown),
  with compute (the compute buffer) and overhead (the process beyond its buffers).

Each reads a lane's shape (shape: `LaneShape`, what its memory depends on besides the model);
cpu_repack holds the matrix types a CPU backend repacks (also read by hardware detection).
"""

from shared.memory.buffers import (
    PINNED_HOST_BACKENDS,
    kv_bytes,
    lane_memory,
    model_bytes,
    output_bytes,
    placement_for,
    recurrent_per_device,
)
from shared.memory.compute import compute_bytes
from shared.memory.overhead import PROCESS_OVERHEAD, VOCAB_BYTES_PER_TOKEN, overhead_bytes
from shared.memory.cpu_repack import (
    AVX2_REPACK,
    AVX512_REPACK,
    NEON_DOTPROD_REPACK,
    NEON_I8MM_REPACK,
    repack_rule,
)
from shared.memory.kv import (
    BLOCK_BYTES,
    BLOCK_VALUES,
    CTX_PAD,
    DEFAULT_N_UBATCH,
    MIB,
    QUANTIZED,
    KvCache,
    KvSize,
    LayerKv,
    MemoryModelError,
    kv_caches,
    kv_cells,
    kv_size,
    layer_kv,
    pad,
    row_bytes,
    swa_cells_for,
)
from shared.memory.placement import (
    CPU,
    NglRule,
    Placement,
    PlacementError,
    SplitMode,
    ngl_count,
    normalised_splits,
    place,
)
from shared.memory.shape import LaneShape

__all__ = [
    "AVX2_REPACK", "AVX512_REPACK", "BLOCK_BYTES", "BLOCK_VALUES", "CPU", "CTX_PAD", "DEFAULT_N_UBATCH", "MIB",
    "NEON_DOTPROD_REPACK", "NEON_I8MM_REPACK", "PINNED_HOST_BACKENDS", "PROCESS_OVERHEAD", "QUANTIZED", "KvCache",
    "KvSize", "LaneShape", "LayerKv", "MemoryModelError", "NglRule", "Placement", "PlacementError",
    "SplitMode", "compute_bytes", "kv_bytes", "kv_caches", "kv_cells", "kv_size", "lane_memory", "layer_kv",
    "model_bytes", "ngl_count", "normalised_splits", "output_bytes", "overhead_bytes", "pad", "place", "placement_for",
    "recurrent_per_device", "repack_rule", "row_bytes", "swa_cells_for", "VOCAB_BYTES_PER_TOKEN",
]  # fmt: skip
