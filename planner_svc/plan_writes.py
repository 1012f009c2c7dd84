"""The bookkeeping around one plan write, without NATS: what the planner writes on a host's
key, the revision its compare-and-set expects there, and what it keeps once the write is
won or lost. planner_svc.service does the write between `begin` and `won`/`lost`.

Why a plan's revision in the bucket never goes down: the write expects the key's latest
entry to be the one the planner last saw on it (`plan_revs`), and is numbered at least as
high as every plan revision the planner saw on the key (`plan_seen`, raised by that same
entry). A planner whose view is stale (a restart, a watch served by a replica still
catching up) loses the compare-and-set instead of writing over a newer plan; it then reads
the key's latest entry from the stream's leader and plans again from it.
"""

from __future__ import annotations

import msgspec

from planner_svc.state import PlannerState
from shared.messages.plans import HostPlan


def above_seen(state: PlannerState, host: str, new: HostPlan) -> HostPlan:
    """The plan to write: never numbered below a revision seen on its key. With the write's
    compare-and-set on the key's latest entry (whose revision plan_seen holds), a plan's
    revision in the bucket can only grow."""
    seen = state.plan_seen.get(host, 0)
    return new if new.plan_revision >= seen else msgspec.structs.replace(new, plan_revision=seen + 1)


def begin(state: PlannerState, host: str, new: HostPlan) -> tuple[HostPlan, HostPlan | None, int]:
    """(the plan to write, the previous plan to restore if the write is lost, the key's
    revision the compare-and-set expects: 0 for a key with no plan)."""
    before = state.plans.get(host)
    new = above_seen(state, host, new)
    state.plans[host] = new  # the watch may echo the write before it returns
    return new, before, state.plan_revs.get(host, 0)


def won(state: PlannerState, host: str, new: HostPlan, revision: int) -> None:
    state.plans[host] = new
    state.plan_revs[host] = max(revision, state.plan_revs.get(host, 0))  # the echo may be newer
    state.plan_stored[host] = True
    state.plan_seen[host] = max(state.plan_seen.get(host, 0), new.plan_revision)


def lost(state: PlannerState, host: str, before: HostPlan | None) -> None:
    """The key moved on: keep the previous plan and replan the host (once its latest entry is in)."""
    if before is None:
        state.plans.pop(host, None)
    else:
        state.plans[host] = before
    state.replan_hosts.add(host)
