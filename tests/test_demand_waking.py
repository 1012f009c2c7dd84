"""Waking, one phase of planning with demand (planner_svc/waking.py), on its own: pure, no planner run."""

from __future__ import annotations

from test_planner import host, llama_1b

from planner_svc.demand_state import DemandState
from planner_svc.waking import effective, known_wakes, wake
from shared.messages.config import Persona
from shared.messages.plans import HostPlan, LaneSpec

PERSONAS = [Persona(model="a"), Persona(model="b"), Persona(model="c", lanes=2)]
REPORTS = [host("h1", models=(llama_1b("a"), llama_1b("b"), llama_1b("c")))]
PLANS = {"h1": HostPlan(host_id="h1", lanes=(LaneSpec(lane_id="a-0", model="a", model_path="/a.gguf", alias="a",
                                                        port=8080, ctx_total=4096, ctx_per_slot=4096, parallel=1),))}


def test_a_job_keeps_only_wakes_for_servable_personas_that_did_not_fail():
    state = DemandState(wakes={"b": 1.0, "ghost": 1.0, "c": 2.0}, failed={"c": (0.0, "no host")})
    after = known_wakes(state, PERSONAS, frozenset({"x"}))
    assert after.wakes == {"b": 1.0} and after.on_demand == {"x"}
    assert state.wakes == {"b": 1.0, "ghost": 1.0, "c": 2.0}  # unchanged


def test_a_woken_persona_is_on_demand_back_on_every_host_and_asks_its_lanes_again():
    excluded = {"b": frozenset({"h1"}), "a": frozenset({"h2"})}
    state = DemandState(wakes={"b": 1.0}, counts={"b": 0, "a": 1}, excluded=excluded)
    after = wake(state, PERSONAS)
    assert after.on_demand == {"b"} and after.excluded == {"a": frozenset({"h2"})} and after.counts == {"a": 1}
    assert state.counts == {"b": 0, "a": 1}  # unchanged


def test_default_on_personas_are_planned_as_they_are_and_on_demand_ones_only_when_woken():
    demand, shown, first = effective(DemandState(), PERSONAS, REPORTS, PLANS)
    assert list(demand.personas) == PERSONAS and shown == REPORTS and first == []  # today's plans
    idle = DemandState(on_demand=frozenset({"b", "c"}))
    assert [p.model for p in effective(idle, PERSONAS, REPORTS, PLANS)[0].personas] == ["a"]
    woken = wake(DemandState(on_demand=frozenset({"b", "c"}), wakes={"c": 5.0}), PERSONAS)
    demand, _, first = effective(woken, PERSONAS, REPORTS, PLANS)
    assert [(p.model, p.lanes) for p in demand.personas] == [("a", None), ("c", 2)]
    assert first == ["a", "c"]  # the lane that runs is placed first, the woken next


def test_a_model_unloaded_from_a_host_is_not_shown_there():
    state = DemandState(on_demand=frozenset({"a"}), excluded={"a": frozenset({"h1"})}, counts={"a": 1})
    _, shown, _ = effective(state, PERSONAS, REPORTS, PLANS)
    assert [m.name for m in shown[0].models] == ["b", "c"]
