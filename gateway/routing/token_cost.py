"""Route by tokens: the lane where this prompt's first token comes soonest. Pure.

A lane's load is not its request count but the prefill still ahead of it: the uncached
prompt tokens of the requests it holds that have not had their first token yet, and of
those waiting for it (llm-d's scorer counts queued uncached prefill tokens the same way).
Each lane prefills at its own measured speed (its answers' `timings.prompt_per_second`).
So the time a prompt waits for its first token on a lane is about

    slot wait + (prefill ahead of it + its own uncached tokens) / the lane's speed

where its own uncached tokens are the prompt's tokens less the prefix the lane holds, and
the slot wait is the requests ahead of it for a slot times how long a request holds one,
shared over the lane's slots. The lane with the least of it wins, where the prefill a lane
would do beyond the warmest lane's counts twice (`colder_work`): a warm lane is kept while
waiting for it costs less than a cold prefill elsewhere, and a hot prefix spreads once the
prefill queued behind it clearly outweighs a cold copy. Ties go as most free slots does
(gateway/routing/affinity.py: free slots, the fewest chunks held, the prompt's rendezvous hash).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.fleet import LaneKey
from gateway.routing.affinity import DEFAULT_PREFILL_RATE, Choice, rendezvous


@dataclass(frozen=True)
class LaneTokens:
    key: LaneKey
    slots: int
    busy: int  # requests holding one of its slots
    waiting: int = 0  # requests waiting in the gateway for this lane
    pending: int = 0  # uncached prompt tokens it has yet to prefill, of the requests it holds or awaits
    rate: float | None = None  # its prefill speed, tokens per second, as its answers timed it
    hold: float | None = None  # seconds a request holds one of its slots, as measured; None: not yet
    matched: int = 0  # tokens of this prompt it holds (its index's match)
    chunks: int = 0  # ... in the index's chunks (what the Choice reports)


def first_token_cost(lane: LaneTokens, prompt_tokens: int) -> float:
    """Seconds until this prompt's first token on `lane`, by its queued prefill and its slots."""
    rate = lane.rate if lane.rate and lane.rate > 0 else DEFAULT_PREFILL_RATE
    uncached = max(0, prompt_tokens - lane.matched)
    ahead = max(0, lane.busy + lane.waiting + 1 - lane.slots)  # requests before this one gets a slot
    hold = lane.hold if lane.hold is not None else prompt_tokens / rate  # at least its own prefill
    return ahead * hold / max(1, lane.slots) + (lane.pending + uncached) / rate


def colder_work(lane: LaneTokens, warmest: int) -> float:
    """Seconds `lane` prefills this prompt beyond what the warmest lane would: counted a second
    time when lanes are compared. That work also delays every request behind it on that lane
    (on a CPU host, its other lanes too, sharing the cores) and writes over what its cache held;
    and measured speeds are noisy (two identical lanes on one 2-core host, loaded, timed 2.2x
    apart), so a conversation leaves its warm lane only for a clear gain, not a coin toss."""
    rate = lane.rate if lane.rate and lane.rate > 0 else DEFAULT_PREFILL_RATE
    return max(0, warmest - lane.matched) / rate


def _order(lane: LaneTokens, cost: float, key: int, held: Mapping[LaneKey, int]) -> tuple:
    # Costs within a microsecond are equal; then the most free slots, the fewest chunks held, the hash.
    return (round(cost, 6), lane.busy + lane.waiting - lane.slots, held.get(lane.key, 0), -rendezvous(key, lane.key))


def choose_by_cost(
    lanes: Sequence[LaneTokens], prompt_tokens: int, key: int, held: Mapping[LaneKey, int] | None = None,
    patient: bool = False,
) -> Choice:
    """The lane for a prompt of `prompt_tokens` whose placing key is `key`.

    `lanes`: every routable lane of the model, full ones too (a full warm lane may still be the
    cheapest: a `patient` request then waits for it, for at most what going now to the cheapest
    open lane would cost, `Choice.patience`); `held`: chunks each lane's index holds.
    """
    held = held or {}
    lanes = [x for x in lanes if x.slots > 0]
    if not lanes:
        return Choice(None, "no_slot")
    costs = {x.key: first_token_cost(x, prompt_tokens) for x in lanes}
    warmest = min(prompt_tokens, max(x.matched for x in lanes))
    ranked = sorted(lanes, key=lambda x: _order(x, costs[x.key] + colder_work(x, warmest), key, held))
    open_lanes = [x for x in ranked if x.busy < x.slots]
    best = ranked[0]
    warm = any(x.matched > 0 for x in lanes)
    if best.busy >= best.slots:
        if patient:
            patience = costs[open_lanes[0].key] if open_lanes else 0.0
            return Choice(None, "wait", best.chunks, wait_for=best.key, patience=patience)
        if not open_lanes:
            return Choice(None, "no_slot")
        best = open_lanes[0]
    reason = "affinity" if best.matched > 0 else ("overflow" if warm else "miss")
    return Choice(best.key, reason, best.chunks)
