"""The compute buffer of a pooled lane (--embeddings, --reranking). Pure.

With pooling every token of a ubatch is an output, so the worst-case graph llama.cpp reserves
computes the logits of all n_ubatch tokens (n_vocab x n_ubatch f32) while the masks and the
residual stream are still held: a 32k-vocabulary model's CPU compute buffer goes from 5.52 to
66.02 MiB (b11434, measured for mean and rank pooling, 1 and 4 slots: tests/test_adapters.py).
"""

from __future__ import annotations

from shared.llama.builds import fa_mask_is_f16
from shared.memory.kv import KvSize
from shared.memory.placement import CPU, Placement
from shared.messages.hosts import ModelFacts


def pooled_compute(facts: ModelFacts, placement: Placement, shape, kv: KvSize, compute: list[int]) -> list[int]:
    """`compute` with the output device's peak raised to the pooled outputs' logits, masks and residual."""
    if not shape.pooled:
        return compute
    n_tokens = min(shape.n_ubatch, kv.cells * kv.streams)
    mask_width = 2 if shape.flash_attn and fa_mask_is_f16(shape.llama_build) else 4
    masks = kv.cells * n_tokens * mask_width + (kv.swa_cells * n_tokens * mask_width if kv.swa_cells else 0)
    embd = facts.n_embd * n_tokens * 4
    logits = facts.n_vocab * n_tokens * 4
    dev = placement.output_device
    resid = 5 * embd if dev == CPU else 4 * embd
    out = list(compute)
    out[1 + dev] = max(out[1 + dev], masks + resid + logits)
    return out
