"""What the dashboard shows: a pure view model over the gateway's FleetView, no sockets, no clock.

The page shows exactly what the gateway routes with (the same FleetView and the same
admission counts), plus the lane events the edge (gateway/dashboard/hub.py) collects. Keeping this pure means the page's
numbers (memory bars, windows, states) are tested here without a browser or a server.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from gateway.admission import LaneCounts, catalogue
from gateway.fleet import FleetView, LaneKey, LaneRoute
from shared.lane_key import lane_key
from shared.llama.flags import effective_cache_type
from shared.messages.config import FleetConfig
from shared.messages.hosts import HostReport
from shared.messages.plans import LaneSpec
from shared.messages.status import LaneEvent, LaneStatus


class EventFeed:
    """The newest lane events, newest first, bounded."""

    def __init__(self, max_events: int = 100) -> None:
        self.items: deque[dict] = deque(maxlen=max_events)

    def add(self, event: LaneEvent, at: float) -> dict:
        item = {"at": at, "host": event.host_id, "lane": event.lane_id, "event": event.event, "detail": event.detail}
        self.items.appendleft(item)
        return item


PAGE_HOSTS = 50  # hosts a page shows unless it asks for fewer
MAX_PAGE_HOSTS = 200
MAX_UNPLACED = 100  # unplaced models listed (all are counted)


@dataclass(frozen=True)
class HostFilter:
    """Which hosts a page shows: by part of the host id, by model served, by state (the host's,
    live or lost, or any of its lanes'), one page of them. Bounded: any query makes a page of at
    most MAX_PAGE_HOSTS hosts, so no page grows with the fleet."""

    text: str = ""
    model: str = ""
    state: str = ""
    offset: int = 0
    limit: int = PAGE_HOSTS

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> HostFilter:
        def number(name: str, default: int, top: int) -> int:
            try:
                return max(0, min(top, int(query.get(name, default))))
            except ValueError:
                return default

        return cls(text=query.get("host", "")[:128], model=query.get("model", "")[:128],
                   state=query.get("state", "")[:32], offset=number("offset", 0, 10**7),
                   limit=max(1, number("limit", PAGE_HOSTS, MAX_PAGE_HOSTS)))  # fmt: skip

    def keeps(self, view: FleetView, host: str) -> bool:
        if self.text and self.text not in host:
            return False
        plan, status = view.plans.get(host), view.statuses.get(host)
        if self.model and not (plan and any(self.model in (s.model, s.alias) for s in plan.lanes)):
            return False
        if self.state and view.host_states.get(host, "live") != self.state:
            live = {lane.lane_id: lane.state for lane in status.lanes} if status else {}
            states = {live.get(s.lane_id, "pending") for s in plan.lanes} if plan else set(live.values())
            return self.state in states
        return True


def fleet_summary(view: FleetView, counts: LaneCounts | None = None) -> dict:
    """The whole fleet in a few numbers, whatever its size: hosts by state, lanes by model and
    state, memory planned and used, lanes with an error, busy slots."""
    counts = counts or LaneCounts()
    hosts = set(view.reports) | set(view.plans) | set(view.statuses)
    by_state: dict[str, int] = {}
    for host in hosts:
        state = view.host_states.get(host, "live")
        by_state[state] = by_state.get(state, 0) + 1
    lanes: dict[str, dict[str, int]] = {}
    planned = used = errors = 0
    for host, plan in view.plans.items():
        status = view.statuses.get(host)
        live = {lane.lane_id: lane for lane in status.lanes} if status else {}
        for spec in plan.lanes:
            lane = live.get(spec.lane_id)
            state = lane.state if lane else "pending"
            per_model = lanes.setdefault(spec.alias, {})
            per_model[state] = per_model.get(state, 0) + 1
            planned += spec.memory.total_bytes
            used += (lane.rss_bytes or 0) if lane else 0
            errors += 1 if lane and lane.last_error else 0
    return {"hosts": len(hosts), "hosts_by_state": dict(sorted(by_state.items())),
            "lanes": sum(sum(s.values()) for s in lanes.values()),
            "lanes_by_model": {m: dict(sorted(s.items())) for m, s in sorted(lanes.items())},
            "planned_bytes": planned, "rss_bytes": used, "lanes_with_errors": errors,
            "slots_busy": sum(counts.in_flight.values())}  # fmt: skip


def dashboard_snapshot(view: FleetView, events: EventFeed, rates: Mapping[LaneKey, float] | None = None,
                       counts: LaneCounts | None = None, page: HostFilter = HostFilter(),
                       summary: dict | None = None) -> dict:  # fmt: skip
    """What a page shows: the fleet's summary, one page of hosts (with a memory bar per device and
    their lanes) by its filter, unplaced models, config, models, tenants and events."""
    rates, counts = rates or {}, counts or LaneCounts()
    config = view.config or FleetConfig()
    hosts = sorted(set(view.reports) | set(view.plans) | set(view.statuses))
    matched = [h for h in hosts if page.keeps(view, h)]
    shown = matched[page.offset:page.offset + page.limit]
    routes = {lane.key: lane for h in shown for lane in view.host_lanes(h)}
    unplaced = [
        {"host": plan.host_id, "model": u.model, "reason": u.reason}
        for plan in (view.plans[h] for h in hosts if h in view.plans)
        for u in plan.unplaced
    ]
    return {
        "config": msgspec.to_builtins(config),
        "config_revision": config.revision,  # counts changes (1, 2, 3 ...), as `lanes status` shows it
        "synced": view.synced,
        "summary": summary if summary is not None else fleet_summary(view, counts),
        "page": {"offset": page.offset, "limit": page.limit, "matched": len(matched), "total": len(hosts),
                 "host": page.text, "model": page.model, "state": page.state},
        "hosts": [_host(view, h, config, routes, rates, counts) for h in shown],
        "unplaced": unplaced[:MAX_UNPLACED],
        "unplaced_count": len(unplaced),
        # Every servable model with its state (ready, loading, unloaded, failed), as GET /v1/models.
        "models": catalogue(view),
        # Whose requests hold slots and wait (tenants of the keys file), per requested model.
        "tenants": [{"tenant": t, "model": m, "in_flight": counts.tenant_in_flight.get((m, t), 0),
                     "queued": counts.tenant_queued.get((m, t), 0)}
                    for m, t in sorted(set(counts.tenant_in_flight) | set(counts.tenant_queued))],  # fmt: skip
        "events": list(events.items),
    }


def _host(view: FleetView, host: str, config: FleetConfig, routes: Mapping[LaneKey, LaneRoute],
          rates: Mapping[LaneKey, float], counts: LaneCounts) -> dict:  # fmt: skip
    report, plan, status = view.reports.get(host), view.plans.get(host), view.statuses.get(host)
    live = {lane.lane_id: lane for lane in status.lanes} if status else {}
    specs = plan.lanes if plan else ()
    host_id = (report or plan or status).host_id
    lanes = []
    for spec in specs:
        key = (host_id, spec.lane_id)
        lanes.append(_lane(spec, live.get(spec.lane_id), routes.get(key), counts.busy(key), rates.get(key, 0.0))
                     | _prompt_cache(spec, counts, f"{host_id}/{spec.lane_id}"))
    return {
        "host_id": host_id,
        "state": view.host_states.get(host, "live"),
        "plan_revision": plan.plan_revision if plan else None,
        "applied_revision": status.plan_revision if status else None,
        "rollout_halted": status.rollout_halted if status else "",
        "devices": _devices(report, plan, specs, live, config),
        "lanes": lanes,
    }


def _lane(spec: LaneSpec, lane: LaneStatus | None, route: LaneRoute | None, busy: int, rate: float) -> dict:
    state = lane.state if lane else "pending"
    if state == "healthy" and lane.lane_key and lane.lane_key != lane_key(spec):
        state = "updating"  # still serving the previous spec while the rollout reaches it
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
        "threads": spec.threads,  # None: llama-server's default (every core)
        "cpus": list(spec.cpus),
        "ctx_total": spec.ctx_total,
        "cache_type_k": effective_cache_type(spec.cache_type_k),
        "cache_type_v": effective_cache_type(spec.cache_type_v),
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


def _prompt_cache(spec: LaneSpec, counts: LaneCounts, lane: str) -> dict:
    """What the lane's answers said of its cache: the share of prompt tokens it did not have to read."""
    prompt = sum(n for (_, name), n in counts.prompt_tokens.items() if name == lane)
    cached = sum(n for (_, name), n in counts.cached_tokens.items() if name == lane)
    return {"prompt_tokens": prompt, "cached_tokens": cached,
            "cache_hit_ratio": round(cached / prompt, 3) if prompt else None,
            "cache_ram_mib": spec.cache_ram_mib}  # fmt: skip


def _devices(report: HostReport | None, plan, specs, live: Mapping[str, LaneStatus], config: FleetConfig) -> list[dict]:
    """One memory bar per device: planned weights, KV, compute, the headroom kept, what is free, real use.

    Planned parts come from each lane's per-device breakdown (a lane split over GPUs, or
    partly offloaded, draws on every device it touches); the headroom is what the plan's
    budget leaves of the device, so the page never re-derives the planner's rules.
    """
    if report is None:
        return []
    cpu_available = min(report.ram_total, report.ram_available + report.lanes_rss)
    bars = [_bar("CPU", report.ram_total, cpu_available, plan.budget_ram if plan else None, config)]
    for i, g in enumerate(report.gpus):
        available = min(g.vram_total, g.vram_free + g.lanes_vram)
        budgets = getattr(plan, "budget_gpus", ()) if plan else ()
        budget = budgets[i] if i < len(budgets) else (plan.budget_gpu if plan and plan.budget_gpu else None)
        bars.append(_bar(f"GPU{i} {g.name}", g.vram_total, available, budget, config))
    for spec in specs:
        lane = live.get(spec.lane_id)
        remote = {w.index for w in getattr(spec, "workers", ())}  # a span's devices on other hosts
        for index, parts in _lane_parts(spec):
            if index in remote:
                continue
            bar = _bar_for(bars, spec, index)
            for part, n in parts.items():
                bar[part] += n
        if lane is None:
            continue
        real = getattr(lane, "devices", ())
        if real:
            for d in real:
                if d.index not in remote:
                    _bar_for(bars, spec, d.index)["real"] += d.total
        elif lane.rss_bytes is not None:
            bars[0]["real"] += lane.rss_bytes
    # What this host holds for other hosts' span lanes (its ggml-rpc-servers).
    bars[0]["lent"] = sum(w.reserved_bytes for w in getattr(plan, "rpc_workers", ())) if plan else 0
    for bar in bars:
        planned = bar["weights"] + bar["kv"] + bar["compute"] + bar["cache"] + bar["lent"]
        bar["free"] = max(0, bar["available"] - planned - bar["headroom"])
    return bars


def _lane_parts(spec: LaneSpec):
    """(the lane's device index, -1 for host RAM; {part: bytes}) for each device a lane uses."""
    m = spec.memory
    if not m.devices:  # a plan from a planner without per-device figures
        index = -1 if m.device == "cpu" else 0
        return [(index, {"weights": m.weights_bytes, "kv": m.kv_bytes + m.recurrent_bytes,
                          "compute": m.compute_bytes + m.overhead_bytes})]  # fmt: skip
    parts = [(d.index, {"weights": d.model_bytes, "kv": d.kv_bytes + d.recurrent_bytes,
                         "compute": d.compute_bytes + d.output_bytes, "cache": d.prompt_cache_bytes})
             for d in m.devices]  # fmt: skip
    overhead = m.total_bytes - sum(d.total for d in m.devices)  # the process itself, in host RAM
    parts.append((-1, {"weights": 0, "kv": 0, "compute": max(0, overhead), "cache": 0}))
    return parts


def _bar_for(bars: list[dict], spec: LaneSpec, index: int) -> dict:
    """The host device behind a lane's device index: the k-th of the GPUs the lane is pinned to."""
    if index < 0 or len(bars) == 1:
        return bars[0]
    pinned = getattr(spec, "gpu_devices", ())
    host_index = pinned[index] if index < len(pinned) else index
    return bars[1 + host_index] if 1 + host_index < len(bars) else bars[-1]


def _bar(name: str, total: int, available: int, budget: int | None, config: FleetConfig) -> dict:
    if budget is None:  # no plan yet: the fleet config's headroom rule for host RAM
        budget = available - config.headroom_bytes - int(config.headroom_fraction * total)
    headroom = max(0, available - max(0, budget))
    return {"device": name, "total": total, "available": available, "headroom": headroom,
            "weights": 0, "kv": 0, "compute": 0, "cache": 0, "lent": 0, "real": 0, "free": 0}  # fmt: skip


class PageFeed:
    """What one open page has been sent, so each push sends only what changed for it: the hosts of
    its page whose rendering changed, the page's order of hosts, and the other parts that changed.
    The first push, and any after a reconnect (a new feed), is the whole snapshot."""

    def __init__(self) -> None:
        self.hosts: dict[str, bytes] = {}  # host id -> its rendering, as last sent
        self.rest: dict[str, bytes] = {}  # every other part of the snapshot, as last sent
        self.order: list[str] | None = None

    def frame(self, snap: dict) -> tuple[str, dict] | None:
        """("snapshot", the whole) first, then ("delta", what changed), or None: nothing did."""
        hosts = {h["host_id"]: msgspec.json.encode(h) for h in snap["hosts"]}
        rest = {k: msgspec.json.encode(v) for k, v in snap.items() if k != "hosts"}
        order = list(hosts)
        first = self.order is None
        changed = [h for h in snap["hosts"] if self.hosts.get(h["host_id"]) != hosts[h["host_id"]]]
        parts = {k: snap[k] for k, v in rest.items() if self.rest.get(k) != v}
        self.hosts, self.rest, moved, self.order = hosts, rest, order != self.order, order
        if first:
            return "snapshot", snap
        if not changed and not parts and not moved:
            return None
        return "delta", {"hosts": changed, "order": order, **parts}
