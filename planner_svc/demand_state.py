"""What the planner knows of demand: a value, folded event by event.

Every fold returns a new `DemandState` and leaves the one it was given as it was, so a planning
job reads the state it was handed while the service folds new events into the next one; the
service (planner_svc/service.py) is the only place that replaces the state it holds. Each time
is on the planner's own clock, passed in: nothing here reads a clock, the bus or a file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from planner_svc.scaling import Change, ScaleState, cut, note_report, rescale
from shared.messages.activity import GatewayActivity, ModelStates
from shared.messages.config import FleetConfig, Persona
from shared.messages.plans import HostPlan

WAKE_TTL = 10.0  # seconds a wake lasts unless a gateway repeats it (they do while they hold requests)
FAILED_TTL = 30.0  # seconds a failed wake is answered as failed before a request may try again
STALE_INTERVALS = 3  # a gateway's activity counts for this many of its report intervals


@dataclass(frozen=True)
class DemandState:
    """What the planner knows of demand, each time on its own clock."""

    wakes: Mapping[str, float] = field(default_factory=dict)  # persona name -> latest wake
    woken_since: Mapping[str, float] = field(default_factory=dict)  # persona name -> first wake of those
    on_demand: frozenset[str] = frozenset()  # personas unloaded at least once
    excluded: Mapping[str, frozenset[str]] = field(default_factory=dict)  # model -> hosts it is unloaded from
    loaded_at: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (host, lane) -> first planned
    # (host, lane) -> when its agent first said healthy: the idle clock and the residency start there.
    healthy_at: Mapping[tuple[str, str], float] = field(default_factory=dict)
    last_used: Mapping[str, float] = field(default_factory=dict)  # persona name -> its last request
    gateways: Mapping[str, tuple[float, GatewayActivity]] = field(default_factory=dict)
    failed: Mapping[str, tuple[float, str]] = field(default_factory=dict)  # persona name -> (when, why)
    waiting: Mapping[str, str] = field(default_factory=dict)  # persona name -> why its wake is not placed yet
    evictions: Mapping[str, int] = field(default_factory=dict)  # reason -> lanes unloaded
    # Lanes wanted per on-demand persona (the lanes it has; a wake asks one, an idle unload 0).
    counts: Mapping[str, int] = field(default_factory=dict)
    # Persona name -> when a wake got it placed: while its lanes still load, it is kept only as
    # long as someone waits for it (a client that gave up does not leave a load behind).
    placed_at: Mapping[str, float] = field(default_factory=dict)
    # Measured loads, kept after their lanes are gone: host -> read rate, persona -> seconds.
    rates: Mapping[str, float] = field(default_factory=dict)
    measured: Mapping[str, float] = field(default_factory=dict)
    # Lanes added by measured demand (planner_svc/scaling.py).
    scale: ScaleState = field(default_factory=ScaleState)

    def first_wake(self, name: str) -> float:
        """When `name` was first woken of the wakes it still has (its latest wake for older state)."""
        return self.woken_since.get(name, self.wakes[name])

    def waiting_order(self) -> list[str]:
        """The woken persona names, the first woken first: by their first wake, as gateways repeat
        a wake every second and by the latest one two waiting models swapped places at every replan."""
        return sorted(self.wakes, key=lambda n: (self.first_wake(n), n))

    def note_wake(self, name: str, now: float) -> tuple[DemandState, bool]:
        """A gateway asks for `name`: the state after, and whether the planner must replan (a new
        or failed-out wake)."""
        fresh = name not in self.wakes
        woken = replace(self, wakes={**self.wakes, name: now},
                        woken_since={**self.woken_since, name: self.woken_since.get(name, now) if not fresh else now})  # fmt: skip
        failed = self.failed.get(name)
        if failed is not None and now - failed[0] < FAILED_TTL:
            return woken, False  # answered as failed until FAILED_TTL passes: no retry loop
        woken = replace(woken, failed={n: v for n, v in self.failed.items() if n != name})
        return woken, fresh or name in self.waiting

    def note_activity(
        self, activity: GatewayActivity, now: float, config: FleetConfig | None = None
    ) -> tuple[DemandState, bool]:
        """Fold one gateway's report in: the state after, and whether some model went busy or idle."""
        before = set(self.busy(now))
        last_used = dict(self.last_used)
        for m in activity.models:
            if m.idle_s is not None:
                last_used[m.name] = max(last_used.get(m.name, now - m.idle_s), now - m.idle_s)
        after = replace(self, gateways={**self.gateways, activity.gateway: (now, activity)}, last_used=last_used,
                        scale=note_report(self.scale, activity, config or FleetConfig()))  # fmt: skip
        return after, set(after.busy(now)) != before

    def fresh_activity(self, now: float) -> list[GatewayActivity]:
        """The reports of the gateways heard from lately."""
        return [act for at, act in self.gateways.values() if now - at <= STALE_INTERVALS * act.interval]

    def busy(self, now: float) -> dict[str, int]:
        """Persona name -> requests in flight or queued at gateways heard from lately."""
        out: dict[str, int] = {}
        for act in self.fresh_activity(now):
            for m in act.models:
                if m.in_flight or m.queued:
                    out[m.name] = out.get(m.name, 0) + m.in_flight + m.queued
        return out

    def note_healthy(self, host_id: str, lane_ids: Sequence[str], now: float) -> DemandState:
        new = {(host_id, lane_id): now for lane_id in lane_ids if (host_id, lane_id) not in self.healthy_at}
        return replace(self, healthy_at={**self.healthy_at, **new}) if new else self

    def adopt(self, states: ModelStates) -> DemandState:
        """Carry on from the active planner's `models` key (a stand-by, or a planner restarted)."""
        return replace(self, on_demand=frozenset(m.name for m in states.models if m.on_demand),
                       evictions=dict(states.evictions))  # fmt: skip

    def forget_lanes(self, plans: Mapping[str, HostPlan]) -> DemandState:
        """Drop load times of lanes no plan has any more."""
        live = {(p.host_id, s.lane_id) for p in plans.values() for s in p.lanes}
        names = {s.alias for p in plans.values() for s in p.lanes}
        return replace(self, placed_at={n: t for n, t in self.placed_at.items() if n in names},
                       loaded_at={k: t for k, t in self.loaded_at.items() if k in live},
                       healthy_at={k: t for k, t in self.healthy_at.items() if k in live})  # fmt: skip

    def expire(self, now: float) -> DemandState:
        wakes = {n: t for n, t in self.wakes.items() if now - t < WAKE_TTL}
        return replace(self, wakes=wakes, woken_since={n: t for n, t in self.woken_since.items() if n in wakes},
                       failed={n: v for n, v in self.failed.items() if now - v[0] < FAILED_TTL},
                       waiting={n: why for n, why in self.waiting.items() if n in wakes},
                       gateways={g: v for g, v in self.gateways.items()
                                 if now - v[0] <= STALE_INTERVALS * v[1].interval})  # fmt: skip

    def rescale(
        self, personas: Sequence[Persona], config: FleetConfig, plans: Mapping[str, HostPlan], now: float
    ) -> tuple[DemandState, tuple[Change, ...]]:
        """The scaling rule (planner_svc/scaling.py) applied to the personas with max_lanes: the
        state after, and the changes it made (a replan is due when there are any)."""
        scale, changes = rescale(self.scale, self.fresh_activity(now), self.healthy_at.keys(), personas, plans,
                                 config, now)  # fmt: skip
        removed = sum(1 for c in changes if c.delta < 0)
        evictions = self.evictions
        if removed:
            evictions = {**evictions, "scaled_down": evictions.get("scaled_down", 0) + removed}
        return replace(self, scale=scale, evictions=evictions), changes

    def apply(self, outcome: Outcome, now: float) -> DemandState:
        """A job's outcome taken in (wakes that came meanwhile stay)."""
        done = outcome.placed | set(outcome.failed)
        wakes = {n: t for n, t in self.wakes.items() if n not in done}
        evictions = dict(self.evictions)
        for reason, n in outcome.evicted.items():
            evictions[reason] = evictions.get(reason, 0) + n
        return replace(
            self,
            scale=cut(self.scale, outcome.extra_placed, now) if outcome.extra_placed else self.scale,
            on_demand=self.on_demand | outcome.on_demand,
            counts=dict(outcome.counts),
            excluded=dict(outcome.excluded),
            loaded_at={**self.loaded_at, **outcome.loaded_at},
            wakes=wakes,
            woken_since={n: t for n, t in self.woken_since.items() if n in wakes},
            placed_at={**self.placed_at, **{n: now for n in outcome.placed}},
            failed={**self.failed, **{n: (now, why) for n, why in outcome.failed.items()}},
            waiting={n: why for n, why in outcome.waiting.items() if n in wakes},
            evictions=evictions,
        )


@dataclass(frozen=True)
class Outcome:
    """What one planning job decided about demand, for `DemandState.apply`."""

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
