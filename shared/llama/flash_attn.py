"""How llama-server resolves `--flash-attn auto` (its default since the value form, b6325): pure.

llama_context::sched_reserve (b11434) reserves a graph with flash attention, then looks at
every FLASH_ATTN_EXT node: if any lands on a device other than its layer's KV device (the
backend's supports_op refused it: head size, K/V types), flash attention is turned off
("layer N is assigned to device X but the Flash Attention tensor is assigned to device Y");
else on ("Flash Attention was auto, set to enabled"). So `auto` is per backend and model:

- CPU (and RPC devices, which run the CPU backend's kernels): every shape: on.
- CUDA / ROCm (ggml-cuda fattn.cu, ggml_cuda_get_best_fattn_kernel, default build without
  GGML_CUDA_FA_ALL_QUANTS): head size K = V in {40,64,72,80,96,112,128,256}, or the MLA-style
  pairs 192/128, 320/256, 512/512, 576/512 (grouped heads: 8, 32, 2, 2 per KV head); K and V of one type
  (or K q8_0 with V q4_0), each of f32, f16, bf16, q8_0, q4_0.
- Metal (ggml-metal supports_op): head size in {32,40,48,64,72,80,96,112,128,192,256,320,512,576},
  K and V of one type among f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1.
- Other backends (Vulkan, SYCL, ...): not modelled: taken as off, which over-sizes the compute
  buffer rather than under-sizing it.
With a quantized V cache, `auto` is forced on ("enabling flash_attn since it is required for
quantized V cache"). Switch-era builds (bare `-fa`) default to off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.messages.hosts import ModelFacts, ServerCaps

_CUDA_SAME_HEAD = frozenset({40, 64, 72, 80, 96, 112, 128, 256})
# K head -> (the V head it needs, what the heads per KV head must be a multiple of; >= 2 always)
_CUDA_PAIRS = {192: (128, 8), 320: (256, 32), 512: (512, 1), 576: (512, 1)}
_CUDA_TYPES = frozenset({"f32", "f16", "bf16", "q8_0", "q4_0"})
_METAL_HEADS = frozenset({32, 40, 48, 64, 72, 80, 96, 112, 128, 192, 256, 320, 512, 576})
_METAL_TYPES = frozenset({"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"})
CPU_KERNEL_BACKENDS = frozenset({"cpu", "rpc"})
_QUANTIZED = frozenset({"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"})


@dataclass(frozen=True)
class FlashAttn:
    on: bool
    reason: str


def _cuda_refuses(facts: ModelFacts, type_k: str, type_v: str) -> str | None:
    dk, dv = facts.head_dim_k, facts.head_dim_v
    n_kv = max(facts.n_head_kv or (0,)) or 1
    gqa = facts.n_head // n_kv if facts.n_head else 1
    if dk in _CUDA_SAME_HEAD:
        if dv != dk:
            return f"head sizes K {dk} / V {dv} differ"
    elif dk in _CUDA_PAIRS:
        need_v, multiple = _CUDA_PAIRS[dk]
        if dv != need_v or gqa < 2 or gqa % multiple:
            return f"head sizes K {dk} / V {dv} with {gqa} heads per KV head have no kernel"
    else:
        return f"no kernel for head size {dk}"
    if type_k != type_v and (type_k, type_v) != ("q8_0", "q4_0"):
        return f"no kernel for K {type_k} with V {type_v}"
    bad = [t for t in (type_k, type_v) if t not in _CUDA_TYPES]
    return f"no kernel for {bad[0]} K/V" if bad else None


def _metal_refuses(facts: ModelFacts, type_k: str, type_v: str) -> str | None:
    if facts.head_dim_k not in _METAL_HEADS:
        return f"no kernel for head size {facts.head_dim_k}"
    if type_k != type_v:
        return f"no kernel for K {type_k} with V {type_v}"
    return None if type_k in _METAL_TYPES else f"no kernel for {type_k} K/V"


def resolve_flash_attn(
    flag: str | None, caps: ServerCaps, backends: Sequence[str], facts: ModelFacts | None, type_k: str, type_v: str
) -> FlashAttn:
    """Whether llama-server runs with flash attention, and why. `backends`: those of the devices
    holding the lane's layers ("cpu" for the host; () for a CPU-only lane); None flag: no flag passed."""
    if flag == "on":
        return FlashAttn(True, "flash attention on (asked)")
    if flag == "off":
        return FlashAttn(False, "flash attention off (asked)")
    if caps.flash_attn_form != "value":
        return FlashAttn(False, "flash attention off: this build's default (bare -fa switch era)")
    if type_v in _QUANTIZED:
        return FlashAttn(True, f"flash attention auto forced on: the {type_v} V cache requires it")
    for backend in dict.fromkeys(backends or ("cpu",)):
        if backend in CPU_KERNEL_BACKENDS:
            continue
        if facts is None:
            return FlashAttn(False, f"flash attention auto taken as off on {backend}: model unknown")
        if backend in ("cuda", "rocm"):
            why = _cuda_refuses(facts, type_k, type_v)
        elif backend == "metal":
            why = _metal_refuses(facts, type_k, type_v)
        else:
            why = "its kernels are not modelled (the compute buffer is sized for off)"
        if why:
            return FlashAttn(False, f"flash attention auto resolves to off on {backend}: {why}")
    where = "/".join(dict.fromkeys(backends or ("cpu",)))
    return FlashAttn(True, f"flash attention auto resolves to on ({where} has kernels for this model)")
