"""A GGUF file's tensors as the memory model counts them: each tensor's size in host and in CUDA
memory, grouped per layer (or per block's experts) with their file range and the matrices a CPU
repacks. Read by the model facts (shared.gguf_facts), the adapters (shared.adapters) and the
projectors (shared.gguf_projector).
"""

from __future__ import annotations

import re

from shared.gguf_scan import GGUFHeader, TensorInfo, tensor_bytes
from shared.messages.hosts import LayerWeights

# ggml types the CPU backend's repack kernels take (ggml-cpu/repack.cpp); which of them a
# given CPU repacks is the host's business (shared.memory.cpu_repack.repack_rule).
_REPACK_TYPES = {"Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "IQ4_NL", "MXFP4", "Q8_0", "Q1_0"}
_INPUT_TENSORS = ("token_embd.", "token_embd_norm.", "token_types.", "position_embd.")
_OUTPUT_TENSORS = ("output.", "output_norm.", "cls.", "cls_out.")
MATRIX_ROW_PADDING = 512  # ggml-cuda: quantized tensors get one row padded to a multiple of this


def _layer_of(name: str, n_layer: int) -> int:
    if name.startswith("blk."):
        try:
            return int(name.split(".", 2)[1])
        except ValueError:
            return -1
    if name.startswith(_OUTPUT_TENSORS):
        return n_layer
    return -1


def cuda_bytes(t: TensorInfo) -> int:
    """A tensor's bytes as ggml-cuda allocates them: a quantized one padded by one row to a multiple
    of MATRIX_ROW_PADDING values, the whole aligned to 128 bytes."""
    size = t.n_bytes
    if t.type_name not in ("F32", "F16", "BF16", "I8", "I16", "I32", "I64", "F64") and t.shape:
        rem = t.shape[0] % MATRIX_ROW_PADDING
        if rem:
            size += tensor_bytes(t.type, (MATRIX_ROW_PADDING - rem,))
    return -(-size // 128) * 128


# llama.cpp's LLM_FFN_EXPS_REGEX (common/common.h): the tensors --n-cpu-moe N moves, block by block.
EXPERT_TENSOR = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")


def group_weights(layer: int, tensors: list[TensorInfo], data_offset: int) -> LayerWeights:
    """One layer's (or one block's experts') tensors as a group: sizes, file range, repack candidates.
    ggml's CPU repacks 2-D matrices (MUL_MAT) and 3-D expert stacks (MUL_MAT_ID) alike."""
    repack: dict[tuple[str, int], int] = {}
    spans: dict[tuple[str, int], tuple[int, int]] = {}
    for t in tensors:
        key = ("", 0)
        if t.type_name in _REPACK_TYPES and len(t.shape) in (2, 3) and not t.name.startswith(_INPUT_TENSORS):
            rows = t.shape[1]
            key = (t.type_name, 8 if rows % 8 == 0 else 4 if rows % 4 == 0 else 1)
            repack[key] = repack.get(key, 0) + -(-t.n_bytes // 32) * 32
        lo, hi = spans.get(key, (t.offset, t.offset + t.n_bytes))
        spans[key] = (min(lo, t.offset), max(hi, t.offset + t.n_bytes))
    return LayerWeights(
        layer=layer,
        bytes=sum(-(-t.n_bytes // 32) * 32 for t in tensors),
        cuda_bytes=sum(cuda_bytes(t) for t in tensors),
        first=data_offset + min(t.offset for t in tensors),
        end=data_offset + max(t.offset + t.n_bytes for t in tensors),
        repack=tuple((k[0], k[1], v) for k, v in sorted(repack.items())),
        spans=tuple((k[0], k[1], data_offset + lo, data_offset + hi) for k, (lo, hi) in sorted(spans.items())),
    )


def expert_weights(header: GGUFHeader, n_layer: int) -> tuple[LayerWeights, ...]:
    """Per block, its expert tensors (the ones llama.cpp's expert regex matches), as one group."""
    groups: dict[int, list[TensorInfo]] = {}
    for t in header.tensors:
        layer = _layer_of(t.name, n_layer)
        if 0 <= layer < n_layer and EXPERT_TENSOR.search(t.name):
            groups.setdefault(layer, []).append(t)
    return tuple(group_weights(layer, groups[layer], header.data_offset) for layer in sorted(groups))


def layer_weights(header: GGUFHeader, n_layer: int) -> tuple[tuple[LayerWeights, ...], int, int]:
    """Per layer index: padded sizes, file range and repackable matrices; plus the tied output's size."""
    groups: dict[int, list[TensorInfo]] = {}
    names = set()
    for t in header.tensors:
        groups.setdefault(_layer_of(t.name, n_layer), []).append(t)
        names.add(t.name)
    out = [group_weights(layer, groups[layer], header.data_offset) for layer in sorted(groups)]
    tied = tied_cuda = 0
    if "output.weight" not in names:
        embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
        if embd is not None:
            tied, tied_cuda = -(-embd.n_bytes // 32) * 32, cuda_bytes(embd)
    return tuple(out), tied, tied_cuda
