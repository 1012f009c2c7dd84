"""Where each lane's saved slots go when it stops or restarts: its buddy, another lane of the same
model that serves meanwhile (docs/slot-cache.md, "Moves"). Pure; planner_svc/planning.py calls it.

"The same model" is the same persona: model and alias. Lanes dedicated to a tenant (an alias whose
cache is private, docs/tenants.md) never send a conversation's cache to a lane others share.

Buddies are chosen when a host's lanes change (a replan that changes no lane keeps them as they
are: a restarted planner rewrites no plan). A lane keeps its buddy while that lane still serves the
model; a lane without one gets a lane of its model on its own host first (no network between
them), else the first lane of the next host by id that serves the model (a ring: each host's
slots go to one other, none takes everyone's). Lost hosts serve nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping

import msgspec

from shared.messages.plans import HostPlan, LaneSpec


def with_buddies(new: Mapping[str, HostPlan], fleet: Mapping[str, HostPlan], lost: Collection[str] = ()) -> dict[str, HostPlan]:
    """`new`: the plans just made, by host id; `fleet`: every host's current plan, by host id (the
    new ones' previous versions among them). Returns the new plans, each lane with its buddy, and
    every other host's plan whose buddies change with them (a lane that had none, or whose buddy
    left): a plan that changes only so is written as its next revision."""
    lost = set(lost)
    quick = _kept_as_they_were(new, fleet)
    if quick is not None:
        return quick
    plans = {h: p for h, p in fleet.items() if h not in lost} | dict(new)
    models = {_persona(s) for p in new.values() for s in p.lanes}
    models |= {_persona(s) for h, p in fleet.items() if h in new for s in p.lanes}  # lanes gone from a new plan
    if not models:
        return dict(new)
    serving: dict[tuple, dict[str, list[str]]] = {}  # persona -> host -> its lanes of the persona
    for h in sorted(plans):
        for s in plans[h].lanes:
            if _persona(s) in models:
                serving.setdefault(_persona(s), {}).setdefault(h, []).append(s.lane_id)
    hosts = {model: list(by_host) for model, by_host in serving.items()}  # sorted: the ring of successors
    out = {}
    for host, hp in plans.items():
        if host not in new and not any(_persona(s) in models for s in hp.lanes):
            continue  # nothing of its models changed: its buddies stand
        before = {s.lane_id: s for s in fleet[host].lanes} if host in fleet else {}
        lanes = tuple(_buddied(spec, before.get(spec.lane_id), host, serving, hosts) for spec in hp.lanes)
        if lanes == hp.lanes and host not in new:
            continue
        made = msgspec.structs.replace(hp, lanes=lanes)
        stored = fleet.get(host)
        if stored is not None and made != stored and made.plan_revision <= stored.plan_revision:
            made = msgspec.structs.replace(made, plan_revision=stored.plan_revision + 1)
        out[host] = made
    return out


def _kept_as_they_were(new, fleet) -> dict[str, HostPlan] | None:
    """The common replan: the new plans run the lanes they ran. Their buddies carry over as they
    were, and no other host's plan changes (no scan of the fleet); else None. Buddies are chosen
    again only when a host's lanes change: a replan that changes no lane (a restarted planner, a
    report) never rewrites a plan for a buddy. A buddy gone meanwhile only means an offer nobody
    takes: its lane's conversations start cold, as before moves."""
    out = {}
    for host, hp in new.items():
        stored = fleet.get(host)
        if stored is None or [(s.lane_id, _persona(s)) for s in hp.lanes] != [(s.lane_id, _persona(s)) for s in stored.lanes]:
            return None
        lanes = [_with(spec, (old.slot_buddy_host, old.slot_buddy_lane)) for spec, old in zip(hp.lanes, stored.lanes)]
        made = msgspec.structs.replace(hp, lanes=tuple(lanes))
        if made != stored and made.plan_revision <= stored.plan_revision:
            made = msgspec.structs.replace(made, plan_revision=stored.plan_revision + 1)
        out[host] = made
    return out


def _buddied(spec: LaneSpec, old: LaneSpec | None, host: str, serving, hosts) -> LaneSpec:
    by_host = serving.get(_persona(spec), {})
    kept = (old.slot_buddy_host, old.slot_buddy_lane) if old is not None else (None, None)
    if kept[0] is not None and kept != (host, spec.lane_id) and kept[1] in by_host.get(kept[0], ()):
        return _with(spec, kept)
    return _with(spec, _choose(by_host, hosts.get(_persona(spec), []), host, spec.lane_id))


def _choose(by_host: Mapping[str, list[str]], ring: list[str], host: str, lane_id: str) -> tuple[str | None, str | None]:
    """Another lane of the model on its own host, else the first lane of the next host that
    serves the model (hosts in id order, as a ring: buddies spread, one per host)."""
    for other in by_host.get(host, ()):
        if other != lane_id:
            return host, other
    if not ring or ring == [host]:
        return None, None
    i = bisect.bisect_right(ring, host) % len(ring)
    nxt = ring[i] if ring[i] != host else ring[(i + 1) % len(ring)]
    return nxt, by_host[nxt][0]


def _persona(spec: LaneSpec) -> tuple[str, str | None]:
    return spec.model, spec.alias


def _with(spec: LaneSpec, buddy: tuple[str | None, str | None]) -> LaneSpec:
    if (spec.slot_buddy_host, spec.slot_buddy_lane) == buddy:
        return spec
    return msgspec.structs.replace(spec, slot_buddy_host=buddy[0], slot_buddy_lane=buddy[1])
