"""A plain answer asked of the lane as a stream and put back together (gateway/edge/assemble.py)."""

from __future__ import annotations

import json

from gateway.edge.assemble import Assembler, kind_of, streamed_body

# The real binary's stream for {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 5} (b11434),
# and its plain answer to the same request.
HEAD = '"created":1796198723,"id":"chatcmpl-D7","model":"chat","system_fingerprint":"b0-unknown"'
STREAM = "".join(f"data: {line}\n\n" for line in [
    '{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],' + HEAD
    + ',"object":"chat.completion.chunk"}',
    '{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"Say"}}],' + HEAD + ',"object":"chat.completion.chunk"}',
    '{"choices":[{"finish_reason":null,"index":0,"delta":{"content":" hi.<"}}],' + HEAD + ',"object":"chat.completion.chunk"}',
    '{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"|im"}}],' + HEAD + ',"object":"chat.completion.chunk"}',
    '{"choices":[{"finish_reason":"length","index":0,"delta":{}}],' + HEAD + ',"object":"chat.completion.chunk"}',
    '{"choices":[],' + HEAD + ',"object":"chat.completion.chunk","usage":{"completion_tokens":5,"prompt_tokens":26,'
    '"total_tokens":31,"prompt_tokens_details":{"cached_tokens":21}},"timings":{"cache_n":21,"prompt_n":5}}',
    "[DONE]",
]).encode()  # fmt: skip
PLAIN = json.loads('{"choices":[{"finish_reason":"length","index":0,"message":{"role":"assistant","content":"Say hi.<|im"}}],'
                   '"created":1796198723,"model":"chat","system_fingerprint":"b0-unknown","object":"chat.completion",'
                   '"usage":{"completion_tokens":5,"prompt_tokens":26,"total_tokens":31,"prompt_tokens_details":'
                   '{"cached_tokens":21}},"id":"chatcmpl-D7","timings":{"cache_n":21,"prompt_n":5}}')  # fmt: skip


def test_the_stream_adds_up_to_the_plain_answer_whatever_the_chunking():
    for size in (1, 7, 64, len(STREAM)):
        parts = Assembler("chat")
        for i in range(0, len(STREAM), size):
            parts.feed(STREAM[i : i + size])
        assert parts.result() == PLAIN and parts.error is None


def test_text_completions_and_an_error_event():
    parts = Assembler("text")
    parts.feed(b'data: {"choices":[{"text":"Hel","index":0,"finish_reason":null}],"id":"c1","model":"m"}\n\n'
               b'data: {"choices":[{"text":"lo","index":0,"finish_reason":"stop"}],"id":"c1","model":"m"}\n\n')  # fmt: skip
    got = parts.result()
    assert got["choices"] == [{"finish_reason": "stop", "index": 0, "text": "Hello", "logprobs": None}]
    assert got["object"] == "text_completion" and got["id"] == "c1"
    broken = Assembler("chat")
    broken.feed(b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n')
    assert broken.error == {"error": {"code": 500, "message": "boom", "type": "server_error"}}


def test_which_requests_are_assembled():
    chat = {"model": "m", "messages": []}
    assert kind_of("/v1/chat/completions", chat) == "chat"
    assert kind_of("/v1/completions", {"prompt": "x"}) == "text"
    assert kind_of("/v1/completions", {"prompt": ["x", "y"]}) is None  # several choices
    assert kind_of("/v1/embeddings", {"input": "x"}) is None
    assert kind_of("/v1/chat/completions", chat | {"stream": True}) is None  # relayed as the stream it is
    for extra in ({"tools": [{}]}, {"logprobs": True}, {"n": 2}, {"top_logprobs": 3}):
        assert kind_of("/v1/chat/completions", chat | extra) is None, extra
    assert kind_of("/v1/chat/completions", chat | {"n": 1, "logprobs": False}) == "chat"
    body = json.loads(streamed_body(chat | {"stream_options": {"x": 1}}))
    assert body["stream"] is True and body["stream_options"] == {"x": 1, "include_usage": True}
