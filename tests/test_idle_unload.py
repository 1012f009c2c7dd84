"""Idle unload, one phase of planning with demand (planner_svc/idle.py), on its own: pure, no planner run."""

from __future__ import annotations

from planner_svc.demand_state import WAKE_TTL, DemandState
from planner_svc.idle import abandoned_loads, due, idle_unloads, unload_idle
from shared.messages.activity import GatewayActivity, ModelActivity
from shared.messages.config import FleetConfig, Persona
from shared.messages.plans import HostPlan, LaneSpec

CONFIG = FleetConfig()


def lane(lane_id: str, alias: str) -> LaneSpec:
    return LaneSpec(lane_id=lane_id, model=alias, model_path=f"/{alias}.gguf", alias=alias, port=8080, ctx_total=4096,
                    ctx_per_slot=4096, parallel=1)  # fmt: skip


PLANS = {"h1": HostPlan(host_id="h1", lanes=(lane("a-0", "a"), lane("b-0", "b")))}


def serving(since: float = 0.0) -> DemandState:
    state = DemandState()
    return state.note_healthy("h1", ["a-0", "b-0"], since)


def names(found) -> list[str]:
    return sorted(p.alias or p.model for p, _ in found)


def test_a_lane_idle_for_its_ttl_goes_and_not_a_moment_before():
    personas = [Persona(model="a", idle_ttl=60), Persona(model="b")]
    assert names(idle_unloads(serving(), CONFIG, personas, PLANS, 59.9)) == []
    assert names(idle_unloads(serving(), CONFIG, personas, PLANS, 60.0)) == ["a"]  # b: no idle_ttl


def test_requests_pins_and_loading_keep_a_lane():
    personas = [Persona(model="a", idle_ttl=60), Persona(model="b", idle_ttl=60, min_lanes=1)]
    used = GatewayActivity(gateway="g", models=(ModelActivity(name="a", idle_s=5.0),))
    state, _ = serving().note_activity(used, 50.0)
    assert names(idle_unloads(state, CONFIG, personas, PLANS, 100.0)) == []  # last request at 45; b is pinned
    assert names(idle_unloads(state, CONFIG, personas, PLANS, 105.0)) == ["a"]
    busy, _ = state.note_activity(GatewayActivity(gateway="g", models=(ModelActivity(name="a", in_flight=1),)), 105.0)
    assert names(idle_unloads(busy, CONFIG, personas, PLANS, 105.0)) == []
    loading = DemandState().note_healthy("h1", ["b-0"], 0.0)  # a-0 never said healthy
    assert names(idle_unloads(loading, CONFIG, personas, PLANS, 1e6)) == []
    assert due(loading, personas, CONFIG, PLANS, 1e6) is False
    assert due(state, personas, CONFIG, PLANS, 105.0) is True


def test_unload_idle_returns_a_new_state_and_what_it_unloaded():
    personas = [Persona(model="a", idle_ttl=60), Persona(model="b")]
    before = serving()
    after, unloaded = unload_idle(before, CONFIG, personas, PLANS, 60.0)
    assert after.on_demand == {"a"} and after.counts == {"a": 0} and after.excluded == {"a": frozenset({"h1"})}
    assert unloaded.evicted == {"idle": 1} and unloaded.victims == (("h1", "a-0", "idle for 60 s"),)
    assert before == serving()  # the state it was given is unchanged


def test_a_load_nobody_waits_for_is_abandoned_after_the_wake_ttl():
    personas = [Persona(model="a"), Persona(model="b")]
    placed = DemandState(placed_at={"a": 0.0})
    assert names(abandoned_loads(placed, personas, PLANS, WAKE_TTL - 0.1)) == []
    assert names(abandoned_loads(placed, personas, PLANS, WAKE_TTL)) == ["a"]
    assert names(abandoned_loads(placed.note_healthy("h1", ["a-0"], 1.0), personas, PLANS, WAKE_TTL)) == []
    after, unloaded = unload_idle(placed, CONFIG, personas, PLANS, WAKE_TTL)
    assert unloaded.evicted == {"abandoned": 1} and after.placed_at == {} and after.counts == {"a": 0}
