"""The gateway's retry policy, branch by branch, without a socket: what a request does after each failure."""

from __future__ import annotations

import pytest

import gateway.routing.tries as routing
from gateway.routing.tries import (
    DROPPED_CONNECTION_RETRIES,
    Attempt,
    Failure,
    GiveUp,
    Try,
    decide,
    describe,
    unreachable_reason,
)

A, B, C = ("h1", "a-0"), ("h2", "b-0"), ("h3", "c-0")
TIMEOUT = 600.0


def next_step(candidates, *history: Attempt):
    return decide(candidates, list(history), request_timeout=TIMEOUT)


def refused(lane) -> Attempt:
    return Attempt(lane, Failure.UNREACHABLE, "ClientConnectorError Cannot connect")


def dropped(lane) -> Attempt:
    return Attempt(lane, Failure.DROPPED, "ServerDisconnectedError Server disconnected")


def answered(lane, status: int = 503) -> Attempt:
    return Attempt(lane, Failure.STATUS, status=status)


def no_slot(status: int = 503, code: str = "queue_full", message: str = "all slots are busy") -> Attempt:
    return Attempt(None, Failure.NO_SLOT, message, status, code)


def lane_failed(attempt: Attempt) -> GiveUp:
    return GiveUp(502, describe(attempt), "lane_failed", retry_after=True)


# ------------------------------------------------------------------ the first try


def test_the_first_try_avoids_nothing():
    assert next_step([A, B]) == Try()
    assert next_step([]) == Try()  # admission answers for an unknown model


@pytest.mark.parametrize("status, retry_after", [(503, True), (404, False)])
def test_no_slot_on_the_first_try_is_admissions_own_answer(status, retry_after):
    step = next_step([A], no_slot(status, "model_not_found", "not served"))
    assert step == GiveUp(status, "not served", "model_not_found", retry_after=retry_after)


# ------------------------------------------------------------------ one retry, on another lane


@pytest.mark.parametrize("first", [refused(A), answered(A, 502), answered(A, 503), answered(A, 504)],
                         ids=["refused", "502", "503", "504"])  # fmt: skip
def test_a_failure_before_the_first_byte_is_retried_once_on_another_lane(first):
    assert next_step([A, B], first) == Try(frozenset({A}), retry=True)
    for second in (refused(B), answered(B)):
        assert next_step([A, B], first, second) == lane_failed(second)  # two tries: the second's failure answers


def spent_dropped(lane) -> list[Attempt]:
    return [dropped(lane)] * DROPPED_CONNECTION_RETRIES


@pytest.mark.parametrize("first", [refused(A), answered(A)], ids=["refused", "status"])
def test_no_other_lane_no_retry(first):
    assert next_step([A], first) == lane_failed(first)


def test_no_slot_for_the_retry_answers_with_the_first_lanes_failure():
    first = answered(A, 504)
    assert next_step([A, B], first, no_slot()) == lane_failed(first)
    assert lane_failed(first).message == "lane h1/a-0 answered 504"


def test_the_retry_avoids_every_lane_that_failed():
    step = next_step([A, B, C], answered(A), dropped(B), refused(B))
    assert step == lane_failed(refused(B))  # two tries counted (the dropped one was free)
    step = next_step([A, B, C], *spent_dropped(C), dropped(A))
    assert step == Try(frozenset({A}), retry=True)  # a dropped connection past the free ones counts and excludes


# ------------------------------------------------------------------ dropped pooled connections


def test_dropped_connections_cost_no_try_up_to_the_limit():
    assert DROPPED_CONNECTION_RETRIES == 4
    for n in range(1, DROPPED_CONNECTION_RETRIES + 1):
        assert next_step([A, B], *[dropped(A)] * n) == Try()  # a fresh connection, the same footing
    # The next one counts as the first try, and the lane is avoided by the retry.
    assert next_step([A, B], *[dropped(A)] * (DROPPED_CONNECTION_RETRIES + 1)) == Try(frozenset({A}), retry=True)
    fifth = [dropped(A)] * (DROPPED_CONNECTION_RETRIES + 1)
    assert next_step([A, B], *fifth, answered(B)) == lane_failed(answered(B))


def test_a_free_dropped_connection_during_the_retry_keeps_the_retry():
    first = answered(A)
    step = next_step([A, B], first, dropped(B))
    assert step == Try(frozenset({A}), retry=True)  # asked again: counted as a retry again, as before
    assert next_step([A, B], first, dropped(B), no_slot()) == lane_failed(dropped(B))  # the last failure speaks


def test_the_only_lane_with_a_broken_connection_is_tried_once_more():
    spent = spent_dropped(A)
    assert next_step([A], *spent, dropped(A)) == Try(frozenset(), retry=True)  # not excluded: nowhere else to go
    assert next_step([A], *spent, dropped(A), dropped(A)) == lane_failed(dropped(A))
    assert next_step([A], refused(A)) == lane_failed(refused(A))  # refused: no second try on it


def test_dropped_connections_never_take_the_lane_out_of_rotation():
    assert unreachable_reason(dropped(A)) == ""
    assert unreachable_reason(answered(A)) == ""
    assert unreachable_reason(no_slot()) == ""
    assert unreachable_reason(refused(A)) == "lane h1/a-0 failed before answering: ClientConnectorError Cannot connect"


# ------------------------------------------------------------------ no retry: timeout, bytes sent


def test_a_timeout_gives_up_at_once():
    for before in ([], [answered(A)], [dropped(A)]):
        step = next_step([A, B], *before, Attempt(A, Failure.TIMEOUT))
        assert step == GiveUp(504, "no answer within the request timeout of 600 s", "timeout")
    assert decide([A], [Attempt(A, Failure.TIMEOUT)], request_timeout=2.5).message.endswith("of 2.5 s")


def test_after_bytes_went_out_nothing_is_retried():
    broke = Attempt(A, Failure.BROKE, "ClientPayloadError Response payload is not completed")
    for candidates in ([], [A], [A, B, C]):
        assert next_step(candidates, broke) == GiveUp(502, describe(broke), "lane_failed")
    assert describe(broke) == "lane h1/a-0 broke off its answer: ClientPayloadError Response payload is not completed"
    assert unreachable_reason(broke) == describe(broke)


# ------------------------------------------------------------------ words


def test_failures_in_words():
    assert describe(answered(B, 502)) == "lane h2/b-0 answered 502"
    assert describe(dropped(A)) == "lane h1/a-0 failed before answering: ServerDisconnectedError Server disconnected"
    assert describe(no_slot(message="queue full")) == "queue full"
    assert describe(Attempt(C, Failure.TIMEOUT)) == "lane h3/c-0 gave no answer in time"


# ------------------------------------------------------------------ every short history


def _loop_as_it_was(candidates, history):
    """The retry loop the HTTP handler ran before routing.py, replayed over a history of failures."""
    tried, failure, attempt, dropped_left, events = frozenset(), "", 0, DROPPED_CONNECTION_RETRIES, iter(history)
    steps = []
    while attempt < 2:
        attempt += 1
        retry = attempt == 2
        if attempt == 2 and not any(lane not in tried for lane in candidates):
            break
        steps.append(Try(tried, retry))
        event = next(events, None)
        if event is None:
            return steps
        if event.failure is Failure.NO_SLOT:
            if attempt == 2:
                break
            return [*steps, GiveUp(event.status, event.detail, event.code, retry_after=event.status == 503)]
        if event.failure is Failure.TIMEOUT:
            return [*steps, GiveUp(504, f"no answer within the request timeout of {TIMEOUT:g} s", "timeout")]
        failure = describe(event)
        if event.failure in (Failure.UNREACHABLE, Failure.DROPPED):
            is_dropped = event.failure is Failure.DROPPED
            if is_dropped and dropped_left > 0:
                dropped_left -= 1
                attempt -= 1
                continue
            if not is_dropped or any(other != event.lane for other in candidates):
                tried |= {event.lane}
            continue
        tried |= {event.lane}  # STATUS
    return [*steps, GiveUp(502, failure or "no lane could take the request", "lane_failed", retry_after=True)]


def test_every_request_gets_the_steps_the_old_loop_took():
    """Every history a request can have, over one lane and over two: decide() answers what the old loop did.

    The tree is finite (free dropped retries and counted tries both run out), so this walks all of it.
    """
    kinds = [refused(A), refused(B), dropped(A), dropped(B), answered(A), answered(B, 504), no_slot(),
             no_slot(404, "model_not_found"), Attempt(A, Failure.TIMEOUT)]  # fmt: skip
    checked = 0
    for candidates in ([A], [A, B]):
        usable = [k for k in kinds if k.lane is None or k.lane in candidates]
        live = [()]
        while live:
            history = live.pop()
            old = _loop_as_it_was(candidates, history)
            assert len(old) == len(history) + 1, history  # only histories a real request has
            new = decide(candidates, list(history), request_timeout=TIMEOUT)
            assert new == old[-1], history
            checked += 1
            if isinstance(new, Try):
                live.extend((*history, event) for event in usable)
    assert checked > 1000


# ------------------------------------------------------------------ a stalled lane


def stalled(lane) -> Attempt:
    return Attempt(lane, Failure.STALLED, "no first token within 30 s")


def test_a_stalled_lane_is_left_for_another_and_marked_stalled_not_unreachable():
    from gateway.routing.tries import stalled_reason

    assert next_step([A, B], stalled(A)) == Try(frozenset({A}), retry=True)
    assert stalled_reason(stalled(A)) == "lane h1/a-0 stalled: no first token within 30 s"
    assert unreachable_reason(stalled(A)) == ""  # its /health answers: only its /slots brings it back
    for other in (refused(A), dropped(A), Attempt(A, Failure.TIMEOUT), Attempt(A, Failure.BROKE, "x")):
        assert stalled_reason(other) == ""


def test_the_only_lane_stalled_is_a_504_with_retry_after():
    step = next_step([A], stalled(A))
    assert isinstance(step, GiveUp) and (step.status, step.code, step.retry_after) == (504, "lane_stalled", True)


def test_two_stalled_lanes_end_the_request():
    step = next_step([A, B], stalled(A), stalled(B))
    assert isinstance(step, GiveUp) and step.status == 502


def test_the_first_byte_timeout():
    from gateway.routing.tries import ASSUMED_PREFILL_RATE, FIRST_BYTE_FLOOR, FIRST_BYTE_MARGIN, first_byte_timeout

    assert first_byte_timeout(5.0, 100_000, 10.0, total=600) == 5.0  # the operator's setting wins
    assert first_byte_timeout(900.0, None, None, total=600) == 600  # never past the request's own time
    assert first_byte_timeout(None, 100, 1000.0, total=600) == FIRST_BYTE_FLOOR  # a short prompt: the floor
    # A long prompt: its prefill at the lane's measured speed, with the margin.
    assert first_byte_timeout(None, 30_000, 500.0, total=600) == FIRST_BYTE_MARGIN * 30_000 / 500.0
    # Not measured yet: a slow assumed speed, so a healthy lane is never cut short on its first long prompt.
    assert first_byte_timeout(None, 4_000, None, total=600) == FIRST_BYTE_MARGIN * 4_000 / ASSUMED_PREFILL_RATE
    assert first_byte_timeout(None, 4_000, 0.0, total=600) == first_byte_timeout(None, 4_000, None, total=600)
    assert first_byte_timeout(None, 10**7, 10.0, total=600) == 600


def test_a_lanes_window_refusal_is_read_for_its_token_count_and_nothing_else_is():
    refusal = (b'{"error":{"code":400,"message":"request (1008 tokens) exceeds the available context size (512 tokens),'
               b' try increasing it","type":"exceed_context_size_error","n_prompt_tokens":1008,"n_ctx":512}}')  # fmt: skip
    assert routing.context_refusal(refusal) == 1008
    for other in (b'{"error":{"code":400,"message":"bad","type":"invalid_request_error"}}', b"not json", b"[]",
                  b'{"error":{"type":"exceed_context_size_error"}}', b'{"error":"text"}'):  # fmt: skip
        assert routing.context_refusal(other) is None, other
