"""Idle unload, a phase of planning with demand (planner_svc/demand.py): which lanes go for
want of requests.

A persona's lanes go when no request came for its `idle_ttl` (only requests count, never a
probe or a scrape) and none is in flight or queued, unless it is pinned (`min_lanes`); a lane
still loading is never idle (its idle time starts once it serves). A woken persona whose lanes
still load while nobody waits for them any more is unloaded too (abandoned). Pure: the state in,
a new state and what was unloaded out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from planner_svc.demand_state import WAKE_TTL, DemandState
from planner_svc.personas import lanes_by_name, persona_name, ttl_of
from shared.messages.config import FleetConfig, Persona
from shared.messages.plans import HostPlan, LaneSpec


@dataclass(frozen=True)
class Unloaded:
    """What the idle phase unloads."""

    evicted: Mapping[str, int] = field(default_factory=dict)  # reason (idle, abandoned) -> lanes
    victims: tuple[tuple[str, str, str], ...] = ()  # (host, lane, reason)
    # Personas with lanes added by demand that idled out: none of the added lanes stays placed.
    extra_placed: Mapping[str, int] = field(default_factory=dict)


def idle_unloads(
    state: DemandState, config: FleetConfig, personas: Sequence[Persona], plans: Mapping[str, HostPlan], now: float
) -> list[tuple[Persona, list[tuple[str, LaneSpec]]]]:
    """Personas whose lanes idled past their idle_ttl: no request (only requests count, never a
    probe or a scrape) for that long, none in flight or queued, not pinned."""
    lanes = lanes_by_name(plans)
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
    lanes = lanes_by_name(plans)
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


def due(
    state: DemandState, personas: Sequence[Persona], config: FleetConfig, plans: Mapping[str, HostPlan], now: float
) -> bool:
    """Does time alone call for a replan: a persona past its idle_ttl, or a wake still waiting."""
    return bool(state.waiting) or bool(idle_unloads(state, config, personas, plans, now))


def unload_idle(
    state: DemandState, config: FleetConfig, personas: Sequence[Persona], plans: Mapping[str, HostPlan], now: float
) -> tuple[DemandState, Unloaded]:
    """The idle and abandoned lanes of `plans` unloaded: each such persona is on demand with no
    lane wanted, and its model left out on the hosts it ran on."""
    on_demand, counts, placed_at = set(state.on_demand), dict(state.counts), dict(state.placed_at)
    excluded = {m: set(h) for m, h in state.excluded.items()}
    evicted: dict[str, int] = {}
    victims: list[tuple[str, str, str]] = []
    extra_placed: dict[str, int] = {}
    for p, lanes in idle_unloads(state, config, personas, plans, now):
        on_demand.add(persona_name(p))
        counts[persona_name(p)] = 0
        if state.scale.extra.get(persona_name(p)):
            extra_placed[persona_name(p)] = 0
        excluded.setdefault(p.model, set()).update(h for h, _ in lanes)
        evicted["idle"] = evicted.get("idle", 0) + len(lanes)
        victims += [(h, s.lane_id, f"idle for {ttl_of(p, config):g} s") for h, s in lanes]
    for p, lanes in abandoned_loads(state, personas, plans, now):
        counts[persona_name(p)] = 0
        excluded.setdefault(p.model, set()).update(h for h, _ in lanes)
        evicted["abandoned"] = evicted.get("abandoned", 0) + len(lanes)
        victims += [(h, s.lane_id, "nobody waits for it any more") for h, s in lanes]
        placed_at.pop(persona_name(p), None)
    after = replace(state, on_demand=frozenset(on_demand), counts=counts, placed_at=placed_at,
                    excluded={m: frozenset(h) for m, h in excluded.items() if h})  # fmt: skip
    return after, Unloaded(evicted=evicted, victims=tuple(victims), extra_placed=extra_placed)
