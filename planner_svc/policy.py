"""Planner policy: what each lane may be. Budgets, the flags with their safety rules,
window bounds, and the corrections the hosts' feedback calls for. Pure functions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from planner_svc.layouts import CPU_RESOURCE
from shared.llama.flags import cache_pair, effective_cache_type, needs_flash_attn
from shared.llama.chat_templates import builtin_template
from shared.llama.flash_attn import FlashAttn, resolve_flash_attn
from shared.memory import CTX_PAD, QUANTIZED
from shared.messages.config import FleetConfig, Persona
from shared.messages.hosts import HostReport, ModelFacts, ServerCaps
from shared.messages.status import LaneFeedback

DEFAULT_CTX_CEILING = 131072


# ------------------------------------------------------------------ budgets


def ram_headroom(report: HostReport, config: FleetConfig) -> int:
    return config.headroom_bytes + int(config.headroom_fraction * report.ram_total)


def ram_budget(report: HostReport, config: FleetConfig) -> int:
    """RAM lanes may use: what is free plus what our own lanes hold, less headroom."""
    usable = min(report.ram_total, report.ram_available + report.lanes_rss + report.workers_rss)
    return max(0, usable - ram_headroom(report, config))


def ram_pressed(report: HostReport, config: FleetConfig) -> bool:
    """The host's free RAM is below the headroom: what runs (lanes' buffers and what their caches
    filled, and everything else) no longer leaves it. Limits are lowered only then."""
    return report.ram_available < ram_headroom(report, config)


GPU_RESERVE = 256 * 1024 * 1024  # per GPU, beyond the headroom fraction: driver, display, fragmentation


def gpu_budgets(report: HostReport, config: FleetConfig) -> dict[int, int]:
    """VRAM lanes may use on each GPU: what is free plus what our own lanes hold there, less headroom.

    A GPU's own `lanes_vram` is what this host's lanes hold on it; older agents sent only
    the host-wide total, which is credited to a host's single GPU.
    """
    if not config.use_gpu or not report.gpus:
        return {}
    per_gpu = [g.lanes_vram for g in report.gpus]
    if not any(per_gpu) and report.lanes_vram and len(report.gpus) == 1:
        per_gpu = [report.lanes_vram]
    budgets = {}
    for i, gpu in enumerate(report.gpus):
        usable = min(gpu.vram_total, gpu.vram_free + per_gpu[i])
        budgets[i] = max(0, usable - int(config.headroom_fraction * gpu.vram_total) - GPU_RESERVE)
    return budgets


def host_budgets(report: HostReport, config: FleetConfig) -> dict:
    """Bytes lanes may use per resource: RAM (CPU_RESOURCE) and each GPU (("gpu", i))."""
    out: dict = {CPU_RESOURCE: ram_budget(report, config)}
    out.update({("gpu", i): b for i, b in gpu_budgets(report, config).items()})
    return out


# ------------------------------------------------------------------ flags


@dataclass(frozen=True)
class Flags:
    cache_type_k: str | None
    cache_type_v: str | None
    flash_attn: str | None
    reasons: tuple[str, ...]


def decide_flags(
    config: FleetConfig, report: HostReport, facts: ModelFacts, feedback: Sequence[LaneFeedback] = ()
) -> Flags:
    """Cache types and flash attention for one lane, with every safety rule applied."""
    assert report.server is not None
    return _decide_flags(config, report.server, facts.is_mla, facts.head_dim_k, facts.head_dim_v, tuple(feedback))


@functools.lru_cache(maxsize=4096)
def _decide_flags(
    config: FleetConfig, caps: ServerCaps, is_mla: bool, head_dim_k: int, head_dim_v: int,
    feedback: tuple[LaneFeedback, ...],
) -> Flags:
    """decide_flags over what it reads (the planner asks it twice per lane and host)."""
    reasons: list[str] = []
    k = config.kv_cache_type_k or config.kv_cache_type
    v = config.kv_cache_type_v or config.kv_cache_type
    fa = config.flash_attn
    if k or v:
        reasons.append(f"cache types {cache_pair(k, v)} from fleet config")

    for fb in feedback:
        if fb.kind == "unsupported" and (k, v) == (fb.cache_type_k, fb.cache_type_v) and (k or v):
            reasons.append(
                f"f16 cache: llama-server refused {cache_pair(k, v)} here ({fb.detail or 'unsupported'})"
            )
            k = v = None
    for name, value in (("K", k), ("V", v)):
        if value is not None and value not in caps.cache_types:
            reasons.append(f"f16 {name} cache: this host's llama-server does not list {value}")
    k = k if k in caps.cache_types else None
    v = v if v in caps.cache_types else None
    if is_mla and v is not None and v != k:
        reasons.append(f"V cache type follows K ({effective_cache_type(k)}): MLA models need matching types")
        v = k
    quantized = {t for t in (k, v) if t in QUANTIZED}
    if quantized and (head_dim_k % 32 or head_dim_v % 32):
        reasons.append("f16 cache: head dimension is not a multiple of the 32-value quantization block")
        k = v = None
        quantized = set()
    if needs_flash_attn(v) and fa != "on":
        reasons.append("flash attention on: a quantized V cache requires it")
        fa = "on"
    if caps.flash_attn_form == "switch" and fa in ("off", "auto"):
        reasons.append(f"no flash-attn flag: this build takes a bare switch and has no '{fa}' (default off)")
        fa = None
    if fa is not None and not any("flash attention on" in r for r in reasons):
        reasons.append(f"flash attention {fa} from fleet config")
    return Flags(k, v, fa, tuple(reasons))


def flash_attn_for(flags: Flags, report: HostReport, gpus: Sequence[int], facts: ModelFacts) -> FlashAttn:
    """Flash attention as this host's llama-server will run the lane, on the devices it uses
    (`auto` resolved per backend: shared.llama.flash_attn)."""
    backends = tuple(report.gpus[g].backend or "unknown" for g in gpus)
    return resolve_flash_attn(
        flags.flash_attn, report.server, backends, facts, effective_cache_type(flags.cache_type_k),
        effective_cache_type(flags.cache_type_v),
    )  # fmt: skip


def chat_template_for(facts: ModelFacts, caps: ServerCaps | None) -> tuple[str | None, str | None]:
    """(--chat-template name, reason) for a file without its own template; (None, None) otherwise."""
    if facts.has_chat_template:
        return None, None
    name = builtin_template(facts)
    if name is None:
        return None, "no chat template in the file: llama-server's ChatML fallback"
    if caps is not None and not caps.has_chat_template:
        return None, f"no chat template in the file, and this llama-server has no --chat-template for {name!r}"
    return name, (
        f"chat template {name} ({facts.architecture}): the file has none, and llama-server's ChatML fallback"
        " would leak <|im_end|> into answers"
    )


def window_bounds(persona: Persona, facts: ModelFacts, feedback: Sequence[LaneFeedback]) -> tuple[int, int, list[str]]:
    reasons = []
    trained = facts.n_ctx_train or DEFAULT_CTX_CEILING
    ceiling = min(persona.ctx_max or trained, trained)
    for fb in feedback:
        if fb.kind == "oom" and fb.ctx_total:
            cap = max(CTX_PAD, fb.ctx_total // persona.parallel // 2)
            if cap < ceiling:
                ceiling = cap
                reasons.append(f"window capped at {cap}: the lane ran out of memory at {fb.ctx_total} total")
    ceiling = ceiling // CTX_PAD * CTX_PAD
    floor = -(-persona.ctx_min // CTX_PAD) * CTX_PAD
    if floor > ceiling:
        reasons.append(f"window floor lowered from {floor} to {ceiling} (trained context / ceiling)")
        floor = ceiling
    return floor, ceiling, reasons


def correction(feedback: Sequence[LaneFeedback]) -> tuple[float, list[str]]:
    factor, reasons = 1.0, []
    for fb in feedback:
        if fb.kind == "over_plan" and fb.planned_bytes and fb.actual_bytes > fb.planned_bytes:
            ratio = fb.actual_bytes / fb.planned_bytes
            if ratio > factor:
                factor = ratio
    if factor > 1.0:
        reasons.append(f"sized {factor:.2f}x larger: the host measured more than planned")
    return factor, reasons


def revert_target(config, report, facts, persona, lane_id, feedback) -> tuple[Flags, int, int, list[str]] | None:
    """A change broke this lane: (flags, floor, ceiling) of the spec it last ran healthy with.

    Applies while the config still asks for what failed; a new config gets its own try.
    """
    requested = decide_flags(config, report, facts)
    for fb in feedback:
        good = fb.last_good
        if good is None or fb.lane_id != lane_id:
            continue
        if (fb.cache_type_k, fb.cache_type_v) != (requested.cache_type_k, requested.cache_type_v):
            continue
        if good.model_path != facts.path or good.parallel != persona.parallel:
            continue
        if any(t is not None and t not in report.server.cache_types for t in (good.cache_type_k, good.cache_type_v)):
            continue
        window = good.ctx_total // good.parallel
        reason = (
            f"reverted to the spec that last ran healthy ({cache_pair(good.cache_type_k, good.cache_type_v)},"
            f" window {window}): the change failed: {fb.detail or fb.kind}"
        )
        return Flags(good.cache_type_k, good.cache_type_v, good.flash_attn, (reason,)), window, window, []
    return None
