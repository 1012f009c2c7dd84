"""Where a request goes, decided without sockets: its prompt and tokens, the lane holding its
prefix, the cost of each lane, and the next try after a failure (or giving up)."""

from gateway.routing.affinity import CHARS_PER_TOKEN, AffinityIndex, Choice, LaneLoad, choose, patience
from gateway.routing.chunks import CHUNK_CHARS, Fingerprint, fingerprint
from gateway.routing.prefix_index import budget_chunks
from gateway.routing.prompts import Prompt, prompt_of, takes_images
from gateway.routing.token_cost import LaneTokens, choose_by_cost
from gateway.routing.tokens import count_tokens
from gateway.routing.tries import (
    REFUSAL_BYTES, RETRY_STATUSES, Attempt, Failure, GiveUp, context_exceeded, context_refusal, decide, describe,
    first_byte_timeout, stalled_reason, too_small, unreachable_reason,
)

__all__ = [
    "CHARS_PER_TOKEN", "CHUNK_CHARS", "REFUSAL_BYTES", "RETRY_STATUSES", "AffinityIndex", "Attempt", "Choice",
    "Failure", "Fingerprint", "GiveUp", "LaneLoad", "LaneTokens", "Prompt", "budget_chunks", "choose",
    "choose_by_cost", "context_exceeded", "context_refusal", "count_tokens", "decide", "describe",
    "fingerprint", "first_byte_timeout", "patience", "prompt_of", "stalled_reason", "takes_images",
    "too_small", "unreachable_reason",
]  # fmt: skip
