"""shared.memory held against CUDA logs from public issue threads (tests/cuda_logs.py).

No GPU here: these lines are the only CUDA truth. Tolerances (issue 18): KV exact, model within
1%, compute within 5% or 16 MiB. A log that misses carries its measured error as a stated bound
with the reason, so a change that makes it worse fails.
"""

from __future__ import annotations

import pytest

from shared.memory import MIB, LaneShape, kv_size, lane_memory, place
from shared.messages.hosts import LayerWeights, ModelFacts
from cuda_logs import LOGS, CudaLog

BY_KEY = {log.key: log for log in LOGS}
Q6_K_BLOCK = (256, 210)  # values, bytes


def printed_bytes(mib: float) -> tuple[int, int]:
    """The byte range a line printed as `%.2f MiB` covers."""
    return round((mib - 0.005) * MIB), round((mib + 0.005) * MIB)


def same_as_printed(n_bytes: int, mib: float) -> bool:
    low, high = printed_bytes(mib)
    return low <= n_bytes <= high


def facts_for(log: CudaLog, block_bytes: int = 0, embd_bytes: int = 0) -> ModelFacts:
    s = log.shape
    n = s["n_layer"]
    layers = []
    if block_bytes:
        offset = embd_bytes
        layers.append(LayerWeights(-1, embd_bytes, embd_bytes, 0, embd_bytes))
        for il in range(n):
            layers.append(LayerWeights(il, block_bytes, block_bytes, offset, offset + block_bytes))
            offset += block_bytes
        layers.append(LayerWeights(n, 0, 0, offset, offset))
    return ModelFacts(
        path=f"/logs/{log.key}.gguf", name=log.key, architecture=s["architecture"], n_layer=n,
        n_embd=s.get("n_embd", 4096), n_head=s.get("n_head", 32), n_head_kv=(s["n_head_kv"],) * n,
        head_dim_k=s.get("head_dim_k", s.get("head_dim")), head_dim_v=s.get("head_dim_v", s.get("head_dim")), n_ctx_train=0, n_vocab=s.get("n_vocab", 0),
        n_ff=s.get("n_ff", 0), layer_weights=tuple(layers),
        tied_output_bytes=embd_bytes if s.get("tied_output") else 0,
        tied_output_cuda_bytes=embd_bytes if s.get("tied_output") else 0,
        n_expert=s.get("n_expert", 0), n_expert_used=s.get("n_expert_used", 0), n_ff_exp=s.get("n_ff_exp", 0),
    )  # fmt: skip


def layout_for(log: CudaLog) -> str:
    """Before b5913 (PR 14363) one KV stream held every slot; the excerpts without a build line are older."""
    return "streams" if (log.build or 0) >= 5913 else "shared"


def build_of(log: CudaLog) -> int:
    """The build whose rules apply: the printed one, else the first of the era the excerpt shows."""
    return log.build or int(log.era.split()[0].lstrip("b").split("-")[0])


HELD = [log for log in LOGS if not log.exclude and "kv" in log.printed]


@pytest.mark.parametrize("log", HELD, ids=lambda log: log.key)
def test_kv_per_device_is_exact(log: CudaLog):
    f, fl = facts_for(log), log.flags
    kv = kv_size(f, ctx=fl["ctx"], parallel=fl["parallel"], type_k=fl["type_k"], type_v=fl["type_v"],
                 layout=layout_for(log), n_ubatch=fl["n_ubatch"])  # fmt: skip
    if "kv_cells" in log.printed:
        assert kv.cells == log.printed["kv_cells"]
    for part, got in (("kv_k", kv.k_bytes), ("kv_v", kv.v_bytes), ("kv_total", kv.total)):
        if part in log.printed:
            assert same_as_printed(got, log.printed[part]), (part, got / MIB, log.printed[part])
    per_layer = {il: lk.k_bytes + lk.v_bytes for il, lk in enumerate(kv.layers)}
    split = fl.get("layers_per_device", (f.n_layer,))
    start = 0
    for dev, count in enumerate(split):
        got = sum(per_layer[il] for il in range(start, start + count))
        assert same_as_printed(got, log.printed["kv"][f"CUDA{dev}"]), (dev, got / MIB)
        start += count


def test_command_r_split_places_the_blocks_where_its_kv_lines_put_them():
    """The 12/28 split the KV lines show is llama.cpp's proportional split of 41 layers (blocks first)."""
    p = place(40, 41, (12, 29), rule="blocks_first", backends=("cuda", "cuda"))
    assert p.layers_on(0) == list(range(12)) and p.layers_on(1) == [*range(12, 40), 40]


def command_r_memory():
    log = BY_KEY["cmdr35b-2gpu-b24xx"]
    values, block = Q6_K_BLOCK
    embd = 256000 * 8192 // values * block  # token_embd as q6_K, from the shape alone
    per_block = round(log.printed["model"]["CUDA0"] * MIB / 12)  # derived: CUDA0's line / its blocks
    f = facts_for(log, block_bytes=per_block, embd_bytes=embd)
    fl = log.flags
    shape = LaneShape(ctx=fl["ctx"], parallel=1, flash_attn=False, layout="shared", n_ubatch=512, n_gpu_layers=41,
                      tensor_split=(12, 29), devices=fl["devices"], ngl_rule="blocks_first")  # fmt: skip
    return log, embd, lane_memory(f, shape)


def test_command_r_cpu_weights_are_the_token_embeddings_and_the_tied_output_is_copied_to_the_last_gpu():
    log, _, mem = command_r_memory()
    cpu, _, gpu1 = mem.devices
    assert same_as_printed(cpu.model_bytes, log.printed["model"]["CPU"])  # exact: q6_K token_embd
    # CUDA1: 28 blocks at CUDA0's per-block size + the token_embd copy. Known gap: the file's blocks are
    # not of one size (a K-quant mix gives some blocks wider types), so CUDA1 is 2.4% over; held at 3%.
    err = gpu1.model_bytes / (log.printed["model"]["CUDA1"] * MIB) - 1
    assert 0.02 < err < 0.03, err


def test_command_r_compute_on_the_first_gpu_is_a_known_gap_from_the_pipeline_copies_term():
    """b24xx without flash attention, pipeline parallelism with 4 copies (printed: n_copies=4).

    Known gap: 880 MiB predicted for 672.01 printed (+31%). The attention peak alone (mask, the f32
    scores of 64 heads over 4096 cells, FFN) is 664 MiB, 1.2% under the line; the rest is the
    pipeline term (3 more mask copies and 12 x n_embd x n_ubatch floats on the first device), fitted
    on RPC devices at b11434. The first pipeline-parallel builds (PR 6017, b2400s) did not reserve it
    on CUDA0, and one log cannot tell which later build began to: not modelled by build, held here."""
    log, _, mem = command_r_memory()
    got = mem.devices[1].compute_bytes
    want = log.printed["compute"]["CUDA0"] * MIB
    err = got / want - 1
    assert 0.30 < err < 0.32, err
    embd = 8192 * 512 * 4
    without_pipeline_term = got - 3 * 4096 * 512 * 4 - 12 * embd
    assert abs(without_pipeline_term - want) <= max(0.05 * want, 16 * MIB)


COMPUTE_HELD = ["qwen3-0.6b-q8kv-fa-b74xx", "qwen2.5-3b-b4701"]


@pytest.mark.parametrize("key", COMPUTE_HELD)
def test_single_gpu_compute_within_tolerance_with_the_builds_logits_reserve(key):
    """Both builds predate PR 23861: logits for all 512 ubatch tokens (296.75 MiB for Qwen's 151936
    tokens) plus the hidden state they come from. The current rule (slots' outputs) misses both."""
    log = BY_KEY[key]
    f, fl = facts_for(log, block_bytes=1), log.flags
    shape = LaneShape(ctx=fl["ctx"], parallel=fl["parallel"], type_k=fl["type_k"], type_v=fl["type_v"],
                      flash_attn=fl["flash_attn"], layout=layout_for(log), n_ubatch=fl["n_ubatch"],
                      n_gpu_layers="all", devices=fl["devices"], llama_build=build_of(log))  # fmt: skip
    mem = lane_memory(f, shape)
    for name, dev in (("CUDA_Host", mem.devices[0]), ("CUDA0", mem.devices[1])):
        want = log.printed["compute"][name] * MIB
        assert abs(dev.compute_bytes - want) <= max(0.05 * want, 16 * MIB), (name, dev.compute_bytes / MIB, want / MIB)
    assert same_as_printed(mem.devices[0].output_bytes, log.printed["output"]["CUDA_Host"])
    current = lane_memory(f, LaneShape(**{**shape.__dict__, "llama_build": 0}))
    want = log.printed["compute"]["CUDA0"] * MIB
    assert want - current.devices[1].compute_bytes > max(0.05 * want, 16 * MIB)  # the build rule is what fits


def test_deepseek_moe_blocks_are_one_size_on_every_gpu():
    """The model lines of the 8-GPU log: 8 and 7 blocks of one size (3167.31 MiB), within 0.01%."""
    model = BY_KEY["deepseek-r1-8gpu-q4k-b45xx"].printed["model"]
    per_block = model["CUDA2"] / 8
    assert abs(model["CUDA3"] / 7 / per_block - 1) < 1e-4


def test_qwen3_moe_partial_offload_places_30_blocks_on_the_gpu_and_the_output_on_the_cpu():
    log = BY_KEY["qwen3-30b-a3b-partial-b5466"]
    p = place(48, 30, (1,), rule="blocks_first", backends=("cuda",))
    assert p.offloaded == 30 and p.output_device == -1 and p.layers_on(0) == list(range(18, 48))
    assert log.printed["offloaded"] == f"{p.offloaded}/{48 + 1}"


def test_excluded_logs_say_why_and_every_log_names_its_thread_and_era():
    for log in LOGS:
        assert log.url.startswith("https://github.com/") and log.era
        assert log.build is None or log.build > 1000
    assert all(len(log.exclude) > 40 for log in LOGS if log.exclude)
