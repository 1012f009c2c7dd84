"""Waking, a phase of planning with demand (planner_svc/demand.py): which personas the
planner places now, and how many lanes each.

A persona is *default-on* until it is first unloaded: planned exactly as before (today's
behaviour and the golden plans are untouched while no one opts in). Once unloaded it is *on
demand*: it keeps the lanes it has, and gets one (or its `lanes`) only when woken. A wake
brings its model back on every host it was unloaded from, and the lanes that run now are
placed first, the woken next, so a newcomer never takes a running lane's room. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import msgspec

from planner_svc.demand_state import DemandState
from planner_svc.personas import lanes_by_name, persona_for, persona_name
from shared.messages.config import Demand, Persona
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan


def known_wakes(state: DemandState, personas: Sequence[Persona], extra: frozenset[str]) -> DemandState:
    """The state a job starts from: the model files no persona names on demand from the start
    (`extra`), and only the wakes for servable personas that have not failed."""
    known = {persona_name(p) for p in personas}
    return replace(state, on_demand=state.on_demand | extra,
                   wakes={n: t for n, t in state.wakes.items() if n in known and n not in state.failed})  # fmt: skip


def wake(state: DemandState, personas: Sequence[Persona]) -> DemandState:
    """Each woken persona on demand from now, its model no longer left out anywhere, and a
    count of lanes asked anew where it had none."""
    excluded, counts = dict(state.excluded), dict(state.counts)
    for name in state.wakes:
        woken = persona_for(personas, name)
        excluded.pop(woken.model, None)
        if not counts.get(name):
            counts.pop(name, None)
    return replace(state, on_demand=state.on_demand | set(state.wakes), excluded=excluded, counts=counts)


def effective(
    state: DemandState,
    personas: Sequence[Persona],
    reports: Sequence[HostReport],
    plans: Mapping[str, HostPlan],
) -> tuple[Demand, list[HostReport], list[str]]:
    """The demand, reports and placing order the planner is run with now."""
    lanes = lanes_by_name(plans)
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
    woken = [persona_for(personas, n).model for n in state.waiting_order() if persona_for(personas, n) is not None]
    # Only while a wake waits: otherwise personas keep their priority order (today's plans).
    first = list(dict.fromkeys([m for _, m in sorted(residents)] + woken)) if woken else []
    shown = [_without(r, {m for m, hosts in state.excluded.items() if r.host_id in hosts}) for r in reports]
    return Demand(personas=tuple(out)), shown, first


def _without(report: HostReport, models: set[str]) -> HostReport:
    if not models:
        return report
    return msgspec.structs.replace(report, models=tuple(m for m in report.models if m.name not in models))
