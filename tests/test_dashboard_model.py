"""The dashboard's view model: what each memory bar and lane row shows, folded from bus entries."""

from __future__ import annotations

from planner_svc.planner import plan
from shared.messages import FleetConfig, HostStatus, LaneEvent, LaneStatus, encode
from test_planner import GIB, host, llama_1b, llama_8b

from gateway.dashboard_model import DashboardModel, LaneTraffic


def _fleet(model: DashboardModel, config: FleetConfig = FleetConfig(), *, ram: int = 32 * GIB):
    report = host("h1", ram_available=ram, ram_total=64 * GIB, models=(llama_8b(), llama_1b()))
    fleet = plan([report], config)
    model.apply_kv("config", encode(config), 7)
    model.apply_kv("report.h1", encode(report), 8)
    model.apply_kv("plan.h1", encode(fleet.hosts[0]), 9)
    return report, fleet.hosts[0]


def test_memory_bar_adds_up_planned_parts_and_keeps_headroom() -> None:
    model = DashboardModel()
    report, hp = _fleet(model)
    snap = model.snapshot()
    (h,) = snap["hosts"]
    (cpu,) = h["devices"]
    assert cpu["device"] == "CPU" and cpu["total"] == 64 * GIB and cpu["available"] == 32 * GIB
    assert cpu["weights"] == sum(s.memory.weights_bytes for s in hp.lanes) > 0
    assert cpu["kv"] == sum(s.memory.kv_bytes for s in hp.lanes) > 0
    assert cpu["compute"] == sum(s.memory.compute_bytes + s.memory.overhead_bytes for s in hp.lanes)
    assert cpu["headroom"] == 512 * 2**20 + int(0.05 * 64 * GIB)
    planned = cpu["weights"] + cpu["kv"] + cpu["compute"]
    assert planned == sum(s.memory.total_bytes for s in hp.lanes)
    assert cpu["free"] == cpu["available"] - planned - cpu["headroom"]
    assert cpu["free"] >= 0
    assert {lane["state"] for lane in h["lanes"]} == {"pending"}


def test_lane_rows_follow_status_traffic_and_config() -> None:
    model = DashboardModel()
    config = FleetConfig(kv_cache_type="q8_0", flash_attn="on")
    _, hp = _fleet(model, config)
    spec = hp.lanes[0]
    status = HostStatus(
        host_id="h1",
        plan_revision=hp.plan_revision,
        lanes=(LaneStatus(lane_id=spec.lane_id, state="healthy", kv_bytes=spec.memory.kv_bytes, rss_bytes=GIB),),
    )
    assert model.apply_kv("status.h1", encode(status), 10)
    snap = model.snapshot({("h1", spec.lane_id): LaneTraffic(busy=1, requests_per_second=2.5)})
    row = next(lane for lane in snap["hosts"][0]["lanes"] if lane["lane_id"] == spec.lane_id)
    assert row["state"] == "healthy"
    assert (row["cache_type_k"], row["cache_type_v"], row["flash_attn"]) == ("q8_0", "q8_0", "on")
    assert row["ctx_per_slot"] == spec.ctx_per_slot and row["parallel"] == spec.parallel
    assert (row["slots_busy"], row["requests_per_second"]) == (1, 2.5)
    assert row["kv_real_bytes"] == spec.memory.kv_bytes
    assert snap["hosts"][0]["devices"][0]["real"] == GIB
    assert snap["config"]["kv_cache_type"] == "q8_0"


def test_unplaced_models_carry_their_reason() -> None:
    model = DashboardModel()
    _fleet(model, ram=3 * GIB)  # the 8B does not fit beside the 1B
    snap = model.snapshot()
    assert snap["unplaced"], snap
    assert all(u["reason"] and u["host"] == "h1" for u in snap["unplaced"])


def test_bad_entries_and_foreign_keys_change_nothing() -> None:
    model = DashboardModel()
    _fleet(model)
    before = model.snapshot()
    assert not model.apply_kv("plan.h1", b"{not json", 11)
    assert not model.apply_kv("report.h2", encode(host("h1")), 12)  # host id does not match its key
    assert not model.apply_kv("lease.planner", b"{}", 13)
    assert model.snapshot() == before
    assert model.apply_kv("plan.h1", None, 14)  # deleted
    assert model.snapshot()["hosts"][0]["lanes"] == []


def test_events_newest_first_and_bounded() -> None:
    model = DashboardModel(max_events=3)
    for i, kind in enumerate(["started", "healthy", "crashed", "started"]):
        model.add_event(LaneEvent(host_id="h1", lane_id="l1", event=kind, detail=str(i)), at=float(i))
    events = model.snapshot()["events"]
    assert [e["event"] for e in events] == ["started", "crashed", "healthy"]
    assert events[0]["at"] == 3.0
