"""A planning job: a snapshot of the planner state's inputs, planned later off the event loop.

`planning_job` reads the state on the event loop and changes nothing; the job it returns runs
in a thread, and planner_svc.service applies its `Planned`. It reads the state as
`PlanningInputs` (what planner_svc.state.PlannerState holds), so it does not import the state
that calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

import msgspec

from planner_svc.demand import plan_on_demand
from planner_svc.demand_state import DemandState, Outcome
from planner_svc.slot_buddies import with_buddies
from shared import subjects
from shared.messages.config import Demand, FleetConfig
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan
from shared.messages.status import HostStatus


class PlanningInputs(Protocol):
    """What a planning job reads of the planner's state (planner_svc.state.PlannerState)."""

    config: FleetConfig
    config_revision: int
    demand: Demand | None
    demand_state: DemandState
    reports: dict[str, HostReport]
    rpc_hosts: set[str]
    statuses: dict[str, HostStatus]
    plans: dict[str, HostPlan]
    plan_seen: dict[str, int]
    lost: set[str]
    replan_all: bool
    replan_hosts: set[str]
    planner_id: str
    clock: Callable[[], float]

    def demand_engaged(self) -> bool: ...


class Planned(NamedTuple):
    """What a planning job returns: the plans by host key, and its demand outcome to apply."""

    plans: dict[str, HostPlan]
    outcome: Outcome
    # Other hosts' plans rewritten for their lanes' buddies alone (planner_svc/slot_buddies.py): a
    # host whose next plan waits for its rollout turn keeps that one (its buddies come with it).
    buddies: dict[str, HostPlan] = {}


def planning_job(state: PlanningInputs) -> Callable[[], Planned]:
    """A snapshot of the inputs, planned later off the event loop (the watch keeps
    changing the live dicts meanwhile).

    Only the hosts whose inputs changed are planned, unless the config or demand
    changed or the demand places lanes across hosts (`lanes` set on a persona): a
    host's plan then depends on its own report, status and previous plan alone.
    """
    fleet_wide = state.demand is not None and any(p.lanes is not None for p in state.demand.personas)
    fleet_wide = fleet_wide or state.demand_engaged()
    # A span lane (one lane across hosts) ties its serving host's plan to its workers' plans.
    fleet_wide = fleet_wide or bool(state.rpc_hosts)
    # A lost host's plan is left as it is; its fleet-wide lanes are placed on the live ones.
    if state.replan_all or fleet_wide:
        reports = [r for h, r in state.reports.items() if h not in state.lost]
    else:
        reports = [state.reports[h] for h in sorted(state.replan_hosts) if h in state.reports and h not in state.lost]
    # A newer revision seen on the key (a foreign write the agent may have applied) is
    # passed over, so the plan that replaces it is not refused as older.
    wanted = {subjects.host_token(r.host_id) for r in reports}
    # A few hosts in a large fleet: look them up rather than walk every plan (bench/planner_bench.py).
    plans = state.plans
    if len(wanted) < len(plans):
        plans = {h: plans[h] for h in sorted(wanted) if h in plans}
    previous = {
        p.host_id: msgspec.structs.replace(p, plan_revision=max(p.plan_revision, state.plan_seen.get(host, 0)))
        for host, p in plans.items()
        if host in wanted
    }
    every = _ByHostId(dict(state.plans))  # each lane's buddy may be on any host (a copy: the job runs apart)
    lost = {p.host_id for h, p in every.plans.items() if h in state.lost} if state.lost else set()
    config, demand, config_revision, me = state.config, state.demand, state.config_revision, state.planner_id
    statuses = state.statuses
    per_host = {
        r.host_id: s.feedback if (s := statuses.get(subjects.host_token(r.host_id))) else () for r in reports
    }
    now = state.clock()
    demand_state = state.demand_state.expire(now)  # a value: the watch folds new events into the next one

    def job() -> Planned:
        fleet, outcome = plan_on_demand(
            reports, config, demand, demand_state, now=now, previous=previous, feedback=per_host,
            config_revision=config_revision,
        )  # fmt: skip
        planned = {h.host_id: h for h in fleet.hosts}
        made = with_buddies(planned, every, lost)
        plans = {subjects.host_token(h): msgspec.structs.replace(p, planned_by=me) for h, p in made.items() if h in planned}
        others = {subjects.host_token(h): msgspec.structs.replace(p, planned_by=me) for h, p in made.items() if h not in planned}
        return Planned(plans, outcome, others)

    return job


class _ByHostId(Mapping):
    """Plans keyed by host token, read by host id (planner_svc/slot_buddies.py), without a copy
    keyed otherwise on every job (a single host's replan at 10,000 hosts takes under a millisecond)."""

    def __init__(self, plans: dict[str, HostPlan]) -> None:
        self.plans = plans

    def __getitem__(self, host_id: str) -> HostPlan:
        plan = self.plans[subjects.host_token(host_id)]
        if plan.host_id != host_id:
            raise KeyError(host_id)
        return plan

    def __iter__(self):
        return (p.host_id for p in self.plans.values())

    def __len__(self) -> int:
        return len(self.plans)
