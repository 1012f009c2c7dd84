"""Prefix affinity, prompt rendering, token bounds, usage parsing and the window rule: the pure cores."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

import gateway.routing.tries as routing
from gateway.admission.queue import Admission
from gateway.routing.affinity import (
    DEFAULT_PREFILL_RATE,
    PATIENCE_FACTOR,
    AffinityIndex,
    LaneLoad,
    choose,
    most_free,
    patience,
    within_bound,
)
from gateway.routing.chunks import CHUNK_CHARS, fingerprint
from gateway.routing.prefix_index import ANSWERS_KEPT
from gateway.fleet.view import FleetView
from gateway.routing.prompts import TEMPLATE_TOKENS, TEMPLATE_TOKENS_PER_MESSAGE, prompt_of
from gateway.tenants.usage import prompt_usage
from test_gateway_core import healthy, put_plan, put_status, spec

A, B, C = ("h", "a"), ("h", "b"), ("h", "c")
SYSTEM = "You are a careful assistant who answers in full sentences. " * 20  # 1180 characters


def chat(*turns: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages}


def mark(payload: dict, model: str = "m"):
    return fingerprint(model, prompt_of("/v1/chat/completions", payload).text)


# ------------------------------------------------------------------ hashing


def test_chained_hashes_share_exactly_the_common_prefix():
    first = mark(chat("What is a lane?"))
    second = mark(chat("What is a lane?", "A llama-server process.", "And a slot?"))
    assert len(first.hashes) == len(prompt_of("/v1/chat/completions", chat("What is a lane?")).text) // CHUNK_CHARS
    assert second.hashes[: len(first.hashes)] == first.hashes  # the next turn extends the first
    assert first.key == second.key == first.hashes[0]
    other = mark({"model": "m", "messages": [{"role": "system", "content": SYSTEM.replace("careful", "careless")}]})
    assert other.hashes[0] != first.hashes[0] and not set(other.hashes) & set(first.hashes)


def test_a_change_early_in_the_prompt_changes_every_later_hash():
    text = "x" * (CHUNK_CHARS * 4)
    changed = "y" + text[1:]
    assert not set(fingerprint("m", text).hashes) & set(fingerprint("m", changed).hashes)
    late = text[: CHUNK_CHARS * 3] + "y" + text[CHUNK_CHARS * 3 + 1 :]
    assert fingerprint("m", late).hashes[:3] == fingerprint("m", text).hashes[:3]
    assert fingerprint("m", late).hashes[3] != fingerprint("m", text).hashes[3]


def test_roles_and_message_boundaries_are_part_of_the_prompt():
    as_user = prompt_of("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab"}]}).text
    as_system = prompt_of("/v1/chat/completions", {"messages": [{"role": "system", "content": "ab"}]}).text
    split = prompt_of("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"},
                                                            {"role": "user", "content": "b"}]}).text  # fmt: skip
    assert len({as_user, as_system, split}) == 3


def test_the_model_seeds_the_chain_and_hashes_are_stable_across_processes():
    text = "z" * CHUNK_CHARS * 2
    assert fingerprint("m", text).hashes != fingerprint("n", text).hashes
    # blake2b, not hash(): a second gateway (another process, another PYTHONHASHSEED) gets the same
    assert fingerprint("m", text).hashes[0] == fingerprint("m", "z" * CHUNK_CHARS).hashes[0]
    assert fingerprint("m", "abc").key == fingerprint("m", "abc").key and fingerprint("m", "abc").hashes == ()
    assert fingerprint("m", "q" * CHUNK_CHARS * 1000, max_chunks=8).hashes.__len__() == 8


def test_prompts_of_each_route():
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                       {"type": "image_url", "image_url": {"url": "data:1"}}]}]}
    other = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                       {"type": "image_url", "image_url": {"url": "data:2"}}]}]}
    assert prompt_of("/v1/chat/completions", parts).text != prompt_of("/v1/chat/completions", other).text
    assert prompt_of("/v1/completions", {"prompt": "once upon"}).text == "once upon"
    assert prompt_of("/v1/completions", {"prompt": ["a", "b"]}).kind == "completion"
    assert prompt_of("/v1/embeddings", {"input": "hello"}).kind == "embedding"
    for path, body in [("/v1/completions", {"prompt": [1, 2, 3]}), ("/v1/chat/completions", {"messages": "x"}),
                       ("/v1/chat/completions", {}), ("/v1/chat/completions", [1]), ("/v1/other", {"prompt": "a"})]:
        assert prompt_of(path, body) is None, (path, body)
    tools = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert prompt_of("/v1/chat/completions", tools).extra_bytes > 0


def test_the_token_bound_counts_bytes_and_the_template():
    one = prompt_of("/v1/chat/completions", {"messages": [{"role": "user", "content": "é" * 100}]})
    assert one.token_bound() == len(one.text.encode()) + TEMPLATE_TOKENS_PER_MESSAGE + TEMPLATE_TOKENS
    assert len(one.text.encode()) >= 200  # two bytes per é: never fewer tokens than bytes allow


# ------------------------------------------------------------------ the index


def test_the_index_matches_the_longest_prefix_sent_to_each_lane():
    index = AffinityIndex()
    turn1 = mark(chat("hello"))
    turn2 = mark(chat("hello", "hi, how can I help?" * 20, "tell me more"))
    index.record(A, turn1.hashes)
    assert index.matched(A, turn2.hashes) == len(turn1.hashes)
    assert index.matched(B, turn2.hashes) == 0
    index.record(B, turn2.hashes)
    assert index.matched(B, turn2.hashes) == len(turn2.hashes)
    assert index.matched(A, ()) == 0


def test_a_lane_sent_a_prompt_holds_its_end_past_the_last_whole_chunk():
    """A conversation's next turn repeats the last prompt whole: the lane holds the part of it
    inside the last, partial chunk too (on a short conversation, most of what it holds)."""
    index = AffinityIndex()
    first = "conversation\n" + "lane slot cache " * 40  # 653 characters: 2 whole chunks, 141 more
    sent = fingerprint("m", first)
    assert sent.tail() is not None and sent.tail()[0] == len(first) - 2 * CHUNK_CHARS
    assert fingerprint("m", "x" * CHUNK_CHARS * 2).tail() is None  # ends on a chunk: nothing past it
    index.record(A, sent.hashes, sent.tail())
    nxt = fingerprint("m", first + "\nuser: and then?")
    assert index.matched(A, nxt.hashes) == 2
    assert index.beyond(A, nxt, 2) == len(first) - 2 * CHUNK_CHARS
    assert index.beyond(B, nxt, 2) == 0
    branched = fingerprint("m", first[:-5] + "other things")  # the same whole chunks, another end
    assert index.matched(A, branched.hashes) == 2 and index.beyond(A, branched, 2) == 0
    index.drop(A, sent.hashes[-1:])  # its chunk found evicted: its end goes with it
    assert index.beyond(A, nxt, 2) == 0 and index.tails[A] == {}


def test_a_lane_that_took_anothers_slots_holds_its_conversations_too():
    """A slots_received event (launcher_agent/slot_moves.py): what the index holds of the source
    lane, ends included, is held by the target too, so those conversations are sent there."""
    index = AffinityIndex()
    first = "conversation\n" + "lane slot cache " * 40
    sent = fingerprint("m", first)
    index.record(A, sent.hashes, sent.tail())
    nxt = fingerprint("m", first + "\nuser: and then?")
    assert index.matched(B, nxt.hashes) == 0
    assert index.copy(A, B) == len(sent.hashes) and index.copy(B, B) == 0 and index.copy(("x", "y"), B) == 0
    assert index.matched(B, nxt.hashes) == index.matched(A, nxt.hashes) == 2
    assert index.beyond(B, nxt, 2) == index.beyond(A, nxt, 2) > 0


def test_a_hot_lanes_spread_moves_just_the_conversations_whose_slots_moved():
    """A spread (slots_received with each moved slot's tokens): the conversations whose last answer
    on the source left that many tokens in a slot (one either way) are held by the target too,
    ends included; the others, and a source no answer was heard from, move nothing."""
    index = AffinityIndex()
    turns = [f"conversation {i}\n" + f"lane {i} slot cache " * 40 for i in range(3)]
    sent = [fingerprint("m", t) for t in turns]
    for tokens, fp in zip((700, 800, 900), sent):
        index.record(A, fp.hashes, fp.tail())
        index.answered(A, tokens, fp.hashes)
    moved = index.spread(A, B, (801, 900, 1234))  # 801: the answer that stopped at its end mark
    assert moved == len(sent[1].hashes) + len(sent[2].hashes)
    nxt = [fingerprint("m", t + "\nuser: and then?") for t in turns]
    assert index.matched(B, nxt[0].hashes) == 0 < index.matched(A, nxt[0].hashes)
    for n in (1, 2):
        assert index.matched(B, nxt[n].hashes) == index.matched(A, nxt[n].hashes) > 0
        assert index.beyond(B, nxt[n], index.matched(B, nxt[n].hashes)) > 0
    assert index.spread(B, B, (800,)) == 0 and index.spread(("x", "y"), B, (700,)) == 0
    # Two conversations of one length: both claimed (the wrong one's first answer corrects it).
    other = fingerprint("m", "another\n" + "cache lane " * 60)
    index.record(A, other.hashes)
    index.answered(A, 700, other.hashes)
    assert index.spread(A, ("h", "d"), (700,)) == len(sent[0].hashes) + len(other.hashes)
    # The target knows them by their tokens in turn: a later spread from it finds them.
    assert index.spread(B, ("h", "c"), (900,)) == len(sent[2].hashes)
    index.keep_only([B])
    assert set(index.answers) == {B}


def test_a_lane_keeps_its_last_answers_bounded():
    index = AffinityIndex()
    for tokens in range(ANSWERS_KEPT + 50):
        index.answered(A, tokens, (tokens,))
    assert len(index.answers[A]) == ANSWERS_KEPT and index.answers[A][0] == (50, (50,))


def test_what_a_lane_is_said_to_hold_of_a_prompt_is_never_more_than_it_was_sent():
    rng = random.Random(5)
    for _ in range(300):
        words = [rng.choice("ab c\n") * rng.randint(1, 40) for _ in range(rng.randint(1, 60))]
        sent = "".join(words)
        other = sent[: rng.randint(0, len(sent))] + "".join(rng.choice("abc ") for _ in range(rng.randint(0, 600)))
        index = AffinityIndex()
        fp = fingerprint("m", sent)
        index.record(A, fp.hashes, fp.tail())
        probe = fingerprint("m", other)
        chunks = index.matched(A, probe.hashes)
        shared = next((i for i, (x, y) in enumerate(zip(sent, other)) if x != y), min(len(sent), len(other)))
        assert chunks * CHUNK_CHARS + index.beyond(A, probe, chunks) <= shared


def test_the_ends_kept_go_with_their_chunks_when_the_index_is_trimmed():
    index = AffinityIndex(capacity=4)
    for i in range(20):
        fp = fingerprint("m", f"{i} " * 300)
        index.record(A, fp.hashes, fp.tail())
    assert len(index.lanes[A]) == 4 and set(index.tails[A]) <= set(index.lanes[A])


def test_the_index_is_bounded_and_forgets_the_least_recently_sent():
    index = AffinityIndex(capacity=4)
    index.record(A, (1, 2, 3))
    index.record(A, (4, 5))
    assert list(index.lanes[A]) == [2, 3, 4, 5]
    index.record(A, (2,))  # sent again: now the newest
    index.record(A, (6,))
    assert list(index.lanes[A]) == [4, 5, 2, 6]
    index.record(B, (9,))
    index.keep_only([B])
    assert list(index.lanes) == [B]


# ------------------------------------------------------------------ the choice


def loads(*triples) -> list[LaneLoad]:
    return [LaneLoad(key, slots, busy) for key, slots, busy in triples]


def test_the_longest_match_wins():
    lanes = loads((A, 2, 0), (B, 2, 0), (C, 2, 0))
    assert choose(lanes, {A: 3, B: 5}, key=1).lane == B
    assert choose(lanes, {A: 3, B: 5}, key=1).reason == "affinity"
    assert choose(lanes, {A: 3, B: 5}, key=1).matched == 5


def test_a_miss_goes_to_the_most_free_slots_and_equals_agree_by_the_prompts_key():
    lanes = loads((A, 2, 1), (B, 2, 0), (C, 2, 0))
    picks = {choose(lanes, {}, key=k).lane for k in range(64)}
    assert picks == {B, C}  # never the busier lane; both free ones get new prompts
    assert all(choose(lanes, {}, key=k, turn=t).lane == choose(lanes, {}, key=k).lane for k in range(16) for t in range(3))
    assert choose(lanes, {}, key=7).reason == "miss"


def test_a_miss_among_equals_goes_to_the_lane_holding_the_fewest_chunks():
    lanes = loads((A, 2, 0), (B, 2, 0), (C, 2, 1))
    assert all(choose(lanes, {}, key=k, held={A: 10, B: 3, C: 0}).lane == B for k in range(16))
    assert {choose(lanes, {}, key=k, held={A: 3, B: 3}).lane for k in range(32)} == {A, B}


def test_without_a_prompt_equals_rotate_as_before():
    lanes = loads((A, 2, 0), (B, 2, 0))
    assert {choose(lanes, {}, None, turn).lane for turn in range(4)} == {A, B}
    assert choose(lanes, {}, None).reason == "no_prefix"


def test_ties_in_the_match_fall_back_to_the_most_free_slots():
    lanes = loads((A, 4, 2), (B, 4, 0), (C, 4, 0))
    assert choose(lanes, {A: 2, B: 2}, key=3).lane == B


def test_a_full_lane_is_never_chosen_and_no_open_lane_means_no_slot():
    assert choose(loads((A, 2, 2), (B, 2, 1)), {A: 9}, key=1).lane == B
    assert choose(loads((A, 2, 2), (B, 2, 1)), {A: 9}, key=1).reason == "overflow"
    assert choose(loads((A, 2, 2), (B, 1, 1)), {A: 9}, key=1) == choose(loads((A, 1, 1)), {}, key=1)
    assert choose(loads((A, 2, 2)), {}, key=1).reason == "no_slot"


def test_the_warm_lane_lets_go_past_its_share_of_the_load():
    # Three lanes of four slots: 125% of a third of (2 + 1) requests is 1.25, below the floor of two,
    # so a warm lane already holding two takes no third while the others are idle; holding one, it takes a second.
    lanes = loads((A, 4, 2), (B, 4, 0), (C, 4, 0))
    assert choose(lanes, {A: 8}, key=1).reason == "overflow"
    assert choose(loads((A, 4, 1), (B, 4, 0), (C, 4, 0)), {A: 8}, key=1).lane == A
    # When the others are busy too, the fair share grows and affinity holds.
    assert choose(loads((A, 4, 2), (B, 4, 2), (C, 4, 2)), {A: 8}, key=1).lane == A


def test_a_patient_request_waits_for_its_full_warm_lane():
    lanes = loads((A, 2, 2), (B, 2, 1))
    waits = choose(lanes, {A: 9}, key=1, patient=True)
    assert (waits.lane, waits.reason, waits.wait_for, waits.matched) == (None, "wait", A, 9)
    assert choose(lanes, {A: 9}, key=1).lane == B  # patience spent: the cold lane
    assert choose(lanes, {A: 9, B: 2}, key=1).lane == B  # ... or a shorter match
    assert choose(lanes, {A: 9, B: 2}, key=1).reason == "affinity"
    # Requests already waiting for it count in its load: past the bound, affinity lets go.
    crowded = [LaneLoad(A, 2, 2, waiting=2), LaneLoad(B, 2, 0)]
    assert choose(crowded, {A: 9}, key=1, patient=True).reason == "overflow"
    assert choose(loads((A, 2, 2), (B, 2, 2)), {A: 9}, key=1, patient=True).reason == "wait"
    assert choose(loads((A, 2, 2), (B, 2, 2)), {A: 9}, key=1).reason == "no_slot"


def test_patience_is_the_cold_prefill_of_the_warm_prefix():
    assert patience(8, 512.0, 30.0) == pytest.approx(PATIENCE_FACTOR * 8 * CHUNK_CHARS / 4 / 512.0)
    assert patience(8, None, 30.0) == pytest.approx(PATIENCE_FACTOR * 8 * CHUNK_CHARS / 4 / DEFAULT_PREFILL_RATE)
    assert patience(10**6, 100.0, 30.0) == 15.0  # at most half the queue's wait
    assert patience(0, 100.0, 30.0) == 0


async def test_a_queued_request_waits_for_its_warm_lane_then_takes_any():
    view = FleetView()
    put_plan(view, "h", spec("a", port=1, parallel=1), spec("b", port=2, parallel=1))
    put_status(view, "h", healthy("a", 1), healthy("b", 2))
    admission = Admission(view)
    first = mark(chat("one"))
    warm = await admission.acquire("gemma", prompt=first)  # the conversation's lane, busy now
    other = await admission.acquire("gemma", prompt=mark({"messages": [{"role": "system", "content": "Unrelated. " + SYSTEM}]}))
    assert other.lane.key != warm.lane.key
    admission.counts.prefill_rate[warm.lane.key] = DEFAULT_PREFILL_RATE
    admission.counts.prefill_rate[other.lane.key] = 50.0  # a slow lane: a cold prefill there takes seconds
    turn2 = asyncio.create_task(admission.acquire("gemma", prompt=mark(chat("one", "x" * 300, "two"))))
    await asyncio.sleep(0.05)
    other.release()  # the cold lane frees first: the request keeps waiting for its own
    await asyncio.sleep(0.05)
    assert not turn2.done()
    warm.release()
    assert (await turn2).lane.key == warm.lane.key
    # With its patience spent, a waiter takes whatever frees.
    quick = Admission(view)
    a = await quick.acquire("gemma", prompt=first)
    b = await quick.acquire("gemma", prompt=mark({"messages": [{"role": "system", "content": "Unrelated. " + SYSTEM}]}))
    for lane in (a, b):  # fast lanes: waiting is not worth it
        quick.counts.prefill_rate[lane.lane.key] = 10**6
    again = asyncio.create_task(quick.acquire("gemma", prompt=mark(chat("one", "x" * 300, "two"))))
    await asyncio.sleep(0.05)
    b.release()
    assert (await asyncio.wait_for(again, 2)).lane.key == b.lane.key
    a.release()


def test_the_bound_is_by_slots_with_a_floor():
    big, small = LaneLoad(A, 8, 3), LaneLoad(B, 2, 0)
    assert within_bound(big, [big, small])  # (3+1) <= ceil(1.25 * 4 * 8/10) = 4
    assert not within_bound(LaneLoad(A, 4, 3), [LaneLoad(A, 4, 3), LaneLoad(B, 4, 0)])  # 4 > ceil(1.25 * 2)
    assert within_bound(LaneLoad(A, 1, 0), [LaneLoad(A, 1, 0), LaneLoad(B, 100, 0)])
    assert within_bound(LaneLoad(A, 4, 1), [LaneLoad(A, 4, 1), LaneLoad(B, 100, 0)])  # the floor of two
    assert not within_bound(LaneLoad(A, 4, 1), [LaneLoad(A, 4, 1), LaneLoad(B, 100, 0)], min_cap=1)
    assert within_bound(LaneLoad(A, 4, 3), [LaneLoad(A, 4, 3)])  # a single lane: its own share
    assert not within_bound(LaneLoad(A, 0, 0), [LaneLoad(A, 0, 0)])


def test_under_any_load_the_choice_is_open_and_within_bound_or_the_most_free():
    """Exhaustive over small fleets: the chosen lane always has a free slot; affinity only within the bound."""
    for slots in itertools.product((1, 2, 4), repeat=3):
        for busy in itertools.product(range(5), repeat=3):
            lanes = [LaneLoad(k, s, min(b, s)) for k, s, b in zip((A, B, C), slots, busy)]
            for matched in ({}, {A: 3}, {A: 3, B: 3}, {C: 1, B: 2}):
                got = choose(lanes, matched, key=5)
                free = [x for x in lanes if x.busy < x.slots]
                if not free:
                    assert got.lane is None
                    continue
                lane = next(x for x in lanes if x.key == got.lane)
                assert lane.busy < lane.slots
                if got.reason == "affinity":
                    assert within_bound(lane, lanes) and matched[lane.key] == max(
                        matched.get(x.key, 0) for x in free if within_bound(x, lanes))
                else:
                    assert lane.slots - lane.busy == max(x.slots - x.busy for x in free)


def test_most_free_breaks_equals_deterministically():
    lanes = loads((A, 2, 0), (B, 2, 0))
    assert most_free(lanes, 11, 0) == most_free(list(reversed(lanes)), 11, 5)


def test_the_multi_turn_trace_stays_on_its_lanes_and_balanced():
    """Conversations with their own system prompts, turns in a shuffled order: every turn after the
    first goes back to its conversation's lane, and each lane gets a fair share of conversations."""
    view = FleetView()
    put_plan(view, "h", spec("a", port=1, parallel=2), spec("b", port=2, parallel=2), spec("c", port=3, parallel=2))
    put_status(view, "h", healthy("a", 1), healthy("b", 2), healthy("c", 3))

    async def run() -> tuple[dict, dict]:
        admission = Admission(view)
        rng = random.Random(7)
        convs = {i: [{"role": "system", "content": f"Conversation {i}. " + SYSTEM}] for i in range(12)}
        order = [i for i in convs for _ in range(4)]
        rng.shuffle(order)
        lane_of, moved = {}, 0
        for i in order:
            convs[i].append({"role": "user", "content": f"question {len(convs[i])}"})
            fp = fingerprint("gemma", prompt_of("/v1/chat/completions", {"messages": convs[i]}).text)
            lease = await admission.acquire("gemma", prompt=fp)
            moved += i in lane_of and lane_of[i] != lease.lane.key
            lane_of[i] = lease.lane.key
            convs[i].append({"role": "assistant", "content": "an answer " * 30})
            lease.release()
        per_lane = {}
        for key in lane_of.values():
            per_lane[key] = per_lane.get(key, 0) + 1
        return per_lane, {"moved": moved, "routes": admission.counts.routes}

    per_lane, seen = asyncio.run(run())
    assert seen["moved"] == 0
    assert seen["routes"][("gemma", "affinity")] == 36 and seen["routes"][("gemma", "miss")] == 12
    assert sorted(per_lane.values()) == [4, 4, 4], per_lane  # new conversations go to the emptiest cache


async def test_admission_follows_affinity_and_the_baseline_does_not():
    view = FleetView()
    put_plan(view, "h", spec("a", port=1, parallel=2), spec("b", port=2, parallel=2))
    put_status(view, "h", healthy("a", 1), healthy("b", 2))
    first, second = mark(chat("one")), mark(chat("one", "two" * 100, "three"))
    warm = Admission(view)
    lease = await warm.acquire("gemma", prompt=first)
    lease.release()
    for _ in range(4):
        again = await warm.acquire("gemma", prompt=second)
        assert again.lane.key == lease.lane.key
        again.release()
    cold = Admission(view, use_affinity=False)
    lanes = set()
    for _ in range(4):
        got = await cold.acquire("gemma", prompt=second)
        lanes.add(got.lane.key)
        got.release()
    assert len(lanes) == 2  # most free slots, equals in turn: the same prompt lands on both


async def test_busy_slots_reported_by_the_lane_count_as_load():
    view = FleetView()
    put_plan(view, "h", spec("a", port=1, parallel=2), spec("b", port=2, parallel=2))
    put_status(view, "h", healthy("a", 1), healthy("b", 2))
    admission = Admission(view)
    admission.counts.reported[("h", "a")] = 2  # another client holds both of a's slots
    for _ in range(2):
        assert (await admission.acquire("gemma")).lane.lane_id == "b"
    assert admission.counts.load(("h", "b")) == 2
    waiting = asyncio.create_task(admission.acquire("gemma", prompt=mark(chat("x"))))
    await asyncio.sleep(0)
    assert not waiting.done()
    admission.counts.reported[("h", "a")] = 0
    admission.poke()
    assert (await waiting).lane.lane_id == "a"


# ------------------------------------------------------------------ usage and the window


def test_usage_from_plain_answers_and_stream_tails():
    timings = b'{"usage":{"prompt_tokens":280,"prompt_tokens_details":{"cached_tokens":200}},' \
              b'"timings":{"cache_n":275,"prompt_n":5}}'  # fmt: skip
    assert prompt_usage(timings, streamed=False) == (280, 275, None)  # timings first; 5 tokens time nothing
    timed = b'{"timings":{"cache_n":0,"prompt_n":280,"prompt_per_second":188.9}}'
    assert prompt_usage(timed, streamed=False) == (280, 0, 188.9)
    assert prompt_usage(b'{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}}', False) == (9, 4, None)
    assert prompt_usage(b'{"usage":{"prompt_tokens":9}}', False) == (9, 0, None)
    assert prompt_usage(b'{"data":[1]}', False) is None and prompt_usage(b"not json", False) is None
    stream = (b'ial":1}}]}\n\ndata: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
              b'data: {"choices":[{"finish_reason":"length","delta":{}}],"timings":{"cache_n":275,"prompt_n":5}}\n\n'
              b"data: [DONE]\n\n")  # fmt: skip
    assert prompt_usage(stream, streamed=True) == (280, 275, None)
    assert prompt_usage(b'data: {"choices":[]}\n\ndata: [DONE]\n\n', True) is None
    assert prompt_usage(b'data: {"timings":{"cache_n":-1,"prompt_n":5}}\n\n', True) is None


def test_the_window_rule():
    windows = {A: 1024, B: 4096, C: 0}
    assert routing.too_small(windows, 1023) == frozenset()
    assert routing.too_small(windows, 1024) == {A}  # a prompt of n_ctx tokens is refused by the lane
    assert routing.too_small(windows, 10**6) == {A, B}  # C's window is not known: it decides itself
    assert routing.context_exceeded(windows, 10**6) is None
    refusal = routing.context_exceeded({A: 1024, B: 4096}, 5000)
    assert (refusal.status, refusal.code) == (400, "context_length_exceeded") and "4096" in refusal.message
    assert routing.context_exceeded({A: 1024, B: 4096}, 2000) is None
    assert routing.context_exceeded({}, 5) is None


@pytest.mark.parametrize("text", ["plain ascii words " * 50, "ünïcödé " * 80, "日本語のテキスト" * 40, "🙂" * 100])
def test_the_byte_bound_holds_for_the_real_tokenizers_byte_fallback(text):
    """Each token covers at least one byte, so bytes bound tokens (checked on the real tokenizer in test_gateway)."""
    prompt = prompt_of("/v1/completions", {"prompt": text})
    assert prompt.token_bound() >= len(text.encode())


def test_the_index_knows_which_lanes_hold_a_prompts_first_chunk():
    from gateway.routing.prefix_index import PrefixIndex

    index = PrefixIndex()
    first, other = fingerprint("m", "a" * CHUNK_CHARS * 3), fingerprint("m", "b" * CHUNK_CHARS * 2)
    index.record(("h", "x"), first.hashes)
    index.record(("h", "y"), first.hashes[:1])
    index.record(("h", "y"), other.hashes)
    assert index.holders(first.hashes[0]) == {("h", "x"), ("h", "y")}
    index.drop(("h", "y"), first.hashes[:1])
    assert index.holders(first.hashes[0]) == {("h", "x")}
    index.set_budget(("h", "x"), 1)  # trimmed to its newest chunk: the first one is evicted
    assert index.holders(first.hashes[0]) == set()
    index.copy(("h", "y"), ("h", "z"))
    assert index.holders(other.hashes[0]) == {("h", "y"), ("h", "z")}
    index.keep_only([("h", "z")])
    assert index.holders(other.hashes[0]) == {("h", "z")} and index.firsts == {other.hashes[0]: {("h", "z")}}


async def test_a_model_of_hundreds_of_lanes_weighs_a_shortlist_and_still_finds_the_warm_lane():
    from gateway.admission.queue import SHORTLIST

    view = FleetView()
    lanes = 300
    for i in range(lanes):
        put_plan(view, f"h{i:03d}", spec("a", "m", parallel=2, port=8000))
        put_status(view, f"h{i:03d}", healthy("a", 8000))
    admission = Admission(view)
    prompt = fingerprint("m", "the long shared system prompt " * 200)
    warm = ("h250", "a")
    admission.index.record(warm, prompt.hashes)
    for _ in range(5):  # whatever the window, the lane holding the prompt is weighed and taken
        lease = await admission.acquire("m", prompt=prompt)
        assert lease.lane.key == warm
        lease.release()
    # Without a prompt, the window moves: requests spread beyond the first SHORTLIST lanes.
    taken = set()
    for _ in range(lanes // SHORTLIST + 1):
        lease = await admission.acquire("m")
        taken.add(lease.lane.key)
        lease.release()
    assert any(int(host[1:]) >= SHORTLIST for host, _ in taken)
