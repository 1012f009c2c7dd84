"""How many prompt tokens a lane read, and how many of them it had cached, from its own answer. Pure.

llama-server says it twice: `timings` (`prompt_n` tokens processed, `cache_n` reused
from a slot or its prompt cache), in a plain answer and in a stream's last chunk; and
OpenAI's `usage` (`prompt_tokens`, `prompt_tokens_details.cached_tokens`), in a plain
answer and in a stream only when the client asked for `stream_options.include_usage`.
Timings are preferred: every answer of a llama-server lane carries them.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import msgspec

STREAM_TAIL_BYTES = 16384  # the end of a stream kept to read its last chunks from
PLAIN_BODY_BYTES = 4 * 2**20  # a plain answer longer than this is relayed without reading its usage


MIN_TIMED_TOKENS = 64  # fewer prompt tokens processed say little of the lane's prefill speed


class Usage(NamedTuple):
    prompt: int  # prompt tokens the lane read
    cached: int  # ... of them from a slot or its prompt cache
    prefill_rate: float | None = None  # tokens per second it processed the rest at (timings), when enough


def _timings(answer: dict) -> object:
    """An answer's timings: an object, or (llama-server's `response_fields`) keys "timings/<name>"."""
    if "timings" in answer:
        return answer["timings"]
    flat = {key[8:]: value for key, value in answer.items() if key.startswith("timings/")}
    return flat or None


def _from_answer(answer: object) -> Usage | None:
    if not isinstance(answer, dict):
        return None
    timings = _timings(answer)
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
    if isinstance(usage, dict) and isinstance(usage.get("input_tokens"), int):
        read = usage.get("cache_read_input_tokens")  # Anthropic's: input_tokens leaves out what was cached
        if isinstance(read, int):
            return Usage(usage["input_tokens"] + read, read)
        details = usage.get("input_tokens_details")  # OpenAI Responses': input_tokens counts it
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        return Usage(usage["input_tokens"], cached if isinstance(cached, int) else 0)
    return _from_answer(_inner(answer))


def _inner(answer: dict) -> dict | None:
    """The message an Anthropic `message_start` event carries, or the response a Responses event does."""
    for key in ("message", "response"):
        if isinstance(answer.get(key), dict):
            return answer[key]
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
    timings, usage = _timings(answer), answer.get("usage")
    if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
        return max(0, timings["predicted_n"])
    if isinstance(usage, dict):
        for key in ("completion_tokens", "output_tokens"):  # OpenAI's; Anthropic's and Responses'
            if isinstance(usage.get(key), int):
                return max(0, usage[key])
    return _output_of(_inner(answer))


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


# ------------------------------------------------------------------ an answer read as it passes

EDGE_BYTES = 16384  # of a plain answer too long to keep: its head (embeddings and rerank say usage first)
# and its tail (completions say timings and usage last) are kept
# One generated token is one event in llama-server's streams (measured on b11434, chat and text
# completions): every event before the last says `"finish_reason":null`; a chat stream opens with
# one more that only names the role.
# An Anthropic stream says each token in a `content_block_delta` event, a Responses stream in a
# `response.*.delta` one, a native one (/completion, /infill) in one with `"stop":false` (measured on b11434).
TOKEN_EVENT = b'"finish_reason":null'
ROLE_EVENT = b'"delta":{"role":"assistant","content":null}'
_MARKERS = ((TOKEN_EVENT, 1), (ROLE_EVENT, -1), (b'"type":"content_block_delta"', 1), (b'"stop":false', 1),
            (b'"type":"response.output_text.delta"', 1), (b'"type":"response.reasoning_text.delta"', 1),
            (b'"type":"response.function_call_arguments.delta"', 1))  # fmt: skip
_CARRY = max(len(marker) for marker, _ in _MARKERS) - 1
_OBJECT = {b"timings": re.compile(rb'"timings"\s*:\s*(\{[^{}]*\})'),
           b"usage": re.compile(rb'"usage"\s*:\s*(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})')}  # fmt: skip


def _found_in(text: bytes) -> dict:
    """The timings and usage objects written in a piece of an answer too long to decode whole."""
    found = {}
    for name, pattern in _OBJECT.items():
        match = pattern.search(text)
        if match:
            try:
                found[name.decode()] = msgspec.json.decode(match.group(1))
            except msgspec.DecodeError:
                continue
    return found


class AnswerReader:
    """What an answer cost, read as it passes the gateway in bounded memory: the whole of a plain
    answer up to PLAIN_BODY_BYTES (past that its head and tail), a stream's tail and the tokens
    it carried so far, so an answer cut short (its client left, its lane broke) is charged too."""

    def __init__(self, streamed: bool) -> None:
        self.streamed = streamed
        self.head = bytearray()
        self.tail = bytearray()
        self.size = 0
        self.token_events = 0
        self._seam = b""  # the end of the last chunk, where an event's marker may continue

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.streamed:
            seam, joined = self._seam, self._seam + chunk  # a marker the seam holds whole was counted
            self.token_events += sum(sign * (joined.count(marker) - seam.count(marker)) for marker, sign in _MARKERS)
            self._seam = joined[-_CARRY:]
            self.head += chunk[: max(0, EDGE_BYTES - len(self.head))]  # where Anthropic's stream says its prompt
        elif self.size <= PLAIN_BODY_BYTES:
            self.head += chunk
        else:  # too long to keep whole: its first EDGE_BYTES only
            self.head += chunk[: max(0, EDGE_BYTES - len(self.head))]
            del self.head[EDGE_BYTES:]
        limit = STREAM_TAIL_BYTES if self.streamed else EDGE_BYTES
        self.tail += chunk[-limit:]
        del self.tail[: max(0, len(self.tail) - limit)]

    def _whole(self) -> bytes | None:
        return bytes(self.head) if not self.streamed and self.size <= PLAIN_BODY_BYTES else None

    def usage(self) -> Usage | None:
        """The prompt tokens the lane read (and had cached), when the answer says them."""
        whole = self._whole()
        if whole is not None:
            return prompt_usage(whole, False)
        if self.streamed:
            return prompt_usage(bytes(self.tail), True) or prompt_usage(bytes(self.head), True)
        return _from_answer(_found_in(bytes(self.tail))) or _from_answer(_found_in(bytes(self.head)))

    def said_output(self) -> int | None:
        """The tokens the lane says it generated, when the answer got as far as saying it."""
        whole = self._whole()
        if whole is not None:
            try:
                return _output_of(msgspec.json.decode(whole))
            except msgspec.DecodeError:
                return None
        if self.streamed:
            return output_tokens(bytes(self.tail), True) or None
        return _output_of(_found_in(bytes(self.tail)))

    def output(self) -> int:
        """Tokens generated: as the lane said, else (a stream cut short) the token events it carried."""
        said = self.said_output()
        return said if said is not None else (max(0, self.token_events) if self.streamed else 0)
