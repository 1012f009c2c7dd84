"""Rollouts paced per model across the fleet: which hosts get their new plan now.

Pure: the plans the planner wants (`desired`), the plans the hosts hold (`published`) and
what each host's agent reports (`statuses`) in, the plans to publish out. A fleet-wide
change restarts a serving lane; here at most `max_unavailable` lanes of one model are out
of service at a time across all hosts (a count, or a fraction of the model's lanes, at
least one), the next only once they serve again (healthy, not draining, running the spec
their plan gives them: its lane key). A lane whose change is not yet released keeps its previous spec in its
host's plan. A lane that a change broke (its agent's feedback names the spec it last ran
healthy with) halts its model's rollout: the planner reverts that lane (policy.revert_target)
and no other lane of the model takes the change until the config changes again (as the
agent's own halt, HostStatus.rollout_halted) or the failure's feedback expires.

Changes that take nothing out of service go at once: new lanes, removed lanes, lanes that
are down anyway, hosts with no status (no agent reports yet) and specs whose lane key does not change.
The agent paces its own host further (HostPlan.max_restarts).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import msgspec

from shared.lane_key import lane_key
from shared.messages.plans import HostPlan, LaneSpec
from shared.messages.status import HostStatus, LaneStatus


@dataclass(frozen=True)
class Change:
    host: str
    lane_id: str
    model: str
    new: LaneSpec
    old: LaneSpec


def failures(statuses: Mapping[str, HostStatus]) -> dict[tuple[str, str, float], str]:
    """Lanes a change broke (their agent names the spec they last ran healthy with), by (host,
    lane, when the agent noted it): the model of each."""
    return {(host, f.lane_id, f.noted_at): f.model for host, s in statuses.items() for f in s.feedback if f.last_good}


def allowed(max_unavailable: int | float, lanes: int) -> int:
    """Lanes of a model with `lanes` lanes that may be out of service at once (at least one)."""
    if isinstance(max_unavailable, float):
        return max(1, math.floor(max_unavailable * lanes))
    return max(1, max_unavailable)


def runs(spec: LaneSpec, lane: LaneStatus | None) -> bool:
    """Does this lane serve, and run this spec (its lane key; an agent too old to report one
    runs the argv its plan gave it, argv[0] maybe a wrapper)?"""
    if lane is None or lane.state != "healthy" or lane.draining:
        return False
    if lane.lane_key:
        return lane.lane_key == lane_key(spec)
    args = tuple(spec.args)
    return bool(args) and len(lane.argv) > len(args) and tuple(lane.argv[len(lane.argv) - len(args) :]) == args


def _lane(statuses: Mapping[str, HostStatus], host: str, lane_id: str) -> LaneStatus | None:
    status = statuses.get(host)
    return next((x for x in status.lanes if x.lane_id == lane_id), None) if status else None


def paced(
    desired: Mapping[str, HostPlan],
    published: Mapping[str, HostPlan],
    statuses: Mapping[str, HostStatus],
    max_unavailable: int | float = 1,
    lost: Collection[str] = (),
    rejected: Collection[str] = (),
    failed_at: Mapping[tuple[str, str, float], tuple[str, float]] | None = None,
) -> dict[str, HostPlan]:
    """The plan to publish for each host of `desired` (keys are host tokens in all three maps).

    A host's result is its published plan itself when nothing of its change may go yet. Hosts in
    `rejected` refused their latest plan: their lanes serve what they run, and do not hold up
    the rollout of the others. `failed_at`: each lane failure a change caused (`failures`) with the
    config revision current when the planner first saw it; a failure halts its model's rollout
    until the config changes again (None: every failure is of the change now rolling)."""
    changes: list[Change] = []
    for host, want in sorted(desired.items()):
        before = published.get(host)
        old = {s.lane_id: s for s in before.lanes} if before else {}
        for spec in want.lanes:
            prev = old.get(spec.lane_id)
            if prev is not None and lane_key(prev) != lane_key(spec) and _lane(statuses, host, spec.lane_id) is not None:
                changes.append(Change(host, spec.lane_id, spec.model, spec, prev))
    if failed_at is None:  # every failure is of the change now rolling
        failed_at = {key: (model, math.inf) for key, model in failures(statuses).items()}
    held: set[tuple[str, str]] = set()
    reasons: dict[str, list[str]] = {}
    for model in sorted({c.model for c in changes}):
        pending = [c for c in changes if c.model == model and _serving_now(statuses, c)]
        room, why = _room(model, desired, published, statuses, max_unavailable, lost, rejected, failed_at)
        for c in pending:
            if room > 0 and not why:
                room -= 1
                continue
            held.add((c.host, c.lane_id))
            reasons.setdefault(c.host, []).append(
                f"{c.lane_id} keeps its previous spec: {why or f'{model} has lanes out of service (max_unavailable {max_unavailable})'}"
            )
    return {host: _held_back(host, want, published.get(host), held, reasons.get(host, [])) for host, want in desired.items()}


def _out(spec: LaneSpec, lane: LaneStatus | None, halted: bool) -> bool:
    """Out of service, or about to be: not serving its planned spec (the agent restarts it soon),
    unless the agent halted its rollout (then it keeps serving what it runs)."""
    if runs(spec, lane):
        return False
    return not (halted and lane is not None and lane.state == "healthy" and not lane.draining)


def _serving_now(statuses: Mapping[str, HostStatus], change: Change) -> bool:
    """A change that would take a serving lane out (one that is down takes its new spec at once)."""
    lane = _lane(statuses, change.host, change.lane_id)
    return lane is not None and lane.state == "healthy"


def _room(model, desired, published, statuses, max_unavailable, lost, rejected, failed_at) -> tuple[int, str]:
    """(how many more of the model's lanes may go out of service now, why none may: a halt)."""
    newest = max((p.config_revision for p in desired.values()), default=0)
    for (host, lane_id, _), (broken, revision) in sorted(failed_at.items()):
        if broken == model and revision >= newest:  # a failure of an older config's change: it rolls again
            return 0, f"{model}'s rollout halted: its new spec failed on {host} ({lane_id})"
    hosts = (set(published) | set(desired)) - set(lost)
    total = max(
        sum(1 for h in hosts if h in published for s in published[h].lanes if s.model == model),
        sum(1 for h in hosts if h in desired for s in desired[h].lanes if s.model == model),
    )
    out = sum(
        1
        for h in sorted(hosts)
        if h in published and h in statuses
        for s in published[h].lanes
        if s.model == model and _out(s, _lane(statuses, h, s.lane_id), halted=bool(statuses[h].rollout_halted) or h in rejected)
    )
    return allowed(max_unavailable, total) - out, ""


def _held_back(host: str, want: HostPlan, before: HostPlan | None, held: set, reasons: list[str]) -> HostPlan:
    """`want` with its held lanes at their previous spec, numbered past `before`; `before`
    itself when that is all it would be."""
    keep = {s.lane_id: s for s in before.lanes} if before else {}
    lanes = tuple(keep[s.lane_id] if (host, s.lane_id) in held else s for s in want.lanes)
    if lanes == want.lanes:
        return want
    ports = [s.port for s in lanes]
    if len(ports) != len(set(ports)):
        return want  # a held spec's port went to another lane: nothing is held back on this host
    out = msgspec.structs.replace(want, lanes=lanes, reasons=(*want.reasons, *reasons))
    if before is not None and _same(out, before):
        return before
    return msgspec.structs.replace(out, plan_revision=max(want.plan_revision, (before.plan_revision if before else 0) + 1))


def _same(a: HostPlan, b: HostPlan) -> bool:
    """The same plan but for its numbering, author, notes and budgets, which drift with every
    report (nothing for the agent to do: no new revision while a change waits)."""
    blank = dict(plan_revision=0, config_revision=0, planned_by="", reasons=(), budget_ram=0, budget_gpu=0, budget_gpus=())
    return msgspec.structs.replace(a, **blank) == msgspec.structs.replace(b, **blank)
