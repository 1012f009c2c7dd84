"""How many prompt tokens a lane read, and how many of them it had cached, from its own answer. Pure.

llama-server says it twice: `timings` (`prompt_n` tokens processed, `cache_n` reused
from a slot or its prompt cache), in a plain answer and in a stream's last chunk; and
OpenAI's `usage` (`prompt_tokens`, `prompt_tokens_details.cached_tokens`), in a plain
answer and in a stream only when the client asked for `stream_options.include_usage`.
Timings are preferred: every answer of a llama-server lane carries them.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

STREAM_TAIL_BYTES = 16384  # the end of a stream kept to read its last chunks from
PLAIN_BODY_BYTES = 4 * 2**20  # a plain answer longer than this is relayed without reading its usage


MIN_TIMED_TOKENS = 64  # fewer prompt tokens processed say little of the lane's prefill speed


class Usage(NamedTuple):
    prompt: int  # prompt tokens the lane read
    cached: int  # ... of them from a slot or its prompt cache
    prefill_rate: float | None = None  # tokens per second it processed the rest at (timings), when enough


def _from_answer(answer: object) -> Usage | None:
    if not isinstance(answer, dict):
        return None
    timings = answer.get("timings")
    if isinstance(timings, dict):
        done, cached = timings.get("prompt_n"), timings.get("cache_n")
        if isinstance(done, int) and isinstance(cached, int) and done >= 0 and cached >= 0:
            rate = timings.get("prompt_per_second")
            timed = isinstance(rate, (int, float)) and rate > 0 and done >= MIN_TIMED_TOKENS
            return Usage(done + cached, cached, float(rate) if timed else None)
    usage = answer.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        return Usage(usage["prompt_tokens"], cached if isinstance(cached, int) else 0)
    return None


def prompt_usage(body: bytes, streamed: bool) -> Usage | None:
    """(prompt tokens, cached prompt tokens) of an answer (a stream's tail), or None when it says neither."""
    if not streamed:
        try:
            return _from_answer(msgspec.json.decode(body))
        except msgspec.DecodeError:
            return None
    for line in reversed(body.split(b"\n")):
        line = line.strip()
        if not line.startswith(b"data: {"):
            continue
        try:
            found = _from_answer(msgspec.json.decode(line[6:]))
        except msgspec.DecodeError:
            continue  # the tail cut the first line it kept
        if found is not None:
            return found
    return None


def _output_of(answer: object) -> int | None:
    if not isinstance(answer, dict):
        return None
    timings, usage = answer.get("timings"), answer.get("usage")
    if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
        return max(0, timings["predicted_n"])
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return max(0, usage["completion_tokens"])
    return None


def output_tokens(body: bytes, streamed: bool) -> int:
    """Tokens the lane generated (timings.predicted_n, else usage.completion_tokens): a tenant's cost. 0: unsaid."""
    if not streamed:
        try:
            return _output_of(msgspec.json.decode(body)) or 0
        except msgspec.DecodeError:
            return 0
    for line in reversed(body.split(b"\n")):
        line = line.strip()
        if line.startswith(b"data: {"):
            try:
                found = _output_of(msgspec.json.decode(line[6:]))
            except msgspec.DecodeError:
                continue
            if found is not None:
                return found
    return 0
