"""Which lanes to evict so a woken model gets a lane: pure, over byte vectors.

Peers evict by model count (llama.cpp's router), by keep-alive order (Ollama) or least
recently used (LocalAI); none picks victims by the bytes they free on the devices the new
lane needs. Here a woken model goes, in this order:

1. to a host where its lane fits with no eviction (most room left first);
2. else to the host where the smallest set of evictable lanes frees enough on every device
   the lane needs; among sets of one size, the lowest persona priority, then idle before busy,
   then the least recently used, is evicted first.

Kept from eviction: a lane pinned by its persona's `min_lanes`; one that has served for less than
its residency (anti-thrash: A B A A C A B C never swaps on every request); one whose model has
requests in flight or queued at any gateway, until the wake has waited as long as that lane's
residency: then a busy lane of no higher priority than the woken model may go too (it drains:
its requests in flight finish, its queued ones wake it again), so a model wanted all the time
cannot starve the others of the memory; idle lanes go before busy ones. A lane's residency is
RESIDENCY_LOADS times what its load cost, at most the fleet's `min_residency`: a lane serves ten
times its load before a swap may take it, so swapping never spends more than about a tenth of
the time loading, and a model that loads in half a second is not held for 30 s like one that
loads in a minute. bench/router_bench.py showed both: with a flat 30 s and busy lanes never
evicted, requests for the other models waited past the gateway's hold bound where llama.cpp's
router swapped at once. `now` is a value; no clock here.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Resource = tuple  # ("cpu",) or ("gpu", index), as planner_svc.layouts names them

# Sets are searched exhaustively among this many most-preferred candidates per host
# (2^12 subsets at most); a host with more idle lanes than that is searched among these.
MAX_CANDIDATES = 12
RESIDENCY_LOADS = 10.0  # a lane serves this many times its load time before it may be evicted


def residency(min_residency: float, load_seconds: float | None) -> float:
    """Seconds a lane is kept from eviction once it serves: RESIDENCY_LOADS x its load time, at
    most the fleet's `min_residency` (all of it where the load time is not known)."""
    if load_seconds is None or load_seconds <= 0:
        return min_residency
    return min(min_residency, RESIDENCY_LOADS * load_seconds)


@dataclass(frozen=True)
class Candidate:
    """A lane that runs now, as eviction sees it."""

    host_id: str
    lane_id: str
    model: str
    frees: Mapping[Resource, int]  # its predicted bytes per device
    priority: int = 0
    last_used: float = 0.0  # planner clock: its model's last request (or its load)
    loaded_at: float = 0.0  # planner clock: when it was first planned
    busy: bool = False  # requests in flight or queued for its model
    pinned: bool = False  # its persona's min_lanes keeps it
    load_seconds: float | None = None  # what loading it cost (measured, else predicted); None: unknown

    @property
    def key(self) -> tuple[str, str]:
        return (self.host_id, self.lane_id)


@dataclass(frozen=True)
class Room:
    """One host that holds the woken model: what is free, and what its lane needs there."""

    host_id: str
    free: Mapping[Resource, int]
    needs: Mapping[Resource, int] | None  # None: the lane cannot go there even alone
    why_not: str = ""  # the reason, when needs is None


@dataclass(frozen=True)
class Placement:
    host_id: str
    victims: tuple[tuple[str, str], ...] = ()  # (host, lane) to evict first, in preference order
    reason: str = ""


@dataclass(frozen=True)
class NoRoom:
    reason: str
    failed: bool = False  # no host can take the lane even alone: waiting will not help
    blocked: tuple[str, ...] = field(default_factory=tuple)  # why each refused candidate stays


def deficit(room: Room) -> dict[Resource, int]:
    """Bytes the lane lacks on each device it needs (only the positive parts)."""
    assert room.needs is not None
    return {r: b - room.free.get(r, 0) for r, b in room.needs.items() if b > room.free.get(r, 0)}


def refusal(c: Candidate, *, now: float, min_residency: float, waited: float = 0.0, priority: int = 0) -> str:
    """Why a lane may not be evicted now, or "". `waited`: seconds the wake has waited;
    `priority`: the woken persona's."""
    if c.pinned:
        return f"{c.lane_id} on {c.host_id} is pinned (min_lanes)"
    if c.busy and c.priority > priority:
        return f"{c.lane_id} on {c.host_id} has requests in flight or queued, at a higher priority"
    kept = residency(min_residency, c.load_seconds)
    if c.busy and waited < kept:
        return f"{c.lane_id} on {c.host_id} has requests in flight or queued (the wake waited {waited:.0f} of {kept:.1f} s)"
    age = now - c.loaded_at
    if age < kept:
        why = f"min residency {kept:g} s" if kept == min_residency else f"residency {kept:.1f} s: {RESIDENCY_LOADS:g} x its {c.load_seconds:.2f} s load"
        return f"{c.lane_id} on {c.host_id} loaded {age:.0f} s ago ({why})"
    return ""


def preference(c: Candidate) -> tuple:
    """Evicted first: lowest priority, then idle before busy, then least recently used (then a stable order)."""
    return (c.priority, c.busy, c.last_used, c.loaded_at, c.host_id, c.lane_id)


def covers(victims: Sequence[Candidate], need: Mapping[Resource, int]) -> bool:
    return all(sum(v.frees.get(r, 0) for v in victims) >= b for r, b in need.items())


def smallest_set(need: Mapping[Resource, int], eligible: Sequence[Candidate]) -> tuple[Candidate, ...] | None:
    """The fewest lanes that free `need`; among sets of one size, the most preferred (in
    preference order, compared lane by lane). None when even all of them do not."""
    ranked = sorted(eligible, key=preference)[:MAX_CANDIDATES]
    useful = [c for c in ranked if any(c.frees.get(r, 0) > 0 for r in need)]
    for size in range(1, len(useful) + 1):
        for combo in itertools.combinations(useful, size):  # lexicographic: most preferred first
            if covers(combo, need):
                return combo
    return None


def choose(
    rooms: Sequence[Room], candidates: Sequence[Candidate], *, now: float, min_residency: float,
    waited: float = 0.0, priority: int = 0,
) -> Placement | NoRoom:
    """Where the woken model's lane goes, and what must be evicted for it. `waited`: seconds the
    wake has waited; `priority`: the woken persona's."""
    possible = [r for r in rooms if r.needs is not None]
    if not possible:
        why = "; ".join(f"{r.host_id}: {r.why_not}" for r in rooms) or "no host holds this model"
        return NoRoom(f"cannot be placed on any host, even alone: {why}", failed=True)
    fitting = [r for r in possible if not deficit(r)]
    if fitting:
        best = min(fitting, key=lambda r: (-_slack(r), r.host_id))
        return Placement(best.host_id, (), "fits with no eviction")
    options = []
    blocked: list[str] = []
    for room in possible:
        here = [c for c in candidates if c.host_id == room.host_id]
        eligible = []
        for c in here:
            why = refusal(c, now=now, min_residency=min_residency, waited=waited, priority=priority)
            if why:
                blocked.append(why)
            else:
                eligible.append(c)
        need = deficit(room)
        victims = smallest_set(need, eligible)
        if victims is not None:
            options.append((len(victims), [preference(v)[:3] for v in victims], room.host_id, victims))
    if not options:
        why = "; ".join(blocked) if blocked else "evicting every lane would not free enough"
        return NoRoom(f"no room: {why}", blocked=tuple(blocked))
    options.sort(key=lambda o: o[:3])
    _, _, host, victims = options[0]
    names = ", ".join(v.lane_id for v in victims)
    if any(v.busy for v in victims):
        return Placement(host, tuple(v.key for v in victims),
                         f"evicts {names} on {host} (draining busy lanes: the wake waited {waited:.0f} s; the fewest that free enough)")  # fmt: skip
    return Placement(host, tuple(v.key for v in victims), f"evicts {names} on {host} (idle, the fewest that free enough)")


def _slack(room: Room) -> int:
    """The least room left on any device the lane needs, once it is placed."""
    return min((room.free.get(r, 0) - b for r, b in (room.needs or {}).items()), default=0)
