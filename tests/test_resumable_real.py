"""Resumable streams through any gateway (issue 38 points 3 and 4), with the real llama-server:
a streamed chat carrying X-Conversation-Id through gateway A, A killed with SIGKILL mid-answer,
the client resumes through gateway B from the bytes it had and receives the rest, with no gap
and no repeat; a client that leaves such a stream does not stop it; lookups answer only the
tenant that started a conversation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from fixtures_bus import free_port_base
from real_lane import lane_healthy, start_lane
from waiting import eventually

from gateway.edge import conversations
from gateway.tenants import Tenant

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
ASK = {"model": "gemma", "max_tokens": 160, "stream": True,
       "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]}  # fmt: skip


def _gateway(lane_port: int, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(HERE / "static_gateway.py"), str(lane_port), str(port)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "serving"
    return proc


@pytest.fixture
async def lane_and_gateways(llama_server, gemma_model):
    lane_port, a_port, b_port = (free_port_base(3) + i for i in range(3))
    procs = [start_lane(llama_server, gemma_model, lane_port)]
    try:
        async with aiohttp.ClientSession() as http:
            await lane_healthy(http, f"http://127.0.0.1:{lane_port}")
            procs += [_gateway(lane_port, a_port), _gateway(lane_port, b_port)]
            yield http, f"http://127.0.0.1:{lane_port}", procs[1], f"http://127.0.0.1:{a_port}", \
                f"http://127.0.0.1:{b_port}"  # fmt: skip
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(15)


async def _lane_replay(http: aiohttp.ClientSession, lane: str, conversation: str) -> bytes:
    """The whole stream as the lane buffered it, once it is done (straight from the lane)."""
    scoped = conversations.scoped(Tenant(), conversation)

    async def done() -> bool:
        async with http.post(lane + "/v1/streams/lookup", json={"conversation_ids": [scoped]}) as resp:
            found = await resp.json()
        return bool(found) and found[0]["is_done"]

    await eventually(done, timeout=120, what="the lane done with the conversation")
    async with http.get(lane + "/v1/stream", params={"conv_id": scoped, "from": "0"}) as resp:
        assert resp.status == 200
        return await resp.read()


async def test_a_gateway_killed_mid_stream_loses_nothing_the_client_resumes_through_another(lane_and_gateways):
    http, lane, a_proc, a, b = lane_and_gateways
    got = bytearray()
    resp = await http.post(a + "/v1/chat/completions", json=ASK, headers={"X-Conversation-Id": "story-1"})
    assert resp.status == 200
    while got.count(b"data: ") < 12:  # a dozen tokens in
        got += await resp.content.readany()
    os.kill(a_proc.pid, signal.SIGKILL)
    a_proc.wait(10)
    try:
        while chunk := await resp.content.readany():  # what was on its way when A died
            got += chunk
    except aiohttp.ClientError:
        pass
    resp.close()
    assert b"[DONE]" not in got  # A died mid-answer
    async with http.post(b + "/v1/streams/lookup", json={"conversation_ids": ["story-1", "other"]}) as found:
        (entry,) = await found.json()
    assert entry["conversation_id"] == "story-1"
    async with http.get(b + "/v1/stream", params={"conv_id": "story-1", "from": str(len(got))}) as rest:
        assert rest.status == 200 and rest.headers["Content-Type"].startswith("text/event-stream")
        tail = await rest.read()
    whole = bytes(got) + tail
    assert whole == await _lane_replay(http, lane, "story-1")  # no gap, no repeat: the lane's own bytes
    assert whole.rstrip().endswith(b"data: [DONE]") and whole.count(b"data: [DONE]") == 1


async def test_a_client_that_leaves_a_resumable_stream_does_not_stop_it(lane_and_gateways):
    http, lane, _, a, b = lane_and_gateways
    resp = await http.post(a + "/v1/chat/completions", json=ASK, headers={"X-Conversation-Id": "story-2"})
    got = bytearray()
    while got.count(b"data: ") < 4:
        got += await resp.content.readany()
    resp.close()  # the client leaves; the conversation asked to be kept
    whole = await _lane_replay(http, lane, "story-2")
    assert whole.startswith(bytes(got)) and whole.rstrip().endswith(b"data: [DONE]")
    assert whole.count(b'"finish_reason":null') > 4 + 20  # generated on, well past where the client left


async def test_conversations_are_the_tenants_own(lane_and_gateways):
    http, lane, _, a, b = lane_and_gateways
    async with http.post(a + "/v1/chat/completions", json=ASK | {"max_tokens": 4},
                         headers={"X-Conversation-Id": "mine"}) as resp:  # fmt: skip
        await resp.read()
    # Another tenant's scope (as another key's tenant would be): the lane holds "mine" for anonymous only.
    other = conversations.scoped(Tenant("acme"), "mine")
    async with http.post(lane + "/v1/streams/lookup", json={"conversation_ids": [other]}) as resp:
        assert await resp.json() == []
    async with http.get(b + "/v1/stream", params={"conv_id": "nobody-started-this"}) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["message"] == "Stream not found or expired"
    async with http.post(b + "/v1/chat/completions", json=ASK, headers={"X-Conversation-Id": "x" * 200}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_conversation_id"
