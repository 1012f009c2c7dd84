"""Which matrix weights a CPU backend repacks into its CPU_REPACK buffer (ggml-cpu/repack.cpp).

Shared by hardware detection (what this host's CPU repacks, reported to the planner) and the
memory model (a repacked matrix is a copy in RAM, not a mapping of the file).
"""

from __future__ import annotations

from collections.abc import Sequence

# x86 with AVX2 (ggml_repack_get_optimal_repack_type): "TYPE:rows", rows the multiple the row count needs.
AVX2_REPACK = ("Q4_0:8", "Q4_K:8", "IQ4_NL:8", "MXFP4:8")
AVX512_REPACK = (*AVX2_REPACK, "Q2_K:8")
NEON_I8MM_REPACK = ("Q4_0:4", "Q4_K:8", "Q5_K:8", "Q6_K:8", "IQ4_NL:4", "MXFP4:4", "Q8_0:4", "Q1_0:4")
NEON_DOTPROD_REPACK = NEON_I8MM_REPACK


def repack_rule(cpu_repack: Sequence[str] | None) -> dict[str, int]:
    """{"Q4_K": 8, ...} from a host's report (None: assume x86 AVX2)."""
    rule = {}
    for item in AVX2_REPACK if cpu_repack is None else cpu_repack:
        name, _, rows = item.partition(":")
        rule[name] = int(rows or 1)
    return rule
