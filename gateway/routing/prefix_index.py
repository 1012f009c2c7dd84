"""Per lane, the prompt prefixes it holds, corrected by what its answers say it reused. Pure.

An entry is one chained chunk hash (gateway/routing/chunks.py): hash i stands for the prompt's
first i+1 chunks. Entries are recorded on the lane a prompt is sent to, the moment it is
sent, with a stamp from the lane's own counter; the oldest go first.

What llama-server keeps decides how many entries a lane holds, not a fixed size: its
slots (each keeps the last prompt it processed, up to its window) and its host-RAM prompt
cache (--cache-ram MiB, at the KV bytes a token takes; gateway/fleet/view.py, kept_tokens), which
`budget_chunks` turns into chunks. And each answer says what the lane really reused (`timings.cache_n`): the prompt's
first `reused` chunks are confirmed; where the index predicted more, the lane had evicted
the entry it matched on, and everything recorded no later than it (llama-server's cache
drops its oldest prompts first) is dropped too.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gateway.fleet import LaneKey
from gateway.routing.chunks import Fingerprint

LANE_CAPACITY = 16384  # chunks per lane whose budget is not known (4M characters)
ANSWERS_KEPT = 256  # per lane: the last answers' prompts, by the tokens each left in its slot
MIN_CHUNKS = 64  # no budget below this: a lane always keeps its slots' last prompts


def budget_chunks(tokens: int, chars_per_token: float, chunk_chars: int) -> int:
    """Chunks a lane holds, from the prompt tokens it keeps (gateway/fleet/view.py, kept_tokens):
    its slots' windows plus what its --cache-ram budget stores. 0 tokens: not known."""
    if tokens <= 0:
        return LANE_CAPACITY
    return max(MIN_CHUNKS, int(tokens * chars_per_token / chunk_chars))


@dataclass(frozen=True)
class Correction:
    """What one answer changed in a lane's entries."""

    confirmed: int  # leading chunks of the prompt the lane reused
    dropped: tuple[int, ...] = ()  # hashes found evicted (the stale match and everything older)


@dataclass
class PrefixIndex:
    """Per lane: chunk hash -> stamp, oldest first; bounded by each lane's budget."""

    capacity: int = LANE_CAPACITY  # for a lane without a budget
    budgets: dict[LaneKey, int] = field(default_factory=dict)
    lanes: dict[LaneKey, OrderedDict[int, int]] = field(default_factory=dict)
    clocks: dict[LaneKey, int] = field(default_factory=dict)
    # Per lane: chunk hash -> (characters, hash) of the last prompt sent that ended after that
    # chunk, inside the next (Fingerprint.tail): the lane holds that much more of a prompt that
    # repeats it. Gone with the chunk's entry.
    tails: dict[LaneKey, dict[int, tuple[int, int]]] = field(default_factory=dict)
    # Per lane: the tokens a slot holds after an answer (its prompt and output, less the last token,
    # which llama-server samples but never decodes) and that prompt's hashes, newest last. A hot lane
    # that spreads idle conversations names each moved slot by its tokens (`spread`).
    answers: dict[LaneKey, deque[tuple[int, tuple[int, ...]]]] = field(default_factory=dict)
    # First chunk hash of a recorded prompt -> the lanes that hold it: every lane that can match a
    # prompt holds its first chunk, so a model with thousands of lanes weighs those lanes only
    # (Admission's shortlist), not every lane for every request.
    firsts: dict[int, set[LaneKey]] = field(default_factory=dict)

    def set_budget(self, lane: LaneKey, chunks: int) -> None:
        self.budgets[lane] = max(1, chunks)
        self._trim(lane)

    def limit(self, lane: LaneKey) -> int:
        return self.budgets.get(lane, self.capacity)

    def record(self, lane: LaneKey, hashes: Sequence[int], tail: tuple[int, int] | None = None) -> None:
        held = self.lanes.setdefault(lane, OrderedDict())
        clock = self.clocks.get(lane, 0)
        for h in hashes:
            clock += 1
            held[h] = clock
            held.move_to_end(h)
        self.clocks[lane] = clock
        if hashes:
            self.firsts.setdefault(hashes[0], set()).add(lane)
        if tail is not None and hashes:
            self.tails.setdefault(lane, {})[hashes[-1]] = tail
        self._trim(lane)

    def _trim(self, lane: LaneKey) -> None:
        held, cap = self.lanes.get(lane), self.limit(lane)
        while held and len(held) > cap:
            self._forget(lane, held.popitem(last=False)[0])

    def _forget(self, lane: LaneKey, h: int) -> None:
        tails = self.tails.get(lane)
        if tails:
            tails.pop(h, None)
        holders = self.firsts.get(h)
        if holders is not None:
            holders.discard(lane)
            if not holders:
                del self.firsts[h]

    def holders(self, first: int) -> set[LaneKey]:
        """The lanes holding a prompt whose first chunk hashes to `first`."""
        return self.firsts.get(first, set())

    def beyond(self, lane: LaneKey, prompt: Fingerprint, matched: int) -> int:
        """Characters the lane holds past the prompt's first `matched` whole chunks: the end of an
        earlier prompt, sent to it, that this one repeats."""
        tail = self.tails.get(lane, {}).get(prompt.hashes[matched - 1]) if matched > 0 else None
        return tail[0] if tail is not None and prompt.after(matched, tail[0]) == tail[1] else 0

    def matched(self, lane: LaneKey, hashes: Sequence[int]) -> int:
        """Leading chunks of the prompt the lane holds: hash i stands for the whole prefix up to i."""
        held = self.lanes.get(lane)
        if not held:
            return 0
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in held:
                return i + 1
        return 0

    def stamp(self, lane: LaneKey, hashes: Sequence[int], matched: int) -> int:
        """The stamp of the entry a match of `matched` chunks rests on (0: none): kept with the
        request, so its answer can tell what was recorded before that entry."""
        held = self.lanes.get(lane)
        if not held or matched <= 0:
            return 0
        return held.get(hashes[matched - 1], 0)

    def correct(self, lane: LaneKey, hashes: Sequence[int], predicted: int, stamp: int, reused: int) -> Correction:
        """The lane reused `reused` leading chunks where the index predicted `predicted` (matched on
        the entry stamped `stamp`). One chunk of slack: the chunks are characters, reuse is tokens."""
        reused = max(0, min(reused, len(hashes)))
        held = self.lanes.get(lane)
        if held is None:
            return Correction(reused)
        # (reused above the prediction: the lane held more than this gateway knew; the prompt's
        # hashes were all recorded when it was sent)
        if reused >= predicted - 1 or stamp <= 0:
            return Correction(reused)
        dropped = []
        while held:
            h, s = next(iter(held.items()))
            if s > stamp:
                break
            held.popitem(last=False)
            self._forget(lane, h)
            dropped.append(h)
        return Correction(reused, tuple(dropped))

    def drop(self, lane: LaneKey, hashes: Iterable[int]) -> None:
        held = self.lanes.get(lane)
        if held:
            for h in hashes:
                held.pop(h, None)
                self._forget(lane, h)

    def copy(self, source: LaneKey, target: LaneKey) -> int:
        """A lane's saved slots were restored into `target` (a slots_received event): what the
        index holds of `source` is held by `target` too, so those conversations are sent there.
        Recorded as the target's newest entries, in the source's order; the chunks copied."""
        held = self.lanes.get(source)
        if not held or source == target:
            return 0
        hashes = list(held)  # oldest first
        tails = dict(self.tails.get(source, {}))
        self.record(target, hashes)
        if tails:
            kept = self.lanes.get(target, {})
            self.tails.setdefault(target, {}).update({h: t for h, t in tails.items() if h in kept})
        return len(hashes)

    def answered(self, lane: LaneKey, tokens: int, hashes: Sequence[int]) -> None:
        """An answer left `tokens` tokens in a slot of `lane`, for the prompt of these hashes."""
        self.answers.setdefault(lane, deque(maxlen=ANSWERS_KEPT)).append((tokens, tuple(hashes)))

    def spread(self, source: LaneKey, target: LaneKey, moved: Sequence[int]) -> int:
        """A hot lane's idle conversations were restored into `target` (slots_received naming each
        slot's tokens): the conversations whose last answers on `source` left that many tokens (one
        either way where none did exactly: an answer stopped by its end mark) are held by `target`
        too, as its newest entries, so they are sent where their caches now are. Two conversations
        of one length are both claimed: the wrong one's first answer there corrects it (`correct`)."""
        kept = self.answers.get(source, ()) if source != target else ()
        found: dict[int, tuple[int, tuple[int, ...]]] = {}
        for tokens in moved:
            for near in (tokens, tokens - 1, tokens + 1):
                same = [(t, h) for t, h in kept if t == near and h]
                if same:
                    found.update((h[-1], (t, h)) for t, h in same)
                    break
        chunks = 0
        for tokens, hashes in found.values():
            self.record(target, hashes, self.tails.get(source, {}).get(hashes[-1]))
            self.answered(target, tokens, hashes)
            chunks += len(hashes)
        return chunks

    def held(self, lane: LaneKey) -> int:
        return len(self.lanes.get(lane, ()))

    def keep_only(self, lanes: Iterable[LaneKey]) -> None:
        """Forget lanes that left the fleet."""
        keep = set(lanes)
        self.forget({k for k in (*self.lanes, *self.answers, *self.budgets) if k not in keep})

    def forget(self, lanes: Iterable[LaneKey]) -> None:
        """Forget these lanes (gone from the fleet for good)."""
        for lane in lanes:
            for h in self.lanes.get(lane, ()):
                self._forget(lane, h)
            self.lanes.pop(lane, None)
            self.clocks.pop(lane, None)
            self.tails.pop(lane, None)
            self.answers.pop(lane, None)
            self.budgets.pop(lane, None)
