"""The gateway's Prometheus series: requests, latency, queues, and the lanes as it routes them.

One registry per gateway (several gateways may share a test process). Lane gauges are
read at scrape time, the lanes from the FleetView and their load from the admission's
counts, so a lane that leaves the plan leaves the output.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.admission import LaneCounts
from gateway.fleet import FleetView
from shared.version import VERSION

# Seconds: from sub-millisecond (a cached short answer) to minutes (long generations).
OWN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _FleetCollector(Collector):
    def __init__(self, view: FleetView, counts: LaneCounts) -> None:
        self.view, self.counts = view, counts

    def collect(self):
        labels = ["host", "lane", "model"]
        total = GaugeMetricFamily("lanes_lane_slots", "Slots (llama-server --parallel) of a lane", labels=labels)
        busy = GaugeMetricFamily("lanes_lane_slots_busy", "Requests this gateway has in flight on a lane", labels=labels)
        up = GaugeMetricFamily("lanes_lane_routable", "1 when the gateway sends the lane new requests", labels=labels)
        draining = GaugeMetricFamily("lanes_lane_draining", "1 while the lane's agent drains it", labels=labels)
        for lane in self.view.lanes():
            values = [lane.host_id, lane.lane_id, lane.model]
            total.add_metric(values, lane.parallel)
            busy.add_metric(values, self.counts.busy(lane.key))
            up.add_metric(values, 1 if lane.routable else 0)
            draining.add_metric(values, 1 if lane.draining else 0)
        queue = GaugeMetricFamily("lanes_gateway_queue_depth", "Requests waiting for a free slot", labels=["model"])
        # Every served model, at 0 too: a series that vanished would keep its last value on a graph.
        served = {lane.alias: 0 for lane in self.view.lanes()}
        for name, depth in sorted((served | self.counts.queued).items()):
            queue.add_metric([name], depth)
        info = GaugeMetricFamily("lanes_build_info", "Version of this lanes service", labels=["service", "version"])
        info.add_metric(["gateway", VERSION], 1)
        synced = GaugeMetricFamily("lanes_gateway_fleet_synced", "1 once the plans and status were read from NATS")
        synced.add_metric([], 1 if self.view.synced else 0)
        # The planner's count (KV key `models`), so one scrape of a gateway shows it too.
        evictions = CounterMetricFamily("lanes_evictions", "Lanes the planner unloaded on demand, by reason "
                                        "(idle: past idle_ttl; wake: to make room for a woken model; scaled_down: a lane added by demand, given back)",
                                        labels=["reason"])  # fmt: skip
        counted = self.view.catalogue.evictions if self.view.catalogue else {}
        for reason in ("idle", "wake", "abandoned", "scaled_down"):
            evictions.add_metric([reason], counted.get(reason, 0))
        prompt = CounterMetricFamily("lanes_gateway_prompt_tokens", "Prompt tokens lanes read, from their answers",
                                     labels=["model", "lane"])  # fmt: skip
        cached = CounterMetricFamily(
            "lanes_gateway_cached_prompt_tokens",
            "Prompt tokens lanes reused from a slot or their prompt cache (timings.cache_n)", labels=["model", "lane"],
        )  # fmt: skip
        for (model, lane), n in sorted(self.counts.prompt_tokens.items()):
            prompt.add_metric([model, lane], n)
            cached.add_metric([model, lane], self.counts.cached_tokens.get((model, lane), 0))
        routes = CounterMetricFamily(
            "lanes_gateway_route_choices", "Lane choices by why: affinity, overflow (warm lane over its load"
            " bound), miss (no lane held the prompt), no_prefix (no whole chunk to match: rotated)", labels=["model", "reason"],
        )  # fmt: skip
        for (model, reason), n in sorted(self.counts.routes.items()):
            routes.add_metric([model, reason], n)
        reported = GaugeMetricFamily("lanes_lane_slots_busy_reported", "Busy slots of a lane as its /slots last said",
                                     labels=labels)  # fmt: skip
        for lane in self.view.lanes():
            if lane.key in self.counts.reported:
                reported.add_metric([lane.host_id, lane.lane_id, lane.model], self.counts.reported[lane.key])
        tenants = GaugeMetricFamily("lanes_gateway_tenant_requests_now", "A tenant's requests holding a slot "
                                    "(state in_flight) or waiting for one (queued), by model", labels=["tenant", "model", "state"])  # fmt: skip
        for (model, tenant), n in sorted(self.counts.tenant_in_flight.items()):
            tenants.add_metric([tenant, model, "in_flight"], n)
        for (model, tenant), n in sorted(self.counts.tenant_queued.items()):
            tenants.add_metric([tenant, model, "queued"], n)
        yield from (total, busy, up, draining, queue, info, synced, evictions, prompt, cached, routes, reported, tenants)


class GatewayMetrics:
    def __init__(self, view: FleetView, counts: LaneCounts) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_FleetCollector(view, counts))
        self.requests = Counter(
            "lanes_gateway_requests",
            "Requests answered, by model and HTTP status",
            ["model", "status"],
            registry=self.registry,
        )
        self.endpoint_requests = Counter(
            "lanes_gateway_endpoint_requests",
            "Requests answered, by endpoint (one of the paths the gateway forwards) and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.retries = Counter(
            "lanes_gateway_retries", "Requests sent to a second lane after the first failed before any byte",
            ["model"], registry=self.registry,
        )  # fmt: skip
        self.lane_connections = Counter(
            "lanes_gateway_lane_connections", "Streamed requests' connections to their lanes: a spare opened "
            "ahead of the request (--lane-spares), or a new one", ["how"], registry=self.registry,
        )  # fmt: skip
        self.ttfb = Histogram(
            "lanes_gateway_time_to_first_byte_seconds",
            "From the request's arrival to the first byte of the lane's answer",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.own_time = Histogram(
            "lanes_gateway_own_seconds",
            "The gateway's own time on a streamed answer's way to its first byte: from the request's arrival "
            "to its lane's request sent (its connection to the lane included), and from the lane's first byte to the client's (requests that "
            "waited for no load, no slot and no second lane)",
            ["model"],
            buckets=OWN_BUCKETS,
            registry=self.registry,
        )
        self.cold_starts = Counter(
            "lanes_cold_starts", "Models loaded on request (a held request's model became ready)", ["model"],
            registry=self.registry,
        )  # fmt: skip
        self.cold_start_seconds = Histogram(
            "lanes_cold_start_seconds", "From the first request held for an unloaded model to its lane being ready",
            ["model"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "lanes_gateway_queue_wait_seconds",
            "From a request's arrival to its slot on a lane (held while its model loads, then queued)",
            ["model"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        # By tenant (keys file; "anonymous" without keys, "default" for --api-key) and priority class.
        self.tenant_requests = Counter(
            "lanes_gateway_tenant_requests", "Requests answered, by tenant, class and HTTP status",
            ["tenant", "class", "status"], registry=self.registry,
        )  # fmt: skip
        self.tenant_tokens = Counter(
            "lanes_gateway_tenant_tokens", "Tokens of answers, by tenant, class and kind (prompt, output)",
            ["tenant", "class", "kind"], registry=self.registry,
        )  # fmt: skip
        self.tenant_queue_wait = Histogram(
            "lanes_gateway_tenant_queue_wait_seconds", "From a request's arrival to its slot, by tenant and class",
            ["tenant", "class"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.refusals = Counter(
            "lanes_gateway_refusals", "Requests refused for their tenant or class, by reason (shed, max_concurrent, "
            "tokens_per_minute, tokens_per_day, model_not_allowed)", ["tenant", "class", "reason"], registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "lanes_gateway_request_duration_seconds",
            "From the request's arrival to the answer's last byte",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
