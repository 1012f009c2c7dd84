"""What a client may ask of a lane through the gateway (gateway/edge/bounds.py): refused with
a 400 that names the field before anything reaches a lane."""

from __future__ import annotations

import pytest

from gateway.edge import bounds


@pytest.mark.parametrize(
    "payload, code, field",
    [
        ([1, 2], "invalid_request", "JSON object"),
        ("text", "invalid_request", "JSON object"),
        ({"model": "a\x00b"}, "invalid_model", "model"),
        ({"model": "m\n"}, "invalid_model", "model"),
        ({"model": "x" * 257}, "invalid_model", "model"),
        ({"model": 7}, "invalid_model", "model"),
        ({"n": 17}, "out_of_range", "'n'"),
        ({"n": 0}, "out_of_range", "'n'"),
        ({"n_probs": 21}, "out_of_range", "n_probs"),
        ({"n_probs": 262144}, "out_of_range", "n_probs"),
        ({"top_logprobs": 100}, "out_of_range", "top_logprobs"),
        ({"max_tokens": 2**31}, "out_of_range", "max_tokens"),
        ({"max_tokens": -2}, "out_of_range", "max_tokens"),
        ({"max_tokens": 1.5}, "out_of_range", "max_tokens"),
        ({"max_tokens": True}, "out_of_range", "max_tokens"),
        ({"max_completion_tokens": 10**12}, "out_of_range", "max_completion_tokens"),
        ({"n_predict": "9"}, "out_of_range", "n_predict"),
        ({"logit_bias": {str(i): 1 for i in range(4097)}}, "out_of_range", "logit_bias"),
        ({"logit_bias": 5}, "out_of_range", "logit_bias"),
    ],
)  # fmt: skip
def test_out_of_bounds_is_refused_by_name(payload, code, field):
    message, got = bounds.refusal(payload)
    assert got == code and field in message, (message, got)


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"model": "gemma", "max_tokens": 2**31 - 1, "n": 16, "n_probs": 20, "top_logprobs": 0},
        {"model": "gemma:adapter-1", "max_tokens": -1, "seed": 2**32 - 1},
        {"logit_bias": {"15043": -100}, "n_keep": -1},
        {"model": "qwen2.5-coder/7b", "logit_bias": [[15043, False]]},
    ],
)
def test_what_a_client_may_ask_passes(payload):
    assert bounds.refusal(payload) is None
