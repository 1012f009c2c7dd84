"""The agent's Prometheus series: its lanes as it runs them, and llama-server's own series renamed.

llama-server (started with --metrics) names its series `llamacpp:...`; they are
re-exported as `lanes_llama_...` with host, lane and model labels (see
shared.llama.endpoints). Each scrape reads every lane's /metrics at once (bounded by a
short timeout): no background polling, and a lane that does not answer simply has no
series this time.
"""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.version import VERSION
from launcher_agent import lane_http
from launcher_agent.supervisor import Supervisor
from shared.llama import endpoints

SCRAPE_TIMEOUT = 1.0
LANE_LABELS = ["host", "lane", "model"]


class _AgentCollector(Collector):
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.llama: dict[str, list[Metric]] = {}  # lane id -> its renamed series from the last scrape

    def collect(self):
        host = self.sup.cfg.host_id
        gauges = {
            "healthy": GaugeMetricFamily("lanes_lane_healthy", "1 while the lane serves", labels=LANE_LABELS),
            "draining": GaugeMetricFamily("lanes_lane_draining", "1 while the lane drains", labels=LANE_LABELS),
            "slots": GaugeMetricFamily("lanes_lane_slots", "Slots (--parallel) of the lane", labels=LANE_LABELS),
            "threads": GaugeMetricFamily("lanes_lane_threads", "CPU threads (--threads) the plan gives the lane; "
                                         "absent: llama-server's default", labels=LANE_LABELS),  # fmt: skip
            "rss": GaugeMetricFamily("lanes_lane_resident_bytes", "Resident memory of the lane's process",
                                     labels=LANE_LABELS),  # fmt: skip
        }
        by_device = ["host", "lane", "model", "device"]
        planned = GaugeMetricFamily("lanes_lane_planned_bytes", "Memory the plan gives the lane", labels=by_device)
        kv_planned = GaugeMetricFamily("lanes_lane_kv_planned_bytes", "KV cache the plan predicts", labels=by_device)
        kv_real = GaugeMetricFamily("lanes_lane_kv_bytes", "KV cache llama-server reports", labels=by_device)
        restarts = CounterMetricFamily("lanes_lane_restarts", "Restarts of the lane by this agent", labels=LANE_LABELS)
        for lane_id, lane in sorted(self.sup.lanes.items()):
            values = [host, lane_id, lane.spec.model]
            gauges["healthy"].add_metric(values, 1 if lane.state == "healthy" else 0)
            gauges["draining"].add_metric(values, 1 if lane.draining else 0)
            gauges["slots"].add_metric(values, lane.spec.parallel)
            if lane.spec.threads is not None:
                gauges["threads"].add_metric(values, lane.spec.threads)
            restarts.add_metric(values, lane.restarts)
            memory, proc = lane.spec.memory, lane.process
            # Per device when the plan splits the lane (device names as llama-server prints them,
            # lower case: cpu, gpu0 ...); otherwise the whole lane on its one device.
            for d in memory.devices or ():
                planned.add_metric(values + [d.device.lower()], d.total)
                kv_planned.add_metric(values + [d.device.lower()], d.kv_bytes)
            if not memory.devices:
                planned.add_metric(values + [memory.device], memory.total_bytes)
                kv_planned.add_metric(values + [memory.device], memory.kv_bytes)
            printed = proc.printed_devices() if proc is not None and memory.devices else ()
            for d in printed:
                kv_real.add_metric(values + [d.device.lower()], d.kv_bytes)
            if not printed and proc is not None and proc.kv_bytes() is not None:
                kv_real.add_metric(values + [memory.device], proc.kv_bytes())
            if proc is not None and proc.rss() is not None:
                gauges["rss"].add_metric(values, proc.rss())
        halted = CounterMetricFamily("lanes_rollouts_halted", "Config changes this agent stopped rolling out "
                                     "because a lane broke with them (the planner then rolls back)", labels=["host"])  # fmt: skip
        halted.add_metric([host], self.sup.rollouts_halted)
        info = GaugeMetricFamily("lanes_build_info", "Version of this lanes service", labels=["service", "version"])
        info.add_metric(["agent", VERSION], 1)
        yield from (*gauges.values(), planned, kv_planned, kv_real, restarts, halted, info)
        for lane_id in sorted(self.llama):
            if lane_id in self.sup.lanes:
                yield from self.llama[lane_id]


class AgentMetrics:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.registry = CollectorRegistry()
        self._collector = _AgentCollector(sup)
        self.registry.register(self._collector)

    async def refresh(self) -> None:
        """Read every serving lane's /metrics now (called before each scrape)."""
        lanes = [lane for lane in self.sup.lanes.values() if lane.state == "healthy" and lane.process is not None]
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            results = await asyncio.gather(*(self._scrape(session, lane) for lane in lanes))
        self._collector.llama = {lane.spec.lane_id: series for lane, series in zip(lanes, results) if series}

    async def _scrape(self, session: aiohttp.ClientSession, lane) -> list[Metric]:
        url = endpoints.url(lane.spec.bind, lane.spec.port, endpoints.METRICS)
        try:
            async with session.get(url, headers=lane_http.auth_headers(lane.api_key)) as resp:
                if resp.status != 200:
                    return []
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return []
        labels = {"host": self.sup.cfg.host_id, "lane": lane.spec.lane_id, "model": lane.spec.model}
        try:
            return endpoints.rename_llama_series(text, labels)
        except ValueError:
            return []
