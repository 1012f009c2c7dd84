"""The gateway's pure core: lane discovery from plans and status, route choice, queue admission."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.queue import Admission
from gateway.refusals import QueueFull, QueueTimeout, UnknownModel
from gateway.fleet.view import FleetView
from shared import subjects
from shared.messages.config import FleetConfig
from shared.messages.plans import HostPlan, LaneSpec
from shared.messages.status import HostStatus, LaneStatus
from shared.messages.wire import encode


def spec(lane_id: str, model: str = "gemma", alias: str | None = None, port: int = 8080, parallel: int = 2,
         bind: str = "127.0.0.1") -> LaneSpec:  # fmt: skip
    return LaneSpec(lane_id=lane_id, model=model, model_path=f"/m/{model}.gguf", alias=alias or model, port=port,
                    bind=bind, ctx_total=4096, ctx_per_slot=4096 // parallel, parallel=parallel)  # fmt: skip


def put_plan(view: FleetView, host: str, *specs: LaneSpec) -> None:
    assert view.apply_entry(subjects.plan_key(host), encode(HostPlan(host_id=host, lanes=specs))) is None


def put_status(view: FleetView, host: str, *lanes: LaneStatus, address: str = "") -> None:
    status = HostStatus(host_id=host, lanes=lanes, address=address)
    assert view.apply_entry(subjects.status_key(host), encode(status)) is None


def healthy(lane_id: str, port: int = 8080, draining: bool = False) -> LaneStatus:
    return LaneStatus(lane_id=lane_id, state="healthy", port=port, draining=draining)


def fleet(*hosts: tuple[str, int]) -> FleetView:
    """Hosts with one healthy two-slot lane of model gemma each."""
    view = FleetView()
    for host, port in hosts:
        put_plan(view, host, spec("gemma-0", port=port))
        put_status(view, host, healthy("gemma-0", port))
    return view


# ------------------------------------------------------------------ discovery


def test_lanes_come_from_plans_with_their_agents_state():
    view = FleetView()
    put_plan(view, "h1", spec("gemma-0", alias="chat", port=8080), spec("qwen-0", model="qwen", port=8081))
    put_status(view, "h1", healthy("gemma-0"))
    lanes = {lane.lane_id: lane for lane in view.lanes()}
    assert lanes["gemma-0"].url == "http://127.0.0.1:8080" and lanes["gemma-0"].routable
    assert lanes["qwen-0"].state == "pending" and not lanes["qwen-0"].routable  # no status yet
    assert [lane.lane_id for lane in view.lanes_for("chat")] == ["gemma-0"]
    assert [lane.lane_id for lane in view.lanes_for("gemma")] == ["gemma-0"]  # model name works too


def test_address_is_advertised_then_bind_then_host_name():
    view = FleetView()
    put_plan(view, "h1", spec("a-0", bind="0.0.0.0"))
    assert view.lanes()[0].url == "http://h1:8080"
    put_status(view, "h1", healthy("a-0"), address="10.0.0.7")
    assert view.lanes()[0].url == "http://10.0.0.7:8080"
    put_plan(view, "h2", spec("b-0", bind="10.1.1.1", port=9000))
    put_status(view, "h2", healthy("b-0", 9000), address="fd00::5")
    assert view.lanes()[1].url == "http://[fd00::5]:9000"


def test_a_running_lane_is_reached_on_the_port_it_listens_on():
    view = FleetView()
    put_plan(view, "h1", spec("gemma-0", port=8081))  # the new plan moves it
    put_status(view, "h1", healthy("gemma-0", port=8080))  # the old run still serves
    assert view.lanes()[0].url.endswith(":8080")


def test_draining_unhealthy_and_unreachable_lanes_get_nothing():
    view = FleetView()
    put_plan(view, "h1", spec("a-0", port=1), spec("b-0", port=2), spec("c-0", port=3), spec("d-0", port=4))
    put_status(view, "h1", healthy("a-0", 1, draining=True), LaneStatus(lane_id="b-0", state="loading", port=2),
               healthy("c-0", 3), healthy("d-0", 4))  # fmt: skip
    view.mark_unreachable(("h1", "c-0"), "connection refused")
    assert [lane.lane_id for lane in view.routable("gemma")] == ["d-0"]
    view.mark_reachable(("h1", "c-0"))
    assert [lane.lane_id for lane in view.routable("gemma")] == ["c-0", "d-0"]
    assert [lane.lane_id for lane in view.probe_targets()] == ["a-0", "c-0", "d-0"]
    # The probe's groups are kept between changes and follow each one.
    assert [[lane.lane_id for lane in group] for group in view.probe_groups()] == [[], ["a-0", "c-0", "d-0"]]
    view.mark_unreachable(("h1", "d-0"), "connection refused")
    assert [[lane.lane_id for lane in group] for group in view.probe_groups()] == [["d-0"], ["a-0", "c-0"]]


def test_a_lane_restarted_healthy_is_back_in_rotation_without_waiting_for_the_next_probe():
    """The gateway's verdicts (unreachable, stalled) were of the process that stopped: its agent
    reporting the lane healthy in a new process clears them. The same process keeps them."""
    view = FleetView()
    put_plan(view, "h1", spec("a-0", port=1), spec("b-0", port=2))
    put_status(view, "h1", LaneStatus(lane_id="a-0", state="healthy", port=1, pid=100), healthy("b-0", 2))
    view.mark_unreachable(("h1", "a-0"), "/health: ClientConnectorError")  # its probe, while it restarted
    view.mark_stalled(("h1", "b-0"), "stalled: /slots unanswered")
    put_status(view, "h1", LaneStatus(lane_id="a-0", state="healthy", port=1, pid=100), healthy("b-0", 2))
    assert view.routable("gemma") == []  # the same process (a-0), or none known (b-0): verdicts stand
    put_status(view, "h1", LaneStatus(lane_id="a-0", state="loading", port=1, pid=101), healthy("b-0", 2))
    assert view.routable("gemma") == []
    put_status(view, "h1", LaneStatus(lane_id="a-0", state="healthy", port=1, pid=101),
               LaneStatus(lane_id="b-0", state="healthy", port=2, pid=200))  # fmt: skip
    assert [lane.lane_id for lane in view.routable("gemma")] == ["a-0", "b-0"]


def test_deleted_and_bad_entries():
    view = fleet(("h1", 8080))
    assert view.apply_entry("status.h1", b"{not json") is not None
    assert view.apply_entry("plan.h2", encode(HostPlan(host_id="h1"))) is not None  # foreign host under a key
    assert view.bad_entries == 2 and view.lanes()[0].routable  # the good entries stay
    view.apply_entry("status.h1", None)
    assert view.lanes()[0].state == "pending"
    view.apply_entry("plan.h1", None)
    assert view.lanes() == []


def test_the_config_is_read_and_demand_left_alone():
    view = FleetView()
    view.apply_entry(subjects.CONFIG_KEY, encode(FleetConfig(kv_cache_type="q8_0")))
    assert view.config.kv_cache_type == "q8_0"
    assert view.apply_entry(subjects.DEMAND_KEY, b"anything") is None  # not the gateway's business


# ------------------------------------------------------------------ admission


async def test_requests_fill_slots_then_wait_in_order():
    view = fleet(("h1", 8080), ("h2", 8080))
    adm = Admission(view, max_queue=2, max_wait=5)
    leases = [await adm.acquire("gemma") for _ in range(4)]
    assert sorted(lease.lane.host_id for lease in leases) == ["h1", "h1", "h2", "h2"]
    first = asyncio.create_task(adm.acquire("gemma"))
    await asyncio.sleep(0)
    second = asyncio.create_task(adm.acquire("gemma"))
    await asyncio.sleep(0)
    assert adm.counts.queued == {"gemma": 2}
    with pytest.raises(QueueFull):
        await adm.acquire("gemma")
    freed = leases[0]
    freed.release()
    freed.release()  # twice is once
    got = await first
    assert got.lane.key == freed.lane.key and not second.done()
    leases[1].release()
    assert (await second).lane.key == leases[1].lane.key
    assert adm.counts.queued == {}
    assert sum(adm.counts.in_flight.values()) == 4


async def test_a_wait_ends_in_a_timeout_and_leaves_nothing_behind():
    view = fleet(("h1", 8080))
    adm = Admission(view, max_queue=4, max_wait=0.05)
    held = [await adm.acquire("gemma"), await adm.acquire("gemma")]
    with pytest.raises(QueueTimeout):
        await adm.acquire("gemma")
    assert adm.counts.queued == {} and adm.counts.in_flight == {("h1", "gemma-0"): 2}
    for lease in held:
        lease.release()
    assert adm.counts.in_flight == {} and adm.counts.served == {("h1", "gemma-0"): 2}


async def test_a_cancelled_waiter_gives_back_a_lease_it_was_handed():
    view = fleet(("h1", 8080))
    adm = Admission(view, max_wait=5)
    held = [await adm.acquire("gemma"), await adm.acquire("gemma")]
    waiter = asyncio.create_task(adm.acquire("gemma"))
    await asyncio.sleep(0)
    held[0].release()  # hands the slot to the waiter ...
    waiter.cancel()  # ... which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert adm.counts.in_flight == {("h1", "gemma-0"): 1} and adm.counts.queued == {}


async def test_unknown_model_and_a_model_whose_lanes_are_all_down():
    view = fleet(("h1", 8080))
    adm = Admission(view, max_wait=5)
    with pytest.raises(UnknownModel):
        await adm.acquire("llama")
    put_status(view, "h1", LaneStatus(lane_id="gemma-0", state="starting", port=8080))  # restarting
    waiting = asyncio.create_task(adm.acquire("gemma"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    put_status(view, "h1", healthy("gemma-0"))  # back: the waiter gets it at once
    lease = await asyncio.wait_for(waiting, 1)
    assert lease.lane.lane_id == "gemma-0"


async def test_draining_sends_new_requests_to_the_other_lane():
    view = fleet(("h1", 8080), ("h2", 8080))
    adm = Admission(view)
    put_status(view, "h1", healthy("gemma-0", draining=True))
    assert {(await adm.acquire("gemma")).lane.host_id for _ in range(2)} == {"h2"}


async def test_a_retry_excludes_the_lane_that_failed():
    view = fleet(("h1", 8080), ("h2", 8080))
    adm = Admission(view)
    first = await adm.acquire("gemma")
    first.release()
    again = await adm.acquire("gemma", exclude=frozenset({first.lane.key}))
    assert again.lane.key != first.lane.key


async def test_metrics_read_the_load_from_the_admission():
    from gateway.metrics import GatewayMetrics

    view = fleet(("h1", 8080))
    adm = Admission(view, max_wait=5)
    metrics = GatewayMetrics(view, adm.counts)
    held = [await adm.acquire("gemma"), await adm.acquire("gemma")]
    waiter = asyncio.create_task(adm.acquire("gemma"))
    await asyncio.sleep(0)
    labels = {"host": "h1", "lane": "gemma-0", "model": "gemma"}
    assert metrics.registry.get_sample_value("lanes_lane_slots_busy", labels) == 2
    assert metrics.registry.get_sample_value("lanes_gateway_queue_depth", {"model": "gemma"}) == 1
    held[0].release()
    (await waiter).release()
    held[1].release()
    assert metrics.registry.get_sample_value("lanes_lane_slots_busy", labels) == 0
    assert metrics.registry.get_sample_value("lanes_gateway_queue_depth", {"model": "gemma"}) == 0  # not gone


async def test_a_waiter_whose_client_left_leaves_the_queue_and_is_no_demand():
    view = fleet(("h1", 8080))
    adm = Admission(view, max_wait=30)
    held = [await adm.acquire("gemma"), await adm.acquire("gemma")]
    waiters = [asyncio.create_task(adm.acquire("gemma")) for _ in range(3)]
    await asyncio.sleep(0)
    assert adm.counts.queued == {"gemma": 3}
    for task in waiters:  # the clients hang up: aiohttp cancels their handlers
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert adm.counts.queued == {} and adm.take_queue_waits(asyncio.get_running_loop().time()) == {}
    held[0].release()
    assert adm.counts.in_flight == {view.lanes()[0].key: 1}  # the freed slot went to nobody
    held[1].release()


def test_api_keys_are_checked_against_every_key():
    from gateway.settings import GatewaySettings

    settings = GatewaySettings(api_keys=("sk-one", "sk-two"))
    assert settings.key_ok("sk-one") and settings.key_ok("sk-two")
    assert not settings.key_ok("sk-on") and not settings.key_ok("") and not settings.key_ok("sk-one ")
    assert not GatewaySettings().key_ok("anything")  # no keys configured: the middleware asks for none


def test_a_slots_read_that_times_out_counts_against_the_lane_then_stalls_it():
    from gateway.sync.slots import judge
    from shared.messages.status import LaneLoad

    answered = judge(LaneLoad(lane_id="a", busy=1, progressing=True), 4, now=10.0, stall_after=60)
    assert (answered.reported, answered.unanswered_since, answered.stalled, answered.progressing) == (1, None, "", True)
    first = judge(LaneLoad(lane_id="a", answered=False), 4, now=10.0, stall_after=60)
    assert (first.reported, first.unanswered_since, first.stalled) == (4, 10.0, "")  # every slot busy, not free
    later = judge(LaneLoad(lane_id="a", answered=False, unanswered_for=59.9), 4, now=69.9, stall_after=60)
    assert later.reported == 4 and abs(later.unanswered_since - 10.0) < 1e-9 and not later.stalled
    stuck = judge(LaneLoad(lane_id="a", answered=False, unanswered_for=60.0), 4, now=70.0, stall_after=60)
    assert stuck.stalled.startswith("stalled: /slots unanswered for 60 s")
    assert stuck.stalled == judge(LaneLoad(lane_id="a", answered=False, unanswered_for=89.0), 4, now=99.0,
                                  stall_after=60).stalled  # one reason  # fmt: skip
    unknown = judge(LaneLoad(lane_id="a", busy=None), 4, now=99.0, stall_after=60)  # --no-slots, an error
    assert (unknown.reported, unknown.unanswered_since, unknown.stalled, unknown.progressing) == (None, None, "", False)


def test_an_answer_brings_a_stalled_lane_back_only_when_its_loop_moved_or_idles():
    from launcher_agent.load_feed import LoadFeed, Read

    frozen = ((40, 5979, 5467, 0),)

    feed = LoadFeed("h1")
    first = feed.fold([Read("a", 7, 0.0, ("busy", 1, frozen))], 0.0)
    assert first.lanes[0].progressing  # nothing to compare with yet
    stuck = feed.fold([Read("a", 7, 0.5, ("busy", 1, frozen))], 0.5)
    assert stuck is not None and not stuck.lanes[0].progressing  # answers, but stuck: a change, so sent
    later = feed.fold([Read("a", 7, 1.0, ("busy", 1, ((40, 5979, 5979, 1),)))], 1.0)
    assert later is not None and later.lanes[0].progressing  # a batch later
    feed.fold([Read("a", 7, 1.5, ("busy", 1, frozen))], 1.5)
    idle = feed.fold([Read("a", 7, 2.0, ("busy", 0, ()))], 2.0)
    assert idle is not None and idle.lanes[0].progressing and idle.lanes[0].busy == 0  # idle


def test_a_stalled_lane_leaves_rotation_until_its_slots_answer_not_its_health():
    view = fleet(("h1", 8080))
    (lane,) = view.lanes()
    view.mark_stalled(lane.key, "lane h1/gemma-0 stalled: no first token within 30 s")
    assert not view.lanes()[0].routable and "stalled" in view.lanes()[0].unreachable
    view.mark_reachable(lane.key)  # its /health answered (the HTTP thread): not enough
    assert not view.lanes()[0].routable
    view.mark_progressing(lane.key)  # its /slots answered (the inference loop)
    assert view.lanes()[0].routable
