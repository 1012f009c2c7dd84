"""What a llama-server process holds in RAM beyond its buffers: the runtime and the tokenizer's tables."""

from __future__ import annotations

from shared.memory.kv import MIB
from shared.messages.hosts import ModelFacts


# What a llama-server process holds beyond its buffers (runtime, libraries, HTTP server):
# measured 20-23 MiB of RSS above weights + KV on CPU builds (bench/results.md).
PROCESS_OVERHEAD = 32 * MIB
# The tokenizer's host memory, per vocabulary token (src/llama-vocab.cpp, llama_vocab::impl):
# id_to_token's token_data (std::string text, float score, attr: 40 B), token_to_id's hash node
# (std::string key, id, cached hash, next pointer: a 64 B malloc chunk) and its bucket (8 B),
# cache_token_to_piece's std::string (32 B), plus heap text for the pieces longer than the 15 bytes
# a std::string holds inline: 160 B. Measured: RSS grows 157 B a token from 259 to 262,144 tokens.
VOCAB_BYTES_PER_TOKEN = 160


def overhead_bytes(facts: ModelFacts) -> int:
    """What the process holds in RAM beyond its buffers: the runtime (PROCESS_OVERHEAD) and the
    tokenizer's tables, n_vocab x VOCAB_BYTES_PER_TOKEN (40 MiB for a 262k vocabulary: without it a
    Gemma 3 lane's RSS at load passed its plan once its slots' KV, all touched, replaced compute)."""
    return PROCESS_OVERHEAD + facts.n_vocab * VOCAB_BYTES_PER_TOKEN
