"""Lanes that follow measured demand: when a model gets another lane, and when it gives it back.

Pure: gateway reports are folded in with `note_report`, `rescale` (through `step`) turns the
state, the personas, their plans and `now` into the lanes added above each base count, and
`extra_short` tells which added lanes a plan could not place (`cut` takes them back). Nothing
here reads a clock, the bus or a file.

The rule, for a persona with `max_lanes` (others are never touched):
- Up: some gateway reported its queue wait above `scale_up_wait` in `scale_up_reports`
  reports in a row, the model has fewer than `max_lanes` lanes, and every lane it has serves
  (none still loading: the lane just added gets its chance first). The streaks start again.
- Down: only a lane scaling added goes, once the model had no request queued anywhere and its
  requests in flight fit one lane fewer, continuously for `scale_down_idle` seconds, and at
  least that long after the last change.
- No room: an added lane the planner cannot place (it never evicts for one) is taken back, and
  none is added for that model for `scale_down_idle` seconds.
- Hysteresis: going up takes a sustained wait, going down a sustained calm, and every change
  restarts both, so a load that sits at the edge changes lanes at most once per
  `scale_down_idle`, never on every report.
Reshaping slots and windows from measured concurrency is not done here (not in scope).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from planner_svc.personas import lanes_by_name, persona_name
from shared.messages.activity import GatewayActivity
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.plans import FleetPlan, HostPlan


@dataclass(frozen=True)
class ScaleState:
    streaks: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (gateway, model) -> hot reports in a row
    extra: Mapping[str, int] = field(default_factory=dict)  # model -> lanes added above its base count
    changed_at: Mapping[str, float] = field(default_factory=dict)  # model -> last add or removal
    calm_since: Mapping[str, float] = field(default_factory=dict)  # model -> since when no queue, spare slots
    no_room: Mapping[str, float] = field(default_factory=dict)  # model -> when an added lane found no room


@dataclass(frozen=True)
class ModelLoad:
    """One scalable model as the planner sees it now."""

    name: str
    max_lanes: int
    lanes: int  # lanes planned for it now (the added ones included)
    serving: bool  # every one of them said healthy
    parallel: int = 1  # slots per lane
    in_flight: int = 0  # at every gateway heard from lately
    queued: int = 0


@dataclass(frozen=True)
class Change:
    name: str
    delta: int  # +1 or -1
    reason: str


def note_report(state: ScaleState, activity: GatewayActivity, config: FleetConfig) -> ScaleState:
    """Count each model's consecutive reports (from this gateway) with its wait above target."""
    streaks = {k: v for k, v in state.streaks.items() if k[0] != activity.gateway}
    for m in activity.models:
        if m.wait_s > config.scale_up_wait:
            streaks[(activity.gateway, m.name)] = state.streaks.get((activity.gateway, m.name), 0) + 1
    return replace(state, streaks=streaks)


def hot(state: ScaleState, name: str, config: FleetConfig) -> bool:
    return any(n >= config.scale_up_reports for (_, m), n in state.streaks.items() if m == name)


def step(
    state: ScaleState, models: Mapping[str, ModelLoad], config: FleetConfig, now: float
) -> tuple[ScaleState, tuple[Change, ...]]:
    """The lanes to add or remove now, and the state after them."""
    extra = {n: k for n, k in state.extra.items() if n in models and k > 0}
    changed = {n: t for n, t in state.changed_at.items() if n in models}
    calm = dict(state.calm_since)
    streaks = dict(state.streaks)
    changes: list[Change] = []
    for name in sorted(models):
        m = models[name]
        is_calm = m.queued == 0 and m.in_flight <= max(0, m.lanes - 1) * m.parallel
        if not is_calm:
            calm.pop(name, None)
        else:
            calm.setdefault(name, now)
        quiet_for = now - max(calm.get(name, now), changed.get(name, float("-inf")))
        refused = now - state.no_room.get(name, float("-inf")) < config.scale_down_idle
        if hot(state, name, config) and m.lanes < m.max_lanes and m.serving and m.lanes > 0 and not refused:
            extra[name] = extra.get(name, 0) + 1
            changes.append(Change(name, +1, f"queue wait above {config.scale_up_wait:g} s for "
                                             f"{config.scale_up_reports} reports"))  # fmt: skip
        elif extra.get(name) and is_calm and quiet_for >= config.scale_down_idle:
            extra[name] -= 1
            changes.append(Change(name, -1, f"no queue and spare slots for {config.scale_down_idle:g} s"))
        else:
            continue
        changed[name] = now
        calm.pop(name, None)
        streaks = {k: v for k, v in streaks.items() if k[1] != name}
    calm = {n: t for n, t in calm.items() if n in models}
    extra = {n: k for n, k in extra.items() if k > 0}
    no_room = {n: t for n, t in state.no_room.items() if n in models and now - t < config.scale_down_idle}
    out = ScaleState(streaks=streaks, extra=extra, changed_at=changed, calm_since=calm, no_room=no_room)
    return out, tuple(changes)


def cut(state: ScaleState, placed: Mapping[str, int], now: float) -> ScaleState:
    """The planner placed only `placed` of the lanes added for these models (no room, or the
    model idled out): keep what was placed, and add none for them for a while."""
    extra = {n: (min(k, placed[n]) if n in placed else k) for n, k in state.extra.items()}
    no_room = dict(state.no_room) | {n: now for n in placed}
    return replace(state, extra={n: k for n, k in extra.items() if k > 0}, no_room=no_room)


def rescale(
    state: ScaleState,
    activities: Sequence[GatewayActivity],
    healthy: Collection[tuple[str, str]],
    personas: Sequence[Persona],
    plans: Mapping[str, HostPlan],
    config: FleetConfig,
    now: float,
) -> tuple[ScaleState, tuple[Change, ...]]:
    """The rule applied to the personas with max_lanes, from the reports of the gateways heard
    from lately (`activities`) and the lanes that said healthy ((host, lane) in `healthy`)."""
    lanes = lanes_by_name(plans)
    load: dict[str, list[int]] = {}
    fresh = {a.gateway for a in activities}
    # A gateway gone quiet no longer counts: neither its load nor its streaks.
    state = replace(state, streaks={k: v for k, v in state.streaks.items() if k[0] in fresh})
    for act in activities:
        for m in act.models:
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
            queued=queued, serving=bool(here) and all((h, s.lane_id) in healthy for h, s in here),
        )  # fmt: skip
    return step(state, models, config, now)


def extra_short(fleet: FleetPlan, demand: Demand, extra: Mapping[str, int]) -> dict[str, int]:
    """Personas with lanes added by demand (`extra`) that the plan could not place all of: how
    many of the added ones it placed."""
    out = {}
    for p in demand.personas:
        name = persona_name(p)
        added = extra.get(name, 0)
        if not added or p.lanes is None:
            continue
        missing = p.lanes - sum(1 for h in fleet.hosts for s in h.lanes if s.alias == name)
        if missing > 0:
            out[name] = max(0, added - missing)
    return out
