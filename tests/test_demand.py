"""Models on demand, pure (planner_svc/demand.py and its phases): wakes, eviction through the planner, idle unload."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from record_golden_plans import load_inputs, run
from test_planner import GIB, host, llama_1b

from planner_svc.demand import model_states, plan_on_demand
from planner_svc.demand_state import FAILED_TTL, WAKE_TTL, DemandState
from planner_svc.idle import due
from planner_svc.planner import plan
from shared.messages.activity import GatewayActivity, ModelActivity
from shared.messages.config import Demand, FleetConfig, Persona

CONFIG = FleetConfig(min_residency=30.0)
MODELS = (llama_1b("a"), llama_1b("b"), llama_1b("c"))


def one_room_host(host_id: str = "h1", models=MODELS):
    """RAM for one of the 1 GiB models at a time."""
    return host(host_id, ram_total=4 * GIB, ram_available=int(2.3 * GIB), models=models)


def lanes_of(fleet) -> dict[str, list[str]]:
    return {h.host_id: sorted(s.alias for s in h.lanes) for h in fleet.hosts}


class Fleet:
    """The planner's loop in miniature: plan, apply the outcome, keep the plans."""

    def __init__(self, reports, demand=None, config=CONFIG):
        self.reports, self.demand, self.config = reports, demand, config
        self.state = DemandState()
        self.plans = {}
        self.outcome = None

    def replan(self, now: float, loads: bool = True):
        """`loads`: every planned lane is healthy at once (False: new lanes are still loading)."""
        self.state = self.state.expire(now)
        fleet, self.outcome = plan_on_demand(self.reports, self.config, self.demand, self.state, now=now,
                                             previous=self.plans)  # fmt: skip
        self.state = self.state.apply(self.outcome, now)
        self.plans = {h.host_id: h for h in fleet.hosts}
        self.state = self.state.forget_lanes(self.plans)
        if loads:
            self.healthy(now)
        return fleet

    def healthy(self, now: float) -> None:
        for h in self.plans.values():
            self.state = self.state.note_healthy(h.host_id, [s.lane_id for s in h.lanes], now)

    # The folds return a new state: the harness keeps it, as planner_svc/service.py does.
    def wake(self, name: str, now: float) -> bool:
        self.state, replan = self.state.note_wake(name, now)
        return replan

    def activity(self, activity, now: float, config=None) -> bool:
        self.state, changed = self.state.note_activity(activity, now, config)
        return changed

    def rescale(self, personas, config, plans, now: float):
        self.state, changes = self.state.rescale(personas, config, plans, now)
        return changes


@pytest.mark.parametrize("scenario", load_inputs(), ids=lambda s: s.name)
def test_with_no_demand_features_the_plans_are_todays(scenario):
    fleet, outcome = plan_on_demand(scenario.reports, scenario.config, scenario.demand, DemandState(), now=0.0,
                                    previous=scenario.previous, feedback=scenario.feedback,
                                    config_revision=scenario.config_revision)  # fmt: skip
    assert msgspec.json.encode(fleet) == msgspec.json.encode(run(scenario))
    assert not outcome.evicted and not outcome.failed


def test_a_wake_evicts_the_idle_lane_and_places_the_woken_model():
    f = Fleet([one_room_host()])
    assert lanes_of(f.replan(0.0)) == {"h1": ["a"]}
    assert f.state.wakes == {} and f.state.loaded_at == {("h1", "a-0"): 0.0}
    states = {m.name: m.state for m in model_states(None, f.reports, f.plans, f.state)[0].models}
    assert states == {"a": "loaded", "b": "unloaded", "c": "unloaded"}

    assert f.wake("b", 40.0)
    assert not f.wake("b", 40.5)  # a second request or gateway: the same wake
    fleet = f.replan(41.0)
    assert lanes_of(fleet) == {"h1": ["b"]}
    assert f.outcome.evicted == {"wake": 1} and f.outcome.victims == (("h1", "a-0", "evicted for b"),)
    assert f.state.wakes == {} and "a" in f.state.on_demand
    # a stays unloaded (no request for it), c too: the next plans keep b alone.
    assert lanes_of(f.replan(42.0)) == {"h1": ["b"]}
    assert f.state.evictions == {"wake": 1}


def test_a_busy_lane_is_never_evicted_and_the_wake_waits():
    f = Fleet([one_room_host()])
    f.replan(0.0)
    f.activity(GatewayActivity(gateway="g1", models=(ModelActivity(name="a", in_flight=1),)), 40.0)
    f.wake("b", 40.0)
    assert lanes_of(f.replan(40.0)) == {"h1": ["a"]}
    assert "has requests in flight" in f.state.waiting["b"]
    states = {m.name: (m.state, m.reason) for m in model_states(None, f.reports, f.plans, f.state)[0].models}
    assert states["b"][0] == "waking" and "in flight" in states["b"][1]
    # The request ends (the gateway says so): the next replan evicts a.
    f.activity(GatewayActivity(gateway="g1", models=(ModelActivity(name="a", idle_s=1.0),)), 41.0)
    f.wake("b", 41.0)
    assert lanes_of(f.replan(41.0)) == {"h1": ["b"]}


def test_a_stale_gateway_report_does_not_keep_a_lane_busy_forever():
    report = GatewayActivity(gateway="g1", interval=2.0, models=(ModelActivity(name="a", queued=3),))
    state, _ = DemandState().note_activity(report, 0.0)
    assert state.busy(5.9) == {"a": 3}
    assert state.busy(6.1) == {}


def test_a_lane_loaded_moments_ago_is_not_evicted():
    f = Fleet([one_room_host()])
    f.replan(0.0)
    f.wake("b", 10.0)
    assert lanes_of(f.replan(10.0)) == {"h1": ["a"]}
    assert "min residency 30 s" in f.state.waiting["b"]
    assert due(f.state, [], CONFIG, f.plans, 11.0)  # a waiting wake replans with time
    f.wake("b", 30.0)
    assert lanes_of(f.replan(30.0)) == {"h1": ["b"]}


def test_a_pinned_persona_is_never_evicted():
    demand = Demand(personas=(Persona(model="a", min_lanes=1), Persona(model="b")))
    f = Fleet([one_room_host()], demand)
    f.replan(0.0)
    f.wake("b", 100.0)
    assert lanes_of(f.replan(100.0)) == {"h1": ["a"]}
    assert "pinned" in f.state.waiting["b"]


def test_lowest_priority_then_least_recently_used_is_evicted_first():
    two = host("h1", ram_total=6 * GIB, ram_available=int(3.7 * GIB), models=MODELS)
    demand = Demand(personas=(Persona(model="a", priority=5), Persona(model="b"), Persona(model="c")))
    f = Fleet([two], demand)
    assert lanes_of(f.replan(0.0)) == {"h1": ["a", "b"]}
    f.wake("c", 100.0)
    assert lanes_of(f.replan(100.0)) == {"h1": ["a", "c"]}  # b (priority 0) goes, a (5) stays


def test_a_lane_moves_to_a_host_with_room_rather_than_being_dropped():
    """lanes = 1 fleet-wide: evicted from h1, the planner places it on h2, which has room."""
    h1 = one_room_host("h1", models=(llama_1b("a"), llama_1b("b")))
    h2 = host("h2", ram_total=4 * GIB, ram_available=int(2.3 * GIB), models=(llama_1b("a"),))
    demand = Demand(personas=(Persona(model="a", lanes=1), Persona(model="b", lanes=1)))
    f = Fleet([h1, h2], demand)
    assert lanes_of(f.replan(0.0)) == {"h1": ["a"], "h2": []}  # h1 first: b fits nowhere
    f.wake("b", 100.0)
    assert lanes_of(f.replan(100.0)) == {"h1": ["b"], "h2": ["a"]}


def test_idle_ttl_unloads_and_requests_keep_it():
    demand = Demand(personas=(Persona(model="a", idle_ttl=60),))
    f = Fleet([one_room_host(models=(llama_1b("a"),))], demand)
    assert lanes_of(f.replan(0.0)) == {"h1": ["a"]}
    f.activity(GatewayActivity(gateway="g1", models=(ModelActivity(name="a", idle_s=10.0),)), 50.0)
    assert not due(f.state, demand.personas, CONFIG, f.plans, 99.0)  # last request at 40: due at 100
    assert lanes_of(f.replan(99.0)) == {"h1": ["a"]}
    assert due(f.state, demand.personas, CONFIG, f.plans, 100.0)
    assert lanes_of(f.replan(100.0)) == {"h1": []}
    assert f.outcome.evicted == {"idle": 1}
    assert [m.state for m in model_states(demand, f.reports, f.plans, f.state)[0].models] == ["unloaded"]
    f.wake("a", 200.0)  # a request brings it back
    assert lanes_of(f.replan(200.0)) == {"h1": ["a"]}


def test_idle_ttl_zero_never_unloads_and_the_fleet_default_applies():
    f = Fleet([one_room_host(models=(llama_1b("a"),))])
    f.replan(0.0)
    assert lanes_of(f.replan(1e6)) == {"h1": ["a"]}
    f.config = msgspec.structs.replace(CONFIG, idle_ttl=5.0)
    assert lanes_of(f.replan(1e6 + 1)) == {"h1": []}


def test_a_model_no_host_can_take_fails_once_not_in_a_loop():
    demand = Demand(personas=(Persona(model="a"), Persona(model="ghost")))
    f = Fleet([one_room_host(models=(llama_1b("a"),))], demand)
    f.replan(0.0)
    f.wake("ghost", 1.0)
    f.replan(1.0)
    assert "no host holds this model" in f.state.failed["ghost"][1]
    states = {m.name: m for m in model_states(demand, f.reports, f.plans, f.state)[0].models}
    assert states["ghost"].state == "failed"
    assert not f.wake("ghost", 2.0)  # answered as failed: no replan, no retry
    f.state = f.state.expire(2.0 + FAILED_TTL)
    assert f.wake("ghost", 2.0 + FAILED_TTL)  # later, a request may try again


def test_unlisted_model_files_are_servable_when_a_demand_is_set():
    demand = Demand(personas=(Persona(model="a", alias="chat"),))
    f = Fleet([host("h1", models=MODELS)], demand)
    assert lanes_of(f.replan(0.0)) == {"h1": ["chat"]}  # b and c are not loaded before a request
    names = {m.name: m.state for m in model_states(demand, f.reports, f.plans, f.state)[0].models}
    assert names == {"chat": "loaded", "b": "unloaded", "c": "unloaded"}
    f.wake("c", 1.0)
    assert lanes_of(f.replan(1.0)) == {"h1": ["c", "chat"]}  # room enough: no eviction
    assert not f.outcome.evicted


def test_wakes_expire_unless_repeated():
    state, _ = DemandState().note_wake("b", 0.0)
    state = state.expire(WAKE_TTL - 0.1)
    assert "b" in state.wakes
    state = state.expire(WAKE_TTL)
    assert state.wakes == {}


def test_the_planner_alone_is_unchanged_by_an_empty_order():
    report = host("h1", models=MODELS)
    assert plan([report], CONFIG, first=()) == plan([report], CONFIG)


def test_a_planner_taking_over_carries_on_from_the_models_key():
    """A stand-by follows the active planner's `models` key: after a failover, what was evicted stays unloaded."""
    from planner_svc.state import PlannerState
    from shared import subjects
    from shared.messages.activity import ModelState, ModelStates

    f = Fleet([one_room_host()], config=msgspec.structs.replace(CONFIG, min_residency=0.0))
    f.replan(0.0)
    f.wake("b", 1.0)
    f.replan(1.0)
    written, _ = model_states(None, f.reports, f.plans, f.state)
    assert {m.name: (m.state, m.on_demand) for m in written.models} == {
        "a": ("unloaded", True), "b": ("loaded", True), "c": ("unloaded", False)}
    standby = PlannerState()
    standby.following = True
    standby.apply(subjects.MODELS_KEY, msgspec.json.encode(written), 1)
    assert standby.demand_state.on_demand == {"a", "b"} and standby.demand_state.evictions == {"wake": 1}
    # Planning from the adopted state and the plans keeps b, and does not bring a back.
    fleet, _ = plan_on_demand(f.reports, CONFIG, None, standby.demand_state, now=2.0, previous=f.plans)
    assert lanes_of(fleet) == {"h1": ["b"]}
    # The active planner ignores the key (it writes it).
    active = PlannerState()
    active.caught_up = True
    active.apply(subjects.MODELS_KEY, msgspec.json.encode(ModelStates(models=(ModelState(name="x", model="x",
                                                                                           on_demand=True),))), 2)
    assert active.demand_state.on_demand == set()


def test_cold_start_is_predicted_from_the_rate_a_host_has_shown():
    from planner_svc.coldstart import DEFAULT_READ_RATE, MIN_SECONDS, predicted_seconds, read_rates
    from shared.messages.status import HostStatus, LaneStatus

    f = Fleet([one_room_host()])
    f.replan(0.0)
    size = MODELS[0].file_bytes
    assert predicted_seconds(size, None) == round(size / DEFAULT_READ_RATE, 2)
    assert predicted_seconds(1, None) == MIN_SECONDS
    statuses = {"h1": HostStatus(host_id="h1", lanes=(LaneStatus(lane_id="a-0", state="healthy", load_seconds=2.0),))}
    rates = read_rates(f.reports, f.plans, statuses)
    assert rates == {"h1": size / 2.0}
    states = {m.name: m for m in model_states(None, f.reports, f.plans, f.state, statuses)[0].models}
    assert states["a"].measured_load_s == 2.0
    assert states["b"].predicted_load_s == 2.0 and states["b"].measured_load_s is None  # same size, same host


def test_a_lane_still_loading_neither_idles_out_nor_is_evicted():
    """The idle clock and the residency start when the lane first serves, not when it is planned:
    a model slower to load than its idle_ttl is not unloaded before its first request."""
    demand = Demand(personas=(Persona(model="a", idle_ttl=2.0), Persona(model="b")))
    f = Fleet([one_room_host(models=(llama_1b("a"), llama_1b("b")))], demand,
              config=msgspec.structs.replace(CONFIG, min_residency=1.0))
    assert lanes_of(f.replan(0.0, loads=False)) == {"h1": ["a"]}
    assert lanes_of(f.replan(50.0, loads=False)) == {"h1": ["a"]}  # loading for 50 s: not idle
    f.wake("b", 50.0)
    assert lanes_of(f.replan(50.0, loads=False)) == {"h1": ["a"]}  # not evicted while it loads
    assert "min residency" in f.state.waiting["b"]
    f.healthy(51.0)
    f.wake("b", 52.5)
    assert lanes_of(f.replan(52.5)) == {"h1": ["b"]}  # served 1.5 s: past the residency


def test_a_fold_returns_a_new_state_and_leaves_the_one_it_was_given():
    """The state is a value (a planning job reads it while the service folds the next events in)."""
    state = DemandState()
    woken, replan = state.note_wake("b", 1.0)
    healthy = woken.note_healthy("h1", ["a-0"], 2.0)
    assert replan and woken.wakes == {"b": 1.0} and healthy.healthy_at == {("h1", "a-0"): 2.0}
    assert state == DemandState() and woken.healthy_at == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        healthy.wakes = {}


def test_a_load_nobody_waits_for_any_more_is_dropped_one_someone_waits_for_goes_on():
    demand = Demand(personas=(Persona(model="a"),))  # b: a file no persona names, loaded on request
    f = Fleet([host("h1", models=(llama_1b("a"), llama_1b("b")))], demand)
    assert lanes_of(f.replan(0.0)) == {"h1": ["a"]}
    f.wake("b", 1.0)
    assert lanes_of(f.replan(1.0, loads=False)) == {"h1": ["a", "b"]}  # b loads (slowly)
    waiting = GatewayActivity(gateway="g1", models=(ModelActivity(name="b", queued=1, idle_s=19.0),))  # held since 1
    f.activity(waiting, 20.0)
    assert lanes_of(f.replan(20.0, loads=False)) == {"h1": ["a", "b"]}  # a request still waits: it goes on
    gave_up = GatewayActivity(gateway="g1", models=(ModelActivity(name="b", queued=0, idle_s=20.0),))
    f.activity(gave_up, 21.0)
    assert lanes_of(f.replan(21.0, loads=False)) == {"h1": ["a"]}  # the client gave up: no load left behind
    assert f.outcome.evicted == {"abandoned": 1}
    # A load that finished is not abandoned: idle_ttl governs it.
    f.wake("b", 30.0)
    f.replan(30.0)
    assert lanes_of(f.replan(60.0)) == {"h1": ["a", "b"]}


def test_plan_on_demand_model_states_and_demand_due_answer_with_a_new_state_and_change_none():
    from copy import deepcopy

    from planner_svc.demand import demand_due
    from planner_svc.state import PlannerState
    from shared import subjects
    from shared.messages.status import HostStatus, LaneStatus
    from shared.messages.wire import encode

    demand = Demand(personas=(Persona(model="a", idle_ttl=150), Persona(model="b")))
    f = Fleet([one_room_host()], demand)
    f.replan(0.0)
    f.wake("b", 100.0)
    given = deepcopy(f.state)
    statuses = {"h1": HostStatus(host_id="h1", lanes=(LaneStatus(lane_id="a-0", state="healthy", load_seconds=2.0),))}
    _, outcome = plan_on_demand(f.reports, CONFIG, demand, f.state, now=100.0, previous=f.plans)
    _, learned = model_states(demand, f.reports, f.plans, f.state, statuses)
    after, due_now, _ = demand_due(f.state, demand, f.reports, f.plans, CONFIG, 200.0)
    assert f.state == given  # nothing it was given changed
    assert outcome.evicted == {"wake": 1} and learned.measured == {"a": 2.0} and after.wakes == {} and due_now
    # The planner's questions do not write its state either: the service applies what they return.
    planner = PlannerState(clock=lambda: 200.0)
    planner.apply(subjects.DEMAND_KEY, encode(demand), 1)
    planner.apply(subjects.report_key("h1"), encode(f.reports[0]), 2)
    planner.plans, planner.demand_state = dict(f.plans), f.state
    for question in (planner.demand_due, planner.model_states):
        question()
        assert planner.demand_state is f.state


def test_a_lane_that_loads_fast_is_kept_ten_of_its_loads_not_the_whole_min_residency():
    """The residency is RESIDENCY_LOADS x what the lane's load cost, at most min_residency: a model
    that loads in 0.4 s may be swapped out after 4 s of serving; one that loads in 5 s keeps all 30 s.
    A flat 30 s held requests past the gateway's bound where llama.cpp's router swapped at once."""
    for measured, kept in ((0.4, 4.0), (5.0, 30.0)):
        f = Fleet([one_room_host(models=(llama_1b("a"), llama_1b("b")))], Demand(personas=(Persona(model="a"),)))
        assert lanes_of(f.replan(0.0)) == {"h1": ["a"]}
        f.state = dataclasses.replace(f.state, measured={"a": measured})
        f.wake("b", kept - 0.5)
        assert lanes_of(f.replan(kept - 0.5)) == {"h1": ["a"]}, measured
        expected = "min residency 30 s" if kept == 30.0 else "residency 4.0 s: 10 x its 0.40 s load"
        assert expected in f.state.waiting["b"], f.state.waiting
        assert lanes_of(f.replan(kept + 0.5)) == {"h1": ["b"]}, measured


def test_an_unmeasured_lane_is_kept_ten_of_its_predicted_loads():
    """No load measured yet: the prediction from the file size and the host's read rate (200 MiB/s
    before any load) stands in: a 100 MiB file is kept 5 s, a 1 GiB one the whole 30 s."""
    small = llama_1b("a", file_bytes=100 * 2**20)  # its weights still take 1 GiB: one model fits
    f = Fleet([one_room_host(models=(small, llama_1b("b")))], Demand(personas=(Persona(model="a"),)))
    assert lanes_of(f.replan(0.0)) == {"h1": ["a"]}
    f.wake("b", 4.5)
    assert lanes_of(f.replan(4.5)) == {"h1": ["a"]}
    assert "residency 5.0 s: 10 x its 0.50 s load" in f.state.waiting["b"]
    assert lanes_of(f.replan(5.5)) == {"h1": ["b"]}


def test_a_model_wanted_all_the_time_gives_its_memory_up_to_a_wake_that_waited():
    """Requests for `a` never stop, so `a` is never idle; a wake for `b` that has waited as long as
    `a`'s residency (10 x its 1 s load; counted from the first wake, not its latest repeat) drains `a`."""
    f = Fleet([one_room_host(models=(llama_1b("a"), llama_1b("b")))], Demand(personas=(Persona(model="a"),)))
    assert lanes_of(f.replan(0.0)) == {"h1": ["a"]}
    f.state = dataclasses.replace(f.state, measured={"a": 1.0})
    for t in range(40, 51):  # the gateway repeats the wake every second
        f.activity(GatewayActivity(gateway="g1", models=(ModelActivity(name="a", in_flight=1, queued=3, idle_s=0.0),
                                                         ModelActivity(name="b", queued=1, idle_s=0.0))), float(t))  # fmt: skip
        f.wake("b", float(t))
        if t < 50:
            assert lanes_of(f.replan(float(t))) == {"h1": ["a"]}, t
            assert "has requests in flight or queued" in f.state.waiting["b"]
    assert lanes_of(f.replan(50.0)) == {"h1": ["b"]}  # woken at 40: waited 10 s


def test_the_model_woken_first_goes_first_whatever_its_latest_repeat():
    """Gateways repeat a wake every second; ordered by the latest repeat, two waiting models took
    turns at the head at every replan. The first wake orders them."""
    models = (llama_1b("a"), llama_1b("b"), llama_1b("c"))
    f = Fleet([one_room_host(models=models)], Demand(personas=(Persona(model="a"),)))
    assert lanes_of(f.replan(0.0)) == {"h1": ["a"]}
    f.wake("b", 40.0)
    f.wake("c", 41.0)
    f.wake("c", 44.0)
    f.wake("b", 45.0)  # b's latest repeat is now the younger one
    assert lanes_of(f.replan(45.0)) == {"h1": ["b"]}
    assert "b-0 on h1 loaded 0 s ago" in f.state.waiting["c"]  # c waits for b's residency
