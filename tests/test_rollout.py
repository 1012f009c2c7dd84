"""Rollouts paced per model across the fleet (planner_svc/rollout.py), without NATS."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from planner_svc.rollout import allowed, paced, runs
from shared.llama.flags import lane_args
from shared.messages.hosts import ServerCaps
from shared.messages.plans import HostPlan, LaneSpec
from shared.messages.status import HostStatus, LaneFeedback, LaneStatus

CAPS = ServerCaps()
HOSTS = ("h1", "h2", "h3")


def spec(lane_id: str = "m-0", model: str = "m", port: int = 8080, **kw) -> LaneSpec:
    s = LaneSpec(lane_id=lane_id, model=model, model_path=f"/models/{model}.gguf", alias=model, port=port,
                 ctx_total=4096, ctx_per_slot=4096, parallel=1, **kw)  # fmt: skip
    return msgspec.structs.replace(s, args=lane_args(s, CAPS))


OLD, NEW = spec(), spec(cache_type_k="q8_0")


def plan(host: str, *lanes: LaneSpec, revision: int = 1) -> HostPlan:
    return HostPlan(host_id=host, plan_revision=revision, lanes=lanes)


def running(s: LaneSpec, state: str = "healthy", **kw) -> LaneStatus:
    return LaneStatus(lane_id=s.lane_id, state=state, argv=("/bin/llama-server", *s.args), **kw)


def status(host: str, *lanes: LaneStatus, feedback=()) -> HostStatus:
    return HostStatus(host_id=host, lanes=lanes, feedback=feedback)


def fleet(spec_of: dict[str, LaneSpec], state: str = "healthy"):
    published = {h: plan(h, OLD) for h in HOSTS}
    statuses = {h: status(h, running(spec_of.get(h, OLD), state)) for h in HOSTS}
    desired = {h: plan(h, NEW, revision=2) for h in HOSTS}
    return desired, published, statuses


def new_on(out: dict[str, HostPlan]) -> list[str]:
    return [h for h, p in sorted(out.items()) if p.lanes[0].args == NEW.args]


def test_one_lane_of_a_model_at_a_time_the_others_keep_their_published_plan():
    desired, published, statuses = fleet({})
    out = paced(desired, published, statuses)
    assert new_on(out) == ["h1"]
    assert out["h2"] is published["h2"] and out["h3"] is published["h3"]  # nothing to write there
    assert out["h1"].plan_revision == 2


def test_the_next_goes_once_the_last_serves_its_new_spec_again():
    desired, published, statuses = fleet({})
    published["h1"] = plan("h1", NEW, revision=2)
    statuses["h1"] = status("h1", running(NEW, "loading"))
    assert new_on(paced(desired, published, statuses)) == ["h1"]  # h1 still loading: h2 waits
    statuses["h1"] = status("h1", running(OLD))  # the agent has not restarted it yet
    assert new_on(paced(desired, published, statuses)) == ["h1"]
    statuses["h1"] = status("h1", running(NEW, draining=True))
    assert new_on(paced(desired, published, statuses)) == ["h1"]
    statuses["h1"] = status("h1", running(NEW))
    assert new_on(paced(desired, published, statuses)) == ["h1", "h2"]


def test_a_fraction_of_the_models_lanes_and_never_less_than_one():
    assert allowed(0.25, 8) == 2 and allowed(0.25, 3) == 1 and allowed(2, 3) == 2 and allowed(0.5, 1) == 1
    desired, published, statuses = fleet({})
    assert new_on(paced(desired, published, statuses, max_unavailable=2)) == ["h1", "h2"]
    assert new_on(paced(desired, published, statuses, max_unavailable=0.9)) == ["h1", "h2"]


def test_a_lane_out_of_service_for_another_reason_uses_the_budget():
    desired, published, statuses = fleet({})
    statuses["h3"] = status("h3", running(OLD, "crashed"))
    out = paced(desired, published, statuses)
    assert new_on(out) == ["h3"]  # the lane that is down takes its change at once; none that serves


def test_changes_that_take_nothing_out_of_service_go_at_once():
    desired, published, statuses = fleet({})
    statuses.pop("h2")  # no agent reports for h2 yet
    other = spec("o-0", model="o", port=8081)
    desired["h1"] = plan("h1", NEW, other, revision=2)  # a new lane of another model
    out = paced(desired, published, statuses)
    assert new_on(out) == ["h1", "h2"] and out["h1"].lanes[1] == other


def test_a_lane_its_change_broke_halts_the_models_rollout():
    desired, published, statuses = fleet({})
    published["h1"] = plan("h1", NEW, revision=2)
    broke = LaneFeedback(lane_id="m-0", model="m", kind="crash_loop", last_good=OLD)
    statuses["h1"] = status("h1", running(NEW, "failed"), feedback=(broke,))
    desired["h1"] = plan("h1", OLD, revision=3)  # the planner reverts it (policy.revert_target)
    out = paced(desired, published, statuses)
    assert out["h1"].lanes == (OLD,)  # the revert goes at once: the lane is down anyway
    assert out["h2"] is published["h2"] and out["h3"] is published["h3"]
    other = spec("o-0", model="o")
    held = paced({"h2": plan("h2", other)}, {"h2": plan("h2", msgspec.structs.replace(other, args=("-x",)))},
                 {**statuses, "h2": status("h2", running(msgspec.structs.replace(other, args=("-x",))))})  # fmt: skip
    assert held["h2"].lanes == (other,)  # another model's rollout goes on


def test_a_held_plan_is_not_renumbered_while_it_waits():
    desired, published, statuses = fleet({})
    desired["h2"] = msgspec.structs.replace(desired["h2"], budget_ram=123, plan_revision=7)
    assert paced(desired, published, statuses)["h2"] is published["h2"]


def test_runs_compares_the_args_not_a_wrapper():
    assert runs(NEW, LaneStatus(lane_id="m-0", state="healthy", argv=("/usr/bin/python3", "wrapper.py", *NEW.args)))
    assert not runs(NEW, running(OLD)) and not runs(NEW, None)


@settings(max_examples=150, deadline=None)
@given(
    budget=st.sampled_from([1, 2, 0.34, 0.5]),
    lanes=st.integers(1, 6),
    order=st.lists(st.integers(0, 5), min_size=1, max_size=80),
)
def test_a_rollout_never_has_more_lanes_out_than_allowed_and_finishes(budget, lanes, order):
    """Agents that restart a released lane and bring it back in their own order."""
    hosts = [f"h{i}" for i in range(lanes)]
    published = {h: plan(h, OLD) for h in hosts}
    desired = {h: plan(h, NEW, revision=2) for h in hosts}
    serving = {h: OLD for h in hosts}  # what runs healthy; None while restarting
    limit = allowed(budget, lanes)
    for step in [*order, *list(range(lanes)) * 3]:
        statuses = {h: status(h, running(serving[h]) if serving[h] else running(published[h].lanes[0], "loading"))
                    for h in hosts}  # fmt: skip
        published.update(paced(desired, published, statuses, max_unavailable=budget))
        for h in hosts:  # an agent restarts a lane whose plan changed
            if serving[h] is not None and serving[h].args != published[h].lanes[0].args:
                serving[h] = None
        assert sum(1 for h in hosts if serving[h] is None) <= limit
        h = hosts[step % lanes]
        if serving[h] is None:
            serving[h] = published[h].lanes[0]  # that lane is healthy again
    assert all(serving[h] == NEW for h in hosts), serving


def test_a_halted_agent_keeps_serving_what_it_runs_and_a_new_config_rolls_again():
    desired, published, statuses = fleet({})
    published["h1"] = plan("h1", NEW, revision=2)  # its agent halted before restarting the lane
    statuses["h1"] = HostStatus(host_id="h1", lanes=(running(OLD),), rollout_halted="m-1 failed with the change")
    assert new_on(paced(desired, published, statuses)) == ["h1", "h2"]
    broke = LaneFeedback(lane_id="m-0", model="m", kind="unsupported", last_good=OLD)
    statuses["h1"] = status("h1", running(OLD), feedback=(broke,))
    assert new_on(paced(desired, published, statuses)) == ["h1"]  # halted
    seen_at = {("h1", "m-0", 0.0): ("m", 0)}  # the planner saw it under config r0
    statuses["h1"] = status("h1", running(NEW), feedback=(broke,))
    assert new_on(paced(desired, published, statuses, failed_at=seen_at)) == ["h1"]  # still halted under r0
    newer = {h: msgspec.structs.replace(p, config_revision=1) for h, p in desired.items()}
    assert new_on(paced(newer, published, statuses, failed_at=seen_at)) == ["h1", "h2"]  # the next config rolls again


def test_a_host_that_refused_its_plan_does_not_hold_up_the_others():
    desired, published, statuses = fleet({})
    published["h1"] = plan("h1", NEW, revision=2)  # refused by h1's agent: its lane runs OLD on
    assert new_on(paced(desired, published, statuses)) == ["h1"]
    assert new_on(paced(desired, published, statuses, rejected={"h1"})) == ["h1", "h2"]
