"""The eviction rule (planner_svc/eviction.py), pure: which idle lanes make room for a woken model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner_svc.eviction import MAX_CANDIDATES, RESIDENCY_LOADS, Candidate, NoRoom, Placement, Room, choose, covers, smallest_set

CPU = ("cpu", 0)
GPU0 = ("gpu", 0)
MIB = 1 << 20
NOW = 1000.0


def lane(lane_id, host="a", cpu=0, gpu=0, **kw) -> Candidate:
    frees = {CPU: cpu * MIB} | ({GPU0: gpu * MIB} if gpu else {})
    kw.setdefault("loaded_at", 0.0)
    kw.setdefault("last_used", 0.0)
    return Candidate(host_id=host, lane_id=lane_id, model=lane_id.rsplit("-", 1)[0], frees=frees, **kw)


def room(host="a", free=0, needs=100, gpu_free=None, gpu_needs=None) -> Room:
    f = {CPU: free * MIB} | ({GPU0: gpu_free * MIB} if gpu_free is not None else {})
    n = {CPU: needs * MIB} | ({GPU0: gpu_needs * MIB} if gpu_needs is not None else {})
    return Room(host, f, n)


def pick(rooms, candidates, min_residency=30.0):
    return choose(rooms, candidates, now=NOW, min_residency=min_residency)


def test_a_host_with_room_is_taken_with_no_eviction_the_roomiest_first():
    got = pick([room("a", free=150), room("b", free=400), room("c", free=50)], [lane("x-0", "c", cpu=500)])
    assert got == Placement("b", (), "fits with no eviction")
    tie = pick([room("b", free=200), room("a", free=200)], [])
    assert tie.host_id == "a" and tie.victims == ()


def test_the_smallest_set_that_frees_enough_not_the_oldest_first():
    # LRU would evict small-0 first and then still need big-0: two loads lost, not one.
    small = lane("small-0", cpu=40, last_used=1.0)
    big = lane("big-0", cpu=200, last_used=500.0)
    got = pick([room(free=10, needs=100)], [small, big])
    assert isinstance(got, Placement) and got.victims == (("a", "big-0"),)


def test_among_sets_of_one_size_lowest_priority_then_least_recently_used():
    a = lane("a-0", cpu=100, priority=5, last_used=1.0)
    b = lane("b-0", cpu=100, priority=0, last_used=900.0)
    c = lane("c-0", cpu=100, priority=0, last_used=100.0)
    got = pick([room(needs=100)], [a, b, c])
    assert got.victims == (("a", "c-0"),)  # priority 0 before 5; of those, the least recently used
    two = pick([room(needs=200)], [a, b, c])
    assert two.victims == (("a", "c-0"), ("a", "b-0"))


def test_never_a_busy_a_young_or_a_pinned_lane():
    busy = lane("busy-0", cpu=500, busy=True)
    young = lane("young-0", cpu=500, loaded_at=NOW - 5)
    pinned = lane("pinned-0", cpu=500, pinned=True)
    got = pick([room(needs=100)], [busy, young, pinned])
    assert isinstance(got, NoRoom) and not got.failed
    assert "requests in flight" in got.reason and "loaded 5 s ago (min residency 30 s)" in got.reason
    assert "pinned" in got.reason
    # The young lane becomes evictable once its minimum residency has passed.
    later = choose([room(needs=100)], [busy, young, pinned], now=NOW + 30, min_residency=30)
    assert later.victims == (("a", "young-0"),)


def test_a_busy_lane_is_drained_once_the_wake_has_waited_and_never_one_of_higher_priority():
    """A model wanted all the time would otherwise keep the memory for ever: once the wake has
    waited the lane's residency (10 x its 1 s load here) a busy lane of no higher priority may go
    (it drains first); idle lanes before busy ones."""
    busy = lane("busy-0", cpu=500, busy=True, last_used=1.0, load_seconds=1.0)
    early = choose([room(needs=100)], [busy], now=NOW, min_residency=30, waited=9)
    assert isinstance(early, NoRoom) and "the wake waited 9 of 10.0 s" in early.reason
    late = choose([room(needs=100)], [busy], now=NOW, min_residency=30, waited=10)
    assert late.victims == (("a", "busy-0"),) and "draining busy lanes" in late.reason
    idle = lane("idle-0", cpu=500, last_used=999.0)  # used more recently, but idle: it goes first
    assert choose([room(needs=100)], [busy, idle], now=NOW, min_residency=30, waited=60).victims == (("a", "idle-0"),)
    above = lane("above-0", cpu=500, busy=True, priority=5)
    kept = choose([room(needs=100)], [above], now=NOW, min_residency=30, waited=600, priority=4)
    assert isinstance(kept, NoRoom) and "at a higher priority" in kept.reason
    assert choose([room(needs=100)], [above], now=NOW, min_residency=30, waited=600, priority=5).victims


def test_a_lane_is_kept_ten_of_its_loads_at_most_the_min_residency():
    fast = lane("fast-0", cpu=500, loaded_at=NOW - 5, load_seconds=0.4)  # kept 4 s: served 5
    slow = lane("slow-0", cpu=500, loaded_at=NOW - 5, load_seconds=2.0)  # kept 20 s
    unknown = lane("unknown-0", cpu=500, loaded_at=NOW - 5)  # kept min_residency
    assert RESIDENCY_LOADS == 10
    assert pick([room(needs=100)], [fast, slow, unknown]).victims == (("a", "fast-0"),)
    got = pick([room(needs=100)], [slow, unknown])
    assert isinstance(got, NoRoom)
    assert "residency 20.0 s: 10 x its 2.00 s load" in got.reason and "(min residency 30 s)" in got.reason


def test_victims_must_free_the_device_the_lane_needs():
    """A GPU lane needs VRAM: evicting CPU lanes frees nothing it can use."""
    cpu_lane = lane("cpu-0", cpu=4000)
    gpu_lane = lane("gpu-0", cpu=50, gpu=3000, last_used=999.0)
    got = pick([room(free=1000, needs=200, gpu_free=100, gpu_needs=2000)], [cpu_lane, gpu_lane])
    assert got.victims == (("a", "gpu-0"),)
    none = pick([room(free=1000, needs=200, gpu_free=100, gpu_needs=2000)], [cpu_lane])
    assert isinstance(none, NoRoom) and "would not free enough" in none.reason


def test_across_hosts_the_one_with_fewer_evictions_wins():
    lanes = [lane("a1-0", "a", cpu=60), lane("a2-0", "a", cpu=60), lane("b1-0", "b", cpu=200, priority=9)]
    got = pick([room("a", needs=100), room("b", needs=100)], lanes)
    assert got == Placement("b", (("b", "b1-0"),), got.reason)
    assert "b1-0" in got.reason


def test_a_model_that_fits_no_host_even_alone_fails_at_once():
    got = pick([Room("a", {}, None, "llama-server keeps failing on a: bad magic")], [lane("x-0", cpu=9999)])
    assert isinstance(got, NoRoom) and got.failed and "bad magic" in got.reason
    assert pick([], []).failed


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(0, 3), st.integers(0, 50)),
                   min_size=0, max_size=7),
    need=st.tuples(st.integers(1, 600), st.integers(0, 600)),
)  # fmt: skip
def test_the_set_is_the_smallest_and_most_preferred_by_brute_force(sizes, need):
    candidates = [Candidate(host_id="a", lane_id=f"m{i}-0", model=f"m{i}", frees={CPU: c, GPU0: g}, priority=p,
                            last_used=float(u)) for i, (c, g, p, u) in enumerate(sizes)]  # fmt: skip
    want = {CPU: need[0]} | ({GPU0: need[1]} if need[1] else {})
    got = smallest_set(want, candidates)
    subsets = [s for k in range(1, len(candidates) + 1) for s in itertools.combinations(candidates, k) if covers(s, want)]
    if not subsets:
        assert got is None
        return
    assert got is not None and covers(got, want)
    fewest = min(len(s) for s in subsets)
    assert len(got) == fewest
    key = lambda s: [(c.priority, c.last_used, c.loaded_at, c.host_id, c.lane_id) for c in sorted(
        s, key=lambda c: (c.priority, c.last_used, c.loaded_at, c.host_id, c.lane_id))]  # noqa: E731
    assert key(got) == min(key(s) for s in subsets if len(s) == fewest)


def test_the_search_is_bounded():
    many = [lane(f"m{i}-0", cpu=1, last_used=float(i)) for i in range(40)]
    got = pick([room(needs=MAX_CANDIDATES)], many)
    assert len(got.victims) == MAX_CANDIDATES
    assert isinstance(pick([room(needs=MAX_CANDIDATES + 1)], many), NoRoom)


@pytest.mark.parametrize("age,ok", [(29.9, False), (30.0, True)])
def test_minimum_residency_boundary(age, ok):
    got = pick([room(needs=10)], [lane("x-0", cpu=10, loaded_at=NOW - age)])
    assert isinstance(got, Placement) is ok
