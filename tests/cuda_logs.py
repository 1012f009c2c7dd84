"""CUDA buffer lines from public issue threads: the only CUDA truth this project has (no GPU here).

Each record is one llama-server / llama-cli / llama-bench start as its log printed it: the thread,
the build (or the era when the excerpt shows no `build:` line), the model's shape as print_info (or
the file's public config, where the excerpt lacks print_info: said in `shape_from`), the flags the
log shows, and the buffer lines in MiB as printed (two decimals). tests/test_cuda_logs.py holds
shared.memory's prediction against each.

Where the excerpt lacks per-tensor sizes, per-layer weights are derived from the printed model
buffer of one device (`derived`): that device's model line then checks nothing, the others do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1024 * 1024


@dataclass(frozen=True)
class CudaLog:
    key: str
    url: str
    build: int | None  # the `build: N` line; None when the excerpt has none (era says when)
    era: str
    program: str  # llama-server, llama-cli, llama-bench (or the fork it came from)
    shape: dict  # ModelFacts fields as the log (or the public config) gives them
    shape_from: str
    flags: dict  # ctx, parallel, type_k, type_v, flash_attn, n_gpu_layers, n_ubatch, devices, layers per device
    printed: dict  # "model"/"kv"/"compute"/"output" -> {device: MiB}, "kv_total" etc.
    derived: str = ""
    notes: str = ""
    exclude: str = ""  # why it is recorded but not held against the prediction
    extra: dict = field(default_factory=dict)


LOGS: tuple[CudaLog, ...] = (
    CudaLog(
        key="cmdr35b-2gpu-b24xx",
        url="https://github.com/ggml-org/llama.cpp/pull/6122",
        build=None,
        era="b2400-b2460 (March 2024, the PR's review: before KV streams, pipeline parallelism new)",
        program="llama-server/llama-cli (the PR thread; main-style log)",
        shape=dict(
            architecture="command-r", n_layer=40, n_embd=8192, n_head=64, n_head_kv=64, head_dim=128,
            n_vocab=256000, n_ff=22528, tied_output=True, token_embd_type="q6_K",
        ),
        shape_from="c4ai-command-r-v01's public config (freq_base 8e6 and 41 layers as printed identify it)",
        flags=dict(ctx=4096, parallel=1, type_k="f16", type_v="f16", flash_attn=False, n_gpu_layers=41,
                   n_ubatch=512, devices=("cuda", "cuda"), layers_per_device=(12, 28), pipeline_copies=4),
        printed={
            "model": {"CPU": 1640.62, "CUDA0": 5434.38, "CUDA1": 13989.53},
            "kv": {"CUDA0": 1536.00, "CUDA1": 3584.00},
            "kv_total": 5120.00,
            "output": {"CUDA_Host": 1.95},
            "compute": {"CUDA0": 672.01},  # CUDA1 and CUDA_Host are cut off in the excerpt
        },
        derived="per-block weights: CUDA0's 5434.38 MiB over its 12 blocks",
        notes="RTX 4070 Ti + RTX 3090 Ti; the 12/28 split is what the KV lines print (3 x 128 MiB per block)",
    ),
    CudaLog(
        key="qwen3-0.6b-q8kv-fa-b74xx",
        url="https://github.com/ggml-org/llama.cpp/issues/18258",
        build=7406,
        era="b7406+ (December 2025: 'Major performance drop since b7406'; before PR 23861)",
        program="llama-server",
        shape=dict(architecture="qwen3", n_layer=28, n_embd=1024, n_head=16, n_head_kv=8, head_dim=128,
                   n_vocab=151936, n_ff=3072),
        shape_from="Qwen3-0.6B's public config: its 28 layers, 8 x 128 KV width and 151936 tokens are what the "
        "KV line (28 layers, 587.56 MiB of q8_0 K over 20224 cells) and the output line (0.58 MiB) print; "
        "n_ctx_train 32768 points at the Embedding/Reranker-0.6B variant of the same shape",
        flags=dict(ctx=20224, parallel=1, type_k="q8_0", type_v="q8_0", flash_attn=True, n_gpu_layers="all",
                   n_ubatch=512, devices=("cuda",)),
        printed={
            "kv": {"CUDA0": 1175.12},
            "kv_k": 587.56,
            "kv_v": 587.56,
            "kv_cells": 20224,
            "output": {"CUDA_Host": 0.58},
            "compute": {"CUDA0": 298.75, "CUDA_Host": 41.51},
        },
        notes="CUDA0 compute = logits for all 512 ubatch tokens (296.75) + the normed hidden state (2.00); "
        "CUDA_Host = the f32 mask of 20224 x 512 (39.50) + 2.01",
    ),
    CudaLog(
        key="qwen2.5-3b-b4701",
        url="https://github.com/SciSharp/LLamaSharp/issues/1099",
        build=4701,
        era="b4701 (February 2025; the comment's llama-cli run prints `build: 4701 (be3bbd62)`)",
        program="LLamaSharp (bundled llama.cpp) beside llama-cli b4701",
        shape=dict(architecture="qwen2", n_layer=36, n_embd=2048, n_head=16, n_head_kv=2, head_dim=128,
                   n_vocab=151936, n_ff=11008),
        shape_from="Qwen2.5-3B's public config: the log's 36 layers of n_embd_k_gqa 256 and its 0.58 MiB output "
        "buffer (151936 tokens) match it",
        flags=dict(ctx=4096, parallel=1, type_k="f16", type_v="f16", flash_attn=False, n_gpu_layers="all",
                   n_ubatch=512, devices=("cuda",)),
        printed={
            "kv": {"CUDA0": 144.00},
            "kv_k": 72.00,
            "output": {"CUDA_Host": 0.58},
            "compute": {"CUDA0": 300.75, "CUDA_Host": 12.01},
        },
        notes="ctx 4096 is what 144 MiB of f16 KV over 36 layers of width 256 holds (the excerpt has no n_ctx "
        "line); CUDA0 compute = logits of 512 tokens (296.75) + hidden state (4.00)",
    ),
    CudaLog(
        key="deepseek-r1-8gpu-q4k-b45xx",
        url="https://github.com/ggml-org/llama.cpp/issues/9390",
        build=None,
        era="b4500-b4700 (early 2025: llama_init_from_model, llama_kv_cache_init, before MLA caches)",
        program="llama-server",
        shape=dict(architecture="deepseek2", n_layer=61, n_head_kv=128, head_dim_k=192, head_dim_v=128,
                   n_expert=256, n_expert_used=8),
        shape_from="DeepSeek-V3/R1's public config (61 layers, 128 heads of K 192 = 128 + 64 rope, V 128); "
        "the log prints n_layer = 61 and n_ctx_train 163840",
        flags=dict(ctx=16384, parallel=8, type_k="q4_0", type_v="f16", flash_attn=False, n_gpu_layers=62,
                   n_ubatch=256, devices=("cuda",) * 8, layers_per_device=(8, 8, 8, 7)),
        printed={
            "model": {"CUDA2": 25338.47, "CUDA3": 22171.16, "CUDA4": 25338.47, "CUDA5": 25338.47,
                      "CUDA6": 25338.47, "CUDA7": 19728.83},
            "kv": {"CUDA0": 5824.00, "CUDA1": 5824.00, "CUDA2": 5824.00, "CUDA3": 5096.00},
        },
        notes="8 slots over one shared 16384-cell cache; K q4_0 and V f16 differ; the later devices' lines are "
        "cut off in the excerpt. Model lines: 25338.47 / 8 blocks and 22171.16 / 7 blocks agree to 0.01 MiB "
        "(3167.31 MiB per MoE block)",
    ),
    CudaLog(
        key="qwen3-30b-a3b-partial-b5466",
        url="https://github.com/ggml-org/llama.cpp/issues/13729",
        build=5466,
        era="b5466 (May 2025: before KV streams, -ngl counts blocks first)",
        program="llama-server",
        shape=dict(architecture="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                   n_vocab=151936, n_expert=128, n_expert_used=8, n_ff_exp=768),
        shape_from="Qwen3-30B-A3B's public config (the excerpt prints n_vocab tokens and 49 layers)",
        flags=dict(ctx=4096, parallel=1, n_gpu_layers=30, n_ubatch=512, devices=("cuda",)),
        printed={"model": {"CUDA0": 10750.86, "CPU_Mapped": 6940.48}, "offloaded": "30/49"},
        derived="per-block weights: CUDA0's 10750.86 MiB over its 30 blocks",
        notes="placement check: 30 blocks on CUDA0, the output layer on the CPU (b5466 counts blocks first)",
    ),
    CudaLog(
        key="glm4-32b-ik-fa",
        url="https://github.com/ikawrakow/ik_llama.cpp/pull/344",
        build=None,
        era="ik_llama.cpp fork, April 2025 (llama.cpp's single-stream KV of that time)",
        program="ik_llama.cpp llama-server",
        shape=dict(architecture="glm4", n_layer=61, n_embd=6144, n_head=48, n_head_kv=2, head_dim=128,
                   n_vocab=151552, n_ff=23040),
        shape_from="print_info of the same model in ikawrakow/ik_llama.cpp#370 (glm4, 61 layers, n_head_kv 2)",
        flags=dict(ctx=32768, parallel=1, type_k="f16", type_v="f16", flash_attn=True, n_gpu_layers=62,
                   n_ubatch=512, devices=("cuda",)),
        printed={"model": {"CPU": 471.75, "CUDA0": 16303.48}, "kv": {"CUDA0": 1952.00}},
        notes="a fork: KV only (its compute graph is not llama.cpp's)",
    ),
    CudaLog(
        key="glm4-32b-ik-nofa-8k",
        url="https://github.com/ikawrakow/ik_llama.cpp/pull/333",
        build=None,
        era="ik_llama.cpp fork, April 2025",
        program="ik_llama.cpp llama-server",
        shape=dict(architecture="glm4", n_layer=61, n_embd=6144, n_head=48, n_head_kv=2, head_dim=128,
                   n_vocab=151552, n_ff=23040),
        shape_from="as glm4-32b-ik-fa",
        flags=dict(ctx=8192, parallel=1, type_k="f16", type_v="f16", flash_attn=False, n_gpu_layers=62,
                   n_ubatch=512, devices=("cuda",)),
        printed={"model": {"CPU": 499.50, "CUDA0": 17284.05}, "kv": {"CUDA0": 1952.00}, "output": {"CUDA_Host": 0.58}},
        exclude="ctx 8192 printed with the 32768-cell KV of the other run (1952.00 MiB): the excerpt's ctx line "
        "is not the context its cache was built for, so it cannot be held against a prediction",
    ),
)
