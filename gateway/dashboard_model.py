"""What the dashboard shows: a pure view model over the gateway's FleetView, no sockets, no clock.

The page shows exactly what the gateway routes with (the same FleetView), plus the lane
events the edge (gateway/dashboard.py) collects. Keeping this pure means the page's
numbers (memory bars, windows, states) are tested here without a browser or a server.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import msgspec

from gateway.fleet import FleetView, LaneKey, LaneRoute
from shared.messages import FleetConfig, HostReport, LaneEvent, LaneSpec, LaneStatus

class EventFeed:
    """The newest lane events, newest first, bounded."""

    def __init__(self, max_events: int = 100) -> None:
        self.items: deque[dict] = deque(maxlen=max_events)

    def add(self, event: LaneEvent, at: float) -> dict:
        item = {"at": at, "host": event.host_id, "lane": event.lane_id, "event": event.event, "detail": event.detail}
        self.items.appendleft(item)
        return item


def dashboard_snapshot(view: FleetView, events: EventFeed, rates: Mapping[LaneKey, float] | None = None) -> dict:
    """The page's whole state: hosts with a memory bar per device, lanes, unplaced models, config, events."""
    rates = rates or {}
    config = view.config or FleetConfig()
    hosts = sorted(set(view.reports) | set(view.plans) | set(view.statuses))
    routes = {lane.key: lane for lane in view.lanes()}
    unplaced = [
        {"host": plan.host_id, "model": u.model, "reason": u.reason}
        for plan in (view.plans[h] for h in hosts if h in view.plans)
        for u in plan.unplaced
    ]
    return {
        "config": msgspec.to_builtins(config),
        "config_revision": _config_revision(config, view.config_revision),
        "synced": view.synced,
        "hosts": [_host(view, h, config, routes, rates) for h in hosts],
        "unplaced": unplaced,
        "events": list(events.items),
    }


def _host(view: FleetView, host: str, config: FleetConfig, routes: Mapping[LaneKey, LaneRoute],
          rates: Mapping[LaneKey, float]) -> dict:  # fmt: skip
    report, plan, status = view.reports.get(host), view.plans.get(host), view.statuses.get(host)
    live = {lane.lane_id: lane for lane in status.lanes} if status else {}
    specs = plan.lanes if plan else ()
    host_id = (report or plan or status).host_id
    lanes = []
    for spec in specs:
        key = (host_id, spec.lane_id)
        lanes.append(_lane(spec, live.get(spec.lane_id), routes.get(key), view.busy(key), rates.get(key, 0.0)))
    return {
        "host_id": host_id,
        "state": getattr(status, "host_state", None) or "live",
        "plan_revision": plan.plan_revision if plan else None,
        "applied_revision": status.plan_revision if status else None,
        "rollout_halted": status.rollout_halted if status else "",
        "devices": _devices(report, specs, live, config),
        "lanes": lanes,
    }


def _config_revision(config: FleetConfig, kv_revision: int) -> int:
    """The count of config changes where the config carries one, else the KV revision."""
    return getattr(config, "revision", 0) or kv_revision


def _lane(spec: LaneSpec, lane: LaneStatus | None, route: LaneRoute | None, busy: int, rate: float) -> dict:
    state = lane.state if lane else "pending"
    if route is not None and route.draining:
        state = "draining"
    elif route is not None and route.unreachable and state == "healthy":
        state = "unreachable"
    return {
        "lane_id": spec.lane_id,
        "model": spec.model,
        "alias": spec.alias,
        "port": spec.port,
        "device": spec.memory.device,
        "ctx_per_slot": spec.ctx_per_slot,
        "parallel": spec.parallel,
        "ctx_total": spec.ctx_total,
        "cache_type_k": spec.cache_type_k or "f16",
        "cache_type_v": spec.cache_type_v or "f16",
        "flash_attn": spec.flash_attn or "default",
        "state": state,
        "unreachable": route.unreachable if route else "",
        "slots_busy": busy,
        "requests_per_second": round(rate, 2),
        "planned_bytes": spec.memory.total_bytes,
        "kv_planned_bytes": spec.memory.kv_bytes,
        "kv_real_bytes": lane.kv_bytes if lane else None,
        "rss_bytes": lane.rss_bytes if lane else None,
        "restarts": lane.restarts if lane else 0,
        "last_error": lane.last_error if lane else "",
    }


def _devices(report: HostReport | None, specs, live: Mapping[str, LaneStatus], config: FleetConfig) -> list[dict]:
    """One memory bar per device: planned weights, KV, compute, the headroom kept, what is free."""
    if report is None:
        return []
    bars = [_bar("CPU", report.ram_total, report.ram_available + report.lanes_rss, config)]
    bars += [_bar(f"GPU{i} {g.name}", g.vram_total, g.vram_free, config) for i, g in enumerate(report.gpus)]
    for spec in specs:
        bar = bars[0] if spec.memory.device == "cpu" or len(bars) == 1 else bars[1]
        m = spec.memory
        bar["weights"] += m.weights_bytes
        bar["kv"] += m.kv_bytes + m.recurrent_bytes
        bar["compute"] += m.compute_bytes + m.overhead_bytes
        lane = live.get(spec.lane_id)
        if lane and lane.rss_bytes is not None and spec.memory.device == "cpu":
            bar["real"] += lane.rss_bytes
    for bar in bars:
        planned = bar["weights"] + bar["kv"] + bar["compute"]
        bar["free"] = max(0, bar["available"] - planned - bar["headroom"])
    return bars


def _bar(name: str, total: int, available: int, config: FleetConfig) -> dict:
    headroom = min(total, config.headroom_bytes + int(config.headroom_fraction * total))
    return {"device": name, "total": total, "available": min(total, available), "headroom": headroom,
            "weights": 0, "kv": 0, "compute": 0, "real": 0, "free": 0}  # fmt: skip
