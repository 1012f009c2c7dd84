"""A placed lane -> its LaneSpec: every llama-server flag as the planner decided it, each with its
reason (window, pooling, projector, speculative decoding). Pure; planner_svc/planner.py calls it."""

from __future__ import annotations

from planner_svc.adapters import reranks
from planner_svc.lane_windows import PlannedLane, draft_layout, spec_n_gpu_layers
from planner_svc.layouts import pins_for
from planner_svc.policy import chat_template_for
from planner_svc.prompt_cache import MIB
from shared.memory import ngl_count
from shared.memory.projector import DYNAMIC_MAX_TOKENS, image_aspect_cap, image_tokens_cap
from shared.messages.config import FleetConfig
from shared.messages.hosts import HostReport
from shared.messages.plans import LaneSpec


def slot_window(window: int, total: int, kv_unified: bool, n_ctx_train: int) -> int:
    """Tokens one slot may hold. With --kv-unified every slot may use the whole cache, but
    llama-server caps a slot at the model's trained context (server-context.cpp: "the slot
    context exceeds the training context of the model - capping"), however large the cache."""
    if not kv_unified:
        return window
    return min(total, n_ctx_train) if n_ctx_train else total


def lane_spec(report: HostReport, config: FleetConfig, lane: PlannedLane) -> LaneSpec:
    caps = report.server
    report = lane.span.report if lane.span is not None else report  # a span sees its workers as devices
    memory = lane.memory(lane.window, report, config.n_ubatch)
    pins = pins_for(lane.layout, report)
    window_reason = f"window {lane.window} tokens per slot x {lane.persona.parallel} on {lane.device}: " + (
        "the ceiling" if lane.window == lane.ceiling else "the largest multiple of 256 that fits the budget"
    )
    reasons = [window_reason, *lane.reasons]
    reranking = reranks(lane.persona, lane.facts) and caps.has_reranking
    embeddings = not reranking and (
        lane.persona.embeddings if lane.persona.embeddings is not None else bool(lane.facts.pooling)
    )
    pooling = "mean" if embeddings and not lane.facts.pooling else None
    if reranking:
        asked = "the persona asks for it" if lane.persona.reranking else "the model declares rank pooling"
        reasons.append(f"reranking only (--reranking, /v1/rerank): {asked}")
    if embeddings:
        asked = "the persona asks for them" if lane.persona.embeddings else f"the model declares {lane.facts.pooling} pooling"
        reasons.append(f"embeddings only (--embeddings): {asked}" + ("; --pooling mean: the model declares none" if pooling else ""))
    kv_unified = lane.persona.kv_unified and caps.has_kv_unified
    cache_ram_mib = lane.cache_ram // MIB if caps.has_cache_ram else None
    keep_idle = kv_unified and config.slot_cache_bytes > 0 and caps.has_cache_idle_slots and cache_ram_mib != 0
    if keep_idle:
        reasons.append("--no-cache-idle-slots: with --kv-unified llama-server would empty every idle slot, a restored "
                       "one too, into the RAM prompt cache at each new task (and lose it where the cache is smaller); "
                       "they stay in the KV pool until a task needs the room")  # fmt: skip
    mmproj = lane.facts.mmproj if lane.loads_projector and caps.has_mmproj else None
    image_max_tokens = image_max_aspect = None
    if mmproj is not None:
        where = "GPU0, the lane's first device" if lane.layout.gpus else "host RAM"
        reasons.append(f"projector {mmproj.projector_type} (--mmproj {mmproj.path}) in {where}: "
                       f"{memory.projector_bytes / MIB:.1f} MiB of weights and compute")  # fmt: skip
        image_max_tokens = image_tokens_cap(mmproj) if caps.has_image_max_tokens else None
        if image_max_tokens is not None and mmproj.projector_type in DYNAMIC_MAX_TOKENS:
            reasons.append(f"--image-max-tokens {image_max_tokens}: the largest image its build takes, which the plan "
                           "holds (the buffer grows past the warm-up's at the first larger image)")  # fmt: skip
        elif image_max_tokens is not None:
            reasons.append(f"--image-max-tokens {image_max_tokens}: the warm-up's image, which the plan holds; a "
                           "larger image would grow the projector's buffer past it")  # fmt: skip
        image_max_aspect = image_aspect_cap(mmproj, image_max_tokens or 0)
        if image_max_aspect is not None:
            reasons.append(f"images up to {image_max_aspect}:1 (long side over short): the plan holds the largest "
                           "piece of those; gateways refuse longer ones, which llama.cpp would take past it")  # fmt: skip
    return LaneSpec(
        lane_id=lane.lane_id,
        model=lane.persona.model,
        model_path=lane.facts.path,
        alias=lane.persona.alias or lane.persona.model,
        port=report.port_base,  # placeholder until ports are assigned
        bind=report.lane_bind,
        ctx_total=lane.total_ctx(lane.window),
        ctx_per_slot=slot_window(lane.window, lane.total_ctx(lane.window), kv_unified, lane.facts.n_ctx_train),
        parallel=lane.persona.parallel,
        kv_unified=kv_unified,
        swa_full=lane.swa_full,
        cache_idle_slots=False if keep_idle else None,
        n_gpu_layers=spec_n_gpu_layers(lane),
        gpu_devices=pins.gpu_devices,
        device_names=pins.device_names,
        split_mode=pins.split_mode,
        main_gpu=pins.main_gpu,
        tensor_split=pins.tensor_split,
        rpc_servers=pins.rpc_servers,
        cache_type_k=lane.flags.cache_type_k,
        cache_type_v=lane.flags.cache_type_v,
        flash_attn=lane.flags.flash_attn,
        fit_off=caps.has_fit,
        n_ubatch=config.n_ubatch,
        memory=memory,
        reasons=tuple(reasons),
        layout=lane.layout,
        n_cpu_moe=lane.layout.n_cpu_moe,
        chat_template=chat_template_for(lane.facts, caps)[0],
        cache_ram_mib=cache_ram_mib,
        embeddings=embeddings,
        pooling=pooling,
        workers=lane.span_workers,
        adapters=tuple(a.name for a in lane.adapters),
        adapter_paths=tuple(a.path for a in lane.adapters),
        reranking=reranking,
        mmproj_path=mmproj.path if mmproj is not None else None,
        mmproj_offload=bool(lane.layout.gpus) if mmproj is not None else None,
        image_max_tokens=image_max_tokens,
        image_max_aspect=image_max_aspect,
        **_spec_fields(lane),
    )


def _spec_fields(lane: PlannedLane) -> dict:
    """LaneSpec's speculative decoding fields: the type, and the draft where the lane has one."""
    sp = lane.speculation
    if sp is None:
        return {}
    if sp.draft is None:
        return {"spec_type": sp.spec_type}
    layout = draft_layout(lane.layout)
    return {
        "spec_type": sp.spec_type, "draft_model": sp.draft.name, "draft_path": sp.draft.path,
        "draft_n_gpu_layers": ngl_count(layout.n_gpu_layers, sp.draft.n_layer) if layout.gpus else 0,
    }  # fmt: skip
