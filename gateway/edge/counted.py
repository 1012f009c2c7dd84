"""A request as the gateway sends it to a lane so that the answer says what it cost (pure):
every token charged, however the answer ends and whatever the client asked to see."""

from __future__ import annotations

import msgspec

from gateway.edge.assemble import ASSEMBLED_PATHS

# What an answer must say for its tenant to be charged: llama-server's native `response_fields`
# (llama.vscode asks for a few) would otherwise leave the timings out.
CHARGED_FIELDS = ("timings/prompt_n", "timings/cache_n", "timings/predicted_n")


def counted_body(path: str, payload: object, body: bytes, streamed: bool) -> bytes:
    """The body with what charging needs added, or as it came when nothing is missing: a
    streamed completion asks for `timings_per_token` (every chunk says the prompt tokens read
    and the tokens generated so far, so a stream cut short is charged what the lane said), and
    a `response_fields` list gets the timings charging reads."""
    if not isinstance(payload, dict):
        return body
    added: dict = {}
    if streamed and path in ASSEMBLED_PATHS and payload.get("timings_per_token") is None:
        added["timings_per_token"] = True
    fields = payload.get("response_fields")
    if isinstance(fields, list) and fields:
        missing = [f for f in CHARGED_FIELDS if f not in fields]
        if missing:
            added["response_fields"] = [*fields, *missing]
    return msgspec.json.encode(payload | added) if added else body  # (on the request path: msgspec, not json)
