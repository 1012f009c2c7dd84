"""The planner's Prometheus series: the fleet as planned, and the planner's own work.

Read from the planner's state at scrape time (no second copy to keep in step).
Names follow `lanes_*` in base units; labels are host, lane, model and device only.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.version import VERSION

REPLAN_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30)


class _PlanCollector(Collector):
    def __init__(self, service) -> None:
        self.service = service

    def collect(self):
        state = self.service.state
        lane_labels = ["host", "lane", "model", "device"]
        planned = GaugeMetricFamily("lanes_plan_lane_bytes", "Memory the plan gives a lane", labels=lane_labels)
        kv = GaugeMetricFamily("lanes_plan_lane_kv_bytes", "KV cache the plan predicts for a lane", labels=lane_labels)
        slots = GaugeMetricFamily("lanes_plan_lane_slots", "Slots a lane is planned with", labels=["host", "lane", "model"])
        budget = GaugeMetricFamily("lanes_plan_budget_bytes", "Memory lanes may use on a host", labels=["host", "device"])
        unplaced = GaugeMetricFamily("lanes_plan_unplaced", "Models the plan could not place on a host",
                                     labels=["host", "model"])  # fmt: skip
        for host, plan in sorted(state.plans.items()):
            budget.add_metric([plan.host_id, "cpu"], plan.budget_ram)
            budget.add_metric([plan.host_id, "gpu"], plan.budget_gpu)
            for spec in plan.lanes:
                planned.add_metric([plan.host_id, spec.lane_id, spec.model, spec.memory.device], spec.memory.total_bytes)
                kv.add_metric([plan.host_id, spec.lane_id, spec.model, spec.memory.device], spec.memory.kv_bytes)
                slots.add_metric([plan.host_id, spec.lane_id, spec.model], spec.parallel)
            counts: dict[str, int] = {}
            for u in plan.unplaced:
                counts[u.model] = counts.get(u.model, 0) + 1
            for model, n in sorted(counts.items()):
                unplaced.add_metric([plan.host_id, model], n)
        ram = GaugeMetricFamily("lanes_host_memory_bytes", "Memory a host reports in all", labels=["host", "device"])
        free = GaugeMetricFamily("lanes_host_memory_available_bytes", "Memory a host reports free",
                                 labels=["host", "device"])  # fmt: skip
        for host, report in sorted(state.reports.items()):
            ram.add_metric([report.host_id, "cpu"], report.ram_total)
            free.add_metric([report.host_id, "cpu"], report.ram_available)
            for i, gpu in enumerate(report.gpus):
                ram.add_metric([report.host_id, f"gpu{i}"], gpu.vram_total)
                free.add_metric([report.host_id, f"gpu{i}"], gpu.vram_free)
        rollbacks = GaugeMetricFamily("lanes_plan_rollbacks", "Lanes whose change failed and go back to their last "
                                      "good spec, as agents report", labels=["host"])  # fmt: skip
        for host, status in sorted(state.statuses.items()):
            rollbacks.add_metric([status.host_id], sum(1 for f in status.feedback if f.last_good is not None))
        lost = GaugeMetricFamily("lanes_host_lost", "1 while a host is lost (silent past host_lost_after)",
                                 labels=["host"])  # fmt: skip
        rejected = GaugeMetricFamily("lanes_host_plan_rejected", "1 while a host's agent refuses its latest plan",
                                     labels=["host"])  # fmt: skip
        for entry in state.liveness():
            lost.add_metric([entry.host_id], 1 if entry.state == "lost" else 0)
            rejected.add_metric([entry.host_id], 1 if entry.rejected else 0)
        hosts = GaugeMetricFamily("lanes_planner_hosts", "Hosts that reported")
        hosts.add_metric([], len(state.reports))
        revision = GaugeMetricFamily("lanes_planner_config_revision", "Revision of the fleet config planned with")
        revision.add_metric([], state.config_revision)
        replans = CounterMetricFamily("lanes_planner_replans", "Replans done")
        replans.add_metric([], self.service.replans)
        info = GaugeMetricFamily("lanes_build_info", "Version of this lanes service", labels=["service", "version"])
        info.add_metric(["planner", VERSION], 1)
        evictions = CounterMetricFamily("lanes_evictions", "Lanes unloaded on demand, by reason (idle: past its "
                                        "idle_ttl; wake: to make room for a woken model; scaled_down: a lane added by demand, given back)", labels=["reason"])  # fmt: skip
        for reason in ("idle", "wake", "abandoned", "scaled_down"):
            evictions.add_metric([reason], state.demand_state.evictions.get(reason, 0))
        yield from (planned, kv, slots, budget, unplaced, ram, free, rollbacks, lost, rejected, hosts, revision, replans, info, evictions)


class PlannerMetrics:
    def __init__(self, service) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PlanCollector(service))
        self.replan_seconds = Histogram("lanes_planner_replan_seconds", "Time one replan took",
                                        buckets=REPLAN_BUCKETS, registry=self.registry)  # fmt: skip
