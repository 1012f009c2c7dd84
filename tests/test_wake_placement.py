"""Placement of wakes, one phase of planning with demand (planner_svc/wake_placement.py), on its own."""

from __future__ import annotations

from test_demand import CONFIG, Fleet, lanes_of, one_room_host
from test_planner import host, llama_1b

from planner_svc.demand_state import DemandState
from planner_svc.eviction import NoRoom
from planner_svc.personas import servable
from planner_svc.wake_placement import place_wakes, room_on
from planner_svc.waking import wake


def running_a():
    """One host with room for one model; a runs there, served since 0."""
    f = Fleet([one_room_host()])
    f.replan(0.0)
    return f


def woken(f, name: str, now: float) -> tuple[DemandState, list]:
    personas, _ = servable(None, f.reports)
    state, _ = f.state.note_wake(name, now)
    return wake(state, personas), personas


def test_room_on_a_full_host_shows_what_the_woken_lane_lacks_and_what_each_lane_frees():
    f = running_a()
    personas, _ = servable(None, f.reports)
    room, frees = room_on(f.reports[0], CONFIG, personas[1], f.plans["h1"], personas, ())
    assert room.host_id == "h1" and room.needs is not None and list(frees) == ["a-0"]
    assert any(room.free.get(r, 0) < need for r, need in room.needs.items())  # it does not fit as it is
    empty, _ = room_on(host("h2", models=(llama_1b("b"),)), CONFIG, personas[1], None, personas, ())
    assert all(empty.free.get(r, 0) >= need for r, need in empty.needs.items())


def test_a_wake_evicts_the_idle_lane_and_the_evicted_keeps_its_count_left_out_where_it_ran():
    f = running_a()
    state, personas = woken(f, "b", 40.0)
    placed = place_wakes(state, personas, f.reports, CONFIG, f.plans, {}, 0, 40.0)
    assert lanes_of(placed.fleet) == {"h1": ["b"]} and placed.evicted == 1
    assert placed.victims == (("h1", "a-0", "evicted for b"),) and placed.failed == {} and placed.waiting == {}
    assert placed.state.counts == {"a": 1} and placed.state.excluded == {"a": frozenset({"h1"})}
    assert "a" in placed.state.on_demand and placed.previous["h1"].lanes == ()
    assert state.counts == {} and f.plans["h1"].lanes  # what it was given is unchanged


def test_a_wake_the_chooser_finds_no_room_for_waits_and_evicts_nothing():
    f = running_a()
    state, personas = woken(f, "b", 40.0)
    placed = place_wakes(state, personas, f.reports, CONFIG, f.plans, {}, 0, 40.0,
                         chooser=lambda rooms, candidates, **_: NoRoom("not now"))  # fmt: skip
    assert lanes_of(placed.fleet) == {"h1": ["a"]} and placed.waiting == {"b": "not now"} and placed.evicted == 0
    failing = place_wakes(state, personas, f.reports, CONFIG, f.plans, {}, 0, 40.0,
                          chooser=lambda rooms, candidates, **_: NoRoom("never", failed=True))  # fmt: skip
    assert failing.failed == {"b": "never"} and failing.waiting == {}
