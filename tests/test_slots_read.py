"""The gateway's side of the lanes' load (gateway/sync/slots.py): each agent's HostLoad into the
counts admission routes by.

A read answered while this gateway's own requests to the lane end: the slots they held are free,
not busy until the next read. A lane that looked full for a whole read interval after its answers
sent a conversation's next turn cold to another lane: seen as 0.48 cached in CI where
test_slot_save_real measures 0.94."""

from __future__ import annotations

import asyncio
import time

from test_gateway_core import put_plan, put_status, spec

from gateway.admission.queue import Admission
from gateway.fleet.view import FleetView
from gateway.sync.slots import SlotsFeed, still_busy
from shared.messages.status import HostLoad, LaneLoad, LaneStatus
from shared.messages.wire import encode

KEY = ("h1", "gemma-0")


def feed_for(parallel: int = 2, **status) -> tuple[SlotsFeed, Admission]:
    view = FleetView()
    put_plan(view, "h1", spec("gemma-0", port=8080, parallel=parallel))
    put_status(view, "h1", LaneStatus(lane_id="gemma-0", state="healthy", port=8080, **status))
    admission = Admission(view, max_wait=5)
    return SlotsFeed(admission, stall_after=60.0), admission


def load(*lanes: LaneLoad, refresh: float = 10.0) -> HostLoad:
    return HostLoad(host_id="h1", refresh=refresh, lanes=lanes)


def test_slots_that_ended_during_the_read_are_not_counted_busy():
    assert still_busy(2, 2) == 0 and still_busy(2, 1) == 1 and still_busy(1, 3) == 0 and still_busy(3, 0) == 3


async def test_a_read_that_saw_our_requests_busy_does_not_keep_the_lane_full():
    feed, admission = feed_for()
    leases = [await admission.acquire("gemma") for _ in range(2)]
    for lease in leases:  # both answers end while the agent's read is on its way
        lease.release()
    feed.apply(load(LaneLoad(lane_id="gemma-0", busy=2, progressing=True, age=0.2)), time.monotonic())
    assert admission.counts.load(KEY) == 0
    lease = await asyncio.wait_for(admission.acquire("gemma"), 1)  # a slot at once, no wait for the next read
    lease.release()
    # Ends long before the read are not taken off what it saw (another client's requests).
    admission.counts.ended[KEY] = [time.monotonic() - 3.0]
    feed.apply(load(LaneLoad(lane_id="gemma-0", busy=2, progressing=True, age=0.2)), time.monotonic())
    assert admission.counts.load(KEY) == 2


def test_busy_slots_of_other_clients_count_then_go_when_the_agent_says_so():
    feed, admission = feed_for()
    feed.take(encode(load(LaneLoad(lane_id="gemma-0", pid=7, busy=2, progressing=True))))
    assert admission.counts.reported == {KEY: 2} and admission.counts.load(KEY) == 2
    feed.take(encode(load()))  # the lane is no longer among its serving lanes
    assert admission.counts.reported == {}
    feed.take(b'{"kind": "host_load", "host_id": "h1", "lanes": [{"lane_id": "gemma-0", "busy": "two"}]}')
    assert admission.counts.reported == {}  # a bad message is dropped, nothing else
    feed.take(encode(load(LaneLoad(lane_id="gemma-0", busy=None))))  # --no-slots: only our own count
    assert admission.counts.reported == {}


def test_a_read_of_another_process_a_draining_lane_or_an_unknown_host_is_not_counted():
    feed, admission = feed_for(pid=8)
    feed.apply(load(LaneLoad(lane_id="gemma-0", pid=7, busy=2)), 0.0)  # the process before a restart
    assert admission.counts.reported == {}
    feed.apply(load(LaneLoad(lane_id="gemma-0", pid=8, busy=2)), 0.0)
    assert admission.counts.reported == {KEY: 2}
    draining, admission = feed_for(draining=True)
    draining.apply(load(LaneLoad(lane_id="gemma-0", busy=2)), 0.0)
    assert admission.counts.reported == {}
    feed.apply(HostLoad(host_id="h9", lanes=(LaneLoad(lane_id="gemma-0", busy=2),)), 0.0)
    assert ("h9", "gemma-0") not in feed.admission.counts.reported


def test_a_silent_agent_leaves_only_our_own_count_after_three_refreshes():
    feed, admission = feed_for()
    feed.apply(load(LaneLoad(lane_id="gemma-0", busy=2), refresh=10.0), 100.0)
    feed.expire(129.9)
    assert admission.counts.reported == {KEY: 2}
    feed.expire(130.1)
    assert admission.counts.reported == {} and feed.heard == {}


def test_an_unanswered_loop_counts_every_slot_then_stalls_the_lane_until_it_moves():
    feed, admission = feed_for(parallel=4)
    view = admission.view
    feed.apply(load(LaneLoad(lane_id="gemma-0", answered=False, unanswered_for=2.0)), 0.0)
    assert admission.counts.reported == {KEY: 4} and view.routable("gemma")  # full, not out
    feed.apply(load(LaneLoad(lane_id="gemma-0", answered=False, unanswered_for=60.0)), 58.0)
    assert not view.routable("gemma") and view.stalled[KEY].startswith("stalled: /slots unanswered for 60 s")
    feed.apply(load(LaneLoad(lane_id="gemma-0", busy=1, progressing=False)), 60.0)  # answers, stuck
    assert not view.routable("gemma")
    feed.apply(load(LaneLoad(lane_id="gemma-0", busy=1, progressing=True)), 60.5)
    assert view.routable("gemma") and admission.counts.reported == {KEY: 1}
