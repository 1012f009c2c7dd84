"""Models on demand: which personas the planner places now, what a wake evicts, what idles out.

Pure: the service folds wakes and gateway activity into a `DemandState` (planner_svc/
demand_state.py) with its own clock value; `plan_on_demand` turns that state into one fleet
plan and an `Outcome`, `demand_due` and `model_states` answer with a new state beside their
answer, and the service applies what they return. Nothing here reads a clock, the bus or a file.

`plan_on_demand` runs the phases in order, each its own module with its own tests:
- idle unload (planner_svc/idle.py): lanes idle past their persona's `idle_ttl`, and loads
  nobody waits for any more, go;
- waking (planner_svc/waking.py): a woken persona is on demand and asks its lanes again; a
  persona is *default-on* (planned exactly as before) until it is first unloaded;
- placement of wakes (planner_svc/wake_placement.py): the lanes that run now are placed first,
  the woken next; where a wake fits nowhere, `eviction.choose` picks the idle lanes to unload;
- scaling (planner_svc/scaling.py): lanes added by measured demand come on top of a persona's
  count (`max_lanes`); one the plan cannot place is taken back (it never evicts).
`min_lanes` pins: the persona always has that many lanes and none is evicted or idles out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from planner_svc.coldstart import measured_loads, predicted_seconds, read_rates
from planner_svc.demand_state import DemandState, Outcome
from planner_svc.eviction import choose
from planner_svc.idle import due, unload_idle
from planner_svc.personas import lanes_by_name, persona_name, servable
from planner_svc.scaling import Change, cut, extra_short
from planner_svc.wake_placement import place_wakes, placed_names, plan_with
from planner_svc.waking import effective, known_wakes, wake
from shared.messages.activity import ModelState, ModelStates
from shared.messages.config import Demand, FleetConfig
from shared.messages.hosts import HostReport
from shared.messages.plans import FleetPlan, HostPlan
from shared.messages.status import HostStatus, LaneFeedback


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

    `state` is left as it is; what the job decided comes back in the Outcome, for
    `DemandState.apply`. `previous` is keyed by host id, like the plans it returns. `chooser`
    is eviction.choose (a benchmark passes another rule to compare with).
    """
    previous = dict(previous or {})
    feedback = feedback or {}
    personas, extra = servable(demand, reports)
    state = known_wakes(state, personas, extra)
    state, unloaded = unload_idle(state, config, personas, previous, now)
    state = wake(state, personas)
    placing = place_wakes(state, personas, reports, config, previous, feedback, config_revision, now, chooser)
    state, fleet, previous = placing.state, placing.fleet, placing.previous
    extra_placed = dict(unloaded.extra_placed)
    if extra_placed:
        state = replace(state, scale=cut(state.scale, extra_placed, now))
    # A lane added by demand that found no room is taken back (it never evicts), so the plan
    # shows no unplaced lane for it: plan once more without it.
    short = extra_short(fleet, effective(state, personas, reports, previous)[0], state.scale.extra)
    if short:
        extra_placed |= short
        state = replace(state, scale=cut(state.scale, short, now))
        fleet = plan_with(state, personas, reports, config, previous, feedback, config_revision)
    placed = placed_names(fleet)
    # The counts kept for on-demand personas leave the added lanes out: scaling owns those.
    counts = {n: max(0, sum(1 for h in fleet.hosts for s in h.lanes if s.alias == n) - state.scale.extra.get(n, 0))
              for n in state.on_demand}  # fmt: skip
    loaded_at = {
        (h.host_id, s.lane_id): state.loaded_at.get((h.host_id, s.lane_id), now) for h in fleet.hosts for s in h.lanes
    }
    evicted = dict(unloaded.evicted) | ({"wake": placing.evicted} if placing.evicted else {})
    outcome = Outcome(
        on_demand=frozenset(state.on_demand),
        counts=counts,
        excluded=dict(state.excluded),
        loaded_at=loaded_at,
        placed=frozenset(n for n in state.wakes if n in placed),
        failed=placing.failed,
        waiting=placing.waiting,
        evicted=evicted,
        victims=unloaded.victims + placing.victims,
        extra_placed=extra_placed,
    )
    return fleet, outcome


# ------------------------------------------------------------------ what time alone calls for


def engaged(state: DemandState, demand: Demand | None, config: FleetConfig) -> bool:
    """Are models on demand in play (then every live host is planned together)?"""
    personas = demand.personas if demand else ()
    return bool(state.wakes or state.on_demand or state.excluded or config.idle_ttl
                or any(p.idle_ttl or p.min_lanes or p.max_lanes is not None for p in personas))  # fmt: skip


def rescaled(
    state: DemandState, demand: Demand | None, reports: Sequence[HostReport], plans: Mapping[str, HostPlan],
    config: FleetConfig, now: float,
) -> tuple[DemandState, tuple[Change, ...]]:
    """Lanes that follow demand (planner_svc/scaling.py): the state after, and the lanes added or removed."""
    if not demand or not any(p.max_lanes is not None for p in demand.personas):
        return state, ()
    personas, _ = servable(demand, reports)
    return state.rescale(personas, config, plans, now)


def demand_due(
    state: DemandState,
    demand: Demand | None,
    reports: Sequence[HostReport],
    plans: Mapping[str, HostPlan],
    config: FleetConfig,
    now: float,
) -> tuple[DemandState, bool, tuple[Change, ...]]:
    """Does time alone call for a replan (an idle_ttl passed, a wake waits for room, a lane is
    added or removed by demand)? The state after (old wakes expired, the scaling rule applied),
    the answer, and the scaling changes."""
    state = state.expire(now)
    if not engaged(state, demand, config):
        return state, False, ()
    state, changes = rescaled(state, demand, reports, plans, config, now)
    if changes:
        return state, True, changes
    personas, _ = servable(demand, reports)
    return state, due(state, personas, config, plans, now), ()


# ------------------------------------------------------------------ what clients see


def model_states(
    demand: Demand | None,
    reports: Sequence[HostReport],
    plans: Mapping[str, HostPlan],
    state: DemandState,
    statuses: Mapping[str, HostStatus] | None = None,
) -> tuple[ModelStates, DemandState]:
    """Every servable model and its load state, for gateways, `lanes status` and the dashboard,
    with its predicted and measured cold start (planner_svc/coldstart.py); and the state with
    what the running lanes measured, so a prediction outlives the lanes it was learnt from."""
    statuses = statuses or {}
    state = replace(state, rates={**state.rates, **read_rates(reports, plans, statuses)},
                    measured={**state.measured, **measured_loads(plans, statuses)})  # fmt: skip
    rates, measured = state.rates, state.measured
    personas, _ = servable(demand, reports)
    lanes = lanes_by_name(plans)
    holders: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    pooled: set[str] = set()
    ranked: set[str] = set()
    fitted: dict[str, set[str]] = {}  # model -> adapters some host holds for it
    seeing: set[str] = set()  # models a projector that reads images is paired with
    for r in sorted(reports, key=lambda r: r.host_id):
        for m in r.models:
            holders.setdefault(m.name, []).append(r.host_id)
            sizes[m.name] = max(sizes.get(m.name, 0), m.file_bytes)
            if m.pooling:
                pooled.add(m.name)
            if m.pooling == "rank":
                ranked.add(m.name)
            if m.mmproj is not None and m.mmproj.vision:
                seeing.add(m.name)
        for a in r.adapters:
            for base in a.bases:
                fitted.setdefault(base, set()).add(a.name)
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
        reranking = p.reranking if p.reranking is not None else p.model in ranked
        fastest = max((rates[h] for h in held_by if h in rates), default=None)
        out.append(ModelState(name=name, model=p.model, state=load, hosts=hosts, holders=held_by, reason=reason,
                              file_bytes=sizes.get(p.model, 0), on_demand=name in state.on_demand,
                              predicted_load_s=predicted_seconds(sizes.get(p.model, 0), fastest) if held_by else None,
                              measured_load_s=measured.get(name),
                              embeddings=not reranking and (p.embeddings if p.embeddings is not None else p.model in pooled),
                              adapters=tuple(a for a in p.adapters if a in fitted.get(p.model, ())),
                              reranking=reranking,
                              vision=p.vision is not False and p.model in seeing))  # fmt: skip
    return ModelStates(models=tuple(out), evictions=dict(sorted(state.evictions.items()))), state
