"""Every POST endpoint a lane serves that the gateway forwards, and which API each speaks (pure).

Read from llama-server's own routes (b11434, tools/server/server.cpp), each answered by a lane of
the model the body names (its `model` field in every API), or by the fleet's one model when the
body names none, as llama-server itself does. Aliases without `/v1` are llama-server's too."""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

Api = Literal["openai", "anthropic", "responses", "native"]


class Endpoint(NamedTuple):
    api: Api  # whose request, answer and error shapes it speaks
    generates: bool  # takes a slot to generate (vs. counting, rendering or embedding)
    form: bool = False  # a multipart form (an audio file), not JSON: relayed as it came


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint("openai", True),
    "/chat/completions": Endpoint("openai", True),
    "/v1/completions": Endpoint("openai", True),
    "/completions": Endpoint("openai", True),
    "/completion": Endpoint("native", True),
    "/infill": Endpoint("native", True),
    "/v1/messages": Endpoint("anthropic", True),
    "/v1/responses": Endpoint("responses", True),
    "/v1/embeddings": Endpoint("openai", False),
    "/embeddings": Endpoint("openai", False),
    "/embedding": Endpoint("native", False),
    "/v1/rerank": Endpoint("native", False),
    "/rerank": Endpoint("native", False),
    "/v1/reranking": Endpoint("native", False),
    "/reranking": Endpoint("native", False),
    "/v1/messages/count_tokens": Endpoint("anthropic", False),
    "/v1/responses/input_tokens": Endpoint("responses", False),
    "/v1/chat/completions/input_tokens": Endpoint("openai", False),
    "/tokenize": Endpoint("native", False),
    "/detokenize": Endpoint("native", False),
    "/apply-template": Endpoint("native", False),
    "/v1/audio/transcriptions": Endpoint("openai", True, form=True),
}


FORM_MODEL = re.compile(rb'Content-Disposition: form-data; name="model"\r\n(?:[^\r\n]+\r\n)*\r\n([^\r\n]{1,256})\r\n')


def form_fields(body: bytes) -> dict:
    """What routing reads of a multipart form (an audio file and its fields): its `model`."""
    found = FORM_MODEL.search(body)
    return {"model": found.group(1).decode("utf-8", "replace")} if found else {}


def api_of(path: str) -> Api:
    """The API whose error shape a path answers in: Anthropic's under /v1/messages, else OpenAI's."""
    found = ENDPOINTS.get(path)
    return found.api if found is not None else "openai"
