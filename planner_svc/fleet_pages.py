"""The fleet's status one page at a time, filtered, with a summary that stays small. Pure.

A reply holding every host's report, plan and status grew past NATS's 1 MiB maximum payload
at about 150 hosts (74 MiB at 10,000): `lanes status` then failed with MaxPayloadError. As
Kubernetes' list does (limit and continue) and Nomad's and Consul's UIs do, the planner
answers a FleetQuery with the hosts after a cursor that match its filters, at most `limit` of
them and never more than PAGE_BYTES encoded, plus a summary of the whole fleet whose size
grows with the models and lane states, not with the hosts.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from shared.messages.activity import ModelState, ModelStates
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan
from shared.messages.replies import FleetHosts, FleetQuery, FleetStatus, FleetSummary, HostLiveness, ModelLanes
from shared.messages.status import HostStatus

PAGE_BYTES = 256 * 1024  # the most a page may take encoded (NATS allows 1 MiB by default)
ERROR_STATES = frozenset({"failed", "crashed", "mismatch", "unresponsive"})


@dataclass(frozen=True)
class Fleet:
    """What the planner knows, by host id."""

    reports: Mapping[str, HostReport]
    plans: Mapping[str, HostPlan]
    statuses: Mapping[str, HostStatus]
    liveness: Sequence[HostLiveness]  # every host, sorted by host id
    models: Sequence[ModelState]


def _stem(lane_id: str) -> str:
    """The model a lane id names (planner_svc/lane_windows.py lane_id_for: "<model>-<index>")."""
    return lane_id.rpartition("-")[0] or lane_id


def _lane_models(fleet: Fleet, host: str) -> dict[str, str]:
    """Lane id -> model on a host: its plan's, else the lane id's stem (a lane the plan has left)."""
    plan, status = fleet.plans.get(host), fleet.statuses.get(host)
    out = {x.lane_id: _stem(x.lane_id) for x in (status.lanes if status else ())}
    out.update({s.lane_id: s.model for s in (plan.lanes if plan else ())})
    return out


def summary(fleet: Fleet) -> FleetSummary:
    lanes: Counter[tuple[str, str]] = Counter()
    reported: set[tuple[str, str]] = set()
    used = errors = feedback = 0
    for host, status in fleet.statuses.items():
        feedback += len(status.feedback)
        models = _lane_models(fleet, host)
        for lane in status.lanes:
            lanes[(models[lane.lane_id], lane.state)] += 1
            reported.add((host, lane.lane_id))
            used += lane.rss_bytes or 0
            errors += lane.state in ERROR_STATES
    planned = unplaced = 0
    for host, plan in fleet.plans.items():
        unplaced += len(plan.unplaced)
        for spec in plan.lanes:
            planned += spec.memory.total_bytes
            if (host, spec.lane_id) not in reported:
                lanes[(spec.model, "planned")] += 1
    return FleetSummary(
        hosts=len(fleet.liveness), hosts_lost=sum(h.state == "lost" for h in fleet.liveness),
        hosts_rejecting=sum(bool(h.rejected) for h in fleet.liveness),
        lanes=tuple(ModelLanes(model=m, state=s, lanes=n) for (m, s), n in sorted(lanes.items())),
        planned_bytes=planned, used_bytes=used, lane_errors=errors, feedback=feedback, unplaced=unplaced,
    )  # fmt: skip


def matches(query: FleetQuery, fleet: Fleet, live: HostLiveness) -> bool:
    host = live.host_id
    if query.host:
        wanted = query.host
        if not (host.startswith(wanted[:-1]) if wanted.endswith("*") else host == wanted):
            return False
    status = fleet.statuses.get(host)
    if query.model:
        plan = fleet.plans.get(host)
        planned = any(s.model == query.model for s in (plan.lanes if plan else ()))
        if not planned and not any(_stem(x.lane_id) == query.model for x in (status.lanes if status else ())):
            return False
    if query.state and query.state != live.state:
        if not any(x.state == query.state for x in (status.lanes if status else ())):
            return False
    return True


def _size(value) -> int:
    return len(msgspec.json.encode(value))


def page(fleet: Fleet, query: FleetQuery, head: FleetStatus, totals: FleetSummary | None = None) -> FleetStatus:
    """One page: `head` (the config and the planner's own fields) with the hosts after
    query.after that match, the models naming only them, the summary (`totals`, when the caller
    keeps one: a fleet of 10,000 hosts is paged hundreds of times) and the cursor."""
    filtered = query.host or query.model or query.state
    matched = [h for h in fleet.liveness if matches(query, fleet, h)] if filtered else list(fleet.liveness)
    start = bisect.bisect_right([h.host_id for h in matched], query.after) if query.after else 0
    totals = summary(fleet) if totals is None else totals
    base = msgspec.structs.replace(head, summary=totals, matched=len(matched), next_after="~" * 128)
    bare = [_within(m, set()) for m in fleet.models]
    room = PAGE_BYTES - _size(base) - _size(bare)
    taken: list[HostLiveness] = []
    for live in matched[start:]:
        if len(taken) == query.limit:
            break
        host = live.host_id
        named = 2 * (len(host) + 3) * len(bare)  # at most: in every model's hosts and holders
        cost = _size(live) + named + sum(_size(x) for x in (fleet.reports.get(host), fleet.plans.get(host),
                                                            fleet.statuses.get(host)) if x is not None) + 4  # fmt: skip
        if taken and cost > room:
            break
        taken.append(live)
        room -= cost
    ids = {h.host_id for h in taken}
    more = start + len(taken) < len(matched)
    return msgspec.structs.replace(
        base,
        hosts=tuple(taken),
        reports=tuple(fleet.reports[h] for h in sorted(ids) if h in fleet.reports),
        plans=tuple(fleet.plans[h] for h in sorted(ids) if h in fleet.plans),
        statuses=tuple(fleet.statuses[h] for h in sorted(ids) if h in fleet.statuses),
        models=tuple(_within(m, ids) for m in fleet.models),
        next_after=taken[-1].host_id if more and taken else "",
    )


def _within(model: ModelState, hosts: set[str]) -> ModelState:
    """The model as this page sees it: the hosts it names are the page's (the summary counts all)."""
    return msgspec.structs.replace(model, hosts=tuple(h for h in model.hosts if h in hosts),
                                   holders=tuple(h for h in model.holders if h in hosts))  # fmt: skip


# ------------------------------------------------------------------ the values every host shares

NAMED_HOSTS = 16  # hosts a model names in the `models` key (it counts them all)


def hosts_value(liveness: Sequence[HostLiveness]) -> FleetHosts:
    """The `hosts` key: the hosts not simply live (lost, or refusing their plan), and how many
    there are in all; a healthy fleet of any size is a few bytes (it was 0.7 MiB at 10,000)."""
    odd = tuple(msgspec.structs.replace(h, seen_ago_s=0.0) for h in liveness if h.state != "live" or h.rejected)
    return FleetHosts(hosts=odd, total=len(liveness))


def models_value(states: ModelStates) -> ModelStates:
    """The `models` key: each model names at most NAMED_HOSTS of its hosts and holders, and counts
    them all (every holder of 3 models at 10,000 hosts was 0.75 MiB)."""
    cut = []
    for m in states.models:
        if len(m.hosts) > NAMED_HOSTS or len(m.holders) > NAMED_HOSTS:
            m = msgspec.structs.replace(m, hosts=m.hosts[:NAMED_HOSTS], holders=m.holders[:NAMED_HOSTS],
                                        host_count=len(m.hosts), holder_count=len(m.holders))  # fmt: skip
        cut.append(m)
    return msgspec.structs.replace(states, models=tuple(cut))
