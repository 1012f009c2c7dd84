"""The dashboard's view model: what each memory bar and lane row shows, folded from bus entries."""

from __future__ import annotations

import msgspec
from test_planner import GIB, host, llama_1b, llama_8b

from gateway.admission.counts import LaneCounts
from gateway.dashboard.model import EventFeed, dashboard_snapshot
from gateway.fleet.view import FleetView
from planner_svc.planner import plan
from shared.lane_key import lane_key
from shared.messages.config import FleetConfig
from shared.messages.status import HostStatus, LaneEvent, LaneStatus
from shared.messages.wire import encode


def _fleet(view: FleetView, config: FleetConfig = FleetConfig(), *, ram: int = 32 * GIB):
    report = host("h1", ram_available=ram, ram_total=64 * GIB, models=(llama_8b(), llama_1b()))
    fleet = plan([report], config)
    for key, msg in (("config", config), ("report.h1", report), ("plan.h1", fleet.hosts[0])):
        assert view.apply_entry(key, encode(msg)) is None
    return report, fleet.hosts[0]


def snapshot(view: FleetView, rates=None, events: EventFeed | None = None, counts: LaneCounts | None = None) -> dict:
    return dashboard_snapshot(view, events or EventFeed(), rates, counts)


def test_memory_bar_adds_up_planned_parts_and_keeps_headroom() -> None:
    view = FleetView()
    report, hp = _fleet(view)
    snap = snapshot(view)
    (h,) = snap["hosts"]
    (cpu,) = h["devices"]
    assert cpu["device"] == "CPU" and cpu["total"] == 64 * GIB and cpu["available"] == 32 * GIB
    assert cpu["weights"] == sum(s.memory.weights_bytes for s in hp.lanes) > 0
    assert cpu["kv"] == sum(s.memory.kv_bytes for s in hp.lanes) > 0
    # compute, output buffers and the process itself: the rest of each lane's total
    rest = sum(s.memory.total_bytes - s.memory.weights_bytes - s.memory.kv_bytes - s.memory.recurrent_bytes
               - s.memory.prompt_cache_bytes for s in hp.lanes)  # fmt: skip
    assert cpu["compute"] == rest >= sum(s.memory.compute_bytes for s in hp.lanes) > 0
    # the prompt cache (--cache-ram) is its own part of the bar
    assert cpu["cache"] == sum(s.memory.prompt_cache_bytes for s in hp.lanes) > 0
    assert cpu["headroom"] == 512 * 2**20 + int(0.05 * 64 * GIB)
    planned = cpu["weights"] + cpu["kv"] + cpu["compute"] + cpu["cache"]
    assert planned == sum(s.memory.total_bytes for s in hp.lanes)
    assert cpu["free"] == cpu["available"] - planned - cpu["headroom"]
    assert cpu["free"] >= 0
    assert {lane["state"] for lane in h["lanes"]} == {"pending"}


def test_lane_rows_follow_status_traffic_and_config() -> None:
    view = FleetView()
    config = FleetConfig(kv_cache_type="q8_0", flash_attn="on")
    _, hp = _fleet(view, config)
    spec = hp.lanes[0]
    status = HostStatus(
        host_id="h1",
        plan_revision=hp.plan_revision,
        lanes=(
            LaneStatus(
                lane_id=spec.lane_id,
                state="healthy",
                kv_bytes=spec.memory.kv_bytes,
                rss_bytes=GIB,
                argv=("llama-server", "--its", "--own-spelling"),  # not compared: the lane key is
                lane_key=lane_key(spec),
            ),
        ),  # fmt: skip
    )
    before = lane_key(msgspec.structs.replace(spec, ctx_total=512))
    old = HostStatus(host_id="h1", lanes=(LaneStatus(lane_id=spec.lane_id, state="healthy", lane_key=before,
                                                     argv=("llama-server", "--ctx-size", "512")),))  # fmt: skip
    assert view.apply_entry("status.h1", encode(old)) is None
    row = next(lane for lane in snapshot(view)["hosts"][0]["lanes"] if lane["lane_id"] == spec.lane_id)
    assert row["state"] == "updating"  # healthy, but with the spec before this plan
    assert view.apply_entry("status.h1", encode(status)) is None
    counts = LaneCounts(in_flight={("h1", spec.lane_id): 1})
    snap = snapshot(view, {("h1", spec.lane_id): 2.5}, counts=counts)
    row = next(lane for lane in snap["hosts"][0]["lanes"] if lane["lane_id"] == spec.lane_id)
    assert row["state"] == "healthy"
    assert (row["cache_type_k"], row["cache_type_v"], row["flash_attn"]) == ("q8_0", "q8_0", "on")
    assert row["ctx_per_slot"] == spec.ctx_per_slot and row["parallel"] == spec.parallel
    assert (row["slots_busy"], row["requests_per_second"]) == (1, 2.5)
    assert row["kv_real_bytes"] == spec.memory.kv_bytes
    assert snap["hosts"][0]["devices"][0]["real"] == GIB
    assert snap["config"]["kv_cache_type"] == "q8_0"
    view.mark_unreachable(("h1", spec.lane_id), "/health: timeout")
    row = next(lane for lane in snapshot(view)["hosts"][0]["lanes"] if lane["lane_id"] == spec.lane_id)
    assert (row["state"], row["unreachable"]) == ("unreachable", "/health: timeout")


def test_unplaced_models_carry_their_reason() -> None:
    view = FleetView()
    _fleet(view, ram=3 * GIB)  # the 8B does not fit beside the 1B
    snap = snapshot(view)
    assert snap["unplaced"], snap
    assert all(u["reason"] and u["host"] == "h1" for u in snap["unplaced"])


def test_host_liveness_from_the_planners_hosts_key() -> None:
    from shared.messages.replies import FleetHosts, HostLiveness

    view = FleetView()
    _fleet(view)
    assert snapshot(view)["hosts"][0]["state"] == "live"
    lost = FleetHosts(hosts=(HostLiveness(host_id="h1", state="lost"),))
    assert view.apply_entry("hosts", encode(lost)) is None
    (h,) = snapshot(view)["hosts"]
    assert h["state"] == "lost" and h["lanes"]  # its plan is kept: a cut-off host keeps serving
    assert view.apply_entry("hosts", b"{broken") is not None
    assert snapshot(view)["hosts"][0]["state"] == "lost"


def test_a_deleted_plan_empties_the_host() -> None:
    view = FleetView()
    _fleet(view)
    assert snapshot(view)["hosts"][0]["lanes"]
    assert view.apply_entry("plan.h1", None) is None
    assert snapshot(view)["hosts"][0]["lanes"] == []


def test_events_newest_first_and_bounded() -> None:
    feed = EventFeed(max_events=3)
    for i, kind in enumerate(["started", "healthy", "crashed", "started"]):
        feed.add(LaneEvent(host_id="h1", lane_id="l1", event=kind, detail=str(i)), at=float(i))
    events = snapshot(FleetView(), events=feed)["events"]
    assert [e["event"] for e in events] == ["started", "crashed", "healthy"]
    assert events[0]["at"] == 3.0



def test_a_lane_split_over_two_gpus_draws_on_both_bars() -> None:
    from shared.messages.hosts import GpuInfo

    gpus = tuple(GpuInfo(name=f"gpu{i}", vram_total=4 * GIB, vram_free=4 * GIB, device=f"CUDA{i}") for i in range(2))
    report = host("h1", ram_available=32 * GIB, ram_total=64 * GIB, models=(llama_8b(),), gpus=gpus)
    hp = plan([report], FleetConfig()).hosts[0]
    (spec,) = hp.lanes
    on_gpus = [d for d in spec.memory.devices if d.device.startswith("GPU")]
    assert len(on_gpus) == 2, spec.memory.devices  # the planner split it: the premise of this test
    view = FleetView()
    for key, msg in (("report.h1", report), ("plan.h1", hp)):
        assert view.apply_entry(key, encode(msg)) is None
    cpu, gpu0, gpu1 = snapshot(view)["hosts"][0]["devices"]
    for bar, planned in ((gpu0, on_gpus[0]), (gpu1, on_gpus[1])):
        assert bar["weights"] == planned.model_bytes > 0
        assert bar["kv"] == planned.kv_bytes > 0
        assert bar["headroom"] > 0 and bar["free"] >= 0
    assert cpu["weights"] == sum(d.model_bytes for d in spec.memory.devices if d.device == "CPU")  # token embeddings
    assert gpu0["device"].startswith("GPU0") and gpu1["device"].startswith("GPU1")


def test_page_assets_ship_in_the_package_and_fetch_nothing_from_the_network() -> None:
    import re
    import tomllib
    from pathlib import Path

    from gateway.dashboard.hub import STATIC

    names = {p.name for p in STATIC.iterdir()}
    assert {"index.html", "app.js", "style.css"} <= names
    for name in names:
        text = (STATIC / name).read_text()
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), name  # no remote script or style
        assert not re.search(r"""(fetch|EventSource)\(["'`]https?:""", text), name
        assert "@import" not in text and "url(http" not in text, name
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert "static/*" in pyproject["tool"]["setuptools"]["package-data"]["gateway.dashboard"]


def test_requests_per_second_from_finished_requests() -> None:
    import asyncio

    from gateway.dashboard.hub import RATE_SECONDS, DashboardHub

    async def run() -> dict:
        view = FleetView()
        counts = LaneCounts()
        hub = DashboardHub(view, counts)
        then, _ = hub._last_count
        counts.served[("h1", "l1")] = 30
        hub._last_count = (then - RATE_SECONDS * 2, {("h1", "l1"): 10})  # 20 more over 10 s
        hub._update_rates()
        return hub._rates

    rates = asyncio.run(run())
    assert abs(rates[("h1", "l1")] - 20 / (RATE_SECONDS * 2)) < 0.05


def test_lane_rows_show_the_cache_hit_ratio_from_the_lanes_answers() -> None:
    view = FleetView()
    _, hp = _fleet(view)
    first, second = hp.lanes[0], hp.lanes[1]
    counts = LaneCounts()
    counts.note_prompt(first.alias, f"h1/{first.lane_id}", 1000, 900)
    counts.note_prompt("other-alias", f"h1/{first.lane_id}", 1000, 100)  # the same lane under another name
    rows = {lane["lane_id"]: lane for lane in snapshot(view, counts=counts)["hosts"][0]["lanes"]}
    assert rows[first.lane_id]["cache_hit_ratio"] == 0.5 and rows[first.lane_id]["prompt_tokens"] == 2000
    assert rows[second.lane_id]["cache_hit_ratio"] is None  # no answers yet
    assert rows[first.lane_id]["cache_ram_mib"] == first.cache_ram_mib is not None


def test_a_span_draws_its_remote_devices_on_the_workers_bars_only() -> None:
    from test_spans import by_host, fleet_of, span_lane

    reports = fleet_of(3.0, (("w1", 2.3), ("w2", 2.3), ("w3", 2.3)))
    fleet = plan(reports, FleetConfig())
    lane = span_lane(fleet)
    view = FleetView()
    for r in reports:
        assert view.apply_entry(f"report.{r.host_id}", encode(r)) is None
    for hp in fleet.hosts:
        assert view.apply_entry(f"plan.{hp.host_id}", encode(hp)) is None
    bars = {h["host_id"]: h["devices"][0] for h in snapshot(view)["hosts"]}
    remote = {w.index for w in lane.workers}
    local = [d for d in lane.memory.devices if d.index not in remote]
    # The serving host draws only what lies in its own RAM; the workers' shares are theirs.
    assert bars["serve"]["weights"] == sum(d.model_bytes for d in local)
    assert bars["serve"]["lent"] == 0
    for w in lane.workers:
        assert bars[w.host_id]["lent"] == w.reserved_bytes > w.model_bytes > 0
        assert bars[w.host_id]["free"] == max(0, bars[w.host_id]["available"] - bars[w.host_id]["lent"]
                                               - bars[w.host_id]["headroom"])  # fmt: skip
    assert bars["w3"]["lent"] == 0 and by_host(fleet)["w3"].rpc_workers == ()


def test_the_queue_view_shows_each_tenants_requests():
    counts = LaneCounts(tenant_in_flight={("chat", "team-a"): 2},
                        tenant_queued={("chat", "team-a"): 1, ("chat", "batch"): 5})  # fmt: skip
    state = snapshot(FleetView(), counts=counts)
    assert state["tenants"] == [{"tenant": "batch", "model": "chat", "in_flight": 0, "queued": 5},
                                {"tenant": "team-a", "model": "chat", "in_flight": 2, "queued": 1}]  # fmt: skip


def test_a_page_is_sent_whole_then_only_what_changed():
    from gateway.dashboard.model import PageFeed

    view = FleetView()
    _fleet(view)
    feed = PageFeed()
    event, whole = feed.frame(snapshot(view))
    assert event == "snapshot" and [h["host_id"] for h in whole["hosts"]] == ["h1"]
    assert feed.frame(snapshot(view)) is None  # nothing changed: nothing sent
    status = HostStatus(host_id="h1", lanes=(LaneStatus(lane_id=view.plans["h1"].lanes[0].lane_id, state="healthy"),))
    assert view.apply_entry("status.h1", encode(status)) is None
    event, delta = feed.frame(snapshot(view))
    assert event == "delta" and [h["host_id"] for h in delta["hosts"]] == ["h1"] and delta["order"] == ["h1"]
    assert "config" not in delta and "summary" in delta  # the summary counts the lane healthy now
    assert delta["summary"]["lanes_by_model"][view.plans["h1"].lanes[0].alias].get("healthy") == 1


def test_the_filter_pages_and_narrows_the_hosts():
    from gateway.dashboard.model import HostFilter, dashboard_snapshot

    view = FleetView()
    for i in range(7):
        report = host(f"h{i}", ram_available=32 * GIB, ram_total=64 * GIB, models=(llama_1b(),) if i % 2 else (llama_8b(),))
        hp = plan([report], FleetConfig()).hosts[0]
        for key, msg in ((f"report.h{i}", report), (f"plan.h{i}", hp)):
            assert view.apply_entry(key, encode(msg)) is None
    page = dashboard_snapshot(view, EventFeed(), page=HostFilter(limit=3, offset=3))
    assert [h["host_id"] for h in page["hosts"]] == ["h3", "h4", "h5"]
    assert page["page"] == {"offset": 3, "limit": 3, "matched": 7, "total": 7, "host": "", "model": "", "state": ""}
    assert page["summary"]["hosts"] == 7 and page["summary"]["hosts_by_state"] == {"live": 7}
    one = view.plans["h1"].lanes[0].model
    narrowed = dashboard_snapshot(view, EventFeed(), page=HostFilter(model=one))
    assert [h["host_id"] for h in narrowed["hosts"]] == ["h1", "h3", "h5"]
    assert [h["host_id"] for h in dashboard_snapshot(view, EventFeed(), page=HostFilter(text="h6"))["hosts"]] == ["h6"]
    assert dashboard_snapshot(view, EventFeed(), page=HostFilter(state="lost"))["hosts"] == []
    assert dashboard_snapshot(view, EventFeed(), page=HostFilter(state="pending"))["page"]["matched"] == 7
    bounded = HostFilter.from_query({"limit": "100000", "offset": "-5", "host": "x" * 1000})
    assert bounded.limit == 200 and bounded.offset == 0 and len(bounded.text) == 128
    assert HostFilter.from_query({"limit": "many"}).limit == 50


def test_at_ten_thousand_hosts_the_state_and_every_frame_stay_small_and_a_change_is_one_host():
    """A view of 10,000 simulated hosts (30,000 lanes): what a page is sent, whole or as a delta, is
    under 256 KiB, and one host's change reaches a page filtered to it as that host alone. (The
    page's paint and search times in Chromium: bench/dashboard_scale.py.)"""
    from test_fleet_pages import _fleet

    from gateway.dashboard.hub import DashboardHub
    from gateway.dashboard.model import HostFilter, PageFeed
    from shared import subjects

    fleet = _fleet(10_000)
    view = FleetView()
    for table, key in ((fleet.plans, subjects.plan_key), (fleet.statuses, subjects.status_key),
                       (fleet.reports, subjects.report_key)):  # fmt: skip
        for name, msg in table.items():
            assert view.apply_entry(key(name), encode(msg)) is None
    hub = DashboardHub(view, LaneCounts())
    whole = msgspec.json.encode(hub.snapshot())
    assert len(whole) < 256 * 1024, len(whole)
    first = msgspec.json.decode(whole)
    assert first["summary"]["hosts"] == 10_000 and len(first["hosts"]) == 50 and first["page"]["matched"] == 10_000
    target = "host-04242"
    page, feed = HostFilter(text=target), PageFeed()
    event, snap = feed.frame(hub.snapshot(page))
    assert event == "snapshot" and [h["host_id"] for h in snap["hosts"]] == [target]
    status = fleet.statuses[target]
    changed = msgspec.structs.replace(status, lanes=tuple(
        msgspec.structs.replace(lane, state="crashed", last_error="exit 1") for lane in status.lanes))
    assert view.apply_entry(subjects.status_key(target), encode(changed)) is None
    event, delta = feed.frame(hub.snapshot(page))
    assert event == "delta" and [h["host_id"] for h in delta["hosts"]] == [target]
    assert len(msgspec.json.encode(delta)) < 256 * 1024
    assert delta["summary"]["lanes_with_errors"] == snap["summary"]["lanes_with_errors"] + len(status.lanes)
