"""The KV memory model against hand-computed figures (formula in the llama-server reference).

Expected values are worked out here from first principles:
    row(t, n) = n / 32 * block_bytes(t)
    bytes     = cells * streams * sum over layers (row(type_k, hd_k * n_kv) + row(type_v, hd_v * n_kv))
and never by calling the code under test.
"""

from __future__ import annotations

import pytest

from shared.gguf_facts import read_model_facts
from planner_svc.layouts import with_layers
from shared.memory import LaneShape, MemoryModelError, kv_caches, kv_cells, kv_size, lane_memory, row_bytes
from shared.messages.hosts import ModelFacts

MIB = 2**20

# Bytes of one block of 32 values, as ggml's type traits give them.
BLOCK = {
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


def _facts(**kw) -> ModelFacts:
    base = dict(
        path="/models/m.gguf",
        name="m",
        architecture="llama",
        n_layer=8,
        n_embd=512,
        n_head=8,
        n_head_kv=(8,) * 8,
        head_dim_k=64,
        head_dim_v=64,
        n_ctx_train=32768,
        n_vocab=259,
        n_ff=512,
    )
    base.update(kw)
    return ModelFacts(**base)


@pytest.fixture(scope="module")
def llama8(tiny_models) -> ModelFacts:
    return read_model_facts(tiny_models["llama8"])


@pytest.fixture(scope="module")
def gemma3(tiny_models) -> ModelFacts:
    return read_model_facts(tiny_models["gemma3"])


@pytest.fixture(scope="module")
def mla(tiny_models) -> ModelFacts:
    return read_model_facts(tiny_models["mla"])


# ------------------------------------------------------------------ golden numbers (measured on llama-server)


@pytest.mark.parametrize(
    ("type_k", "type_v", "mib"),
    [
        ("f16", "f16", 512),
        ("q8_0", "q8_0", 272),
        ("q4_0", "q4_0", 144),
        ("q8_0", "f16", 392),
    ],
)
def test_golden_llama8_ctx32768(llama8, type_k, type_v, mib):
    kv = kv_size(llama8, ctx=32768, parallel=1, type_k=type_k, type_v=type_v)
    assert kv.total == mib * MIB
    assert kv.cells == 32768
    assert kv.streams == 1
    assert kv.swa_cells == 0
    # K and V each: 8 layers x 32768 cells x (512 values / 32 x block bytes).
    assert kv.k_bytes == 8 * 32768 * (512 // 32) * BLOCK[type_k]
    assert kv.v_bytes == 8 * 32768 * (512 // 32) * BLOCK[type_v]


def test_golden_halves_as_printed(llama8):
    # llama-server prints "K (q8_0): 136.00 MiB, V (q8_0): 136.00 MiB" for the q8_0 case.
    kv = kv_size(llama8, ctx=32768, type_k="q8_0", type_v="q8_0")
    assert kv.k_bytes == 136 * MIB
    assert kv.v_bytes == 136 * MIB


def test_quantized_ratios_are_not_2x_and_4x(llama8):
    f16 = kv_size(llama8, ctx=32768).total
    q8 = kv_size(llama8, ctx=32768, type_k="q8_0", type_v="q8_0").total
    q4 = kv_size(llama8, ctx=32768, type_k="q4_0", type_v="q4_0").total
    assert f16 * 34 == q8 * 64
    assert f16 * 18 == q4 * 64
    assert f16 != 2 * q8


def test_lane_memory_adds_up(llama8):
    mem = lane_memory(llama8, LaneShape(ctx=32768, type_k="q8_0", type_v="q8_0", flash_attn=True))
    assert mem.kv_bytes == 272 * MIB
    assert mem.kv_k_bytes + mem.kv_v_bytes == mem.kv_bytes
    assert mem.overhead_bytes == 32 * 2**20 + llama8.n_vocab * 160  # the runtime, and the tokenizer's tables
    assert mem.total_bytes == mem.weights_bytes + mem.kv_bytes + mem.recurrent_bytes + mem.compute_bytes + sum(
        d.output_bytes for d in mem.devices
    ) + mem.overhead_bytes
    assert mem.compute_bytes > 0


# ------------------------------------------------------------------ one per-layer figure, every total its sum


def test_every_total_is_the_sum_of_the_layers(gemma3):
    kv = kv_size(gemma3, ctx=8192, parallel=2, type_k="q8_0", type_v="f16")
    assert len(kv.layers) == gemma3.n_layer
    assert kv.k_bytes == sum(lk.k_bytes for lk in kv.layers)
    assert kv.v_bytes == sum(lk.v_bytes for lk in kv.layers)
    # gemma3 tiny: 2 KV heads x 64; q8_0 K row 136 bytes, f16 V row 256; 5 SWA layers then one full
    swa = kv.layers[0]
    assert (swa.swa, swa.cells, swa.k_bytes, swa.v_bytes) == (True, 1024, 136 * 1024 * 2, 256 * 1024 * 2)
    assert not kv.layers[5].swa and kv.layers[5].cells == 4096
    caches = kv_caches(kv)
    assert [(c.swa, c.cells, c.layers) for c in caches] == [(False, 4096, 1), (True, 1024, 5)]
    assert sum(c.total for c in caches) == kv.total


def test_layers_without_a_cache_count_zero():
    facts = _facts(n_layer=4, n_head_kv=(8, 0, 8, 8), recurrent_layers=(False, False, True, False))
    kv = kv_size(facts, ctx=1024)
    assert [lk.k_bytes > 0 for lk in kv.layers] == [True, False, False, True]
    assert kv_caches(kv)[0].layers == 2


# ------------------------------------------------------------------ row sizes


@pytest.mark.parametrize("cache_type", sorted(BLOCK))
def test_row_bytes_block_sizes(cache_type):
    assert row_bytes(cache_type, 32) == BLOCK[cache_type]
    assert row_bytes(cache_type, 64) == 2 * BLOCK[cache_type]
    assert row_bytes(cache_type, 4096) == 128 * BLOCK[cache_type]


def test_row_bytes_unquantized_any_length():
    assert row_bytes("f16", 40) == 80
    assert row_bytes("f32", 40) == 160
    assert row_bytes("bf16", 1) == 2


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"])
def test_row_bytes_quantized_needs_whole_blocks(cache_type):
    with pytest.raises(MemoryModelError):
        row_bytes(cache_type, 40)


@pytest.mark.parametrize("bad", ["q6_K", "Q8_0", "f8", "", "q8"])
def test_unknown_cache_type(bad):
    with pytest.raises(MemoryModelError, match="unknown cache type"):
        row_bytes(bad, 64)
    with pytest.raises(MemoryModelError):
        kv_size(_facts(), ctx=4096, type_k=bad)
    with pytest.raises(MemoryModelError):
        kv_size(_facts(), ctx=4096, type_v=bad)


# ------------------------------------------------------------------ cells, streams, padding


@pytest.mark.parametrize("ctx", [0, 1, 100, 255])
def test_context_below_256_is_an_error(ctx):
    with pytest.raises(MemoryModelError, match="256"):
        kv_cells(ctx, 1, False)
    with pytest.raises(MemoryModelError):
        kv_size(_facts(), ctx=ctx)
    with pytest.raises(MemoryModelError):
        lane_memory(with_layers(_facts()), LaneShape(ctx=ctx))


def test_context_256_is_fine():
    assert kv_cells(256, 1, False) == (256, 1, 256)


def test_ctx_padded_to_256():
    # pad(1000, 256) = 1024; pad(4097, 256) = 4352
    assert kv_cells(1000, 1, False)[0] == 1024
    assert kv_cells(4097, 1, False)[0] == 4352
    assert kv_cells(4096, 1, False)[0] == 4096


def test_per_slot_padding_rounds_up():
    # n_ctx = pad(1000) = 1024; cells = pad(1024 // 3 = 341) = 512 per stream; 3 streams.
    cells, streams, per_slot = kv_cells(1000, 3, False)
    assert (cells, streams, per_slot) == (512, 3, 512)
    facts = _facts()
    kv = kv_size(facts, ctx=1000, parallel=3)
    per_cell = 8 * 2 * (512 // 32) * 64  # 8 layers, K+V, f16 rows of 512 values
    assert kv.cells == 512 and kv.streams == 3
    assert kv.total == 512 * 3 * per_cell
    # More than the 1024 cells asked for: rounding per slot can round up.
    assert kv.cells * kv.streams > 1024


def test_per_slot_even_split():
    # 8192 over 4 slots: 2048 cells each, no rounding.
    assert kv_cells(8192, 4, False) == (2048, 4, 2048)


def test_unified_is_one_stream_of_the_whole_context():
    # unified: one stream, cells = pad(1000) = 1024, every slot may use all of it.
    cells, streams, per_slot = kv_cells(1000, 3, True)
    assert (cells, streams, per_slot) == (1024, 1, 1024)
    facts = _facts()
    per_cell = 8 * 2 * (512 // 32) * 64
    unified = kv_size(facts, ctx=1000, parallel=3, kv_unified=True)
    split = kv_size(facts, ctx=1000, parallel=3, kv_unified=False)
    assert unified.total == 1024 * per_cell
    assert split.total == 512 * 3 * per_cell
    assert unified.total < split.total


def test_unified_and_split_equal_when_no_rounding():
    facts = _facts()
    assert kv_size(facts, ctx=8192, parallel=4, kv_unified=True).total == kv_size(facts, ctx=8192, parallel=4).total


def test_parallel_below_one_is_an_error():
    with pytest.raises(MemoryModelError):
        kv_cells(4096, 0, False)


def test_gqa_counts_kv_heads_not_heads():
    # 32 layers, 8 KV heads x 128, f16: 32 * 2 * (1024 / 32 * 64) = 131072 bytes per cell.
    facts = _facts(n_layer=32, n_head=32, n_head_kv=(8,) * 32, head_dim_k=128, head_dim_v=128, n_embd=4096)
    assert kv_size(facts, ctx=8192).total == 8192 * 131072


def test_per_layer_kv_heads():
    # Layers with 0 KV heads hold no cache; other layers count their own head count.
    facts = _facts(n_layer=4, n_head_kv=(8, 4, 0, 2))
    per_head_row = (64 // 32) * 64  # f16 row of 64 values = 128 bytes
    assert kv_size(facts, ctx=1024).total == 1024 * 2 * per_head_row * (8 + 4 + 0 + 2)


# ------------------------------------------------------------------ sliding window (gemma3)


def _gemma_expected(*, cells: int, swa_cells: int, streams: int) -> int:
    # gemma3 tiny: 6 layers, 2 KV heads x 64 -> f16 row 128 values = 256 bytes, K+V = 512 per cell.
    per_cell_layer = 2 * (128 // 32) * 64
    return streams * per_cell_layer * (5 * swa_cells + 1 * cells)


def test_gemma3_facts_shape(gemma3):
    assert gemma3.n_swa == 512
    assert gemma3.swa_layers == (True, True, True, True, True, False)


def test_gemma3_swa_cache_single_slot(gemma3):
    # cells 4096; swa = pad(min(4096, 512 * 1 + 512), 256) = 1024
    kv = kv_size(gemma3, ctx=4096)
    assert (kv.cells, kv.streams, kv.swa_cells) == (4096, 1, 1024)
    assert kv.total == _gemma_expected(cells=4096, swa_cells=1024, streams=1)


def test_gemma3_swa_cache_split_slots(gemma3):
    # ctx 8192 over 4 streams: cells 2048; swa = pad(min(2048, 512 * 1 + 512)) = 1024 per stream
    kv = kv_size(gemma3, ctx=8192, parallel=4)
    assert (kv.cells, kv.streams, kv.swa_cells) == (2048, 4, 1024)
    assert kv.total == _gemma_expected(cells=2048, swa_cells=1024, streams=4)


def test_gemma3_swa_cache_unified(gemma3):
    # unified: cells 8192, one stream; swa = pad(min(8192, 512 * 4 + 512 = 2560)) = 2560
    kv = kv_size(gemma3, ctx=8192, parallel=4, kv_unified=True)
    assert (kv.cells, kv.streams, kv.swa_cells) == (8192, 1, 2560)
    assert kv.total == _gemma_expected(cells=8192, swa_cells=2560, streams=1)


def test_gemma3_swa_cache_capped_by_cells(gemma3):
    # ctx 768: swa = pad(min(768, 1024)) = 768, the same as the full cache
    kv = kv_size(gemma3, ctx=768)
    assert kv.swa_cells == 768
    assert kv.total == _gemma_expected(cells=768, swa_cells=768, streams=1)


def test_gemma3_swa_cache_follows_ubatch(gemma3):
    # n_ubatch 100: swa = pad(min(4096, 512 + 100 = 612)) = 768
    kv = kv_size(gemma3, ctx=4096, n_ubatch=100)
    assert kv.swa_cells == 768
    assert kv.total == _gemma_expected(cells=4096, swa_cells=768, streams=1)


def test_gemma3_swa_full(gemma3):
    kv = kv_size(gemma3, ctx=4096, swa_full=True)
    assert kv.swa_cells == 4096
    assert kv.total == _gemma_expected(cells=4096, swa_cells=4096, streams=1)


def test_gemma3_quantized_swa(gemma3):
    # q8_0 rows of 128 values: 4 blocks x 34 = 136 bytes, K and V
    kv = kv_size(gemma3, ctx=4096, type_k="q8_0", type_v="q8_0")
    assert kv.total == 2 * 136 * (5 * 1024 + 4096)


# ------------------------------------------------------------------ the shared (early 2025) layout


def test_shared_layout_one_stream():
    # one cache for all slots: cells = pad(1000) = 1024, per slot 1024 // 3 = 341
    assert kv_cells(1000, 3, False, "shared") == (1024, 1, 341)
    assert kv_cells(1000, 3, True, "shared") == (1024, 1, 341)
    facts = _facts()
    per_cell = 8 * 2 * (512 // 32) * 64
    assert kv_size(facts, ctx=1000, parallel=3, layout="shared").total == 1024 * per_cell


def test_shared_layout_has_no_swa_cache(gemma3):
    shared = kv_size(gemma3, ctx=4096, layout="shared")
    streams = kv_size(gemma3, ctx=4096, layout="streams")
    assert shared.swa_cells == 0
    assert shared.total == _gemma_expected(cells=4096, swa_cells=4096, streams=1)  # every layer full size
    assert shared.total > streams.total
    # 6 * 4096 vs 5 * 1024 + 4096 layer-cells
    assert shared.total * (5 * 1024 + 4096) == streams.total * 6 * 4096


def test_shared_layout_same_for_non_swa_single_slot(llama8):
    assert kv_size(llama8, ctx=32768, layout="shared").total == 512 * MIB


# ------------------------------------------------------------------ MLA


def test_mla_has_no_v_bytes(mla):
    assert mla.is_mla
    kv = kv_size(mla, ctx=4096)
    assert kv.v_bytes == 0
    # 4 layers x 1 KV head x 576 values, f16: 576 / 32 * 64 = 1152 bytes per cell per layer
    assert kv.k_bytes == 4 * 4096 * 1152
    assert kv.total == kv.k_bytes


def test_mla_quantized(mla):
    # q8_0: 576 / 32 * 34 = 612 bytes per cell per layer
    kv = kv_size(mla, ctx=4096, type_k="q8_0", type_v="q8_0")
    assert kv.k_bytes == 4 * 4096 * 612
    assert kv.v_bytes == 0


def test_non_mla_same_dims_has_v(mla):
    plain = ModelFacts(**{**{f: getattr(mla, f) for f in mla.__struct_fields__}, "is_mla": False})
    kv = kv_size(plain, ctx=4096)
    assert kv.v_bytes == 4 * 4096 * (512 // 32) * 64


# ------------------------------------------------------------------ recurrent / hybrid


def test_recurrent_layers_hold_no_kv_and_fixed_state():
    facts = _facts(
        n_layer=4,
        n_head_kv=(0, 8, 0, 8),
        recurrent_layers=(True, False, True, False),
        recurrent_bytes_per_seq=1_000_000,
    )
    kv = kv_size(facts, ctx=4096)
    assert kv.total == 4096 * 2 * 2 * (512 // 32) * 64  # two attention layers, K+V
    small = lane_memory(with_layers(facts), LaneShape(ctx=4096, parallel=2))
    large = lane_memory(with_layers(facts), LaneShape(ctx=65536, parallel=2))
    assert small.recurrent_bytes == large.recurrent_bytes == 2_000_000


# ------------------------------------------------------------------ Mixture of Experts


def test_expert_overrides_resolve_like_llama_server(tmp_path):
    from tinymodels import write_moe

    from shared.memory import LaneShape, PlacementError, lane_memory, placement_for
    from shared.memory.experts import cpu_expert_blocks, parse_override

    facts = read_model_facts(write_moe(tmp_path / "moe.gguf", n_layer=12))
    assert cpu_expert_blocks(facts, 3) == {0, 1, 2}
    assert cpu_expert_blocks(facts, 99) == set(range(12))
    assert cpu_expert_blocks(facts, 0, [parse_override("exps=CPU")]) == set(range(12))
    assert cpu_expert_blocks(facts, 0, [parse_override(r"blk\.(1[0-9])\.ffn_.*_exps\.=CPU")]) == {10, 11}
    assert cpu_expert_blocks(facts, 1, [parse_override(r"blk\.1\.ffn_.*_exps=cpu")]) == {0, 1}
    for bad in ("blk\\.1\\.=CPU", "ffn_down_exps=CPU", "exps=RPC0", "attn=CPU"):
        with pytest.raises(PlacementError):
            cpu_expert_blocks(facts, 0, [parse_override(bad)])
    with pytest.raises(PlacementError):
        parse_override("exps")
    full = lane_memory(facts, LaneShape(ctx=4096, n_gpu_layers="all", devices=("rpc",)))
    moe = LaneShape(ctx=4096, n_gpu_layers="all", devices=("rpc",), n_cpu_moe=4)
    assert placement_for(facts, moe).cpu_experts == {0, 1, 2, 3}
    half = lane_memory(facts, moe)
    moved = sum(ew.bytes for ew in facts.expert_weights[:4])
    assert full.devices[1].model_bytes - half.devices[1].model_bytes == moved
    assert half.devices[0].model_bytes >= moved  # mapped in RAM (with the blocks' other tensors between)
    assert half.kv_bytes == full.kv_bytes
    # experts of blocks already on the CPU do not move: -ngl 3 keeps blocks 0..9 there
    partial = placement_for(facts, LaneShape(ctx=4096, n_gpu_layers=3, devices=("rpc",), n_cpu_moe=12))
    assert partial.cpu_experts == {10, 11}


def test_experts_in_ram_on_cuda_charge_one_expert_copy_to_the_first_gpu(tmp_path):
    """Op offload: CUDA runs the prompt's expert matmuls of RAM-held blocks itself, from a copy."""
    from tinymodels import write_moe

    from shared.memory import LaneShape, lane_memory
    from shared.memory import placement_for
    from shared.memory.compute import op_offload_bytes

    facts = read_model_facts(write_moe(tmp_path / "moe.gguf", n_layer=6))
    for n_gpus in (1, 2):
        kw = dict(ctx=4096, n_gpu_layers="all", tensor_split=(1.0,) * n_gpus, n_cpu_moe=2)
        rpc = lane_memory(facts, LaneShape(devices=("rpc",) * n_gpus, **kw))
        cuda = lane_memory(facts, LaneShape(devices=("cuda",) * n_gpus, **kw))
        copy = -(-facts.expert_weights[0].cuda_bytes // 3)
        assert cuda.devices[1].compute_bytes == rpc.devices[1].compute_bytes + copy  # the first GPU only
        assert [d.compute_bytes for d in cuda.devices[2:]] == [d.compute_bytes for d in rpc.devices[2:]]
    # RPC devices have no op offload: one device's compute is what it is without experts in RAM (measured)
    one = dict(ctx=4096, n_gpu_layers="all", devices=("rpc",))
    assert lane_memory(facts, LaneShape(n_cpu_moe=2, **one)).compute_bytes == lane_memory(
        facts, LaneShape(**one)).compute_bytes  # fmt: skip
    tiny_batch = placement_for(facts, LaneShape(ctx=4096, n_gpu_layers="all", devices=("cuda",), n_cpu_moe=2))
    assert op_offload_bytes(facts, tiny_batch, 16) == 0  # batches under 32 tokens stay on the CPU
