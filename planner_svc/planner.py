"""The pure lane planner: host reports + fleet config + demand -> one plan per host.

Deterministic (same inputs, byte-identical plans), no I/O, no clock. Every flag
llama-server gets is decided here (each lane's LaneSpec rendered by planner_svc/lane_specs.py)
and nowhere else; each decision leaves a reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from planner_svc.gc_pause import gc_paused
from planner_svc.lane_placing import place_lane
from planner_svc.kept_windows import keep_stable_windows
from planner_svc.lane_specs import lane_spec
from planner_svc.lane_windows import PlannedLane, cost_key, grow_windows, lane_cost, lane_id_for, size_prompt_caches
from planner_svc.layouts import CPU_RESOURCE, Resource
from planner_svc.policy import host_budgets, ram_pressed
from planner_svc.swa_full import choose_swa_full
from planner_svc.span_lanes import LaneKit, SpanBook, grow_spans, place_span
from planner_svc.threads import with_threads
from shared.llama.flags import lane_args
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import HostReport
from shared.messages.plans import FleetPlan, HostPlan, LaneSpec, Unplaced
from shared.messages.status import LaneFeedback

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
    lanes: dict[str, list[PlannedLane]] = {r.host_id: [] for r in reports}
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
            placed, why = place_lane(persona, candidates, config, lanes, remaining, previous, feedback)
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
            used = lane_cost(lane, lane.window, lane.span.report, config.n_ubatch)
            grow_budget[CPU_RESOURCE] -= used.get(CPU_RESOURCE, 0)
    single = [lane for lane in lanes if lane.span is None]
    specs: list[LaneSpec] = []
    if report.server is not None:

        def cost(lane: PlannedLane, window: int) -> dict[Resource, int]:
            return lane_cost(lane, window, report, config.n_ubatch)

        grow_windows(single, grow_budget, cost, [cost_key(lane, report, config.n_ubatch) for lane in single])
        pressed = ram_pressed(report, config)
        keep_stable_windows(single, grow_budget, cost, prev, config, report.server.has_kv_unified, pressed,
                            frozenset(report.serving_lanes))  # fmt: skip
        choose_swa_full(single, grow_budget, cost, config, report.server)
        # A span lane's cache stays 0: its host's RAM went to the lanes and what it lends.
        size_prompt_caches(single, grow_budget, cost, prev, config, report.server.has_cache_ram, pressed)
        busy = {fb.port: fb.detail for fb in feedback if fb.kind == "port_busy" and fb.port}
        specs, no_port = _assign_ports(report, [lane_spec(report, config, lane) for lane in lanes], prev, busy)
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
    backend): a plan an older planner wrote, which lacks them, asks for the same. Nor each
    lane's buddy, which the fleet decides after (planner_svc/slot_buddies.py)."""
    lanes = tuple(
        msgspec.structs.replace(
            s, layout=None, slot_buddy_host=None, slot_buddy_lane=None,
            memory=msgspec.structs.replace(
                s.memory, devices=tuple(msgspec.structs.replace(d, backend="") for d in s.memory.devices)
            ),
        )
        for s in plan.lanes
    )  # fmt: skip
    return msgspec.structs.replace(plan, lanes=lanes)


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


_KIT = LaneKit(PlannedLane, lane_cost, lane_id_for)  # what the span step (planner_svc.span_lanes) builds lanes with
