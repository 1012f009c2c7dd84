"""The agent's drain: a serving lane is marked, its requests finish (or time runs out), then it restarts."""

from __future__ import annotations

from launcher_agent.drain import IDLE_SETTLE, Drains
from launcher_agent.lane import Lane
from launcher_agent.reconcile import Restart, Start, Stop
from shared.messages.plans import LaneSpec


def _spec(lane_id: str) -> LaneSpec:
    return LaneSpec(lane_id=lane_id, model="m", model_path="/m.gguf", alias="m", port=8080, ctx_total=4096,
                    ctx_per_slot=2048, parallel=2)  # fmt: skip


class _Recorder:
    def __init__(self):
        self.events: list[tuple[str, str]] = []

    async def __call__(self, lane, event, detail=""):
        self.events.append((lane.spec.lane_id, event))


async def test_restart_of_a_serving_lane_waits_for_its_requests():
    emit = _Recorder()
    drains = Drains(emit)
    lanes = {"a": Lane(spec=_spec("a"), state="healthy"), "b": Lane(spec=_spec("b"), state="crashed")}
    busy = {"a": 2}

    async def in_flight(lane):
        return busy[lane.spec.lane_id]

    restart_a, restart_b, start_c = Restart(_spec("a"), "change"), Restart(_spec("b"), "change"), Start(_spec("c"), "new")
    actions = [restart_a, restart_b, start_c]
    # First pass: a is marked and held; b does not serve and c is new, so they go at once.
    assert await drains.gate(actions, lanes, now=0, timeout=30, busy=in_flight) == [restart_b, start_c]
    assert lanes["a"].draining and emit.events == [("a", "draining")]
    assert await drains.gate([restart_a], lanes, now=5, timeout=30, busy=in_flight) == []  # still busy
    busy["a"] = 0
    assert await drains.gate([restart_a], lanes, now=6, timeout=30, busy=in_flight) == []  # idle once
    assert await drains.gate([restart_a], lanes, now=6 + IDLE_SETTLE, timeout=30, busy=in_flight) == [restart_a]
    assert not drains.active()


async def test_a_drain_the_plan_takes_back_is_undone_and_time_runs_out():
    drains = Drains(_Recorder())
    lanes = {"a": Lane(spec=_spec("a"), state="healthy")}

    async def busy(lane):
        return 1

    stop_a = Stop("a", "not planned")
    await drains.gate([stop_a], lanes, now=0, timeout=10, busy=busy)
    assert lanes["a"].draining
    assert await drains.gate([], lanes, now=1, timeout=10, busy=busy) == []  # the plan changed its mind
    assert not lanes["a"].draining and not drains.active()
    await drains.gate([stop_a], lanes, now=2, timeout=10, busy=busy)
    assert await drains.gate([stop_a], lanes, now=11.9, timeout=10, busy=busy) == []
    assert await drains.gate([stop_a], lanes, now=12, timeout=10, busy=busy) == [stop_a]  # requests still busy


async def test_a_start_on_the_port_of_a_draining_lane_waits_for_its_stop():
    """An evicted lane's port goes to the lane that replaces it only once its requests are done."""
    drains = Drains(_Recorder())
    lanes = {"a": Lane(spec=_spec("a"), state="healthy")}
    busy = {"a": 1}

    async def in_flight(lane):
        return busy[lane.spec.lane_id]

    stop_a, start_b = Stop("a", "evicted"), Start(_spec("b"), "woken")  # both on port 8080
    other = Start(LaneSpec(lane_id="c", model="m", model_path="/m.gguf", alias="m", port=8081, ctx_total=4096,
                           ctx_per_slot=2048, parallel=2), "new")  # fmt: skip
    assert await drains.gate([stop_a, start_b, other], lanes, now=0, timeout=30, busy=in_flight) == [other]
    assert await drains.gate([stop_a, start_b], lanes, now=5, timeout=30, busy=in_flight) == []
    busy["a"] = 0
    await drains.gate([stop_a, start_b], lanes, now=6, timeout=30, busy=in_flight)
    assert await drains.gate([stop_a, start_b], lanes, now=6 + IDLE_SETTLE, timeout=30, busy=in_flight) == [
        stop_a, start_b]


async def test_through_its_grace_a_drain_needs_no_look_then_one_every_pass():
    """The control loop sleeps until the first drain's grace ends (nothing is asked before), then
    asks each pass; a later drain does not push the first one's end back."""
    from launcher_agent.drain import DRAIN_GRACE

    drains = Drains(_Recorder())
    lanes = {"a": Lane(spec=_spec("a"), state="healthy"), "b": Lane(spec=_spec("b"), state="healthy")}

    async def idle(lane):
        return 0

    assert drains.quiet_for(0.0) == 0.0  # no drain
    await drains.gate([Restart(_spec("a"), "change")], lanes, now=10.0, timeout=30, busy=idle)
    assert drains.quiet_for(10.0) == DRAIN_GRACE
    await drains.gate([Restart(_spec("a"), "change"), Restart(_spec("b"), "change")], lanes, now=10.2, timeout=30,
                      busy=idle)  # fmt: skip
    assert abs(drains.quiet_for(10.2) - (DRAIN_GRACE - 0.2)) < 1e-9
    assert drains.quiet_for(10.0 + DRAIN_GRACE + 0.1) == 0.0  # a's grace is over: it is asked each pass
