"""The planner's view of the lanes bucket: a fold of KV entries into inputs for the planner.

No NATS and no wall clock (the clock is passed in). `PlannerState` is the one object the
service changes in place: planner_svc.service feeds it the watch (`apply`), asks it what to
replan, and writes what `planning_job` returns. Its demand questions (a wake, a gateway's
activity, what time alone calls for, the models' states, a job's outcome) change nothing: each
returns a new `DemandState` (planner_svc/demand_state.py, a value) beside its answer, and the
service puts it in place. Beside it: planner_svc/planning.py (the planning job),
planner_svc/plan_writes.py (the bookkeeping of a plan write), planner_svc/answers.py (the
endpoints' pure answers).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import structlog

from planner_svc.demand import demand_due, engaged, model_states, rescaled
from planner_svc.demand_state import DemandState, Outcome
from planner_svc.planning import Planned, planning_job
from planner_svc.scaling import Change
from shared import defaults, subjects
from shared.messages.activity import ModelStates
from shared.messages.config import Demand, FleetConfig
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan
from shared.messages.replies import HostLiveness
from shared.messages.status import HostStatus, PlanRejected
from shared.messages.wire import schema_problem

log = structlog.get_logger("lanes.planner")
LOST_AFTER_INTERVALS = 3  # a host is lost after this many report intervals of silence


def _logged(changes: tuple[Change, ...]) -> bool:
    """Log the lanes demand adds or removes (planner_svc/scaling.py); True when there are any."""
    for c in changes:
        log.info("lane added by demand" if c.delta > 0 else "lane removed by demand", model=c.name, reason=c.reason)
    return bool(changes)


class PlannerState:
    """The planner's view of the bucket, rebuilt from the watch."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.config = FleetConfig()
        self.config_revision = 0  # counts config changes (FleetConfig.revision)
        self.config_kv_rev = 0  # the config entry's KV revision, for compare-and-set
        self._config_raw: bytes | None = None
        self.demand: Demand | None = None
        self.reports: dict[str, HostReport] = {}
        self.rpc_hosts: set[str] = set()  # hosts whose report offers an RPC worker
        self.statuses: dict[str, HostStatus] = {}
        # The planner's own previous plan per host (adopted from the start-up snapshot, or written).
        self.plans: dict[str, HostPlan] = {}
        self.plan_revs: dict[str, int] = {}  # KV revision of the latest entry, for compare-and-set
        self.plan_seen: dict[str, int] = {}  # highest plan_revision seen on the key
        self.plan_stored: dict[str, bool] = {}  # does the key hold self.plans[host]?
        self.caught_up = False
        # A stand-by planner follows the active one: every plan on a key becomes its own.
        self.following = False
        self.leader = ""  # the lease holder a stand-by follows (whose plans it adopts)
        self.planner_id = ""  # written into every plan this planner writes
        self.seen: dict[str, float] = {}  # host -> when its last report or status came (clock)
        self.lost: set[str] = set()
        self.rejected: dict[str, str] = {}  # host -> why its agent refused the latest plan
        # What the next replan must cover: every host, or only the hosts whose inputs changed.
        self.replan_all = True
        self.replan_hosts: set[str] = set()
        # Models on demand (planner_svc/demand.py): wakes, gateway activity, what was unloaded.
        self.demand_state = DemandState()

    # ------------------------------------------------------------ models on demand

    def _plans_by_host(self) -> dict[str, HostPlan]:
        return {p.host_id: p for p in self.plans.values()}

    def note_wake(self, name: str) -> tuple[DemandState, bool]:
        """The demand state with the wake in, and whether it calls for a replan."""
        return self.demand_state.note_wake(name, self.clock())

    def note_activity(self, activity) -> tuple[DemandState, bool]:
        """The demand state with a gateway's report in, and whether it calls for a replan (a
        model went busy or idle while a wake waits, or the scaling rule adds or removes a lane)."""
        now = self.clock()
        state, changed = self.demand_state.note_activity(activity, now, self.config)
        if changed and (state.waiting or state.wakes):
            return state, True
        state, changes = rescaled(state, self.demand, list(self.reports.values()), self._plans_by_host(),
                                  self.config, now)  # fmt: skip
        return state, _logged(changes)

    def demand_engaged(self) -> bool:
        """Are models on demand in play (then every live host is planned together)?"""
        return engaged(self.demand_state, self.demand, self.config)

    def demand_due(self) -> tuple[DemandState, bool]:
        """The demand state after time passed (old wakes expired, the scaling rule applied), and
        whether time alone calls for a replan (an idle_ttl passed, a wake waits for room, demand
        adds or removes a lane)."""
        state, due, changes = demand_due(self.demand_state, self.demand, list(self.reports.values()),
                                         self._plans_by_host(), self.config, self.clock())  # fmt: skip
        return state, _logged(changes) or due

    def settle_demand(self, outcome: Outcome) -> DemandState:
        """The demand state with a job's outcome in (on the event loop, after the job's thread)."""
        for host, lane, why in outcome.victims:
            log.info("lane unloaded", host=host, lane=lane, reason=why)
        for name, why in outcome.failed.items():
            log.warning("wake failed", model=name, reason=why)
        now = self.clock()
        return self.demand_state.expire(now).apply(outcome, now).forget_lanes(self._plans_by_host())

    def model_states(self) -> tuple[ModelStates, DemandState]:
        return model_states(self.demand, list(self.reports.values()), self._plans_by_host(), self.demand_state,
                            self.statuses)  # fmt: skip

    def apply(self, key: str, value: bytes | None, revision: int) -> bool:
        """Fold one KV entry in. True when the planner must replan (or rewrite a plan)."""
        kind, _, host = key.partition(".")
        try:
            if key == subjects.CONFIG_KEY:
                self.config_kv_rev = revision  # even a bad value: the next config.set replaces it
                self._apply_config(value)
                self.replan_all = True
            elif key == subjects.DEMAND_KEY:
                self.demand = None if value is None else msgspec.json.decode(value, type=Demand)
                self.replan_all = True
            elif kind == "report":
                self._put(self.reports, host, value, HostReport)
                offers = host in self.reports and self.reports[host].rpc_worker is not None
                (self.rpc_hosts.add if offers else self.rpc_hosts.discard)(host)
                self._heard_from(host, value)
                self.replan_hosts.add(host)
            elif kind == "status":
                self._put(self.statuses, host, value, HostStatus)
                if host in self.statuses:
                    s = self.statuses[host]
                    healthy = [x.lane_id for x in s.lanes if x.state == "healthy"]
                    self.demand_state = self.demand_state.note_healthy(s.host_id, healthy, self.clock())
                self._heard_from(host, value)
                applied, planned = self.statuses.get(host), self.plans.get(host)
                if applied and planned and applied.plan_revision >= planned.plan_revision:
                    self.rejected.pop(host, None)  # the agent runs the latest plan
                self.replan_hosts.add(host)
            elif key == subjects.MODELS_KEY:
                # The active planner writes it; one that follows (or starts) carries on from it.
                if value is not None and (self.following or not self.caught_up):
                    self.demand_state = self.demand_state.adopt(msgspec.json.decode(value, type=ModelStates))
                return False
            elif kind == "plan":
                if self._apply_plan(host, value, revision):
                    self.replan_hosts.add(host)
                    return True
                return False
            else:
                return False
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("dropped malformed kv entry", key=key, reason=str(exc))
            return False
        return True

    def _apply_config(self, value: bytes | None) -> None:
        config = FleetConfig() if value is None else msgspec.json.decode(value, type=FleetConfig)
        if (problem := schema_problem(config)) is not None:
            raise msgspec.ValidationError(problem)
        if config.revision:
            self.config_revision = config.revision
        elif value != self._config_raw and self._config_raw is not None:
            self.config_revision += 1  # written around the planner (nats kv put): still one change
        self.config, self._config_raw = config, value

    def _heard_from(self, host: str, value: bytes | None) -> None:
        if value is None:
            self.seen.pop(host, None)
            self.lost.discard(host)
            return
        self.seen[host] = self.clock()
        if host in self.lost:
            self.lost.discard(host)
            log.info("host is back", host=host)
            self.replan_all = True

    def lost_after(self, host: str) -> float:
        if self.config.host_lost_after:
            return self.config.host_lost_after
        report = self.reports.get(host)
        return LOST_AFTER_INTERVALS * (report.report_interval if report else defaults.REPORT_INTERVAL)

    def check_liveness(self) -> bool:
        """Mark hosts silent for too long as lost. True when that calls for a replan."""
        now = self.clock()
        newly = [h for h, t in self.seen.items() if h not in self.lost and now - t > self.lost_after(h)]
        for host in newly:
            self.lost.add(host)
            log.warning(
                "host lost: its plan is kept, fleet-wide lanes move",
                host=host,
                silent_s=round(now - self.seen[host], 1),
            )
        if newly:
            self.replan_all = True
        return bool(newly)

    def liveness(self) -> tuple[HostLiveness, ...]:
        now = self.clock()
        hosts = sorted(set(self.reports) | set(self.statuses))
        return tuple(
            HostLiveness(
                host_id=(self.reports.get(h) or self.statuses[h]).host_id,
                state="lost" if h in self.lost else "live",
                seen_ago_s=round(max(0.0, now - self.seen.get(h, now)), 1),
                rejected=self.rejected.get(h, ""),
            )
            for h in hosts
        )

    def apply_rejection(self, rejection: PlanRejected) -> bool:
        """An agent refused its plan. True when a rewrite can help: its applied plan is newer."""
        host = subjects.host_token(rejection.host_id)
        if host not in self.reports and host not in self.statuses:
            return False  # no such host: nothing to record or rewrite
        self.rejected[host] = f"plan r{rejection.plan_revision}: {rejection.reason[:300]}"
        if rejection.applied_revision > self.plan_seen.get(host, 0):
            self.plan_seen[host] = rejection.applied_revision
            self.plan_stored[host] = False
            self.replan_hosts.add(host)
            return True
        return False

    def _apply_plan(self, host: str, value: bytes | None, revision: int) -> bool:
        """Plans are the planner's own output: anything else on the key is overwritten.

        An entry older than one already seen on the key is a stale read (a watch or get served
        by a replica still catching up): it is ignored, so the compare-and-set revision and the
        previous plan never move backwards."""
        if revision and revision < self.plan_revs.get(host, 0):
            return False
        self.plan_revs[host] = revision if value is not None else 0
        try:
            found = None if value is None else msgspec.json.decode(value, type=HostPlan)
            if found is not None and subjects.host_token(found.host_id) != host:
                raise msgspec.ValidationError(f"host_id {found.host_id!r} does not match key {host!r}")
            if found is not None and (problem := schema_problem(found)) is not None:
                raise msgspec.ValidationError(problem)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("dropped malformed kv entry", key=f"plan.{host}", reason=str(exc), action="rewrite the plan")
            self.plan_stored[host] = False
            return True
        if found is not None:
            self.plan_seen[host] = max(self.plan_seen.get(host, 0), found.plan_revision)
            own = host in self.plans and self.plans[host].planned_by == self.planner_id
            leaders = self.following and found.planned_by and found.planned_by == self.leader
            if not self.caught_up or leaders or (not self.following and not own):
                # A previous (or the active) planner's plan, also one an active planner sees only
                # after its snapshot (a watch on a replica catching up) while it has written none
                # for the host: carry on from the newest, never from nothing (revision 1).
                self.plans[host] = found
        self.plan_stored[host] = found is not None and found == self.plans.get(host)
        if not self.plan_stored[host] and self.caught_up and not self.following:
            log.warning("plan entry not written by this planner; rewriting it", key=f"plan.{host}")
        return not self.plan_stored[host]

    @staticmethod
    def _put(table: dict, host: str, value: bytes | None, kind: type) -> None:
        if value is None:
            table.pop(host, None)
            return
        msg = msgspec.json.decode(value, type=kind)
        if subjects.host_token(msg.host_id) != host:
            raise msgspec.ValidationError(f"host_id {msg.host_id!r} does not match key {host!r}")
        if (problem := schema_problem(msg)) is not None:
            raise msgspec.ValidationError(problem)
        table[host] = msg

    def planning_job(self) -> Callable[[], Planned]:
        """A snapshot of the inputs, planned later off the event loop (planner_svc/planning.py)."""
        job = planning_job(self)
        self.replan_all, self.replan_hosts = False, set()  # the job covers them
        return job
