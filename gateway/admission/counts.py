"""This gateway's load per lane (requests in flight, queued, served, prompt tokens and rates):
written by its admission (gateway/admission/queue.py) only, read by the dashboard and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.fleet import LaneKey
from gateway.routing import CHARS_PER_TOKEN


# Request ends remembered per lane: more, and longer, than end within one /slots read's way here.
ENDS_KEPT = 64
ENDS_KEPT_SECONDS = 5.0


@dataclass
class LaneCounts:
    """This gateway's load: written by its admission only, read by the dashboard and the metrics."""

    in_flight: dict[LaneKey, int] = field(default_factory=dict)  # requests holding a slot of each lane
    served: dict[LaneKey, int] = field(default_factory=dict)  # requests each lane has finished (dashboard rates)
    queued: dict[str, int] = field(default_factory=dict)  # requested model name -> waiting requests
    reported: dict[LaneKey, int] = field(default_factory=dict)  # busy slots each lane's /slots last said
    ended: dict[LaneKey, list[float]] = field(default_factory=dict)  # when its recent requests ended (monotonic)
    routes: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, affinity reason) -> requests

    prompt_tokens: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, "host/lane") -> tokens read
    cached_tokens: dict[tuple[str, str], int] = field(default_factory=dict)  # ... of them reused from its cache
    prefill_rate: dict[LaneKey, float] = field(default_factory=dict)  # prompt tokens per second, from timings
    tenant_in_flight: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, tenant) -> holding a slot
    tenant_queued: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, tenant) -> waiting
    pending: dict[LaneKey, int] = field(default_factory=dict)  # uncached prompt tokens sent, no first token yet
    hold: dict[LaneKey, float] = field(default_factory=dict)  # seconds a request holds a slot (moving average)
    chars_per_token: dict[str, float] = field(default_factory=dict)  # model -> its prompts' characters per token

    def tenant_load(self, tenant: str) -> int:
        """Requests of a tenant holding a slot or waiting, every model together (its concurrency)."""
        return sum(n for (_, t), n in self.tenant_in_flight.items() if t == tenant) + sum(
            n for (_, t), n in self.tenant_queued.items() if t == tenant)

    def note_ended(self, key: LaneKey, at: float) -> None:
        """One of our requests to the lane ended (kept ENDS_KEPT_SECONDS, ENDS_KEPT at most)."""
        ends = self.ended.setdefault(key, [])
        ends.append(at)
        if len(ends) > ENDS_KEPT or ends[0] < at - ENDS_KEPT_SECONDS:
            ends[:] = [t for t in ends[-ENDS_KEPT:] if t >= at - ENDS_KEPT_SECONDS]

    def ended_since(self, key: LaneKey, since: float) -> int:
        """Our requests to the lane that ended at `since` or later: a /slots read made meanwhile may count them."""
        return sum(1 for at in self.ended.get(key, ()) if at >= since)

    def busy(self, key: LaneKey) -> int:
        return self.in_flight.get(key, 0)

    def note_prefill(self, key: LaneKey, tokens_per_second: float) -> None:
        """A lane's prompt processing speed, as its answers time it (a moving average)."""
        before = self.prefill_rate.get(key)
        self.prefill_rate[key] = tokens_per_second if before is None else 0.8 * before + 0.2 * tokens_per_second

    def note_prompt(self, model: str, lane: str, prompt: int, cached: int) -> None:
        """A lane's answer said it read `prompt` tokens, `cached` of them from its cache."""
        self.prompt_tokens[(model, lane)] = self.prompt_tokens.get((model, lane), 0) + prompt
        self.cached_tokens[(model, lane)] = self.cached_tokens.get((model, lane), 0) + cached

    def note_hold(self, key: LaneKey, seconds: float) -> None:
        before = self.hold.get(key)
        self.hold[key] = seconds if before is None else 0.8 * before + 0.2 * seconds

    def note_chars(self, model: str, chars: int, tokens: int) -> None:
        """A prompt of `chars` rendered characters was `tokens` tokens (its answer's prompt_n + cache_n)."""
        if chars > 0 and tokens > 0:
            before = self.chars_per_token.get(model)
            ratio = chars / tokens
            self.chars_per_token[model] = ratio if before is None else 0.8 * before + 0.2 * ratio

    def cpt(self, model: str) -> float:
        return self.chars_per_token.get(model, CHARS_PER_TOKEN)

    def load(self, key: LaneKey) -> int:
        """Requests on the lane: ours, or all its busy slots when /slots says more (other clients)."""
        return max(self.in_flight.get(key, 0), self.reported.get(key, 0))
