"""Which blocks keep their expert tensors in RAM: --n-cpu-moe N and -ot PATTERN=CPU, as llama.cpp reads them.

Pure. llama-server turns `--n-cpu-moe N` into one override per block i < N,
`blk\\.i\\.ffn_(up|down|gate|gate_up)_(ch|)exps` -> the CPU buffer type (common/arg.cpp), and
load_tensors matches every override pattern with std::regex_search against each tensor's name;
a tensor overridden to the CPU goes to the CPU's buffer list (mapped, or repacked when its
kernels repack it). The memory model predicts overrides that move whole blocks' expert tensors
to the CPU (the recipes people use: `exps=CPU`, `blk\\.(1[0-9])\\.ffn_.*_exps\\.=CPU`); a pattern
that would move other tensors, or to another device, is refused rather than mispredicted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from shared.memory.placement import PlacementError
from shared.messages.hosts import ModelFacts

EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# Names of a block's other tensors (llama-arch.cpp): an override must leave them where they are.
_OTHER_SUFFIXES = (
    "attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
    "attn_q_norm.weight", "attn_k_norm.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_sinks.weight",
    "post_attention_norm.weight", "ffn_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias",
    "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "ffn_gate_inp_shexp.weight",
    "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "exp_probs_b.bias",
)  # fmt: skip
_GLOBAL_NAMES = ("token_embd.weight", "output_norm.weight", "output.weight")


def parse_override(text: str) -> tuple[str, str]:
    """`PATTERN=BUFFER` as -ot/--override-tensor takes it (the last '=' splits)."""
    pattern, sep, buffer = text.rpartition("=")
    if not sep or not pattern or not buffer:
        raise PlacementError(f"--override-tensor {text!r}: use PATTERN=BUFFER_TYPE, e.g. exps=CPU")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise PlacementError(f"--override-tensor {text!r}: bad pattern ({exc})") from None
    return pattern, buffer


def n_cpu_moe_patterns(n: int) -> list[str]:
    """The overrides llama-server builds for --n-cpu-moe n (llm_ffn_exps_block_regex)."""
    return [rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps" for i in range(n)]


def cpu_expert_blocks(facts: ModelFacts, n_cpu_moe: int = 0, overrides: Sequence[tuple[str, str]] = ()) -> frozenset[int]:
    """Blocks (with experts) whose expert tensors --n-cpu-moe and the overrides keep in RAM."""
    if n_cpu_moe < 0:
        raise PlacementError(f"--n-cpu-moe {n_cpu_moe}: use a count of blocks")
    with_experts = {ew.layer for ew in facts.expert_weights}
    patterns = [re.compile(p) for p in n_cpu_moe_patterns(n_cpu_moe)]
    for pattern, buffer in overrides:
        if buffer.upper() != "CPU":
            raise PlacementError(f"-ot {pattern}={buffer}: only overrides to CPU are predicted")
        compiled = re.compile(pattern)
        moved = [n for n in _GLOBAL_NAMES if compiled.search(n)]
        for il in range(facts.n_layer):
            moved += [f"blk.{il}.{s}" for s in _OTHER_SUFFIXES if compiled.search(f"blk.{il}.{s}")]
            hits = [compiled.search(f"blk.{il}.{s}") is not None for s in EXPERT_SUFFIXES]
            if any(hits) and not all(hits) and il in with_experts:
                raise PlacementError(f"-ot {pattern}=CPU moves only some of block {il}'s experts: not predicted")
        if moved:
            raise PlacementError(f"-ot {pattern}=CPU moves {moved[0]}, not only expert tensors: not predicted")
        patterns.append(compiled)
    return frozenset(
        il for il in with_experts if any(p.search(f"blk.{il}.{EXPERT_SUFFIXES[0]}") for p in patterns)
    )
