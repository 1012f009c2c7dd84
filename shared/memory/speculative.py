"""What speculative decoding adds to a lane's memory. Pure.

From the b11434 source (tools/server/server-context.cpp, common/speculative.cpp), checked against
the binary's -lv 4 lines (tests/test_speculative_real.py):

- The target context reserves outputs for every drafted token: n_outputs_max = min(n_batch,
  slots x (1 + n_max)) (server_output_limits), n_max the speculator's longest draft. Its compute
  buffer's logits grow to min(n_ubatch, n_outputs_max) rows at load (printed), and its output
  buffer, printed at load for one output per slot, grows to n_outputs_max rows at the first
  drafted batch (output_reserve; not printed): that growth is `speculator_bytes`.
- ngram-mod holds one hash table of 4M int32 entries (16 MiB) in host RAM, whatever the lane
  (printed as "mod size=4194304 (16.000 MB)"). Past the planned buffers, a lane with any n-gram
  speculator held 7-12 MiB more RSS than the same lane without after bench/spec_bench.py's runs
  (one slot, Gemma 3 270M): not traced to a source line yet (the maps that grow with the tokens
  seen, the samplers' candidate arrays over drafted positions), so it is counted as measured,
  12 MiB per slot (NGRAM_MEASURED_PER_SLOT).
- draft-simple loads a second model: its weights on the lane's devices (--spec-draft-ngl), a KV
  cache sized like the target's (the whole context over the same slots, upstream #28433) with its
  own K/V types, a compute buffer at the target's ubatch (#27569) and one output per slot.
"""

from __future__ import annotations

import dataclasses

import msgspec

from shared.memory.kv import MIB, MemoryModelError
from shared.memory.shape import LaneShape
from shared.messages.plans import MemoryBreakdown

# The longest draft of each kind at llama-server's defaults (common/common.h): draft.n_max 3,
# ngram_simple/map_k/map_k4v.size_m 48, ngram_mod.n_max 64, ngram-cache 8.
N_MAX = {
    "draft-simple": 3, "ngram-simple": 48, "ngram-map-k": 48, "ngram-map-k4v": 48, "ngram-mod": 64,
    "ngram-cache": 8,
}  # fmt: skip
DRAFT_KINDS = frozenset({"draft-simple"})
NGRAM_MOD_TABLE = 4 * 1024 * 1024 * 4  # common_ngram_mod(n_match, 4M entries) of int32
# RSS a lane with an n-gram speculator held beyond its planned buffers, per slot (see the docstring).
NGRAM_MEASURED_PER_SLOT = 12 * MIB
DEFAULT_N_BATCH = 2048


def n_outputs(spec_type: str | None, parallel: int, n_ubatch: int, n_max: int | None = None) -> int:
    """The target's n_outputs_max (server_output_limits): one per slot without speculation.
    `n_max`: the longest draft when not the type's default (--spec-draft-n-max)."""
    if spec_type is None:
        return parallel
    n_batch = max(DEFAULT_N_BATCH, n_ubatch)  # lane_args passes --batch-size only above 2048
    return max(1, min(n_batch, parallel * (1 + (N_MAX[spec_type] if n_max is None else n_max))))


def target_shape(shape: LaneShape, spec_type: str | None, n_max: int | None = None) -> LaneShape:
    """The target's shape with the outputs its speculator makes it reserve."""
    if spec_type is None:
        return shape
    return dataclasses.replace(shape, n_outputs=n_outputs(spec_type, shape.parallel, shape.n_ubatch, n_max))


def draft_shape(shape: LaneShape, type_k: str = "f16", type_v: str = "f16") -> LaneShape:
    """The draft context's shape: the target's context, slots, flash attention and ubatch; its own
    K/V types; one output per slot; no prompt cache, projector or adapter of its own (the draft is
    loaded bare: llama_model_load_from_file, common/speculative.cpp)."""
    return dataclasses.replace(shape, type_k=type_k, type_v=type_v, n_outputs=0, cache_ram=0, mmproj=False,
                               adapters=())  # fmt: skip


def speculator_host_bytes(spec_type: str | None, n_vocab: int, parallel: int, n_ubatch: int,
                          n_max: int | None = None) -> int:  # fmt: skip
    """Host RAM the speculator takes that no line prints: the output buffer's growth to every drafted
    token's logits, and the n-gram tables."""
    if spec_type is None:
        return 0
    growth = (n_outputs(spec_type, parallel, n_ubatch, n_max) - parallel) * n_vocab * 4
    table = NGRAM_MOD_TABLE if spec_type == "ngram-mod" else 0
    measured = NGRAM_MEASURED_PER_SLOT * parallel if spec_type.startswith("ngram-") else 0
    return growth + table + measured


def on_devices(draft: MemoryBreakdown, indices: tuple[int, ...]) -> MemoryBreakdown:
    """The draft's breakdown, planned over its own device list (--spec-draft-device), moved to where
    those devices sit among the lane's: llama.cpp gives the draft the devices named there, in that
    order, with the target's tensor split read by position (common_base_params_to_speculative)."""
    moved = []
    for d in draft.devices:
        if d.index >= 0:
            index = indices[d.index]
            d = msgspec.structs.replace(d, index=index, device=f"GPU{index}")
        moved.append(d)
    return msgspec.structs.replace(draft, devices=tuple(moved))


def with_speculation(target: MemoryBreakdown, draft: MemoryBreakdown | None, host_bytes: int) -> MemoryBreakdown:
    """The lane's breakdown with the draft's buffers added to the same devices and kinds (llama-server
    prints the draft's lines beside the target's: the per-device sums are what it prints) and the
    speculator's unprinted host bytes on the CPU. `draft`: lane_memory of the draft at draft_shape."""
    by_index = {d.index: d for d in draft.devices} if draft is not None else {}
    devices = []
    for d in target.devices:
        extra = by_index.pop(d.index, None)
        if extra is not None:
            d = msgspec.structs.replace(
                d, model_bytes=d.model_bytes + extra.model_bytes, kv_bytes=d.kv_bytes + extra.kv_bytes,
                compute_bytes=d.compute_bytes + extra.compute_bytes, output_bytes=d.output_bytes + extra.output_bytes,
                draft_bytes=extra.total,
            )  # fmt: skip
        if d.index < 0 and host_bytes:
            d = msgspec.structs.replace(d, speculator_bytes=host_bytes)
        devices.append(d)
    if by_index:
        raise MemoryModelError(f"the draft lies on devices the target does not use: {sorted(by_index)}")
    draft_total = sum(d.draft_bytes for d in devices)
    return msgspec.structs.replace(
        target,
        weights_bytes=target.weights_bytes + (draft.weights_bytes if draft else 0),
        kv_bytes=target.kv_bytes + (draft.kv_bytes if draft else 0),
        compute_bytes=target.compute_bytes + (draft.compute_bytes if draft else 0),
        total_bytes=target.total_bytes + draft_total + host_bytes,
        devices=tuple(devices),
        draft_bytes=draft_total,
        speculator_bytes=host_bytes,
    )
