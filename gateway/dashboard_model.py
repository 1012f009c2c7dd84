"""What the dashboard shows, folded from the bus: a pure view model, no sockets, no clock.

The edge (gateway/dashboard.py) feeds it KV entries and lane events as they arrive and
pushes `snapshot()` to every open page. Keeping the fold pure means the page's numbers
(memory bars, windows, states) are tested here without a browser or a server.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import msgspec

from shared import subjects
from shared.messages import FleetConfig, HostPlan, HostReport, HostStatus, LaneEvent, LaneSpec, LaneStatus

EVENT_KINDS_SHOWN = ("started", "healthy", "crashed", "stopped", "failed", "mismatch", "rejected", "draining",
                     "unresponsive", "rolled_back")  # fmt: skip


class LaneTraffic(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway itself sees of a lane: requests in flight and recent rate."""

    busy: int = 0
    requests_per_second: float = 0.0


class DashboardModel:
    def __init__(self, max_events: int = 100) -> None:
        self.config = FleetConfig()
        self.config_revision = 0
        self.reports: dict[str, HostReport] = {}
        self.plans: dict[str, HostPlan] = {}
        self.statuses: dict[str, HostStatus] = {}
        self.events: deque[dict] = deque(maxlen=max_events)

    def apply_kv(self, key: str, value: bytes | None, revision: int) -> bool:
        """Fold one KV entry in; False (and nothing changed) for keys the page does not show or bad values."""
        kind, _, host = key.partition(".")
        tables: dict[str, tuple[dict, type]] = {
            "report": (self.reports, HostReport),
            "plan": (self.plans, HostPlan),
            "status": (self.statuses, HostStatus),
        }
        try:
            if key == subjects.CONFIG_KEY:
                self.config = FleetConfig() if value is None else msgspec.json.decode(value, type=FleetConfig)
                self.config_revision = _config_revision(self.config, revision)
                return True
            if kind not in tables or not host:
                return False
            table, type_ = tables[kind]
            if value is None:
                return table.pop(host, None) is not None
            msg = msgspec.json.decode(value, type=type_)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return False
        if subjects.host_token(msg.host_id) != host:
            return False
        table[host] = msg
        return True

    def add_event(self, event: LaneEvent, at: float) -> dict:
        item = {"at": at, "host": event.host_id, "lane": event.lane_id, "event": event.event, "detail": event.detail}
        self.events.appendleft(item)
        return item

    def snapshot(self, traffic: Mapping[tuple[str, str], LaneTraffic] | None = None) -> dict:
        traffic = traffic or {}
        hosts = sorted(set(self.reports) | set(self.plans) | set(self.statuses))
        unplaced = [
            {"host": plan.host_id, "model": u.model, "reason": u.reason}
            for plan in (self.plans[h] for h in hosts if h in self.plans)
            for u in plan.unplaced
        ]
        return {
            "config": msgspec.to_builtins(self.config),
            "config_revision": self.config_revision,
            "hosts": [self._host(h, traffic) for h in hosts],
            "unplaced": unplaced,
            "events": list(self.events),
        }

    def _host(self, host: str, traffic: Mapping[tuple[str, str], LaneTraffic]) -> dict:
        report, plan, status = self.reports.get(host), self.plans.get(host), self.statuses.get(host)
        live = {lane.lane_id: lane for lane in status.lanes} if status else {}
        specs = plan.lanes if plan else ()
        host_id = (report or plan or status).host_id
        lanes = [_lane(s, live.get(s.lane_id), traffic.get((host_id, s.lane_id), LaneTraffic())) for s in specs]
        return {
            "host_id": host_id,
            "state": getattr(status, "host_state", None) or "live",
            "plan_revision": plan.plan_revision if plan else None,
            "applied_revision": status.plan_revision if status else None,
            "rollout_halted": status.rollout_halted if status else "",
            "devices": _devices(report, specs, live, self.config),
            "lanes": lanes,
        }


def _config_revision(config: FleetConfig, kv_revision: int) -> int:
    """The count of config changes where the config carries one, else the KV revision."""
    return getattr(config, "revision", 0) or kv_revision


def _lane(spec: LaneSpec, lane: LaneStatus | None, seen: LaneTraffic) -> dict:
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
        "state": lane.state if lane else "pending",
        "slots_busy": seen.busy,
        "requests_per_second": round(seen.requests_per_second, 2),
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
