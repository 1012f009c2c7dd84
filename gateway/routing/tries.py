"""What a request does after each failure: try a lane again, or give up with which error.

Pure: the HTTP edge (gateway/edge/forward.py) performs the tries and records each failure as an
`Attempt`; `decide` reads the candidates and that history and answers the next step. The
lane itself is picked by admission (most free slots, a bounded wait): routing only says
which lanes a try must avoid. llama.cpp's server keeps slot choice apart from HTTP the same way.

The policy: a request that failed before its lane sent a byte is retried once, on another
lane where there is one; after bytes went out nothing is retried. A pooled connection that
broke before any answer (the lane restarted or idled it out) is retried on a fresh one and
costs no try, up to DROPPED_CONNECTION_RETRIES times per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import msgspec

from gateway.fleet import LaneKey

TRIES = 2  # the first, and one retry
# A lane that answers these sent no body worth keeping; 401: it did not take the key this
# gateway holds for it (restarted with a new one not read yet): another lane, or a later try.
RETRY_STATUSES = (401, 502, 503, 504)
DROPPED_CONNECTION_RETRIES = 4  # stale pooled connections retried before a try counts


class Failure(Enum):
    UNREACHABLE = "unreachable"  # not connected at all (refused, no route, name unknown)
    DROPPED = "dropped"  # any other connection error before an answer (reset, closed, connect timed out)
    STATUS = "status"  # the lane answered one of RETRY_STATUSES
    TIMEOUT = "timeout"  # the request's own time ran out
    NO_SLOT = "no_slot"  # admission gave no lane (unknown model, queue full, waited too long)
    BROKE = "broke"  # the answer broke off after it began
    STALLED = "stalled"  # no first token within the first-byte timeout, or none for the idle timeout mid-stream


@dataclass(frozen=True)
class Attempt:
    """One failed try, as the edge saw it."""

    lane: LaneKey | None  # None for NO_SLOT: no lane was given
    failure: Failure
    detail: str = ""  # the error ("ClientOSError [Errno 104] ..."), or admission's message for NO_SLOT
    status: int = 0  # the lane's answer (STATUS), or admission's status (NO_SLOT)
    code: str = ""  # admission's error code (NO_SLOT)


@dataclass(frozen=True)
class Try:
    """Ask admission for a lane outside `exclude`."""

    exclude: frozenset[LaneKey] = frozenset()
    retry: bool = False  # a second try after a failure (counted as a retry)


@dataclass(frozen=True)
class GiveUp:
    """Answer the client with this OpenAI error."""

    status: int
    message: str
    code: str
    retry_after: bool = False  # with the gateway's Retry-After header
    detail: tuple[tuple[str, int], ...] = ()  # fields beside the code, as the lane says them (n_prompt_tokens, n_ctx)


Step = Try | GiveUp


def describe(attempt: Attempt) -> str:
    """The failure in words, for the log, the client and the lane's unreachable reason."""
    if attempt.lane is None:
        return attempt.detail
    lane = f"lane {attempt.lane[0]}/{attempt.lane[1]}"
    if attempt.failure is Failure.STATUS:
        return f"{lane} answered {attempt.status}"
    if attempt.failure is Failure.BROKE:
        return f"{lane} broke off its answer: {attempt.detail}"
    if attempt.failure is Failure.TIMEOUT:
        return f"{lane} gave no answer in time"
    if attempt.failure is Failure.STALLED:
        return f"{lane} stalled: {attempt.detail}"
    return f"{lane} failed before answering: {attempt.detail}"


def unreachable_reason(attempt: Attempt) -> str:
    """Why the failure takes the lane out of rotation until its probe brings it back; "" if it does not.

    A lane not reached at all, or one whose answer broke off, is unreachable. A connection
    broken before any answer (often a pooled one the lane had just closed) says nothing of the lane.
    """
    return describe(attempt) if attempt.failure in (Failure.UNREACHABLE, Failure.BROKE) else ""


def stalled_reason(attempt: Attempt) -> str:
    """Why the lane is taken out of rotation until its /slots answers again; "" if it is not.

    Its /health still answers (llama-server's HTTP thread serves it whatever its inference
    loop does), so a stalled lane stays out until its /slots answers again, not until the
    next /health probe; its agent restarts it if its loop stays stuck (launcher_agent/health.py).
    """
    return describe(attempt) if attempt.failure is Failure.STALLED else ""


# ------------------------------------------------------------------ the first byte

FIRST_BYTE_FLOOR = 30.0  # seconds: no derived first-byte timeout is shorter
FIRST_BYTE_MARGIN = 4.0  # times the prefill the measured speed predicts
ASSUMED_PREFILL_RATE = 50.0  # tokens per second where a lane's speed is not measured yet (slow CPU)


def first_byte_timeout(
    configured: float | None, prompt_tokens: int | None, prefill_rate: float | None, *, total: float,
    floor: float = FIRST_BYTE_FLOOR,
) -> float:
    """Seconds a streamed answer may take to its first token before the lane counts as stalled.

    `configured` (--first-byte-timeout) wins. Otherwise the prompt's prefill at the lane's
    measured speed (its answers' timings; a slow assumed speed before any), times a margin,
    never under `floor`: a lane busy with other slots prefills slower than it measured alone.
    Never past the request's own `total`.
    """
    if configured is not None:
        return min(configured, total)
    rate = prefill_rate if prefill_rate and prefill_rate > 0 else ASSUMED_PREFILL_RATE
    predicted = FIRST_BYTE_MARGIN * (prompt_tokens or 0) / rate
    return min(max(floor, predicted), total)


@dataclass(frozen=True)
class _Progress:
    tries: int  # tries that count (free dropped-connection retries do not)
    tried: frozenset[LaneKey]  # lanes a retry avoids
    failure: str  # the last lane failure, in words


def _progress(candidates: frozenset[LaneKey], history: Sequence[Attempt]) -> _Progress:
    tries, tried, failure, dropped_left = 0, frozenset[LaneKey](), "", DROPPED_CONNECTION_RETRIES
    for attempt in history:
        tries += 1
        failure = describe(attempt) if attempt.lane is not None else failure
        if attempt.failure is Failure.DROPPED:
            if dropped_left > 0:
                dropped_left -= 1
                tries -= 1  # the next try takes another connection (the connector dropped this one)
                continue
            if not candidates - {attempt.lane}:
                continue  # the only lane, and a broken connection to it: try it once more
        if attempt.lane is not None:
            tried |= {attempt.lane}
    return _Progress(tries, tried, failure)


def decide(candidates: Iterable[LaneKey], history: Sequence[Attempt], *, request_timeout: float) -> Step:
    """The next step for a request to a model served by `candidates`, after the failures in `history`."""
    lanes = frozenset(candidates)
    last = history[-1] if history else None
    if last is not None and last.failure is Failure.BROKE:
        return GiveUp(502, describe(last), "lane_failed")  # bytes went out: never retried
    if last is not None and last.failure is Failure.STALLED and not lanes - {last.lane}:
        return GiveUp(504, describe(last), "lane_stalled", retry_after=True)  # no other lane to try
    if last is not None and last.failure is Failure.TIMEOUT:  # trying again would double the load
        return GiveUp(504, f"no answer within the request timeout of {request_timeout:g} s", "timeout")
    done = _progress(lanes, history)
    lane_failed = GiveUp(502, done.failure, "lane_failed", retry_after=True)
    if last is not None and last.failure is Failure.NO_SLOT:
        if done.tries > 1:  # no slot for the retry: the first lane's failure is the answer
            return lane_failed
        return GiveUp(last.status, last.detail, last.code, retry_after=last.status == 503)
    if done.tries >= TRIES:
        return lane_failed
    if done.tries == 0:
        return Try(done.tried)
    if not lanes - done.tried:
        return lane_failed  # no other lane to try
    return Try(done.tried, retry=True)


# ------------------------------------------------------------------ the window


def too_small(windows: Mapping[LaneKey, int], tokens: int) -> frozenset[LaneKey]:
    """Lanes whose per-slot window cannot hold a prompt of `tokens`.

    llama-server refuses a prompt of n_ctx tokens or more (exceed_context_size_error, 400):
    the first generated token needs a cell. A window of 0 is one the plan did not say: let
    the lane decide.
    """
    return frozenset(lane for lane, window in windows.items() if 0 < window <= tokens)


REFUSAL_BYTES = 64 * 1024  # a 400 from a lane larger than this is relayed unread


class _Refusal(msgspec.Struct):
    type: str = ""
    n_prompt_tokens: int = 0


class _RefusalBody(msgspec.Struct):
    error: _Refusal | None = None


def context_refusal(body: bytes) -> int | None:
    """The prompt's tokens when a lane's 400 is llama-server's exceed_context_size_error, else None.

    The gateway counts a prompt's tokens before routing only when a lane's tokenizer answers in
    time; otherwise the lane refuses what its window cannot hold, and the prompt, counted now,
    goes to a lane whose window can (too_small).
    """
    try:
        found = msgspec.json.decode(body, type=_RefusalBody).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if found is None or found.type != "exceed_context_size_error" or found.n_prompt_tokens <= 0:
        return None
    return found.n_prompt_tokens


def context_exceeded(windows: Mapping[LaneKey, int], tokens: int) -> GiveUp | None:
    """The 400 for a prompt no lane of the model can hold, before any lane is tried; None if one can."""
    if not windows or too_small(windows, tokens) != frozenset(windows):
        return None
    largest = max(windows.values())
    return GiveUp(
        400,
        f"This model's maximum context length is {largest} tokens per request; the prompt has {tokens}"
        " (counted by the lane's tokenizer). Shorten the prompt.",
        "context_length_exceeded",
        detail=(("n_prompt_tokens", tokens), ("n_ctx", largest)),  # llama-server's own fields for it
    )
