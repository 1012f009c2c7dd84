"""Lanes that follow measured demand, pure (planner_svc/scaling.py), and through plan_on_demand."""

from __future__ import annotations

import itertools

import msgspec
from test_demand import Fleet, lanes_of
from test_planner import GIB, host, llama_1b

from planner_svc.scaling import ModelLoad, ScaleState, extra_short, note_report, rescale, step
from shared.messages.activity import GatewayActivity, ModelActivity
from shared.lane_key import lane_key
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.plans import FleetPlan, HostPlan, LaneSpec

CONFIG = FleetConfig(scale_up_wait=2.0, scale_up_reports=3, scale_down_idle=60.0)


def report(wait: float, gateway: str = "g1", name: str = "a", queued: int = 0) -> GatewayActivity:
    return GatewayActivity(gateway=gateway, models=(ModelActivity(name=name, queued=queued, wait_s=wait),))


def load(lanes=1, max_lanes=2, serving=True, in_flight=0, queued=0, parallel=1, name="a") -> dict[str, ModelLoad]:
    return {name: ModelLoad(name=name, max_lanes=max_lanes, lanes=lanes, serving=serving, parallel=parallel,
                            in_flight=in_flight, queued=queued)}  # fmt: skip


def hot_state(n: int = 3, gateway: str = "g1") -> ScaleState:
    s = ScaleState()
    for _ in range(n):
        s = note_report(s, report(5.0, gateway), CONFIG)
    return s


# ------------------------------------------------------------------ streaks


def test_streaks_count_consecutive_hot_reports_and_a_cool_one_resets():
    s = ScaleState()
    for i in range(1, 4):
        s = note_report(s, report(2.5), CONFIG)
        assert s.streaks == {("g1", "a"): i}
    s = note_report(s, report(2.0), CONFIG)  # at the target is not above it
    assert s.streaks == {}
    s = note_report(s, report(9.0), CONFIG)
    s = note_report(s, GatewayActivity(gateway="g1", models=()), CONFIG)  # the model gone from the report
    assert s.streaks == {}


def test_streaks_are_per_gateway_and_another_gateway_does_not_reset_them():
    s = hot_state(2, "g1")
    s = note_report(s, report(0.0, "g2"), CONFIG)
    s = note_report(s, report(5.0, "g1"), CONFIG)
    assert s.streaks == {("g1", "a"): 3}


def test_an_older_gateways_report_decodes_with_no_wait():
    old = b'{"type":"gateway_activity","gateway":"g1","interval":2.0,"models":[{"name":"a","queued":3}]}'
    act = msgspec.json.decode(old, type=GatewayActivity)
    assert act.models[0].wait_s == 0.0
    assert note_report(ScaleState(), act, CONFIG).streaks == {}


# ------------------------------------------------------------------ up


def test_a_sustained_wait_adds_one_lane_and_the_streak_starts_again():
    s, changes = step(hot_state(2), load(queued=4, in_flight=1), CONFIG, now=10.0)
    assert changes == () and s.extra == {}  # two reports are not enough
    s, changes = step(hot_state(3), load(queued=4, in_flight=1), CONFIG, now=10.0)
    assert [(c.name, c.delta) for c in changes] == [("a", 1)]
    assert s.extra == {"a": 1} and s.streaks == {} and s.changed_at == {"a": 10.0}


def test_never_above_max_lanes_never_while_a_lane_loads_never_from_zero():
    for kwargs in ({"lanes": 2, "max_lanes": 2}, {"lanes": 1, "serving": False}, {"lanes": 0}):
        s, changes = step(hot_state(), load(queued=4, **kwargs), CONFIG, now=10.0)
        assert changes == () and s.extra == {}, kwargs


def test_personas_without_max_lanes_are_not_in_the_view_and_lose_nothing():
    s = ScaleState(extra={"gone": 1})
    s, changes = step(s, {}, CONFIG, now=0.0)
    assert changes == () and s.extra == {}


# ------------------------------------------------------------------ down


def test_an_added_lane_goes_after_a_sustained_calm_only():
    s = ScaleState(extra={"a": 1}, changed_at={"a": 0.0})
    s, c = step(s, load(lanes=2, in_flight=2), CONFIG, now=100.0)  # both slots busy: not calm
    assert c == () and "a" not in s.calm_since
    s, c = step(s, load(lanes=2, in_flight=1), CONFIG, now=110.0)  # one lane could carry it: calm starts
    assert c == () and s.calm_since == {"a": 110.0}
    s, c = step(s, load(lanes=2, in_flight=1), CONFIG, now=169.0)
    assert c == ()
    s, c = step(s, load(lanes=2, in_flight=0), CONFIG, now=170.0)
    assert [(x.name, x.delta) for x in c] == [("a", -1)] and s.extra == {}


def test_a_queue_or_busy_slots_break_the_calm():
    s = ScaleState(extra={"a": 1}, changed_at={"a": 0.0})
    s, _ = step(s, load(lanes=2), CONFIG, now=100.0)
    s, _ = step(s, load(lanes=2, queued=1), CONFIG, now=130.0)
    s, c = step(s, load(lanes=2), CONFIG, now=161.0)
    assert c == () and s.calm_since == {"a": 161.0}


def test_the_base_lanes_are_never_removed():
    s, c = step(ScaleState(), load(lanes=2, max_lanes=3), CONFIG, now=1000.0)
    s, c = step(s, load(lanes=2, max_lanes=3), CONFIG, now=5000.0)
    assert c == () and s.extra == {}


def test_no_removal_sooner_than_scale_down_idle_after_the_add():
    s = ScaleState(extra={"a": 1}, changed_at={"a": 100.0}, calm_since={"a": 0.0})
    s, c = step(s, load(lanes=2), CONFIG, now=150.0)
    assert c == ()
    s, c = step(s, load(lanes=2), CONFIG, now=160.0)
    assert [x.delta for x in c] == [-1]


# ------------------------------------------------------------------ no flapping


def simulate(trace, config=CONFIG, max_lanes=3, parallel=2):
    """A model whose queue wait and load follow `trace` (per 2 s report: requests in flight or
    queued over all its lanes); a new lane serves at the next report. Returns lanes per report."""
    s, lanes, out = ScaleState(), 1, []
    for i, demand in enumerate(trace):
        now = 2.0 * i
        capacity = lanes * parallel
        queued = max(0, demand - capacity)
        s = note_report(s, report(5.0 if queued else 0.0, queued=queued), config)
        s, _ = step(s, load(lanes=lanes, max_lanes=max_lanes, parallel=parallel, in_flight=min(demand, capacity),
                            queued=queued), config, now)  # fmt: skip
        lanes = 1 + s.extra.get("a", 0)
        out.append(lanes)
    return out


def changes_of(lanes):
    return sum(1 for a, b in itertools.pairwise(lanes) if a != b)


def test_a_step_up_then_down_scales_once_each_way_and_returns_to_the_idle_shape():
    lanes = simulate([1] * 10 + [6] * 60 + [1] * 100)
    assert max(lanes) == 3 and lanes[-1] == 1
    assert lanes[10 + 1] == 1 and lanes[10 + 2] == 2  # the third hot report adds a lane
    assert changes_of(lanes) == 4  # 1 -> 2 -> 3 -> 2 -> 1, nothing else


def test_a_load_at_the_edge_of_one_lane_never_flaps():
    # Demand alternating between just over one lane and just under: each hot spell is shorter
    # than the streak, so no lane is added, and nothing changes at all.
    lanes = simulate([3, 2] * 200)
    assert set(lanes) == {1}


def test_a_load_that_needs_two_lanes_keeps_them_through_short_lulls():
    # Bursts needing two lanes with lulls of 40 s (shorter than scale_down_idle): one add, no removal.
    trace = ([4] * 30 + [0] * 20) * 6
    lanes = simulate(trace)
    assert changes_of(lanes) == 1 and lanes[-1] == 2


def test_lanes_change_at_most_once_per_scale_down_idle_on_any_trace():
    import random

    rnd = random.Random(7)
    trace = [rnd.choice([0, 1, 2, 3, 5, 8]) for _ in range(2000)]
    lanes = simulate(trace)
    downs = [i for i, (a, b) in enumerate(itertools.pairwise(lanes)) if b < a]
    ups = [i for i, (a, b) in enumerate(itertools.pairwise(lanes)) if b > a]
    for d in downs:  # every removal comes scale_down_idle after the change before it
        before = max(i for i in ups + downs if i < d) if any(i < d for i in ups + downs) else -1000
        assert 2.0 * (d - before) >= CONFIG.scale_down_idle
    assert all(1 <= n <= 3 for n in lanes)


# ------------------------------------------------------------------ through the planner


def roomy_host():
    return host("h1", ram_total=8 * GIB, ram_available=int(5 * GIB), models=(llama_1b("a"),))


def tight_host():
    return host("h1", ram_total=4 * GIB, ram_available=int(2.3 * GIB), models=(llama_1b("a"),))


def scaled_fleet(report_host, max_lanes=2):
    demand = Demand(personas=(Persona(model="a", max_lanes=max_lanes),))
    f = Fleet([report_host], demand, config=CONFIG)
    return f, demand


def busy(f, now, wait, queued=2, in_flight=1):
    f.activity(GatewayActivity(gateway="g1", models=(
        ModelActivity(name="a", in_flight=in_flight, queued=queued, wait_s=wait),)), now, CONFIG)  # fmt: skip


def test_max_lanes_unset_changes_no_plan():
    plain = Fleet([roomy_host()], Demand(personas=(Persona(model="a"),)), config=CONFIG)
    scaled, _ = scaled_fleet(roomy_host())
    assert msgspec.json.encode(plain.replan(0.0)) == msgspec.json.encode(scaled.replan(0.0))


def test_the_planner_adds_the_lane_where_it_fits_and_takes_it_back_when_idle():
    f, demand = scaled_fleet(roomy_host())
    assert lanes_of(f.replan(0.0)) == {"h1": ["a"]}
    for i in range(3):
        busy(f, 2.0 * i, wait=4.0)
    changes = f.rescale(demand.personas, CONFIG, f.plans, 6.0)
    assert [c.delta for c in changes] == [1]
    fleet = f.replan(7.0)
    assert lanes_of(fleet) == {"h1": ["a", "a"]} and not fleet.unplaced and not fleet.hosts[0].unplaced
    first = next(s for s in fleet.hosts[0].lanes if s.lane_id == "a-0")
    assert first == next(s for s in f.plans["h1"].lanes if s.lane_id == "a-0")
    # The load stops: quiet for scale_down_idle, then one lane again.
    f.activity(GatewayActivity(gateway="g1", models=(ModelActivity(name="a"),)), 10.0, CONFIG)
    assert f.rescale(demand.personas, CONFIG, f.plans, 10.0) == ()
    assert f.rescale(demand.personas, CONFIG, f.plans, 69.0) == ()
    f.activity(GatewayActivity(gateway="g1", models=(ModelActivity(name="a"),)), 70.0, CONFIG)
    assert [c.delta for c in f.rescale(demand.personas, CONFIG, f.plans, 71.0)] == [-1]
    assert f.state.evictions == {"scaled_down": 1}  # lanes_evictions_total{reason="scaled_down"}
    assert lanes_of(f.replan(72.0)) == {"h1": ["a"]}


def test_an_added_lane_with_no_room_is_taken_back_and_not_asked_again_at_once():
    f, demand = scaled_fleet(tight_host())
    f.replan(0.0)
    for i in range(3):
        busy(f, 2.0 * i, wait=4.0)
    assert [c.delta for c in f.rescale(demand.personas, CONFIG, f.plans, 6.0)] == [1]
    fleet = f.replan(7.0)
    assert lanes_of(fleet) == {"h1": ["a"]} and not fleet.unplaced and not fleet.hosts[0].unplaced
    assert f.state.scale.extra == {} and f.outcome.extra_placed == {"a": 0}
    for i in range(3):
        busy(f, 8.0 + 2.0 * i, wait=4.0)
    assert f.rescale(demand.personas, CONFIG, f.plans, 14.0) == ()  # no room lately: no retry loop


def test_on_two_holders_the_running_lanes_stay_and_one_is_added():
    # Fixed windows: with an open ctx_max the planner shares the room between the lanes of the
    # host that gets the new one (the running lane narrows). Its prompt cache keeps its limit
    # while the host is not pressed (a ceiling filled lazily): the running lane is not restarted.
    hosts = [host(h, ram_total=8 * GIB, ram_available=int(5 * GIB), models=(llama_1b("a"),)) for h in ("h1", "h2")]
    demand = Demand(personas=(Persona(model="a", max_lanes=3, ctx_min=8192, ctx_max=8192),))
    f = Fleet(hosts, demand, config=CONFIG)
    before = f.replan(0.0)
    assert lanes_of(before) == {"h1": ["a"], "h2": ["a"]}
    for i in range(3):
        busy(f, 2.0 * i, wait=4.0)
    assert [c.delta for c in f.rescale(demand.personas, CONFIG, f.plans, 6.0)] == [1]
    after = f.replan(7.0)
    assert sum(len(h.lanes) for h in after.hosts) == 3 and not after.unplaced
    kept = {(h.host_id, s.lane_id): s for h in before.hosts for s in h.lanes}
    now = {(h.host_id, s.lane_id): s for h in after.hosts for s in h.lanes}
    grown = next(h.host_id for h in after.hosts if len(h.lanes) == 2)
    for (h, lane_id), spec in kept.items():
        if h != grown:
            assert now[(h, lane_id)] == spec  # the other host's lane is untouched
        else:  # same lane, port, window and --cache-ram: nothing that restarts it
            assert lane_key(now[(h, lane_id)]) == lane_key(spec)
            assert now[(h, lane_id)].cache_ram_mib == spec.cache_ram_mib


def test_a_gateway_gone_quiet_neither_adds_lanes_nor_keeps_them():
    f, demand = scaled_fleet(roomy_host())
    f.replan(0.0)
    for i in range(3):
        busy(f, 2.0 * i, wait=4.0)
    # Its reports stop: past STALE_INTERVALS of its interval, its streak no longer counts.
    assert f.rescale(demand.personas, CONFIG, f.plans, 4.0 + 3 * 2.0 + 1.0) == ()
    assert f.state.scale.streaks == {}


# ------------------------------------------------------------------ the scaling phase on its own (no planner run)


def _plans(*lanes: str) -> dict[str, HostPlan]:
    specs = tuple(LaneSpec(lane_id=f"a-{i}", model="a", model_path="/a.gguf", alias="a", port=8080 + i,
                           ctx_total=4096, ctx_per_slot=4096, parallel=1) for i, _ in enumerate(lanes))  # fmt: skip
    return {"h1": HostPlan(host_id="h1", lanes=specs)}


def test_rescale_adds_a_lane_only_when_every_lane_serves_and_counts_only_fresh_gateways():
    personas = [Persona(model="a", max_lanes=2)]
    hot = hot_state()
    plans = _plans("a-0")
    state, changes = rescale(hot, [report(5.0, queued=2)], {("h1", "a-0")}, personas, plans, CONFIG, 6.0)
    assert [c.delta for c in changes] == [1] and state.extra == {"a": 1}
    assert rescale(hot, [report(5.0, queued=2)], set(), personas, plans, CONFIG, 6.0)[1] == ()  # still loading
    quiet, changes = rescale(hot, [], {("h1", "a-0")}, personas, plans, CONFIG, 6.0)  # g1 not heard from lately
    assert changes == () and quiet.streaks == {}
    assert rescale(hot, [report(5.0)], {("h1", "a-0")}, [Persona(model="a")], plans, CONFIG, 6.0)[1] == ()


def test_extra_short_tells_how_many_added_lanes_the_plan_placed():
    demand = Demand(personas=(Persona(model="a", lanes=3, max_lanes=3),))
    two = FleetPlan(hosts=tuple(_plans("a-0", "a-1").values()))
    assert extra_short(two, demand, {"a": 2}) == {"a": 1}  # 3 asked, 2 placed: one of the 2 added
    assert extra_short(two, demand, {}) == {}  # none added: nothing to take back
    three = FleetPlan(hosts=tuple(_plans("a-0", "a-1", "a-2").values()))
    assert extra_short(three, demand, {"a": 2}) == {}
