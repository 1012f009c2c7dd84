"""Routing by tokens and the index corrected by measurement: pure cores, with property tests."""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.queue import HOT_MIN_CHUNKS, Admission
from gateway.routing.affinity import DEFAULT_PREFILL_RATE
from gateway.routing.chunks import CHUNK_CHARS, fingerprint
from gateway.fleet import LaneKey
from gateway.fleet.view import FleetView
from gateway.routing.prefix_index import MIN_CHUNKS, PrefixIndex, budget_chunks
from gateway.routing.token_cost import LaneTokens, choose_by_cost, first_token_cost
from test_gateway_core import healthy, put_plan, put_status, spec

A, B, C = ("h", "a"), ("h", "b"), ("h", "c")
KEY = 12345


def lane_strategy(key):
    return st.builds(
        LaneTokens,
        key=st.just(key),
        slots=st.integers(1, 8),
        busy=st.integers(0, 10),
        waiting=st.integers(0, 4),
        pending=st.integers(0, 20000),
        rate=st.one_of(st.none(), st.floats(5, 5000)),
        hold=st.one_of(st.none(), st.floats(0.01, 60)),
        matched=st.integers(0, 4000),
        chunks=st.integers(0, 60),
    )


fleets = st.tuples(lane_strategy(A), lane_strategy(B), lane_strategy(C)).map(list)


def ranked_cost(lane: LaneTokens, lanes: list[LaneTokens], tokens: int) -> float:
    """What lanes are compared by: the first-token cost, plus once more the seconds of prefill the
    lane would do beyond the warmest lane's."""
    warmest = min(tokens, max(x.matched for x in lanes))
    rate = lane.rate or DEFAULT_PREFILL_RATE
    return first_token_cost(lane, tokens) + max(0, warmest - lane.matched) / rate


@given(fleets, st.integers(1, 4000))
@settings(max_examples=300, deadline=None)
def test_the_choice_is_the_open_lane_whose_first_token_comes_soonest(lanes, tokens):
    """Soonest, where a colder lane's extra prefill counts twice."""
    choice = choose_by_cost(lanes, tokens, KEY)
    open_lanes = [x for x in lanes if x.busy < x.slots]
    if not open_lanes:
        assert choice.lane is None and choice.reason == "no_slot"
        return
    chosen = next(x for x in lanes if x.key == choice.lane)
    assert chosen.busy < chosen.slots  # never a full lane
    cheapest = min(ranked_cost(x, lanes, tokens) for x in open_lanes)
    assert round(ranked_cost(chosen, lanes, tokens), 6) == round(cheapest, 6)
    assert choice.reason == ("affinity" if chosen.matched else "overflow" if any(x.matched for x in lanes) else "miss")


@given(fleets, st.integers(1, 4000))
@settings(max_examples=300, deadline=None)
def test_a_patient_request_waits_only_for_a_full_lane_cheaper_than_any_open_one(lanes, tokens):
    choice = choose_by_cost(lanes, tokens, KEY, patient=True)
    costs = {x.key: first_token_cost(x, tokens) for x in lanes}
    ranks = {x.key: ranked_cost(x, lanes, tokens) for x in lanes}
    open_lanes = [x for x in lanes if x.busy < x.slots]
    if choice.reason == "wait":
        awaited = next(x for x in lanes if x.key == choice.wait_for)
        assert awaited.busy >= awaited.slots
        assert all(round(ranks[awaited.key], 6) <= round(ranks[x.key], 6) for x in open_lanes)
        # no longer than going now to the open lane it would take costs
        assert choice.patience == (costs[choose_by_cost(lanes, tokens, KEY).lane] if open_lanes else 0.0)
    else:
        assert choice == choose_by_cost(lanes, tokens, KEY)  # an open lane is cheapest: the same as impatient


@given(fleets, st.integers(1, 4000), st.randoms(use_true_random=False))
@settings(max_examples=200, deadline=None)
def test_the_order_lanes_are_listed_in_changes_nothing(lanes, tokens, rnd):
    shuffled = list(lanes)
    rnd.shuffle(shuffled)
    assert choose_by_cost(shuffled, tokens, KEY, patient=True) == choose_by_cost(lanes, tokens, KEY, patient=True)


@given(fleets, st.integers(1, 4000), st.integers(1, 5000))
@settings(max_examples=300, deadline=None)
def test_more_prefill_queued_on_a_lane_never_draws_a_request_to_it(lanes, tokens, more):
    choice = choose_by_cost(lanes, tokens, KEY)
    if choice.lane is None:
        return
    for other in lanes:
        if other.key == choice.lane:
            continue
        heavier = [LaneTokens(**{**x.__dict__, "pending": x.pending + more}) if x.key == other.key else x
                   for x in lanes]  # fmt: skip
        assert choose_by_cost(heavier, tokens, KEY).lane == choice.lane


@given(fleets, st.integers(1, 4000), st.integers(1, 4000))
@settings(max_examples=300, deadline=None)
def test_holding_more_of_the_prompt_never_loses_the_chosen_lane_its_request(lanes, tokens, more):
    choice = choose_by_cost(lanes, tokens, KEY)
    if choice.lane is None:
        return
    warmer = [LaneTokens(**{**x.__dict__, "matched": x.matched + more}) if x.key == choice.lane else x for x in lanes]
    assert choose_by_cost(warmer, tokens, KEY).lane == choice.lane


def test_a_conversation_stays_on_its_warm_lane_when_two_like_lanes_are_timed_apart():
    """Measured in a loaded run of tests/test_slot_save_real.py (two identical lanes on one
    2-core host): their prefill was timed at 4203 and 9114 tokens/s. A 999-token turn whose
    previous 938 tokens the slower lane holds (2 whole chunks and the end of the last prompt),
    another turn's 61 tokens ahead on each lane, stays on the warm lane. Counted by whole chunks
    alone and the cold lane's extra work once, a turn like it went cold and halved the round's
    cached share (its lane's other conversation then went cold too)."""
    warm = LaneTokens(A, 2, 1, pending=61, rate=4203.0, matched=938, chunks=2)
    cold = LaneTokens(B, 2, 1, pending=61, rate=9114.0)
    assert choose_by_cost([warm, cold], 999, KEY).lane == A
    # Held by whole chunks alone, with more ahead of it, it still stays: the cold lane's extra work counts twice.
    assert choose_by_cost([LaneTokens(A, 2, 1, pending=330, rate=4203.0, matched=730, chunks=2),
                           LaneTokens(B, 2, 1, pending=330, rate=9114.0)], 999, KEY).lane == A  # fmt: skip


def test_a_warm_lane_is_kept_while_waiting_for_it_costs_less_than_a_cold_prefill_whose_extra_work_counts_twice():
    rate, prompt = 100.0, 3000  # a 30 s cold prefill, 29 s of it more than the warm lane's 1 s
    cold = LaneTokens(B, 2, 0, rate=rate)
    for pending, kept in ((0, True), (5700, True), (5900, False)):  # 57 s + 1 s against 30 + 29 s, then 60 s
        warm = LaneTokens(A, 2, 1, pending=pending, rate=rate, matched=2900, chunks=45)
        assert (choose_by_cost([warm, cold], prompt, KEY).lane == A) is kept, pending
    # Full: a patient request waits for it as long as a cold prefill would take, then goes.
    full = LaneTokens(A, 2, 2, rate=rate, hold=4.0, matched=2900, chunks=45)
    choice = choose_by_cost([full, cold], prompt, KEY, patient=True)
    assert (choice.reason, choice.wait_for, choice.patience) == ("wait", A, first_token_cost(cold, prompt))
    assert choose_by_cost([full, cold], prompt, KEY).lane == B


def test_each_lane_at_its_own_measured_speed():
    slow = LaneTokens(A, 2, 0, rate=50.0, matched=1000)
    fast = LaneTokens(B, 2, 0, rate=1000.0)
    assert choose_by_cost([slow, fast], 2000, KEY).lane == B  # 1000 tokens at 50/s: 20 s; 2000 at 1000/s: 2 s
    assert first_token_cost(LaneTokens(A, 2, 0), 500) == 500 / DEFAULT_PREFILL_RATE  # unmeasured: the default


def _hot_spot(rounds: int, lanes: int, slots: int, conversations: int, seed: int) -> list[int]:
    """A closed loop: conversations sharing one long system prompt, each request held a while."""
    rnd = random.Random(seed)
    keys = [("h", str(i)) for i in range(lanes)]
    index, served = PrefixIndex(), dict.fromkeys(keys, 0)
    system = "s" * (CHUNK_CHARS * 24)
    texts = [system + f"user {c} " * 40 for c in range(conversations)]
    running: list[tuple[int, tuple]] = []  # (finish round, lane)
    for now in range(rounds):
        running = [r for r in running if r[0] > now]
        c = rnd.randrange(conversations)
        mark = fingerprint("m", texts[c])
        texts[c] += f" reply {now} and the next question " * 8
        loads = []
        for key in keys:
            busy = sum(1 for r in running if r[1] == key)
            m = index.matched(key, mark.hashes)
            loads.append(LaneTokens(key, slots, busy, rate=200.0, hold=2.0, matched=m * CHUNK_CHARS // 4, chunks=m))
        choice = choose_by_cost(loads, mark.chars // 4, mark.key)
        if choice.lane is None:
            continue
        index.record(choice.lane, mark.hashes)
        served[choice.lane] += 1
        running.append((now + rnd.randint(1, 2 * lanes * slots), choice.lane))
    return list(served.values())


def test_a_hot_system_prompt_does_not_pile_onto_one_lane():
    for seed in range(5):
        served = _hot_spot(400, lanes=2, slots=4, conversations=16, seed=seed)
        assert max(served) / (sum(served) / len(served)) <= 1.3, served


# ------------------------------------------------------------------ the index


def test_the_budget_is_what_llama_server_keeps():
    assert budget_chunks(0, 4.0, CHUNK_CHARS) > 1000  # not known: the old fixed bound
    assert budget_chunks(2 * 4096, 4.0, CHUNK_CHARS) == 2 * 4096 * 4 // CHUNK_CHARS
    assert budget_chunks(10, 4.0, CHUNK_CHARS) == MIN_CHUNKS


@given(st.lists(st.lists(st.integers(0, 200), max_size=30), max_size=40), st.integers(1, 50))
@settings(max_examples=200, deadline=None)
def test_a_lane_never_holds_more_than_its_budget(prompts, budget):
    index = PrefixIndex()
    index.set_budget(A, budget)
    for hashes in prompts:
        index.record(A, hashes)
        assert index.held(A) <= budget
        if hashes and len(set(hashes)) <= budget:
            assert hashes[-1] in index.lanes[A]  # the newest is always kept


@given(st.integers(2, 20), st.integers(0, 20), st.integers(1, 10))
@settings(max_examples=200, deadline=None)
def test_an_answer_that_reused_less_drops_the_stale_entry_and_all_older(n, reused, others):
    index = PrefixIndex()
    old = list(range(1000, 1000 + others))
    prompt = list(range(1, n + 1))
    index.record(A, old)
    index.record(A, prompt[: n - 1])  # the previous turn
    newer = [5000, 5001]
    index.record(A, newer)  # another conversation after it
    predicted = index.matched(A, prompt)
    stamp = index.stamp(A, prompt, predicted)
    index.record(A, prompt)  # sent now
    reused = min(reused, n)
    fix = index.correct(A, prompt, predicted, stamp, reused)
    assert fix.confirmed == reused
    assert index.matched(A, prompt) == n  # the lane holds this prompt now, whatever it had before
    assert all(h in index.lanes[A] for h in newer)  # recorded after the stale entry: kept
    if reused >= predicted - 1:
        assert fix.dropped == () and all(h in index.lanes[A] for h in old)
    else:
        assert set(old) <= set(fix.dropped) and not set(old) & set(index.lanes[A])


# ------------------------------------------------------------------ admission


async def test_admission_counts_prefill_ahead_and_its_answer_corrects_the_index():
    view = FleetView()
    put_plan(view, "h", spec("a", "m", parallel=2), spec("b", "m", parallel=2))
    put_status(view, "h", healthy("a"), healthy("b"))
    admission = Admission(view)
    lane_a = next(x for x in view.lanes() if x.lane_id == "a")
    assert admission.index.limit(lane_a.key) < 16384  # bounded by the plan's slots and --cache-ram
    text = "x" * (CHUNK_CHARS * 10)
    first = await admission.acquire("m", prompt=fingerprint("m", text))
    assert admission.counts.pending[first.lane.key] == len(text) // 4  # cold: all of it ahead
    first.prefilled()
    assert admission.counts.pending[first.lane.key] == 0
    await asyncio.sleep(0)
    first.release()
    admission.measured(first, 2560, 0)  # 2560 tokens: 1 character each, none reused
    assert admission.counts.cpt("m") == 1.0
    nxt = fingerprint("m", text + "y" * CHUNK_CHARS * 2)
    second = await admission.acquire("m", prompt=nxt)
    assert second.lane.key == first.lane.key and second.chunks == 10
    second.release()
    admission.measured(second, len(text) + 2 * CHUNK_CHARS, 100)  # it had evicted the first turn
    assert admission.index.matched(second.lane.key, nxt.hashes) == len(nxt.hashes)  # held now


async def _overflow_past_a_warm_lane(base: str) -> tuple[Admission, list, LaneKey, LaneKey]:
    """Two idle lanes; `base` sent (a miss), then a long turn after it (to the warm lane: its prefill
    queues there), then a short one, which the queued prefill sends cold to the other lane."""
    view = FleetView()
    put_plan(view, "h", spec("a", "m", parallel=4), spec("b", "m", parallel=4))
    put_status(view, "h", healthy("a"), healthy("b"))
    admission = Admission(view)
    told: list[tuple] = []
    admission.on_hot = lambda source, target: told.append((source, target))
    first = await admission.acquire("m", prompt=fingerprint("m", base))
    second = await admission.acquire("m", prompt=fingerprint("m", base + "z" * CHUNK_CHARS * 40))
    assert second.lane.key == first.lane.key and told == []
    third = await admission.acquire("m", prompt=fingerprint("m", base + "w" * CHUNK_CHARS * 2))
    assert sum(n for (_, why), n in admission.counts.routes.items() if why == "overflow") == 1
    return admission, told, first.lane.key, third.lane.key


async def test_a_request_sent_cold_past_its_busy_warm_lane_asks_that_lane_to_spread():
    """The hot-spot signal (gateway/sync/hot_spots.py): the lane holding a prompt has so much
    prefill queued that the prompt goes cold to another lane ("overflow"): the admission names
    both, warm first. Nothing is said for a miss, for affinity, or for a prefix under HOT_MIN_CHUNKS."""
    _, told, warm, cold = await _overflow_past_a_warm_lane("x" * (CHUNK_CHARS * 10))
    assert warm != cold and told == [(warm, cold)]
    _, told, warm, cold = await _overflow_past_a_warm_lane("s" * (CHUNK_CHARS * (HOT_MIN_CHUNKS - 1)))
    assert warm != cold and told == [], "a short prefix's overflow asked too"


async def test_a_lane_not_timed_yet_is_taken_at_its_models_timed_speed():
    """A lane just started has no measured speed: taken at the fixed default, it would look six
    times slower than a timed CPU lane of the same model (or far faster than a slow one) and get
    no new conversation while the other is free. It is taken at the median of its model's."""
    view = FleetView()
    put_plan(view, "h", spec("a", "m", parallel=4), spec("b", "m", parallel=4))
    put_status(view, "h", healthy("a"), healthy("b"))
    admission = Admission(view)
    a = next(x.key for x in view.lanes() if x.lane_id == "a")
    admission.counts.prefill_rate[a] = 6 * DEFAULT_PREFILL_RATE
    admission.index.record(a, fingerprint("m", "y" * CHUNK_CHARS * 8).hashes)  # a holds a conversation
    new = await admission.acquire("m", prompt=fingerprint("m", "n" * CHUNK_CHARS * 4))
    assert new.lane.key != a, "the untimed lane was passed over"
