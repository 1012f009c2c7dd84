"""The gateway's hold-and-wake core (gateway/admission/waking.py): states, the model list, activity, held requests."""

from __future__ import annotations

import asyncio

import pytest
from test_gateway_core import healthy, put_plan, put_status, spec

import gateway.admission.waking as waking
from gateway.admission.counts import LaneCounts
from gateway.fleet.view import FleetView
from shared import subjects
from shared.messages.activity import ModelState, ModelStates
from shared.messages.status import LaneStatus
from shared.messages.wire import encode


def put_models(view: FleetView, *models: ModelState) -> None:
    assert view.apply_entry(subjects.MODELS_KEY, encode(ModelStates(models=models, evictions={"wake": 2}))) is None


def fleet() -> FleetView:
    """chat (model gemma) runs on host a; llama is unloaded; phi failed; ghost is unknown."""
    view = FleetView()
    put_plan(view, "a", spec("gemma-0", model="gemma", alias="chat"))
    put_status(view, "a", healthy("gemma-0"))
    put_models(
        view,
        ModelState(name="chat", model="gemma", state="loaded", hosts=("a",), holders=("a",)),
        ModelState(name="llama", model="llama", state="unloaded", holders=("a", "b"), predicted_load_s=4.0),
        ModelState(name="phi", model="phi", state="failed", holders=("b",), reason="bad magic"),
    )
    return view


def test_states_of_requested_names():
    view = fleet()
    assert waking.classify(view, "chat").state == "ready"
    assert waking.classify(view, "gemma").name == "chat"  # the file name routes to its persona
    assert waking.classify(view, "llama") == waking.ModelView("llama", "unloaded")
    assert waking.classify(view, "phi") == waking.ModelView("phi", "failed", "bad magic")
    assert waking.classify(view, "ghost").state == "unknown"
    put_plan(view, "b", spec("llama-0", model="llama"))  # planned, not up yet
    assert waking.classify(view, "llama").state == "loading"
    put_status(view, "b", LaneStatus(lane_id="llama-0", state="failed", last_error="out of memory"))
    assert waking.classify(view, "llama").state == "failed" and waking.classify(view, "llama").reason == "out of memory"


def test_no_models_key_yet_is_the_old_behaviour():
    view = FleetView()
    put_plan(view, "a", spec("gemma-0"))
    assert waking.classify(view, "gemma").state == "loading"
    assert waking.classify(view, "llama").state == "unknown"  # a 404, as before


def test_the_model_list_has_every_model_with_state_and_place():
    listed = {m["id"]: m for m in waking.catalogue(fleet())}
    assert sorted(listed) == ["chat", "llama", "phi"]
    assert listed["chat"]["state"] == "ready" and listed["chat"]["where"] == [{"host": "a", "lane": "gemma-0",
                                                                                 "state": "ready"}]  # fmt: skip
    assert listed["chat"]["lanes"] == {"model": "gemma", "total": 1, "ready": 1}
    assert listed["llama"]["state"] == "unloaded" and listed["llama"]["holders"] == ["a", "b"]
    assert listed["llama"]["predicted_load_s"] == 4.0
    assert listed["phi"]["state"] == "failed" and listed["phi"]["reason"] == "bad magic"
    assert all(m["object"] == "model" and m["owned_by"] == "lanes" for m in listed.values())


def test_the_hold_bound_is_the_option_or_the_prediction_plus_a_margin():
    view = fleet()
    assert waking.load_bound(view, "llama", 7.0) == (7.0, 4.0)
    assert waking.load_bound(view, "llama", None) == (4.0 * 1.5 + waking.LOAD_MARGIN, 4.0)
    assert waking.load_bound(view, "phi", None) == (waking.DEFAULT_LOAD_TIMEOUT, None)


def test_activity_counts_in_flight_queued_and_held_per_persona():
    view = fleet()
    counts = LaneCounts(in_flight={("a", "gemma-0"): 2}, queued={"gemma": 1, "ghost": 4})
    got = waking.activity(view, counts, {"llama": 3}, {"chat": 90.0}, now=100.0)
    assert {a.name: (a.in_flight, a.queued, a.idle_s) for a in got} == {
        "chat": (2, 1, 10.0), "llama": (0, 3, None)}  # an unknown name counts nowhere


async def test_held_requests_go_when_the_model_is_ready_and_wake_once():
    view = fleet()
    woken: list[str] = []

    async def publish(name: str) -> None:
        woken.append(name)

    cold: list[tuple[str, float]] = []
    waker = waking.Waker(view, publish=publish, on_cold_start=lambda m, s: cold.append((m, s)))
    model = waking.classify(view, "llama")
    held = [asyncio.create_task(waker.wait_ready(model, 5.0)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert woken == ["llama"] and waker.counts() == {"llama": 3} and waker.wanted() == ["llama"]
    put_plan(view, "b", spec("llama-0", model="llama"))
    assert waker.wanted() == []  # placed: no more wakes
    put_status(view, "b", healthy("llama-0"))
    await asyncio.wait_for(asyncio.gather(*held), 1)
    assert [m for m, _ in cold] == ["llama"] and waker.counts() == {}


async def test_held_clients_that_leave_are_no_longer_held_nor_woken_for():
    view = fleet()
    entered = asyncio.Event()

    async def publish(name: str) -> None:  # a wake still being sent when the client leaves
        entered.set()
        await asyncio.sleep(3600)

    waker = waking.Waker(view, publish=publish)
    held = [asyncio.create_task(waker.wait_ready(waking.classify(view, "llama"), 30.0)) for _ in range(2)]
    await entered.wait()
    assert waker.counts() == {"llama": 2} and waker.wanted() == ["llama"]
    for task in held:  # the clients hang up (aiohttp cancels their handlers), one of them mid-wake
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert waker.held == {} and waker.counts() == {} and waker.wanted() == []


async def test_a_failed_load_answers_held_requests_with_the_reason():
    view = fleet()
    waker = waking.Waker(view)
    held = asyncio.create_task(waker.wait_ready(waking.classify(view, "llama"), 5.0))
    await asyncio.sleep(0.05)
    put_models(view, ModelState(name="llama", model="llama", state="failed", reason="llama-server: bad magic"))
    with pytest.raises(waking.LoadFailed, match="bad magic"):
        await asyncio.wait_for(held, 1)


async def test_a_load_past_its_bound_is_a_timeout_with_retry_after_and_the_queue_is_bounded():
    view = fleet()
    waker = waking.Waker(view, max_held=1)
    first = asyncio.create_task(waker.wait_ready(waking.classify(view, "llama"), 0.2))
    await asyncio.sleep(0.05)
    with pytest.raises(waking.HeldFull):
        await waker.wait_ready(waking.classify(view, "llama"), 0.2)
    with pytest.raises(waking.LoadTimeout) as late:
        await first
    assert late.value.retry_after == 4  # the predicted load time
    assert waker.held == {}


def test_a_request_naming_no_model_goes_to_the_only_one():
    assert waking.only_model([{"id": "gemma"}]) == ("gemma", "")
    assert waking.only_model([]) == (None, "this fleet serves no model")
    name, why = waking.only_model([{"id": m} for m in "abcdefg"])
    assert name is None and why == "this fleet serves 7 models (a, b, c, d, e, ...): name one"


def test_activity_reports_the_longest_queue_wait_per_persona():
    view = fleet()
    got = waking.activity(view, LaneCounts(), {}, {}, now=100.0, waits={"gemma": 1.5, "chat": 3.25, "ghost": 9.0})
    assert {a.name: a.wait_s for a in got} == {"chat": 3.25}  # the file name counts under its persona


async def test_admission_measures_queue_waits_ended_and_still_waiting():
    from gateway.admission.queue import Admission

    view = fleet()  # chat has one lane of two slots
    admission = Admission(view, max_wait=5.0)
    loop = asyncio.get_running_loop()
    first, other = await admission.acquire("chat"), await admission.acquire("chat")
    assert admission.take_queue_waits(loop.time()) == {}  # a slot at once is no queue wait
    second = asyncio.create_task(admission.acquire("chat"))
    await asyncio.sleep(0.3)
    still = admission.take_queue_waits(loop.time())
    assert 0.25 <= still["chat"] < 1.0  # the waiter still queued, at its age so far
    first.release()
    lease = await asyncio.wait_for(second, 1)
    ended = admission.take_queue_waits(loop.time())
    assert 0.25 <= ended["chat"] < 1.0  # the wait that ended since the last report
    assert admission.take_queue_waits(loop.time()) == {}  # cleared: each interval reports its own
    lease.release()
    other.release()
