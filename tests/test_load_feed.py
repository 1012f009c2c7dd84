"""The agent's load feed (launcher_agent/load_feed.py): what it sends of its lanes' /slots reads, and when.

Every gateway learns each lane's load from these messages instead of reading /slots itself, so
a message must go whenever something a router uses changed, and little else."""

from __future__ import annotations

import msgspec

from launcher_agent.load_feed import LoadFeed, Read
from shared.messages.status import HostLoad
from shared.messages.wire import decode, encode

IDLE = ("busy", 0, ())


def busy(n: int, decoded: int = 1):
    return ("busy", n, tuple((i, 100, 100, decoded) for i in range(n)))


def test_the_first_round_goes_whole_then_only_changes():
    feed = LoadFeed("h1", refresh=10.0)
    first = feed.fold([Read("a-0", 11, 0.0, IDLE), Read("b-0", 12, 0.0, IDLE)], 0.0)
    assert first is not None and [(lane.lane_id, lane.busy, lane.pid) for lane in first.lanes] == [
        ("a-0", 0, 11), ("b-0", 0, 12)]  # fmt: skip
    assert feed.fold([Read("a-0", 11, 0.5, IDLE), Read("b-0", 12, 0.5, IDLE)], 0.5) is None  # nothing changed
    # Tokens decoded but the same busy slots: moving is not news either.
    feed.fold([Read("a-0", 11, 1.0, busy(2, 1)), Read("b-0", 12, 1.0, IDLE)], 1.0)
    assert feed.fold([Read("a-0", 11, 1.5, busy(2, 5)), Read("b-0", 12, 1.5, IDLE)], 1.5) is None
    changed = feed.fold([Read("a-0", 11, 2.0, busy(1, 9)), Read("b-0", 12, 2.0, IDLE)], 2.0)
    assert changed is not None and {lane.lane_id: lane.busy for lane in changed.lanes} == {"a-0": 1, "b-0": 0}


def test_a_new_process_a_lane_gone_and_the_refresh_are_sent():
    feed = LoadFeed("h1", refresh=10.0)
    feed.fold([Read("a-0", 11, 0.0, IDLE)], 0.0)
    restarted = feed.fold([Read("a-0", 21, 1.0, IDLE)], 1.0)
    assert restarted is not None and restarted.lanes[0].pid == 21
    gone = feed.fold([], 2.0)
    assert gone is not None and gone.lanes == ()
    assert feed.fold([], 3.0) is None
    assert feed.fold([], 11.9) is None
    refresh = feed.fold([], 12.0)  # whole every refresh seconds: a gateway that missed one catches up
    assert refresh is not None and refresh.refresh == 10.0


def test_a_gateway_that_asks_gets_everything_at_the_next_round():
    feed = LoadFeed("h1")
    feed.fold([Read("a-0", 11, 0.0, IDLE)], 0.0)
    assert feed.fold([Read("a-0", 11, 0.5, IDLE)], 0.5) is None
    feed.ask()
    again = feed.fold([Read("a-0", 11, 1.0, IDLE)], 1.0)
    assert again is not None and again.lanes[0].busy == 0


def test_an_unanswered_loop_is_sent_every_round_with_its_silence():
    feed = LoadFeed("h1")
    feed.fold([Read("a-0", 11, 0.0, busy(1))], 0.0)
    first = feed.fold([Read("a-0", 11, 0.5, ("timeout", 0, ()))], 1.5)  # sent at 0.5, timed out at 1.5
    lane = first.lanes[0]
    assert not lane.answered and lane.busy is None and lane.unanswered_for == 1.0 and lane.age == 1.0
    later = feed.fold([Read("a-0", 11, 2.0, ("timeout", 0, ()))], 3.0)
    assert later is not None and later.lanes[0].unanswered_for == 2.5  # since its first silent read
    back = feed.fold([Read("a-0", 11, 3.5, busy(1, 2))], 3.6)
    assert back is not None and back.lanes[0].answered and back.lanes[0].progressing
    assert feed.unanswered_since == {}
    silent_again = feed.fold([Read("a-0", 11, 4.0, ("timeout", 0, ()))], 5.0)
    assert silent_again.lanes[0].unanswered_for == 1.0  # a new silence counts from its own start


def test_a_lane_that_cannot_say_is_sent_as_unknown():
    feed = LoadFeed("h1")
    msg = feed.fold([Read("a-0", 11, 0.0, ("unknown", 0, ()))], 0.0)
    assert msg.lanes[0].answered and msg.lanes[0].busy is None


def test_the_message_is_bounded_and_round_trips():
    feed = LoadFeed("h1")
    msg = feed.fold([Read(f"l-{i}", 100 + i, 0.0, busy(i % 4)) for i in range(16)], 0.25)
    assert decode(encode(msg), HostLoad) == msg
    assert len(encode(msg)) < 4096  # 16 lanes: a host's whole load in a few KiB
    hostile = msgspec.json.encode({"kind": "host_load", "host_id": "h1", "lanes": [{"lane_id": "a", "busy": -1}]})
    try:
        decode(hostile, HostLoad)
    except msgspec.ValidationError as exc:
        assert "busy" in str(exc)
    else:
        raise AssertionError("a negative busy count was accepted")
