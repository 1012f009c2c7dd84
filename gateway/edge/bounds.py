"""What a request may ask of a lane, bounded before it is forwarded (pure).

A client must not make a lane pay for what no answer needs: a probability list over a whole
262k vocabulary at every token (`n_probs`), hundreds of parallel choices (`n`), a bias table
larger than any vocabulary, or a number llama-server cannot hold (it parses counts as 32-bit
integers, and a bigger one would fail at the lane as a 500). Limits follow OpenAI's where it
has one (`top_logprobs` <= 20, `n` at most 128 there; lanes keep 16, a lane's slots being few).
"""

from __future__ import annotations

INT32_MAX = 2**31 - 1
MAX_CHOICES = 16  # n: each choice takes a slot of the lane
MAX_PROBS = 20  # n_probs / top_logprobs: OpenAI's own maximum
MAX_BIAS = 4096  # logit_bias entries
MAX_NAME = 256  # a model name's characters

# field -> (smallest, largest) for an integer field
_INTEGERS = {
    "n": (1, MAX_CHOICES),
    "n_probs": (0, MAX_PROBS),
    "top_logprobs": (0, MAX_PROBS),
    "max_tokens": (-1, INT32_MAX),
    "max_completion_tokens": (-1, INT32_MAX),
    "n_predict": (-1, INT32_MAX),
    "n_keep": (-1, INT32_MAX),
    "seed": (-1, 2**32 - 1),
}


def refusal(payload: object) -> tuple[str, str] | None:
    """(message, code) of a 400 for a request out of bounds, or None."""
    if not isinstance(payload, dict):
        return "the request body must be a JSON object", "invalid_request"
    name = payload.get("model")
    if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME or not name.isprintable()):
        return f"'model' must be a name of at most {MAX_NAME} printable characters", "invalid_model"
    for field, (low, high) in _INTEGERS.items():
        value = payload.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            return f"'{field}' must be an integer from {low} to {high}", "out_of_range"
    bias = payload.get("logit_bias")
    if bias is not None and (not isinstance(bias, (dict, list)) or len(bias) > MAX_BIAS):
        return f"'logit_bias' must be an object or list of at most {MAX_BIAS} entries", "out_of_range"
    return None
