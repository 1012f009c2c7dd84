"""The pure lane planner: host reports + fleet config + demand -> one plan per host.

Deterministic (same inputs, byte-identical plans), no I/O, no clock. Every flag
llama-server gets is decided here and nowhere else; each decision leaves a reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from planner_svc.adapters import reranks
from planner_svc.gc_pause import gc_paused
from planner_svc.lane_placing import _place
from planner_svc.lane_windows import _COST_KEYS, _cost, _grow_memo, _keep_stable, _Lane, _n_gpu_layers, _prompt_caches, draft_layout, lane_id_for
from planner_svc.layouts import CPU_RESOURCE, Resource, pins_for
from planner_svc.policy import chat_template_for, host_budgets
from planner_svc.prompt_cache import MIB
from planner_svc.span_lanes import LaneKit, SpanBook, grow_spans, place_span
from planner_svc.threads import with_threads
from shared.llama.flags import lane_args
from shared.memory import ngl_count
from shared.messages import (
    Demand,
    FleetConfig,
    FleetPlan,
    HostPlan,
    HostReport,
    LaneFeedback,
    LaneSpec,
    Persona,
    Unplaced,
)

# ------------------------------------------------------------------ the planner


def default_demand(reports: Sequence[HostReport]) -> Demand:
    """No demand given: every model found is served, one lane on each host holding it."""
    names = sorted({m.name for r in reports for m in r.models})
    return Demand(personas=tuple(Persona(model=n) for n in names))


@gc_paused  # a large replan makes no cycles; collections would walk every object it holds
def plan(
    reports: Sequence[HostReport],
    config: FleetConfig,
    demand: Demand | None = None,
    *,
    previous: Mapping[str, HostPlan] | None = None,
    feedback: Mapping[str, Sequence[LaneFeedback]] | None = None,
    config_revision: int = 0,
    first: Sequence[str] = (),
) -> FleetPlan:
    """`first`: models placed before all others, in this order (on demand: the lanes that run,
    then the woken models), so a newcomer never takes a running lane's room unasked."""
    previous = previous or {}
    feedback = feedback or {}
    reports = sorted({r.host_id: r for r in reports}.values(), key=lambda r: r.host_id)
    if demand is None or not demand.personas:
        demand = default_demand(reports)
    rank = {m: i for i, m in reversed(list(enumerate(first)))}
    personas = sorted(demand.personas, key=lambda p: (rank.get(p.model, len(first)), -p.priority, p.model, p.alias or ""))

    host_reasons: dict[str, list[str]] = {r.host_id: [] for r in reports}
    host_unplaced: dict[str, list[Unplaced]] = {r.host_id: [] for r in reports}
    fleet_unplaced: list[Unplaced] = []
    remaining: dict[str, dict[Resource, int]] = {}
    for r in reports:
        remaining[r.host_id] = host_budgets(r, config)
        if r.server is None:
            host_reasons[r.host_id].append("no lanes: no usable llama-server binary on this host")
    lanes: dict[str, list[_Lane]] = {r.host_id: [] for r in reports}
    span_book = SpanBook()
    deferred = []  # (persona, candidates, why, target host) of lanes that fit no single host

    holding: dict[str, list] = {}  # model name -> [(host, its facts)], hosts in order
    for r, m in ((r, m) for r in reports if r.server is not None for m in r.models):
        holding.setdefault(m.name, []).append((r, m))
    for persona in personas:
        holders = list(holding.get(persona.model, ()))
        if not holders:
            fleet_unplaced.append(Unplaced(model=persona.model, reason="no host with a llama-server holds this model"))
            continue
        wanted = len(holders) if persona.lanes is None else persona.lanes
        for i in range(wanted):
            candidates = holders if persona.lanes is not None else [holders[i]]
            placed, why = _place(persona, candidates, config, lanes, remaining, previous, feedback)
            if not placed:
                target = candidates[0][0].host_id if len(candidates) == 1 else None
                deferred += [(persona, candidates, why, target)] * (wanted - i if persona.lanes is not None else 1)
                if persona.lanes is not None:
                    break

    # Spans last: a lane across hosts takes what the single-host lanes left at their floors.
    failed_spans: set[str] = set()
    for persona, candidates, why, target in deferred:
        if persona.model in failed_spans:
            continue  # one unplaced entry for the lanes of a persona no span takes
        if persona.lanes is not None or not span_book.has(persona.model):
            placed, span_why = place_span(
                persona, candidates, reports, config, lanes, remaining, previous, feedback, span_book, _KIT
            )
            if placed:
                continue
            why = f"{why}; {span_why}" if span_why else why
            if persona.lanes is not None:
                failed_spans.add(persona.model)
        entry = Unplaced(model=persona.model, reason=why)
        (host_unplaced[target] if target else fleet_unplaced).append(entry)
    grow_spans(span_book, remaining, config, _KIT)

    plans = []
    for r in reports:
        plans.append(
            _host_plan(
                r,
                config,
                lanes[r.host_id],
                host_reasons[r.host_id],
                host_unplaced[r.host_id],
                previous.get(r.host_id),
                config_revision,
                feedback.get(r.host_id, ()),
                span_book,
            )
        )
    return FleetPlan(hosts=tuple(plans), unplaced=tuple(fleet_unplaced))


def _host_plan(
    report, config, lanes, reasons, unplaced, prev: HostPlan | None, config_revision, feedback=(), span_book=None
) -> HostPlan:
    budgets = host_budgets(report, config)
    span_book = span_book or SpanBook()
    # Memory lent to other hosts' span lanes, and this host's own span lanes (their windows were
    # chosen when they were placed), come off before the other lanes grow.
    grow_budget = dict(budgets)
    grow_budget[CPU_RESOURCE] = grow_budget.get(CPU_RESOURCE, 0) - span_book.lent.get(report.host_id, 0)
    for lane in lanes:
        if lane.span is not None:
            used = _cost(lane, lane.window, lane.span.report, config.n_ubatch)
            grow_budget[CPU_RESOURCE] -= used.get(CPU_RESOURCE, 0)
    single = [lane for lane in lanes if lane.span is None]
    specs: list[LaneSpec] = []
    if report.server is not None:

        def cost(lane: _Lane, window: int) -> dict[Resource, int]:
            return _cost(lane, window, report, config.n_ubatch)

        _grow_memo(single, grow_budget, cost, [_COST_KEYS.key(lane, report, config.n_ubatch) for lane in single])
        _keep_stable(single, grow_budget, cost, prev, config, report.server.has_kv_unified)
        # A span lane's cache stays 0: its host's RAM went to the lanes and what it lends.
        _prompt_caches(single, grow_budget, cost, prev, config, report.server.has_cache_ram)
        busy = {fb.port: fb.detail for fb in feedback if fb.kind == "port_busy" and fb.port}
        specs, no_port = _assign_ports(report, [_spec(report, config, lane) for lane in lanes], prev, busy)
        specs = with_threads(report, config, specs, prev)
        if not report.renders_argv:  # an agent too old to render argv itself reads it from the plan
            specs = [msgspec.structs.replace(s, args=lane_args(s, report.server)) for s in specs]
        reasons = list(reasons) + [
            f"port {port} is given to no lane: taken by another program on this host" for port in sorted(busy)
        ]
        unplaced = list(unplaced) + [
            Unplaced(
                model=s.model, reason=f"no free port in {report.port_base}..{report.port_base + report.port_count - 1}"
            )
            for s in no_port
        ]
    draft = HostPlan(
        host_id=report.host_id,
        plan_revision=0,
        config_revision=config_revision,
        budget_ram=budgets[CPU_RESOURCE],
        budget_gpu=sum(b for r, b in budgets.items() if r[0] == "gpu"),
        budget_gpus=tuple(budgets.get(("gpu", i), 0) for i in range(len(report.gpus))),
        max_restarts=config.max_restarts_per_host,
        drain_timeout=config.drain_timeout,
        slot_cache_bytes=config.slot_cache_bytes,
        lane_log_max_bytes=config.lane_log_max_bytes, lane_log_files=config.lane_log_files,
        lanes=tuple(specs),
        unplaced=tuple(unplaced),
        reasons=tuple(reasons),
        rpc_workers=tuple(sorted(span_book.specs.get(report.host_id, ()), key=lambda w: (w.port, w.lane_id))),
    )
    if prev is None:
        return msgspec.structs.replace(draft, plan_revision=1)
    # Budgets drift with every report; a plan is rewritten only when what it asks for changes.
    comparable = msgspec.structs.replace(
        prev,
        plan_revision=0,
        config_revision=config_revision,
        budget_ram=draft.budget_ram,
        budget_gpu=draft.budget_gpu,
        budget_gpus=draft.budget_gpus,
        planned_by="",
    )
    if _asked(comparable) == _asked(draft):
        return (
            prev
            if prev.config_revision == config_revision
            else msgspec.structs.replace(prev, config_revision=config_revision)
        )
    return msgspec.structs.replace(draft, plan_revision=prev.plan_revision + 1)


def _asked(plan: HostPlan) -> HostPlan:
    """The plan without what follows from the rest of it (each lane's layout, each device's
    backend): a plan an older planner wrote, which lacks them, asks for the same."""
    lanes = tuple(
        msgspec.structs.replace(
            s, layout=None,
            memory=msgspec.structs.replace(
                s.memory, devices=tuple(msgspec.structs.replace(d, backend="") for d in s.memory.devices)
            ),
        )
        for s in plan.lanes
    )  # fmt: skip
    return msgspec.structs.replace(plan, lanes=lanes)


def _spec(report: HostReport, config: FleetConfig, lane: _Lane) -> LaneSpec:
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
    mmproj = lane.facts.mmproj if lane.loads_projector and caps.has_mmproj else None
    if mmproj is not None:
        where = "GPU0, the lane's first device" if lane.layout.gpus else "host RAM"
        reasons.append(f"projector {mmproj.projector_type} (--mmproj {mmproj.path}) in {where}: "
                       f"{memory.projector_bytes / MIB:.1f} MiB of weights and compute")  # fmt: skip
    return LaneSpec(
        lane_id=lane.lane_id,
        model=lane.persona.model,
        model_path=lane.facts.path,
        alias=lane.persona.alias or lane.persona.model,
        port=report.port_base,  # placeholder until ports are assigned
        bind=report.lane_bind,
        ctx_total=lane.total_ctx(lane.window),
        ctx_per_slot=lane.window if not lane.persona.kv_unified else lane.total_ctx(lane.window),
        parallel=lane.persona.parallel,
        kv_unified=lane.persona.kv_unified and caps.has_kv_unified,
        n_gpu_layers=_n_gpu_layers(lane),
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
        cache_ram_mib=lane.cache_ram // MIB if caps.has_cache_ram else None,
        embeddings=embeddings,
        pooling=pooling,
        workers=lane.span_workers,
        adapters=tuple(a.name for a in lane.adapters),
        adapter_paths=tuple(a.path for a in lane.adapters),
        reranking=reranking,
        mmproj_path=mmproj.path if mmproj is not None else None,
        mmproj_offload=bool(lane.layout.gpus) if mmproj is not None else None,
        **_spec_fields(lane),
    )


def _spec_fields(lane: _Lane) -> dict:
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


def _assign_ports(
    report: HostReport, specs: list[LaneSpec], prev: HostPlan | None, busy: Mapping[int, str] | None = None
) -> tuple[list[LaneSpec], list[LaneSpec]]:
    """Keep each lane's previous port; give new lanes the lowest free port in the host's range.

    Ports the host said another program holds (`busy`) are given to no lane: a lane
    that had one moves to a free port (the host plan's reasons say why).
    """
    busy = busy or {}
    allowed = range(report.port_base, min(report.port_base + report.port_count, 65536))  # ports end at 65535
    before = {s.lane_id: s.port for s in prev.lanes} if prev else {}
    taken: set[int] = set(busy)
    ports: dict[str, int] = {}
    for spec in specs:
        port = before.get(spec.lane_id)
        if port in allowed and port not in taken:
            ports[spec.lane_id] = port
            taken.add(port)
    out, dropped = [], []
    for spec in specs:
        port = ports.get(spec.lane_id)
        if port is None:
            port = next((p for p in allowed if p not in taken), None)
            if port is None:
                dropped.append(spec)
                continue
            taken.add(port)
        out.append(msgspec.structs.replace(spec, port=port))
    return out, dropped


_KIT = LaneKit(_Lane, _cost, lane_id_for)  # what the span step (planner_svc.span_lanes) builds lanes with
