"""Models on demand: which personas the planner places now, what a wake evicts, what idles out.

Pure: the service folds wakes and gateway activity into a `DemandState` with its own clock
value, and `plan_on_demand` turns a snapshot of it into one fleet plan and an `Outcome` the
service applies. Nothing here reads a clock, the bus or a file.

The rules, by persona name (its alias, or its model's name; what a lane spec calls alias):
- A persona is *default-on* until it is first unloaded: planned exactly as before (today's
  behaviour and the golden plans are untouched while no one opts in).
- Once unloaded (evicted, or idle past its `idle_ttl`) it is *on demand*: it keeps the lanes
  it has, and gets one (or its `lanes`) only when woken. Model files no persona names, when
  a demand is set, are on demand from the start.
- A wake places the persona with the lanes that run now placed first and the woken next, so a
  newcomer never takes a running lane's room; where it fits nowhere, `eviction.choose` picks
  the idle lanes to unload (through the agent's drain), and the plan is made again.
- `min_lanes` pins: the persona always has that many lanes and none is evicted or idles out.
- `max_lanes`: lanes added by measured demand (planner_svc/scaling.py) come on top of the
  persona's count; one the plan cannot place is taken back (it never evicts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass, field, fields

import msgspec

from planner_svc.coldstart import measured_loads, predicted_seconds, read_rates
from planner_svc.eviction import Candidate, NoRoom, Placement, Room, choose
from planner_svc.layouts import CPU_RESOURCE, Layout, cost_vector
from planner_svc.planner import default_demand, plan
from planner_svc.policy import gpu_budgets, ram_budget
from planner_svc.scaling import ModelLoad, ScaleState, cut, note_report, step
from shared.messages import (
    Demand,
    FleetConfig,
    FleetPlan,
    GatewayActivity,
    HostPlan,
    HostReport,
    HostStatus,
    LaneFeedback,
    LaneSpec,
    ModelState,
    ModelStates,
    Persona,
)

WAKE_TTL = 10.0  # seconds a wake lasts unless a gateway repeats it (they do while they hold requests)
FAILED_TTL = 30.0  # seconds a failed wake is answered as failed before a request may try again
STALE_INTERVALS = 3  # a gateway's activity counts for this many of its report intervals
MAX_ROUNDS = 4  # evict-and-replan rounds per job


def persona_name(p: Persona) -> str:
    return p.alias or p.model


@dataclass
class DemandState:
    """What the planner knows of demand, each time on its own clock."""

    wakes: dict[str, float] = field(default_factory=dict)  # persona name -> latest wake
    on_demand: set[str] = field(default_factory=set)  # personas unloaded at least once
    excluded: dict[str, frozenset[str]] = field(default_factory=dict)  # model -> hosts it is unloaded from
    loaded_at: dict[tuple[str, str], float] = field(default_factory=dict)  # (host, lane) -> first planned
    # (host, lane) -> when its agent first said healthy: the idle clock and the residency start there.
    healthy_at: dict[tuple[str, str], float] = field(default_factory=dict)
    last_used: dict[str, float] = field(default_factory=dict)  # persona name -> its last request
    gateways: dict[str, tuple[float, GatewayActivity]] = field(default_factory=dict)
    failed: dict[str, tuple[float, str]] = field(default_factory=dict)  # persona name -> (when, why)
    waiting: dict[str, str] = field(default_factory=dict)  # persona name -> why its wake is not placed yet
    evictions: dict[str, int] = field(default_factory=dict)  # reason -> lanes unloaded
    # Lanes wanted per on-demand persona (the lanes it has; a wake asks one, an idle unload 0).
    counts: dict[str, int] = field(default_factory=dict)
    # Persona name -> when a wake got it placed: while its lanes still load, it is kept only as
    # long as someone waits for it (a client that gave up does not leave a load behind).
    placed_at: dict[str, float] = field(default_factory=dict)
    # Measured loads, kept after their lanes are gone: host -> read rate, persona -> seconds.
    rates: dict[str, float] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)
    # Lanes added by measured demand (planner_svc/scaling.py; immutable, replaced on each change).
    scale: ScaleState = field(default_factory=ScaleState)

    def note_wake(self, name: str, now: float) -> bool:
        """A gateway asks for `name`. True when the planner must replan (a new or failed-out wake)."""
        fresh = name not in self.wakes
        self.wakes[name] = now
        failed = self.failed.get(name)
        if failed is not None and now - failed[0] < FAILED_TTL:
            return False  # answered as failed until FAILED_TTL passes: no retry loop
        self.failed.pop(name, None)
        return fresh or name in self.waiting

    def note_activity(self, activity: GatewayActivity, now: float, config: FleetConfig | None = None) -> bool:
        """Fold one gateway's report in. True when some model went busy or idle."""
        before = set(self.busy(now))
        self.gateways[activity.gateway] = (now, activity)
        self.scale = note_report(self.scale, activity, config or FleetConfig())
        for m in activity.models:
            if m.idle_s is not None:
                self.last_used[m.name] = max(self.last_used.get(m.name, now - m.idle_s), now - m.idle_s)
        return set(self.busy(now)) != before

    def busy(self, now: float) -> dict[str, int]:
        """Persona name -> requests in flight or queued at gateways heard from lately."""
        out: dict[str, int] = {}
        for at, act in self.gateways.values():
            if now - at > STALE_INTERVALS * act.interval:
                continue
            for m in act.models:
                if m.in_flight or m.queued:
                    out[m.name] = out.get(m.name, 0) + m.in_flight + m.queued
        return out

    def note_healthy(self, host_id: str, lane_ids: Sequence[str], now: float) -> None:
        for lane_id in lane_ids:
            self.healthy_at.setdefault((host_id, lane_id), now)

    def adopt(self, states: ModelStates) -> None:
        """Carry on from the active planner's `models` key (a stand-by, or a planner restarted)."""
        self.on_demand = {m.name for m in states.models if m.on_demand}
        self.evictions = dict(states.evictions)

    def forget_lanes(self, plans: Mapping[str, HostPlan]) -> None:
        """Drop load times of lanes no plan has any more."""
        live = {(p.host_id, s.lane_id) for p in plans.values() for s in p.lanes}
        names = {s.alias for p in plans.values() for s in p.lanes}
        self.placed_at = {n: t for n, t in self.placed_at.items() if n in names}
        self.loaded_at = {k: t for k, t in self.loaded_at.items() if k in live}
        self.healthy_at = {k: t for k, t in self.healthy_at.items() if k in live}

    def expire(self, now: float) -> None:
        self.wakes = {n: t for n, t in self.wakes.items() if now - t < WAKE_TTL}
        self.failed = {n: v for n, v in self.failed.items() if now - v[0] < FAILED_TTL}
        self.waiting = {n: why for n, why in self.waiting.items() if n in self.wakes}
        self.gateways = {g: v for g, v in self.gateways.items() if now - v[0] <= STALE_INTERVALS * v[1].interval}

    def due(self, personas: Sequence[Persona], config: FleetConfig, plans: Mapping[str, HostPlan], now: float) -> bool:
        """Does time alone call for a replan: a persona past its idle_ttl, or a wake still waiting."""
        return bool(self.waiting) or bool(idle_unloads(self, config, personas, plans, now))

    def snapshot(self) -> DemandState:
        """A copy the planning job may change (every table copied, field by field)."""
        return DemandState(**{f.name: v if isinstance(v, ScaleState) else type(v)(v)
                              for f in fields(self) for v in (getattr(self, f.name),)})  # fmt: skip

    def rescale(
        self, personas: Sequence[Persona], config: FleetConfig, plans: Mapping[str, HostPlan], now: float
    ) -> tuple:
        """Apply the scaling rule (planner_svc/scaling.py) to the personas with max_lanes; the
        changes it made (a replan is due when there are any)."""
        lanes = _lanes_by_name(plans)
        load: dict[str, list[int]] = {}
        fresh = {g for g, (at, act) in self.gateways.items() if now - at <= STALE_INTERVALS * act.interval}
        # A gateway gone quiet no longer counts: neither its load nor its streaks.
        self.scale = dataclasses.replace(self.scale, streaks={k: v for k, v in self.scale.streaks.items()
                                                              if k[0] in fresh})  # fmt: skip
        for g in fresh:
            for m in self.gateways[g][1].models:
                got = load.setdefault(m.name, [0, 0])
                got[0] += m.in_flight
                got[1] += m.queued
        models = {}
        for p in personas:
            name = persona_name(p)
            if p.max_lanes is None:
                continue
            here = lanes.get(name, [])
            in_flight, queued = load.get(name, (0, 0))
            models[name] = ModelLoad(
                name=name, max_lanes=p.max_lanes, lanes=len(here), parallel=p.parallel, in_flight=in_flight,
                queued=queued, serving=bool(here) and all((h, s.lane_id) in self.healthy_at for h, s in here),
            )  # fmt: skip
        self.scale, changes = step(self.scale, models, config, now)
        removed = sum(1 for c in changes if c.delta < 0)
        if removed:
            self.evictions["scaled_down"] = self.evictions.get("scaled_down", 0) + removed
        return changes

    def apply(self, outcome: Outcome, now: float) -> None:
        """Take a job's outcome in (wakes that came meanwhile stay)."""
        if outcome.extra_placed:
            self.scale = cut(self.scale, outcome.extra_placed, now)
        self.on_demand |= outcome.on_demand
        self.counts = dict(outcome.counts)
        self.excluded = dict(outcome.excluded)
        self.loaded_at = self.loaded_at | dict(outcome.loaded_at)
        for name in outcome.placed | set(outcome.failed):
            self.wakes.pop(name, None)
        for name in outcome.placed:
            self.placed_at[name] = now
        for name, why in outcome.failed.items():
            self.failed[name] = (now, why)
        self.waiting = {n: why for n, why in outcome.waiting.items() if n in self.wakes}
        for reason, n in outcome.evicted.items():
            self.evictions[reason] = self.evictions.get(reason, 0) + n


@dataclass(frozen=True)
class Outcome:
    on_demand: frozenset[str] = frozenset()
    counts: Mapping[str, int] = field(default_factory=dict)
    excluded: Mapping[str, frozenset[str]] = field(default_factory=dict)
    loaded_at: Mapping[tuple[str, str], float] = field(default_factory=dict)
    placed: frozenset[str] = frozenset()  # woken personas that have lanes now
    failed: Mapping[str, str] = field(default_factory=dict)
    waiting: Mapping[str, str] = field(default_factory=dict)
    evicted: Mapping[str, int] = field(default_factory=dict)  # reason -> lanes
    victims: tuple[tuple[str, str, str], ...] = ()  # (host, lane, reason), for the log
    # Personas whose lanes added by demand were not all placed (no room, or idled out): how many were.
    extra_placed: Mapping[str, int] = field(default_factory=dict)


# ------------------------------------------------------------------ who is servable


def servable(demand: Demand | None, reports: Sequence[HostReport]) -> tuple[list[Persona], frozenset[str]]:
    """Every persona, and the names of those on demand from the start: with a demand set, each
    model file no persona names is servable too, loaded only when asked for."""
    if demand is None or not demand.personas:
        return list(default_demand(reports).personas), frozenset()
    named = {p.model for p in demand.personas}
    extra = sorted({m.name for r in reports for m in r.models} - named)
    return list(demand.personas) + [Persona(model=n) for n in extra], frozenset(extra)


def _lanes_by_name(plans: Mapping[str, HostPlan]) -> dict[str, list[tuple[str, LaneSpec]]]:
    out: dict[str, list[tuple[str, LaneSpec]]] = {}
    for p in plans.values():
        for spec in p.lanes:
            out.setdefault(spec.alias, []).append((p.host_id, spec))
    return out


def ttl_of(p: Persona, config: FleetConfig) -> float:
    return p.idle_ttl if p.idle_ttl is not None else config.idle_ttl


def idle_unloads(
    state: DemandState, config: FleetConfig, personas: Sequence[Persona], plans: Mapping[str, HostPlan], now: float
) -> list[tuple[Persona, list[tuple[str, LaneSpec]]]]:
    """Personas whose lanes idled past their idle_ttl: no request (only requests count, never a
    probe or a scrape) for that long, none in flight or queued, not pinned."""
    lanes = _lanes_by_name(plans)
    busy = state.busy(now)
    out = []
    for p in personas:
        name, ttl = persona_name(p), ttl_of(p, config)
        here = lanes.get(name, [])
        if ttl <= 0 or p.min_lanes > 0 or not here or busy.get(name):
            continue
        if any((h, s.lane_id) not in state.healthy_at for h, s in here):
            continue  # still loading: its idle time starts once it serves
        last = max([state.last_used.get(name, float("-inf")), state.wakes.get(name, float("-inf"))]
                   + [state.healthy_at[(h, s.lane_id)] for h, s in here])  # fmt: skip
        if now - last >= ttl:
            out.append((p, here))
    return out


def abandoned_loads(
    state: DemandState, personas: Sequence[Persona], plans: Mapping[str, HostPlan], now: float
) -> list[tuple[Persona, list[tuple[str, LaneSpec]]]]:
    """Woken personas whose lanes still load while nobody waits for them any more: no request
    held or queued at any gateway, no wake for WAKE_TTL, none served since. Unloaded, so a
    client that gives up leaves no load behind (one that still waits keeps it going)."""
    lanes = _lanes_by_name(plans)
    busy = state.busy(now)
    out = []
    for p in personas:
        name = persona_name(p)
        since = state.placed_at.get(name)
        here = lanes.get(name, [])
        if since is None or not here or p.min_lanes or busy.get(name) or name in state.wakes:
            continue
        if any((h, s.lane_id) in state.healthy_at for h, s in here):
            continue  # it serves: idle_ttl governs it now
        if now - since >= WAKE_TTL and state.last_used.get(name, float("-inf")) <= since:
            out.append((p, here))
    return out


def effective(
    state: DemandState,
    personas: Sequence[Persona],
    reports: Sequence[HostReport],
    plans: Mapping[str, HostPlan],
) -> tuple[Demand, list[HostReport], list[str]]:
    """The demand, reports and placing order the planner is run with now."""
    lanes = _lanes_by_name(plans)
    out: list[Persona] = []
    residents: list[tuple[int, str]] = []
    for p in personas:
        name = persona_name(p)
        excluded = state.excluded.get(p.model, frozenset())
        running = [h for h, _ in lanes.get(name, []) if h not in excluded]
        if running:
            residents.append((-p.priority, p.model))
        extra = state.scale.extra.get(name, 0) if p.max_lanes is not None else 0
        if name not in state.on_demand and name not in state.wakes:
            if extra:
                holders = sum(1 for r in reports for m in r.models if m.name == p.model)
                base = p.lanes if p.lanes is not None else holders
                p = msgspec.structs.replace(p, lanes=min(p.max_lanes, max(base, p.min_lanes) + extra))
            out.append(p)
            continue
        n = state.counts.get(name, len(running))
        if n == 0 and name in state.wakes:
            n = p.lanes or 1
        n = max(n, p.min_lanes)
        if n and extra:
            n = min(p.max_lanes, n + extra)
        if n:
            out.append(msgspec.structs.replace(p, lanes=n))
    woken = [persona_for(personas, n).model for n in sorted(state.wakes, key=lambda n: (state.wakes[n], n))
             if persona_for(personas, n) is not None]  # fmt: skip
    # Only while a wake waits: otherwise personas keep their priority order (today's plans).
    first = list(dict.fromkeys([m for _, m in sorted(residents)] + woken)) if woken else []
    shown = [_without(r, {m for m, hosts in state.excluded.items() if r.host_id in hosts}) for r in reports]
    return Demand(personas=tuple(out)), shown, first


def persona_for(personas: Sequence[Persona], name: str) -> Persona | None:
    return next((p for p in personas if persona_name(p) == name), None)


def _without(report: HostReport, models: set[str]) -> HostReport:
    if not models:
        return report
    return msgspec.structs.replace(report, models=tuple(m for m in report.models if m.name not in models))


# ------------------------------------------------------------------ sizing for eviction


def _budgets(report: HostReport, config: FleetConfig) -> dict:
    out = {CPU_RESOURCE: ram_budget(report, config)}
    out.update({("gpu", i): b for i, b in gpu_budgets(report, config).items()})
    return out


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
        ctx_min = p.ctx_min if p else spec.ctx_per_slot
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
    budgets = _budgets(report, config)
    used: dict = {}
    for cost in frees.values():
        for r, b in cost.items():
            used[r] = used.get(r, 0) + b
    free = {r: b - used.get(r, 0) for r, b in budgets.items()}
    return Room(host, free, needs), frees


# ------------------------------------------------------------------ the job


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
        for spec in plans_now[host].lanes if host in plans_now else ():
            p = persona_for(personas, spec.alias)
            # The residency counts from when it served; a lane still loading is as new.
            loaded = state.healthy_at.get((host, spec.lane_id), now)
            candidates.append(Candidate(
                host_id=host, lane_id=spec.lane_id, model=spec.alias, frees=frees.get(spec.lane_id, {}),
                priority=p.priority if p else 0, last_used=state.last_used.get(spec.alias, loaded),
                loaded_at=loaded, busy=bool(busy.get(spec.alias)), pinned=bool(p and p.min_lanes),
            ))  # fmt: skip
    return rooms, candidates


def _placed(fleet: FleetPlan) -> set[str]:
    return {s.alias for h in fleet.hosts for s in h.lanes}


def plan_on_demand(
    reports: Sequence[HostReport],
    config: FleetConfig,
    demand: Demand | None,
    state: DemandState,
    *,
    now: float,
    previous: Mapping[str, HostPlan] | None = None,
    feedback: Mapping[str, Sequence[LaneFeedback]] | None = None,
    config_revision: int = 0,
    chooser=choose,
) -> tuple[FleetPlan, Outcome]:
    """One fleet plan with demand applied: idle unloads, wakes, and the evictions they need.

    `state` is a snapshot: it is changed here and handed back in the Outcome. `previous` is
    keyed by host id, like the plans it returns. `chooser` is eviction.choose (a benchmark
    passes another rule to compare with).
    """
    previous = dict(previous or {})
    feedback = feedback or {}
    personas, extra = servable(demand, reports)
    state.on_demand |= extra
    known = {persona_name(p) for p in personas}
    state.wakes = {n: t for n, t in state.wakes.items() if n in known and n not in state.failed}
    evicted: dict[str, int] = {}
    victims_log: list[tuple[str, str, str]] = []
    excluded = {m: set(h) for m, h in state.excluded.items()}
    extra_placed: dict[str, int] = {}
    for p, lanes in idle_unloads(state, config, personas, previous, now):
        state.on_demand.add(persona_name(p))
        state.counts[persona_name(p)] = 0
        if state.scale.extra.get(persona_name(p)):
            extra_placed[persona_name(p)] = 0
        excluded.setdefault(p.model, set()).update(h for h, _ in lanes)
        evicted["idle"] = evicted.get("idle", 0) + len(lanes)
        victims_log += [(h, s.lane_id, f"idle for {ttl_of(p, config):g} s") for h, s in lanes]
    for p, lanes in abandoned_loads(state, personas, previous, now):
        state.counts[persona_name(p)] = 0
        excluded.setdefault(p.model, set()).update(h for h, _ in lanes)
        evicted["abandoned"] = evicted.get("abandoned", 0) + len(lanes)
        victims_log += [(h, s.lane_id, "nobody waits for it any more") for h, s in lanes]
        state.placed_at.pop(persona_name(p), None)
    for name in state.wakes:
        state.on_demand.add(name)
        woken = persona_for(personas, name)
        excluded.pop(woken.model, None)
        if not state.counts.get(name):
            state.counts.pop(name, None)
    state.excluded = {m: frozenset(h) for m, h in excluded.items() if h}

    failed: dict[str, str] = {}
    waiting: dict[str, str] = {}
    for round_ in range(MAX_ROUNDS + 1):
        eff, shown, first = effective(state, personas, reports, previous)
        fleet = plan(shown, config, eff, previous=previous, feedback=feedback, config_revision=config_revision,
                     first=first)  # fmt: skip
        placed = _placed(fleet)
        pending = sorted((n for n in state.wakes if n not in placed and n not in failed), key=lambda n: (state.wakes[n], n))
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
        choice = chooser(rooms, candidates, now=now, min_residency=config.min_residency)
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
        for host, lane_id in choice.victims:
            spec = lanes_now[(host, lane_id)]
            # It keeps its count: where another host has room, the next round places it there.
            state.counts.setdefault(spec.alias, sum(1 for s in lanes_now.values() if s.alias == spec.alias))
            state.on_demand.add(spec.alias)
            state.excluded = dict(state.excluded) | {spec.model: state.excluded.get(spec.model, frozenset()) | {host}}
            victims_log.append((host, lane_id, f"evicted for {name}"))
        evicted["wake"] = evicted.get("wake", 0) + len(choice.victims)
        # The evicted lanes leave `previous`' count of what runs (the next round sees them gone).
        gone = set(choice.victims)
        previous = {h: msgspec.structs.replace(p, lanes=tuple(s for s in p.lanes if (h, s.lane_id) not in gone))
                    if any((h, s.lane_id) in gone for s in p.lanes) else p for h, p in previous.items()}  # fmt: skip
    if extra_placed:
        state.scale = cut(state.scale, extra_placed, now)
    # A lane added by demand that found no room is taken back (it never evicts), so the plan
    # shows no unplaced lane for it: plan once more without it.
    short = _extra_short(fleet, effective(state, personas, reports, previous)[0], state)
    if short:
        extra_placed |= short
        state.scale = cut(state.scale, short, now)
        eff, shown, first = effective(state, personas, reports, previous)
        fleet = plan(shown, config, eff, previous=previous, feedback=feedback, config_revision=config_revision,
                     first=first)  # fmt: skip
    placed = _placed(fleet)
    # The counts kept for on-demand personas leave the added lanes out: scaling owns those.
    counts = {n: max(0, sum(1 for h in fleet.hosts for s in h.lanes if s.alias == n) - state.scale.extra.get(n, 0))
              for n in state.on_demand}  # fmt: skip
    loaded_at = {
        (h.host_id, s.lane_id): state.loaded_at.get((h.host_id, s.lane_id), now) for h in fleet.hosts for s in h.lanes
    }
    outcome = Outcome(
        on_demand=frozenset(state.on_demand),
        counts=counts,
        excluded=dict(state.excluded),
        loaded_at=loaded_at,
        placed=frozenset(n for n in state.wakes if n in placed),
        failed=failed,
        waiting=waiting,
        evicted=evicted,
        victims=tuple(victims_log),
        extra_placed=extra_placed,
    )
    return fleet, outcome


def _extra_short(fleet: FleetPlan, demand: Demand, state: DemandState) -> dict[str, int]:
    """Personas with lanes added by demand that the plan could not place all of: how many of
    the added ones it placed."""
    out = {}
    for p in demand.personas:
        name = persona_name(p)
        extra = state.scale.extra.get(name, 0)
        if not extra or p.lanes is None:
            continue
        missing = p.lanes - sum(1 for h in fleet.hosts for s in h.lanes if s.alias == name)
        if missing > 0:
            out[name] = max(0, extra - missing)
    return out


# ------------------------------------------------------------------ what clients see


def model_states(
    demand: Demand | None,
    reports: Sequence[HostReport],
    plans: Mapping[str, HostPlan],
    state: DemandState,
    statuses: Mapping[str, HostStatus] | None = None,
) -> ModelStates:
    """Every servable model and its load state, for gateways, `lanes status` and the dashboard,
    with its predicted and measured cold start (planner_svc/coldstart.py). What the running lanes
    measured is kept in `state`, so a prediction outlives the lanes it was learnt from."""
    statuses = statuses or {}
    # What the lanes that run now measured; what earlier lanes measured is kept in the state.
    state.rates.update(read_rates(reports, plans, statuses))
    state.measured.update(measured_loads(plans, statuses))
    rates, measured = state.rates, state.measured
    personas, _ = servable(demand, reports)
    lanes = _lanes_by_name(plans)
    holders: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    pooled: set[str] = set()
    for r in sorted(reports, key=lambda r: r.host_id):
        for m in r.models:
            holders.setdefault(m.name, []).append(r.host_id)
            sizes[m.name] = max(sizes.get(m.name, 0), m.file_bytes)
            if m.pooling:
                pooled.add(m.name)
    out = []
    for p in sorted(personas, key=persona_name):
        name = persona_name(p)
        hosts = tuple(sorted({h for h, _ in lanes.get(name, [])}))
        if name in state.failed:
            load, reason = "failed", state.failed[name][1]
        elif hosts:
            load, reason = "loaded", ""
        elif name in state.wakes:
            load, reason = "waking", state.waiting.get(name, "")
        else:
            load, reason = "unloaded", ""
        held_by = tuple(holders.get(p.model, ()))
        fastest = max((rates[h] for h in held_by if h in rates), default=None)
        out.append(ModelState(name=name, model=p.model, state=load, hosts=hosts, holders=held_by, reason=reason,
                              file_bytes=sizes.get(p.model, 0), on_demand=name in state.on_demand,
                              predicted_load_s=predicted_seconds(sizes.get(p.model, 0), fastest) if held_by else None,
                              measured_load_s=measured.get(name),
                              embeddings=p.embeddings if p.embeddings is not None else p.model in pooled))  # fmt: skip
    return ModelStates(models=tuple(out), evictions=dict(sorted(state.evictions.items())))
