"""What a llama-server build accepts, from its build number alone: for planning without the binary
(`lanes estimate --llama-build N`). Pure.

A binary's own --help is the authority (shared.llama.flags.parse_caps); these thresholds are the
releases where each rule changed, read off the llama.cpp pull requests (approximate to a few
builds where the merge and the release differ):
- b5913 (Jul 2025, PR 14363): one KV stream per slot, the separate sliding-window cache, -kvu.
- b6100 (Aug 2025, PR 15077): --n-cpu-moe / --cpu-moe.
- b6325 (Aug 2025): -fa on|off|auto, default auto (before: a bare switch, default off).
- b7400 (Dec 2025): -ngl puts the output layer first (auto/all accepted) and -fit.
- ~b9380 (May 29 2026, PR 23764, commit 031ddb2e0): with flash attention the KQ mask is f16 (before: f32).
- ~b9400 (Jun 1 2026, PR 23861, commit de6f727aa): llama-server reserves logits for its slots' outputs
  (n_outputs_max); before, the prompt graph reserved logits for every ubatch token (n_vocab x n_ubatch
  floats). Both commits lie between b9341 and b9518; b9272 (May 22) still reserved every token
  (issue 23527). The exact release is not known here, hence the round numbers.
"""

from __future__ import annotations

from shared.messages.hosts import ServerCaps

KV_STREAMS_BUILD = 5913
N_CPU_MOE_BUILD = 6100
FA_VALUE_BUILD = 6325
OUTPUT_FIRST_BUILD = 7400
FA_F16_MASK_BUILD = 9380
LOGITS_SLOTS_BUILD = 9400


def caps_for_build(build: int) -> ServerCaps:
    """The capabilities a build of this number has (what --help would list)."""
    if build < 1:
        raise ValueError(f"build {build}: a llama.cpp build number is positive (b6325 -> 6325)")
    streams = build >= KV_STREAMS_BUILD
    output_first = build >= OUTPUT_FIRST_BUILD
    return ServerCaps(
        build=build,
        version=f"version: {build} (planned from the build number)",
        flash_attn_form="value" if build >= FA_VALUE_BUILD else "switch",
        has_fit=output_first,
        has_kv_unified=streams,
        has_swa_full=streams,
        kv_layout="streams" if streams else "shared",
        ngl_rule="output_first" if output_first else "blocks_first",
        has_n_cpu_moe=build >= N_CPU_MOE_BUILD,
    )


def reserves_logits_per_token(build: int) -> bool:
    """Whether this build's prompt graph reserves logits for every ubatch token (0: current build)."""
    return 0 < build < LOGITS_SLOTS_BUILD


def fa_mask_is_f16(build: int) -> bool:
    """Whether this build's flash-attention KQ mask is f16 (0: current build)."""
    return not 0 < build < FA_F16_MASK_BUILD
