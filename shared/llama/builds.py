"""What a llama-server build accepts, from its build number alone: for planning without the binary
(`lanes estimate --llama-build N`). Pure.

A binary's own --help is the authority (shared.llama.flags.parse_caps); these thresholds are the
releases where each rule changed, read off the llama.cpp pull requests (approximate to a few
builds where the merge and the release differ):
- b5913 (Jul 2025, PR 14363): one KV stream per slot, the separate sliding-window cache, -kvu.
- b6100 (Aug 2025, PR 15077): --n-cpu-moe / --cpu-moe.
- b6325 (Aug 2025): -fa on|off|auto, default auto (before: a bare switch, default off).
- b7400 (Dec 2025): -ngl puts the output layer first (auto/all accepted) and -fit.
"""

from __future__ import annotations

from shared.messages import ServerCaps

KV_STREAMS_BUILD = 5913
N_CPU_MOE_BUILD = 6100
FA_VALUE_BUILD = 6325
OUTPUT_FIRST_BUILD = 7400


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
