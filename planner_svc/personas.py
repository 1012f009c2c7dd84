"""Personas by name: which the planner may serve, and the lanes each has in a set of plans.

Pure helpers the demand phases share (planner_svc/demand.py and the modules it composes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner_svc.planner import default_demand
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan, LaneSpec


def persona_name(p: Persona) -> str:
    return p.alias or p.model


def persona_for(personas: Sequence[Persona], name: str) -> Persona | None:
    return next((p for p in personas if persona_name(p) == name), None)


def ttl_of(p: Persona, config: FleetConfig) -> float:
    return p.idle_ttl if p.idle_ttl is not None else config.idle_ttl


def servable(demand: Demand | None, reports: Sequence[HostReport]) -> tuple[list[Persona], frozenset[str]]:
    """Every persona, and the names of those on demand from the start: with a demand set, each
    model file no persona names is servable too, loaded only when asked for."""
    if demand is None or not demand.personas:
        return list(default_demand(reports).personas), frozenset()
    named = {p.model for p in demand.personas}
    extra = sorted({m.name for r in reports for m in r.models} - named)
    return list(demand.personas) + [Persona(model=n) for n in extra], frozenset(extra)


def lanes_by_name(plans: Mapping[str, HostPlan]) -> dict[str, list[tuple[str, LaneSpec]]]:
    """Persona name -> (host, lane spec) of each lane the plans give it."""
    out: dict[str, list[tuple[str, LaneSpec]]] = {}
    for p in plans.values():
        for spec in p.lanes:
            out.setdefault(spec.alias, []).append((p.host_id, spec))
    return out
