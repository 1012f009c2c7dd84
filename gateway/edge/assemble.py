"""A plain (non-streamed) answer, asked of the lane as a stream and put back together (pure).

Why: llama-server stops generating when the connection of a *streamed* request closes, but
goes on to the end of a plain one whose client left (measured with the real binary: a plain
request's slot was still busy 6.6 s after its connection closed, a streamed one's was free
after 1.7 s; bench/RESULTS.md, "Clients that leave"). So the gateway asks the lane for a
stream (with its usage) and answers the client with the one JSON body it asked for; a client
that leaves then closes a stream, and the slot is freed. It also gives plain requests a first
token to time (the first-byte timeout) and a pace to watch (the idle timeout).

Only requests whose answer is text in one choice are assembled (chat and text completions
without tools, log-probabilities, several choices or echo); any other is relayed as it is.
"""

from __future__ import annotations

import json

ASSEMBLED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "text"}
_NOT_ASSEMBLED = ("tools", "functions", "tool_choice", "logprobs", "top_logprobs", "n_probs", "echo", "best_of")


def kind_of(path: str, payload: object) -> str | None:
    """"chat" or "text" when the plain request at `path` is asked as a stream and assembled; else None."""
    kind = ASSEMBLED_PATHS.get(path)
    if kind is None or not isinstance(payload, dict) or payload.get("stream"):
        return None
    if any(payload.get(key) not in (None, False, 0) for key in _NOT_ASSEMBLED):
        return None
    if payload.get("n") not in (None, 1):
        return None
    if kind == "text" and not isinstance(payload.get("prompt"), str):
        return None  # several prompts are several choices
    return kind


def streamed_body(payload: dict) -> bytes:
    """The same request, as a stream whose last chunk carries its usage (and every chunk its timings)."""
    options = payload.get("stream_options") if isinstance(payload.get("stream_options"), dict) else {}
    return json.dumps(payload | {"stream": True, "stream_options": options | {"include_usage": True},
                                 "timings_per_token": True}).encode()  # fmt: skip


class Assembler:
    """Feeds on the lane's server-sent events; `result()` is the plain answer they add up to."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._buffer = b""
        self._head: dict = {}
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._finish: str | None = None
        self._extra: dict = {}
        self.error: dict | None = None  # an error event in the stream: the answer is that error

    def feed(self, data: bytes) -> None:
        self._buffer += data
        while b"\n\n" in self._buffer:
            event, _, self._buffer = self._buffer.partition(b"\n\n")
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, data: bytes) -> None:
        if data == b"[DONE]" or not data:
            return
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            return
        if "error" in chunk:
            self.error = chunk
            return
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in chunk:
                self._head.setdefault(key, chunk[key])
        for key in ("usage", "timings"):
            if chunk.get(key):
                self._extra[key] = chunk[key]
        for choice in chunk.get("choices") or ():
            if self.kind == "chat":
                delta = choice.get("delta") or {}
                self._text.append(delta.get("content") or "")
                self._reasoning.append(delta.get("reasoning_content") or "")
            else:
                self._text.append(choice.get("text") or "")
            self._finish = choice.get("finish_reason") or self._finish

    def result(self) -> dict:
        if self.kind == "chat":
            message = {"role": "assistant", "content": "".join(self._text)}
            if any(self._reasoning):
                message["reasoning_content"] = "".join(self._reasoning)
            choice = {"finish_reason": self._finish, "index": 0, "message": message}
            kind = "chat.completion"
        else:
            choice = {"finish_reason": self._finish, "index": 0, "text": "".join(self._text), "logprobs": None}
            kind = "text_completion"
        head = {k: v for k, v in self._head.items() if k != "id"}
        return {"choices": [choice], **head, "object": kind, **self._extra, "id": self._head.get("id", "")}
