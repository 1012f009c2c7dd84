"""The planner service's state, without NATS: what a KV entry changes and what gets replanned."""

from __future__ import annotations

import msgspec

from planner_svc.state import PlannerState
from shared import subjects
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import HostReport, ModelFacts, ServerCaps
from shared.messages.wire import encode

GIB = 2**30
MODEL = ModelFacts(path="/m/a.gguf", name="a", architecture="llama", n_layer=8, n_embd=512, n_head=8,
                   n_head_kv=(8,) * 8, head_dim_k=64, head_dim_v=64, n_ctx_train=8192, weight_bytes=GIB)  # fmt: skip


def report(host: str, free: int = 8) -> bytes:
    return encode(HostReport(host_id=host, cpu_cores=4, ram_total=16 * GIB, ram_available=free * GIB,
                             server=ServerCaps(), models=(MODEL,)))  # fmt: skip


def caught_up_state(hosts=("h1", "h2", "h3")) -> PlannerState:
    state = PlannerState()
    for i, host in enumerate(hosts):
        assert state.apply(subjects.report_key(host), report(host), i + 1)
    state.caught_up = True
    return state


def test_first_replan_covers_every_host_then_only_changed_ones():
    state = caught_up_state()
    assert sorted(state.planning_job()().plans) == ["h1", "h2", "h3"]
    assert state.planning_job()().plans == {}  # nothing changed
    state.apply(subjects.report_key("h2"), report("h2", free=6), 10)
    assert sorted(state.planning_job()().plans) == ["h2"]


def test_a_single_host_replan_equals_its_part_of_a_full_replan():
    state = caught_up_state()
    for i, (host, written) in enumerate(state.planning_job()().plans.items()):  # as the service writes them
        state.apply(subjects.plan_key(host), encode(written), 5 + i)
    state.apply(subjects.report_key("h2"), report("h2", free=5), 10)
    alone = state.planning_job()().plans["h2"]
    state.replan_all = True
    assert state.planning_job()().plans["h2"] == alone


def test_config_and_fleet_wide_demand_replan_everything():
    state = caught_up_state()
    state.planning_job()()
    state.apply(subjects.CONFIG_KEY, encode(FleetConfig(kv_cache_type="q8_0")), 20)
    assert sorted(state.planning_job()().plans) == ["h1", "h2", "h3"]
    state.apply(subjects.DEMAND_KEY, encode(Demand(personas=(Persona(model="a", lanes=2),))), 21)
    state.planning_job()()
    state.apply(subjects.report_key("h1"), report("h1", free=7), 22)
    # Two lanes spread over the fleet: one host's change can move a lane elsewhere.
    assert sorted(state.planning_job()().plans) == ["h1", "h2", "h3"]


def test_malformed_entries_are_dropped_and_a_bad_config_does_not_pin_its_revision():
    state = caught_up_state()
    assert not state.apply(subjects.report_key("h1"), b"{nope", 30)
    assert state.reports["h1"].ram_available == 8 * GIB
    assert not state.apply(subjects.CONFIG_KEY, b"{nope", 31)
    assert state.config_kv_rev == 31  # the next config.set compares against this revision
    mismatched = msgspec.json.decode(report("h9"), type=HostReport)
    assert not state.apply(subjects.report_key("h1"), encode(mismatched), 32)


def test_config_set_merges_numbers_and_refuses_what_the_planner_owns():
    import pytest

    from planner_svc.answers import merged_config
    from shared.messages.replies import ConfigSet

    current = FleetConfig(kv_cache_type="q8_0", revision=4)
    new = merged_config(current, ConfigSet(changes={"flash_attn": "on"}), 5)
    assert (new.kv_cache_type, new.flash_attn, new.revision) == ("q8_0", "on", 5)
    assert merged_config(current, ConfigSet(changes={"kv_cache_type": "q8_0"}), 5) is None  # nothing changes
    for bad in ({"revision": 9}, {"kv_cache_type": "q9_0"}, {"no_such_knob": 1}):
        with pytest.raises(msgspec.ValidationError):
            merged_config(current, ConfigSet(changes=bad), 5)


def test_explain_lists_each_lane_reason_and_unplaced_model():
    from planner_svc.planner import plan
    from planner_svc.answers import explain_lines

    small = msgspec.json.decode(report("h1"), type=HostReport)
    host_plan = plan([small], FleetConfig()).hosts[0]
    lines = explain_lines(host_plan, None)
    assert lines[0] == "host h1 plan r1 (config r0)"
    assert any(line.startswith("a-0: window ") for line in lines)
    assert any("a-0 CPU: layers" in line for line in lines)


def test_a_host_lost_after_not_above_a_report_interval_is_refused():
    from planner_svc.answers import config_problem

    reports = {h: msgspec.json.decode(report(h), type=HostReport) for h in ("h1", "h2")}
    slow = msgspec.structs.replace(reports["h2"], report_interval=45.0)
    assert config_problem(FleetConfig(host_lost_after=90.0), reports) is None
    assert config_problem(FleetConfig(), {"h2": slow}) is None  # unset: 3 report intervals per host
    problem = config_problem(FleetConfig(host_lost_after=40.0), {**reports, "h2": slow})
    assert problem == ("host_lost_after 40 s is not above host h2's report interval of 45 s:"
                       " every such host would be lost between two reports")  # fmt: skip
    assert config_problem(FleetConfig(host_lost_after=30.0), reports) is not None  # equal is too short


def test_a_change_after_a_quiet_spell_is_replanned_at_once_a_burst_waits_out_the_last_replan():
    """The planner rests as long as its last replan took, counted from when that one ended: at most
    half its time planning under a stream of changes, no wait for an operator's change later."""
    from planner_svc.service import SETTLE_SECONDS, settle_for

    assert settle_for(0.0, 0.0) == SETTLE_SECONDS  # a small fleet: a burst settles for 5 ms
    assert settle_for(1.4, 2.0) == SETTLE_SECONDS  # the last 1.4 s replan ended 2 s ago: start now
    assert abs(settle_for(1.4, 0.1) - 1.3) < 1e-9  # it ended 0.1 s ago: rest the remaining 1.3 s


def test_a_plan_that_says_the_same_is_the_same_whoever_planned_it():
    from planner_svc.service import same_plan
    from shared.messages.plans import HostPlan

    stored = HostPlan(host_id="h1", plan_revision=5, planned_by="planner-7")
    assert same_plan(stored, msgspec.structs.replace(stored, planned_by="planner-9"))  # a restarted planner
    assert not same_plan(stored, msgspec.structs.replace(stored, planned_by="planner-9", plan_revision=6))
    assert not same_plan(None, stored)
