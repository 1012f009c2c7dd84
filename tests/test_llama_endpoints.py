"""shared.llama.endpoints: llama-server's addresses and what its answers mean."""

from __future__ import annotations

import pytest

from shared.llama import endpoints


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", ""])
def test_a_wildcard_bind_is_reached_on_the_loopback(bind):
    assert endpoints.connect_host(bind) == "127.0.0.1"
    assert endpoints.url(bind, 8080, endpoints.HEALTH) == "http://127.0.0.1:8080/health"


def test_a_named_bind_is_reached_where_it_listens():
    assert endpoints.url("10.0.0.7", 8081, endpoints.METRICS) == "http://10.0.0.7:8081/metrics"
    assert endpoints.url("::1", 8081, endpoints.SLOTS) == "http://[::1]:8081/slots"


def test_health():
    assert endpoints.is_healthy(200)
    assert not endpoints.is_healthy(503)  # {"error":{"message":"Loading model"}}
    assert not endpoints.is_healthy(0)  # refused: still starting
    assert endpoints.answered(endpoints.HEALTH, 503) == "/health answered 503"
    assert endpoints.answered(endpoints.HEALTH, 0) == "/health answered nothing"


PROPS = {"default_generation_settings": {"n_ctx": 2048}, "total_slots": 2, "model_alias": "m", "build_info": "b11434"}


@pytest.mark.parametrize(
    "status, props, expected",
    [
        (200, PROPS, ("healthy", "")),
        (200, {**PROPS, "total_slots": 4}, ("mismatch", "llama-server serves 2048 per slot x 4 slots; planned 2048 x 2")),
        (200, {**PROPS, "default_generation_settings": {"n_ctx": 4096}}, ("mismatch",
         "llama-server serves 4096 per slot x 2 slots; planned 2048 x 2")),
        (503, None, ("loading", "/props answered 503")),
        (200, ["not", "a", "dict"], ("loading", "/props answered 200")),
        (0, None, ("loading", "/props answered nothing")),
    ],
)  # fmt: skip
def test_props_say_whether_the_planned_shape_is_served(status, props, expected):
    assert endpoints.props_readiness(status, props, ctx_per_slot=2048, parallel=2) == expected


@pytest.mark.parametrize(
    "status, slots, busy",
    [
        (200, [{"id": 0, "is_processing": False}, {"id": 1, "is_processing": True}], 1),
        (200, [{"id": 0, "is_processing": False}], 0),
        (200, [], 0),
        (0, None, None),  # nothing answers: nothing serves
        (501, None, 1),  # --no-slots: it cannot say, so only the drain timeout ends the wait
        (200, {"oops": 1}, 1),
    ],
)
def test_busy_slots(status, slots, busy):
    assert endpoints.busy_slots(status, slots) == busy


def test_metrics_that_are_not_exposition_text_raise():
    with pytest.raises(ValueError):
        endpoints.rename_llama_series("llamacpp:x{ 1", {"host": "h"})
    assert endpoints.rename_llama_series("# TYPE other gauge\nother 1\n", {"host": "h"}) == []


def test_loop_work_reads_each_busy_slots_counters():
    # As b11434's /slots showed them mid-prefill and mid-generation (bench/busy_loop.json).
    slots = [{"id": 0, "id_task": 40, "is_processing": True, "n_prompt_tokens": 2511,
              "n_prompt_tokens_processed": 2501, "next_token": [{"n_decoded": 10, "n_remain": 54}]},
             {"id": 1, "id_task": 39, "is_processing": False, "n_prompt_tokens": 0, "next_token": [{"n_decoded": 0}]},
             {"id": 2, "id_task": 9, "is_processing": True}]  # fmt: skip
    assert endpoints.loop_work(200, slots) == ((9, -1, -1, -1), (40, 2511, 2501, 10))
    assert endpoints.loop_work(0, None) is None  # unanswered
    assert endpoints.loop_work(501, {"error": {}}) == ()  # --no-slots: nothing to read a stall from
    assert endpoints.loop_work(200, [{"is_processing": False}]) == ()
