"""Placement of wakes, a phase of planning with demand (planner_svc/demand.py): room for a woken
persona, and the idle lanes a wake evicts when it fits nowhere.

Each round plans the fleet with the woken placed after the lanes that run now; the oldest wake
the plan could not place gets its room per host (`room_on`, at its floor window), and
`eviction.choose` picks the lanes to unload (through the agent's drain). The evicted lanes keep
their count, so the next round places them on another host where there is room. Pure: the
state in, a new state, the plan and the decisions out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import msgspec

from planner_svc.coldstart import predicted_seconds
from planner_svc.demand_state import DemandState
from planner_svc.eviction import Candidate, NoRoom, Placement, Room, choose
from planner_svc.layouts import CPU_RESOURCE, Layout, cost_vector
from planner_svc.personas import persona_for
from planner_svc.planner import plan
from planner_svc.policy import host_budgets
from planner_svc.waking import effective
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import HostReport
from shared.messages.plans import FleetPlan, HostPlan, LaneSpec
from shared.messages.status import LaneFeedback

MAX_ROUNDS = 4  # evict-and-replan rounds per job


def _cost(spec: LaneSpec, report: HostReport) -> dict:
    """A lane's fixed bytes per resource. Its prompt cache is left out: the planner gives caches
    the RAM the lanes leave, so a newcomer shrinks them and never needs an eviction for them."""
    layout = spec.layout or (Layout("gpu", spec.gpu_devices, (), spec.n_gpu_layers) if spec.gpu_devices else Layout())
    try:
        cost = cost_vector(spec.memory, layout, report)
    except (IndexError, KeyError):
        cost = {CPU_RESOURCE: spec.memory.total_bytes}
    cost[CPU_RESOURCE] = max(0, cost.get(CPU_RESOURCE, 0) - spec.memory.prompt_cache_bytes)
    return cost


def room_on(
    report: HostReport,
    config: FleetConfig,
    woken: Persona,
    host_plan: HostPlan | None,
    personas: Sequence[Persona],
    feedback: Sequence[LaneFeedback],
) -> tuple[Room, dict[str, dict]]:
    """What the woken persona's lane needs on this host at its floor window, what is free there
    with the host's lanes at their floors (as the planner judges a fit), and what each lane frees."""
    host = report.host_id
    floor = msgspec.structs.replace(woken, lanes=1, ctx_max=woken.ctx_min, min_lanes=0)
    alone = plan([report], config, Demand(personas=(floor,)), feedback={host: feedback})
    specs = alone.hosts[0].lanes if alone.hosts else ()
    if not specs:
        why = "; ".join(u.reason for u in (*alone.unplaced, *(alone.hosts[0].unplaced if alone.hosts else ())))
        return Room(host, {}, None, why or "does not fit"), {}
    needs = _cost(specs[0], report)
    lanes = host_plan.lanes if host_plan else ()
    counts: dict[str, int] = {}
    for spec in lanes:
        counts[spec.alias] = counts.get(spec.alias, 0) + 1
    at_floor = []
    for name, n in sorted(counts.items()):
        p = persona_for(personas, name)
        spec = next(s for s in lanes if s.alias == name)
        ctx_min = p.ctx_min if p else spec.ctx_total // spec.parallel  # its window per slot, shared or not
        at_floor.append(Persona(model=spec.model, alias=spec.alias, lanes=n, parallel=spec.parallel,
                                kv_unified=spec.kv_unified, ctx_min=ctx_min, ctx_max=ctx_min,
                                priority=p.priority if p else 0))  # fmt: skip
    frees: dict[str, dict] = {s.lane_id: _cost(s, report) for s in lanes}
    if at_floor:
        probe = plan([report], config, Demand(personas=tuple(at_floor)), previous={host: host_plan} if host_plan else None,
                     feedback={host: feedback}, first=[p.model for p in at_floor])  # fmt: skip
        for s in probe.hosts[0].lanes if probe.hosts else ():
            if s.lane_id in frees:
                frees[s.lane_id] = _cost(s, report)
    have = host_budgets(report, config)
    used: dict = {}
    for cost in frees.values():
        for r, b in cost.items():
            used[r] = used.get(r, 0) + b
    free = {r: b - used.get(r, 0) for r, b in have.items()}
    return Room(host, free, needs), frees


def _rooms_and_candidates(woken, fleet, reports, config, personas, feedback, state, now):
    """For each host holding the woken model: its Room, and the lanes there as eviction Candidates."""
    plans_now = {h.host_id: h for h in fleet.hosts}
    busy = state.busy(now)
    rooms, candidates = [], []
    for report in reports:
        if not any(m.name == woken.model for m in report.models):
            continue
        host = report.host_id
        room, frees = room_on(report, config, woken, plans_now.get(host), personas, feedback.get(host, ()))
        rooms.append(room)
        sizes = {m.path: m.file_bytes for m in report.models}
        for spec in plans_now[host].lanes if host in plans_now else ():
            p = persona_for(personas, spec.alias)
            # The residency counts from when it served; a lane still loading is as new.
            loaded = state.healthy_at.get((host, spec.lane_id), now)
            candidates.append(Candidate(
                host_id=host, lane_id=spec.lane_id, model=spec.alias, frees=frees.get(spec.lane_id, {}),
                priority=p.priority if p else 0, last_used=state.last_used.get(spec.alias, loaded),
                loaded_at=loaded, busy=bool(busy.get(spec.alias)), pinned=bool(p and p.min_lanes),
                load_seconds=_load_seconds(state, spec, sizes.get(spec.model_path), host),
            ))  # fmt: skip
    return rooms, candidates


def _load_seconds(state: DemandState, spec: LaneSpec, file_bytes: int | None, host: str) -> float | None:
    """What loading the lane cost: its model's measured load, else the prediction from its file
    size and the host's read rate (planner_svc/coldstart.py); None where neither is known."""
    if state.measured.get(spec.alias):
        return state.measured[spec.alias]
    return predicted_seconds(file_bytes, state.rates.get(host)) if file_bytes else None


def placed_names(fleet: FleetPlan) -> set[str]:
    return {s.alias for h in fleet.hosts for s in h.lanes}


def plan_with(state, personas, reports, config, previous, feedback, config_revision) -> FleetPlan:
    """The fleet planned with demand as `state` shapes it (planner_svc/waking.py's `effective`)."""
    eff, shown, first = effective(state, personas, reports, previous)
    return plan(shown, config, eff, previous=previous, feedback=feedback, config_revision=config_revision, first=first)


@dataclass(frozen=True)
class WakesPlaced:
    state: DemandState  # evicted personas on demand, keeping their count, left out where they ran
    fleet: FleetPlan
    previous: Mapping[str, HostPlan]  # the plans the job started from, less the evicted lanes
    failed: Mapping[str, str] = field(default_factory=dict)  # persona name -> why its wake failed
    waiting: Mapping[str, str] = field(default_factory=dict)  # persona name -> why it waits
    evicted: int = 0
    victims: tuple[tuple[str, str, str], ...] = ()  # (host, lane, reason)


def place_wakes(
    state: DemandState,
    personas: Sequence[Persona],
    reports: Sequence[HostReport],
    config: FleetConfig,
    previous: Mapping[str, HostPlan],
    feedback: Mapping[str, Sequence[LaneFeedback]],
    config_revision: int,
    now: float,
    chooser=choose,
) -> WakesPlaced:
    """Plan, evicting for the oldest unplaced wake, for at most MAX_ROUNDS rounds."""
    failed: dict[str, str] = {}
    waiting: dict[str, str] = {}
    evicted = 0
    victims_log: list[tuple[str, str, str]] = []
    for round_ in range(MAX_ROUNDS + 1):
        fleet = plan_with(state, personas, reports, config, previous, feedback, config_revision)
        placed = placed_names(fleet)
        pending = [n for n in state.waiting_order() if n not in placed and n not in failed]
        for n in pending[1:]:
            waiting.setdefault(n, f"waits behind {pending[0]}")  # retried while it waits
        if not pending:
            break
        name = pending[0]
        if round_ == MAX_ROUNDS:
            waiting.setdefault(name, f"no room yet after {MAX_ROUNDS} rounds of eviction")
            break
        woken = persona_for(personas, name)
        rooms, candidates = _rooms_and_candidates(woken, fleet, reports, config, personas, feedback, state, now)
        choice = chooser(rooms, candidates, now=now, min_residency=config.min_residency,
                         waited=now - state.first_wake(name), priority=woken.priority)  # fmt: skip
        if isinstance(choice, NoRoom):
            (failed if choice.failed else waiting)[name] = choice.reason
            if not choice.failed:
                break  # the oldest wake waits; younger ones wait behind it (no queue jumping)
            continue
        assert isinstance(choice, Placement)
        if not choice.victims:
            why = [u.reason for h in fleet.hosts for u in h.unplaced if u.model == woken.model] + [
                u.reason for u in fleet.unplaced if u.model == woken.model
            ]
            waiting[name] = "the planner could not place it: " + (why[0] if why else "no reason given")
            break
        lanes_now = {(h.host_id, s.lane_id): s for h in fleet.hosts for s in h.lanes}
        counts, on_demand, excluded = dict(state.counts), set(state.on_demand), dict(state.excluded)
        for host, lane_id in choice.victims:
            spec = lanes_now[(host, lane_id)]
            # It keeps its count: where another host has room, the next round places it there.
            counts.setdefault(spec.alias, sum(1 for s in lanes_now.values() if s.alias == spec.alias))
            on_demand.add(spec.alias)
            excluded[spec.model] = excluded.get(spec.model, frozenset()) | {host}
            victims_log.append((host, lane_id, f"evicted for {name}"))
        state = replace(state, counts=counts, on_demand=frozenset(on_demand), excluded=excluded)
        evicted += len(choice.victims)
        # The evicted lanes leave `previous`' count of what runs (the next round sees them gone).
        gone = set(choice.victims)
        previous = {h: msgspec.structs.replace(p, lanes=tuple(s for s in p.lanes if (h, s.lane_id) not in gone))
                    if any((h, s.lane_id) in gone for s in p.lanes) else p for h, p in previous.items()}  # fmt: skip
    return WakesPlaced(state=state, fleet=fleet, previous=previous, failed=failed, waiting=waiting, evicted=evicted,
                       victims=tuple(victims_log))  # fmt: skip
