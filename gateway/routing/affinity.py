"""Prefix affinity: send a prompt to the lane that already holds the most of it. Pure.

A llama-server lane keeps the prompts it processed, in its slots and in its host-RAM
prompt cache (--cache-ram), and skips the prefill of whatever prefix a new prompt
shares with one of them (`timings.cache_n`). A conversation's next turn repeats the
previous turn's prompt and adds to it, so sending it back to the same lane skips most
of its prefill; most free slots would put it on a cold lane about half the time.

What this follows:
- The chained chunk hashes of the Gateway API inference extension's prefix-cache
  scorer (llm-d's default scheduler; kubernetes-sigs/gateway-api-inference-extension,
  pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go): the prompt text cut
  into fixed-size chunks, hash(i) = H(chunk i, hash(i-1)), hash(-1) = H(model), only
  whole chunks; an LRU of the hashes sent to each server, bounded per server; the
  server with the longest run of matching chunks scores highest; the request's hashes
  are recorded on the server chosen, at the moment it is chosen.
- The load rule of SGLang's cache-aware router (sgl-project/sglang,
  sgl-router/src/policies/cache_aware.rs): affinity while loads are balanced, the
  least loaded worker once they are not, and the tree updated either way. Here
  "balanced" is the bounded-load rule of consistent hashing with bounded loads (as
  KubeAI's prefix hash uses it): a warm lane keeps a request only while its load after
  taking it stays within LOAD_BOUND x its fair share of the model's load (or MIN_CAP
  requests, at low load), so a hot conversation cannot pile onto one lane.
- llm-d's current default rule in time (stay on the warm endpoint until its uncached
  prefill exceeds a latency budget): a request whose warm lane is full but within its
  bound waits for that lane's next free slot for up to four times what a cold lane would
  take to prefill the prefix the warm one holds (`patience`), then takes any lane. On a busy
  fleet every free slot is on the "wrong" lane half the time; without waiting, affinity
  would hold only on an idle one.

Chunks are characters, not tokens: the gateway has no tokenizer, and a match only has
to predict llama-server's token-level reuse. 256 characters is about 64 tokens, the
scorer's 64-character blocks x 4: finer costs memory and hashing for no better
prediction (a turn shares all but its last few hundred characters with the next).
The hashes are blake2b, not Python's per-process `hash`, so several gateways that saw
the same requests in the same order hold the same index and choose the same lanes;
where they did not (each saw part of the traffic), a miss picks among equally free
lanes first by the fewest chunks held (SGLang's smallest tree), then by rendezvous
hashing of the prompt's first chunk, so gateways with the same history agree on where
a new conversation goes whenever they agree on the load (each reads /slots).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.fleet import LaneKey
from gateway.routing.chunks import CHUNK_CHARS, chunk_hash
from gateway.routing.prefix_index import PrefixIndex
LOAD_BOUND = 1.25  # a warm lane's load may reach 125% of its fair share
MIN_CAP = 2  # ... or two requests: one other request on it costs less than a cold prefill at low load
CHARS_PER_TOKEN = 4  # to turn matched characters into the tokens a cold lane would prefill
DEFAULT_PREFILL_RATE = 500.0  # tokens per second, until a lane's answers timed it
PATIENCE_FACTOR = 4  # a wait worth up to this many cold prefills of the warm prefix


AffinityIndex = PrefixIndex  # the name the rest of the gateway knew it by


@dataclass(frozen=True)
class LaneLoad:
    key: LaneKey
    slots: int
    busy: int  # requests it holds now, as far as the gateway knows
    waiting: int = 0  # requests waiting in the gateway for this lane (its warm prefix)

    @property
    def load(self) -> int:
        return self.busy + self.waiting


@dataclass(frozen=True)
class Choice:
    lane: LaneKey | None
    # affinity | wait (for the warm lane's next free slot) | overflow (every warm lane full or over
    # its bound) | miss | no_prefix (no key: equals rotate) | no_slot
    reason: str
    matched: int = 0  # chunks the chosen (or awaited) lane holds
    wait_for: LaneKey | None = None  # reason "wait": the lane
    patience: float = 0.0  # reason "wait", by tokens (gateway/routing/token_cost.py): seconds it may wait for it


def within_bound(lane: LaneLoad, lanes: Sequence[LaneLoad], bound: float = LOAD_BOUND, min_cap: int = MIN_CAP) -> bool:
    """Would this lane, taking one more request, stay within `bound` x its share of the load?

    The load counts requests waiting for a lane as well as those it holds. The share is by
    slots, so a lane with twice the slots may carry twice the requests. At low load the
    share is below one request, so MIN_CAP keeps a floor (SGLang's router likewise calls
    loads imbalanced only past an absolute difference too).
    """
    total_slots = sum(x.slots for x in lanes)
    if total_slots <= 0:
        return False
    load = sum(x.load for x in lanes) + 1
    cap = max(min_cap, math.ceil(bound * load * lane.slots / total_slots - 1e-9))
    return lane.load + 1 <= cap


def rendezvous(key: int, lane: LaneKey) -> int:
    return chunk_hash(key.to_bytes(8, "little") + f"{lane[0]}\x1f{lane[1]}".encode())


def most_free(
    open_lanes: Sequence[LaneLoad], key: int | None, turn: int, held: Mapping[LaneKey, int] | None = None
) -> LaneLoad:
    """Today's choice, most free slots; among equals the lane holding the fewest chunks (SGLang's
    smallest tree: new conversations spread over the lanes' caches), then the prompt's rendezvous
    hash; in turn for a request without a prompt."""
    most = max(x.slots - x.busy for x in open_lanes)
    best = [x for x in open_lanes if x.slots - x.busy == most]
    if key is None:
        return best[turn % len(best)]
    held = held or {}
    fewest = min(held.get(x.key, 0) for x in best)
    best = [x for x in best if held.get(x.key, 0) == fewest]
    return max(best, key=lambda x: rendezvous(key, x.key))


def patience(matched: int, prefill_rate: float | None, max_wait: float) -> float:
    """Seconds a request may wait for its warm lane: PATIENCE_FACTOR times what a cold lane would
    take to prefill the prefix the warm one holds, at most half the queue's wait.

    More than one prefill: a cold prefill also slows every request sharing that lane's threads
    and evicts what its cache held, and a busy fleet frees a warm slot within about one answer.
    llm-d stays on the warm endpoint far longer (until its queued uncached prefill exceeds
    20,480 tok/s x 14 s); here the load bound, not the time, is what lets a hot prefix go.
    """
    tokens = matched * CHUNK_CHARS / CHARS_PER_TOKEN
    return min(PATIENCE_FACTOR * tokens / (prefill_rate or DEFAULT_PREFILL_RATE), max_wait / 2)


def choose(
    lanes: Sequence[LaneLoad],
    matched: Mapping[LaneKey, int],
    key: int | None = None,
    turn: int = 0,
    bound: float = LOAD_BOUND,
    held: Mapping[LaneKey, int] | None = None,
    patient: bool = False,
) -> Choice:
    """The lane for a request: the longest match within the load bound, else the most free slots.

    `lanes`: every routable lane of the model (full ones too: they count in the load);
    `matched`: chunks of the prompt each lane holds; `key`: the prompt's placing key,
    None for a request with no prompt the gateway reads; `held`: chunks each lane's index
    holds; `patient`: the request may still wait for its warm lane's next free slot rather
    than be prefilled cold elsewhere (llm-d's rule in time: the edge gives it as long as a
    cold lane would take to prefill the warm prefix), so a busy fleet keeps its affinity.
    """
    open_lanes = [x for x in lanes if x.busy < x.slots]
    if key is None:
        return Choice(most_free(open_lanes, None, turn).key, "no_prefix") if open_lanes else Choice(None, "no_slot")
    warm = [x for x in lanes if matched.get(x.key, 0) > 0]
    allowed = [x for x in warm if within_bound(x, lanes, bound)]
    if allowed:
        longest = max(matched[x.key] for x in allowed)
        tied = [x for x in allowed if matched[x.key] == longest]
        free = [x for x in tied if x.busy < x.slots]
        if free:
            return Choice(most_free(free, key, turn, held).key, "affinity", longest)
        if patient:
            awaited = min(tied, key=lambda x: (x.load - x.slots, rendezvous(key, x.key)))
            return Choice(None, "wait", longest, wait_for=awaited.key)
        free = [x for x in allowed if x.busy < x.slots]
        if free:  # a shorter match now rather than none
            longest = max(matched[x.key] for x in free)
            tied = [x for x in free if matched[x.key] == longest]
            return Choice(most_free(tied, key, turn, held).key, "affinity", longest)
    if not open_lanes:
        return Choice(None, "no_slot")
    lane = most_free(open_lanes, key, turn, held)
    return Choice(lane.key, "overflow" if warm else "miss", matched.get(lane.key, 0))
