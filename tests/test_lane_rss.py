"""A lane's planned total covers the llama-server process's RSS once loaded (real binary, CPU).

RSS is what the kernel charges the process: the pages of the mapped model file it read, every
buffer it touched (KV cleared, weights repacked, compute pages the warm-up ran through), and what
the runtime and the tokenizer hold on the heap. The plan counts every buffer in full, and the
runtime plus the tokenizer's tables (shared.memory.overhead_bytes: n_vocab x 160 B); without the
tokenizer term a 262k-vocabulary lane with 4 slots ran past its plan (Gemma 3 270M, q8_0 cache,
32k x4: RSS 401-406 MiB against 394 planned), see docs/memory-model.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest
from tinymodels import write_llama

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from measure import load_and_stop  # noqa: E402

from shared.gguf_facts import read_model_facts  # noqa: E402
from shared.memory import MIB, LaneShape, lane_memory  # noqa: E402

SHAPES = [(32768, 4, "q8_0", "on"), (8192, 1, "f16", "on"), (8192, 4, "f16", "on")]


def _rss_at_load(binary: str, model: Path, ctx: int, parallel: int, cache: str, fa: str) -> int:
    loaded = load_and_stop(
        binary,
        ["-m", str(model), "-c", str(ctx), "-np", str(parallel), "-ctk", cache, "-ctv", cache, "-fa", fa, "-ngl", "0",
         "-fit", "off", "--cache-ram", "0"],
        on_loaded=lambda pid: {"rss": psutil.Process(pid).memory_info().rss},
    )  # fmt: skip
    assert loaded.ok, loaded.lines[-5:]
    return loaded.extra["rss"]


@pytest.fixture(scope="module")
def vocab_262k(tmp_path_factory) -> Path:
    return write_llama(tmp_path_factory.mktemp("rss") / "llama_v262k.gguf", n_layer=2, n_embd=64, n_head=2,
                       n_head_kv=1, head_dim=32, n_ff=128, n_vocab=262144, n_ctx_train=65536)  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"c{s[0]}x{s[1]}-{s[2]}-fa{s[3]}")
def test_planned_total_covers_rss_at_load_gemma(llama_server, gemma_model, shape):
    ctx, parallel, cache, fa = shape
    facts = read_model_facts(gemma_model)
    planned = lane_memory(facts, LaneShape(ctx=ctx, parallel=parallel, type_k=cache, type_v=cache, flash_attn=fa == "on"))
    rss = _rss_at_load(llama_server, gemma_model, ctx, parallel, cache, fa)
    assert planned.total_bytes >= rss, (planned.total_bytes / MIB, rss / MIB)


def test_planned_total_covers_rss_at_load_262k_vocabulary(llama_server, vocab_262k):
    """Tiny weights, a 262k vocabulary: the tokenizer's tables are most of the process."""
    facts = read_model_facts(vocab_262k)
    planned = lane_memory(facts, LaneShape(ctx=4096, parallel=1, flash_attn=True))
    rss = _rss_at_load(llama_server, vocab_262k, 4096, 1, "f16", "on")
    assert planned.total_bytes >= rss, (planned.total_bytes / MIB, rss / MIB)
    # and the tokenizer term is what makes it: without it the plan is short of the process
    assert planned.total_bytes - facts.n_vocab * 160 < rss, (planned.total_bytes / MIB, rss / MIB)
