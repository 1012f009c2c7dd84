"""Every token charged (issue 36 point 5): what an answer cost its tenant, read as the answer passes
the gateway in bounded memory, for every kind of answer and however it ends.

The lane here is a stub that sends llama-server's own answers, recorded from b11434
(tests/llama_answers.json); the gateway is the real one, in process."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from stub_http import lane_app, serve
from test_gateway_core import healthy, put_plan, put_status, spec
from waiting import eventually

from gateway.edge import adapters, counted
from gateway.edge.app_keys import METRICS
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gateway.tenants.usage import EDGE_BYTES, PLAIN_BODY_BYTES, AnswerReader

ANSWERS = json.loads((Path(__file__).parent / "llama_answers.json").read_text())
# What each recorded answer says it cost: (prompt tokens, output tokens).
SAID = {"text_stream": (6, 8), "chat_stream": (26, 5), "embeddings": (17, 0), "rerank": (46, 0)}
# Anthropic's usage leaves the cached prompt out of input_tokens (27 = 5 read + 22 cached in the stream,
# 27 + 0 in the plain answer); Responses' counts it in (27, of them 22 cached).
OTHER_APIS = {"messages_plain": (27, 5), "messages_stream": (27, 5), "responses_plain": (27, 5),
              "responses_stream": (27, 5), "infill_stream": (19, 3), "infill_fields": (19, 3)}  # fmt: skip


def _events(stream: str) -> list[bytes]:
    return [e.encode() + b"\n\n" for e in stream.split("\n\n") if e.strip()]


def _many_vectors() -> list[dict]:
    """1200 vectors of 256 floats as llama-server writes them: over PLAIN_BODY_BYTES in all."""
    return [{"index": i, "object": "embedding", "embedding": [0.0938158854842186] * 256} for i in range(1200)]


def _fed(reader: AnswerReader, body: bytes, step: int) -> AnswerReader:
    for i in range(0, len(body), step):
        reader.feed(body[i : i + step])
    return reader


# ------------------------------------------------------------------ the reader (pure)


@pytest.mark.parametrize("kind", ["text_stream", "chat_stream"])
@pytest.mark.parametrize("step", [1, 5, 64, 100_000])
def test_a_stream_costs_what_it_says_and_cut_short_the_tokens_it_carried(kind, step):
    body = ANSWERS[kind].encode()
    whole = _fed(AnswerReader(True), body, step)
    assert (whole.usage().prompt, whole.output()) == SAID[kind]
    assert whole.token_events == SAID[kind][1]  # one event a token, as the lane counts them
    events = _events(ANSWERS[kind])
    for kept in range(len(events) - 1):  # cut before its last event (the one that says the cost)
        cut = _fed(AnswerReader(True), b"".join(events[:kept]), step)
        assert cut.usage() is None and cut.output() == max(0, kept - (kind == "chat_stream"))


@pytest.mark.parametrize("kind", sorted(OTHER_APIS))
@pytest.mark.parametrize("step", [1, 7, 100_000])
def test_anthropic_and_responses_answers_cost_what_they_say_and_cut_short_the_deltas_they_carried(kind, step):
    body = ANSWERS[kind].encode()
    streamed = kind.endswith("stream")
    read = _fed(AnswerReader(streamed), body, step)
    assert (read.usage().prompt, read.output()) == OTHER_APIS[kind]
    if not streamed:
        return
    assert read.token_events == OTHER_APIS[kind][1]  # one delta event a token
    events = _events(ANSWERS[kind])
    deltas = [e for e in events if b"content_block_delta" in e or b"output_text.delta" in e or b'"stop":false' in e]
    opening = events[: events.index(deltas[0])]
    # A long answer cut short: its opening (Anthropic says the prompt there) far out of the kept tail.
    cut = _fed(AnswerReader(True), b"".join(opening + deltas * 4000), step if step > 1 else 4096)
    assert cut.output() == 4000 * len(deltas)
    if kind == "messages_stream":
        assert cut.usage().prompt == 27  # from the stream's head
    assert len(cut.tail) <= 16384 and len(cut.head) <= EDGE_BYTES


def test_what_charging_needs_is_asked_of_the_lane_and_nothing_else_is_touched():
    stream = {"model": "m", "stream": True, "messages": []}
    assert json.loads(counted.counted_body("/v1/chat/completions", stream, b"{}", True))["timings_per_token"] is True
    assert counted.counted_body("/v1/chat/completions", stream | {"timings_per_token": False}, b"x", True) == b"x"
    assert counted.counted_body("/v1/messages", stream, b"x", True) == b"x"  # its usage is in its events already
    vscode = {"response_fields": ["content", "timings/prompt_n"]}
    asked = json.loads(counted.counted_body("/infill", vscode, b"x", False))["response_fields"]
    assert asked == ["content", "timings/prompt_n", "timings/cache_n", "timings/predicted_n"]
    whole = {"response_fields": ["content", *counted.CHARGED_FIELDS]}
    assert counted.counted_body("/infill", whole, b"x", False) == b"x"
    assert counted.counted_body("/infill", {"prompt": "x"}, b"x", False) == b"x"


def test_a_plain_answer_too_long_to_keep_is_read_from_its_head_and_tail_in_bounded_memory():
    answer = json.loads(ANSWERS["embeddings"])
    answer["data"] = _many_vectors()
    body = json.dumps(answer, separators=(",", ":")).encode()
    assert len(body) > PLAIN_BODY_BYTES  # usage comes first in llama-server's embeddings answer
    read = _fed(AnswerReader(False), body, 65536)
    assert (read.usage().prompt, read.output()) == SAID["embeddings"]
    assert len(read.head) <= EDGE_BYTES and len(read.tail) <= EDGE_BYTES
    plain = json.loads(ANSWERS["text_plain"])  # and timings and usage last in a completion's
    plain["choices"][0]["text"] = "x" * (PLAIN_BODY_BYTES + 10)
    read = _fed(AnswerReader(False), json.dumps(plain).encode(), 65536)
    assert (read.usage().prompt, read.output()) == SAID["text_stream"]


def test_an_adapter_applied_by_id_is_seen_and_one_at_scale_zero_is_not():
    assert adapters.applied_by_id({"lora": [{"id": 0, "scale": 1.0}]})
    assert adapters.applied_by_id({"lora": [{"id": 1}]})  # llama-server's default scale is 1
    assert not adapters.applied_by_id({"lora": [{"id": 0, "scale": 0.0}]})
    assert not adapters.applied_by_id({"lora": [{"name": "style"}]}) and not adapters.applied_by_id({"lora": "style"})


# ------------------------------------------------------------------ through the gateway


async def _lane() -> tuple[web.AppRunner, int]:
    """A lane that answers as llama-server did; `hold: k` sends k token events, then nothing."""

    async def generate(request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        kind = "chat_stream" if request.path.endswith("/chat/completions") else "text_stream"
        assert payload.get("stream") is True  # plain chat and text answers are asked as streams
        events = _events(ANSWERS[kind])
        hold = payload.get("hold")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if hold is None:
            for event in events:
                await resp.write(event)
        else:  # k tokens in one write (one read for the gateway), then generating on until closed
            await resp.write(b"".join(events[: hold + (kind == "chat_stream")]))
            await asyncio.sleep(3600)
        await resp.write_eof()
        return resp

    async def embeddings(request: web.Request) -> web.Response:
        answer = json.loads(ANSWERS["embeddings"])
        if (await request.json()).get("big"):
            answer["data"] = _many_vectors()
        return web.json_response(answer)

    async def rerank(request: web.Request) -> web.Response:
        return web.Response(body=ANSWERS["rerank"], content_type="application/json")

    app = lane_app({"/v1/completions": generate, "/v1/chat/completions": generate, "/v1/embeddings": embeddings,
                    "/v1/rerank": rerank})  # fmt: skip
    return await serve(app, handler_cancellation=True)  # a held answer stops when the gateway hangs up


REQUESTS = {  # kind -> (path, body)
    "text_stream": ("/v1/completions", {"prompt": "The three primary colors are", "stream": True}),
    "text_plain": ("/v1/completions", {"prompt": "The three primary colors are"}),
    "chat_stream": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}], "stream": True}),
    "chat_plain": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}]}),
    "embeddings": ("/v1/embeddings", {"input": "hello world"}),
    "embeddings_big": ("/v1/embeddings", {"input": "hello world", "big": True}),
    "rerank": ("/v1/rerank", {"query": "hello", "documents": ["hello world", "a b c"]}),
}
EXPECTED = {"text_stream": SAID["text_stream"], "text_plain": SAID["text_stream"], "chat_stream": SAID["chat_stream"],
            "chat_plain": SAID["chat_stream"], "embeddings": SAID["embeddings"],
            "embeddings_big": SAID["embeddings"], "rerank": SAID["rerank"]}  # fmt: skip


def _charged(gw: Gateway) -> tuple[float, float]:
    registry = gw.app[METRICS].registry
    labels = {"tenant": "anonymous", "class": "standard"}
    return tuple(registry.get_sample_value("lanes_gateway_tenant_tokens_total", {**labels, "kind": kind}) or 0.0
                 for kind in ("prompt", "output"))  # fmt: skip


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_every_kind_of_answer_is_charged_what_the_lane_said_and_one_cut_short_what_it_carried(seed):
    rng = random.Random(seed)
    lane, port = await _lane()
    gw = Gateway(GatewaySettings(port=0))
    put_plan(gw.view, "h", spec("a", "m", parallel=4, port=port))
    put_status(gw.view, "h", healthy("a", port))
    gw.view.mark_synced()
    runner = web.AppRunner(gw.app, handler_cancellation=True)  # as run_gateway serves it: a client that
    await runner.setup()  # hangs up cancels its handler
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(12):
                kind = rng.choice([*REQUESTS, "left_stream", "left_plain"])
                before = _charged(gw)
                if kind in REQUESTS:
                    path, body = REQUESTS[kind]
                    async with http.post(url + path, json={"model": "m", **body}) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
                    after = _charged(gw)
                    assert (after[0] - before[0], after[1] - before[1]) == EXPECTED[kind], kind
                    continue
                # The client leaves after k tokens (a stream read that far; a plain answer not waited for).
                held = rng.randint(1, 4)
                path, body = REQUESTS[rng.choice(["text_stream", "chat_stream"])]
                body = {**body, "stream": kind == "left_stream", "hold": held, "model": "m"}
                if kind == "left_stream":
                    resp = await http.post(url + path, json=body)
                    seen = 0
                    while seen < held + (path.endswith("/chat/completions")):
                        line = await resp.content.readline()
                        seen += line.startswith(b"data: {")
                    resp.close()  # the client hangs up
                else:  # a plain answer: the gateway assembles it; the client leaves once its tokens came
                    asking = asyncio.create_task(http.post(url + path, json=body))
                    counts, key = gw.admission.counts, next(iter(gw.view.lanes())).key
                    await eventually(lambda: counts.busy(key) and not counts.pending.get(key), timeout=10,
                                     what="the lane's first read (its k tokens, one write) in the gateway")
                    asking.cancel()
                    await asyncio.gather(asking, return_exceptions=True)
                await eventually(lambda: _charged(gw)[1] != before[1], timeout=10, what="the cut answer charged")
                after = _charged(gw)
                assert after[1] - before[1] == held, (kind, held)  # the tokens the lane sent, no more
                assert after[0] - before[0] > 0  # its prompt as estimated when it was sent: never free
    finally:
        await runner.cleanup()
        await lane.cleanup()


async def test_an_adapter_applied_by_id_is_refused_with_how_to_name_it():
    gw = Gateway(GatewaySettings(port=0))
    put_plan(gw.view, "h", spec("a", "m", port=9))
    put_status(gw.view, "h", healthy("a", 9))
    gw.view.mark_synced()
    runner, port = await serve(gw.app)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "prompt": "x", "lora": [{"id": 0, "scale": 1.0}]}
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                answer = await resp.json()
        assert resp.status == 400 and answer["error"]["code"] == "adapter_by_id", answer
    finally:
        await runner.cleanup()
