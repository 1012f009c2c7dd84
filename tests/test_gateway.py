"""The gateway in front of real llama-server lanes over real NATS, used with the official `openai` client.

One fleet for the module: a nats-server, the planner and one agent (host "a") serving
the real Gemma 3 270M Q4_K_M file in two lanes of two slots each. (Lanes on separate
hosts are tests/test_netns.py's.) Each test runs its own gateway (own settings, own
port) on that bus.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections import Counter
from contextlib import asynccontextmanager

import aiohttp
import openai
import pytest
from fixtures_bus import Services, agent_config, client, free_port_base, host_status, lane_of
from waiting import eventually
from test_metrics import samples

import gateway.routing.prompts as prompts
from gateway.service import Gateway, run_gateway
from gateway.routing.tokens import count_tokens
from gateway.settings import GatewaySettings
from shared import subjects
from shared.messages.config import Demand, Persona
from shared.messages.replies import ConfigSet
from shared.messages.wire import encode
from msgspec.json import encode as encode_json
from shared.natsserver import NatsServer

ALIAS = "chat"
HOST = "a"
LANES = 2
KEY = "sk-test-" + "0123456789abcdef"
BEARER = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Count from one to ten."}]
LONG = {"max_tokens": 1500, "extra_body": {"ignore_eos": True}}  # a stream that lasts seconds


def _place_model(src, folder):
    """A hard link (the agent refuses symlinks out of its folder), a copy across file systems."""
    folder.mkdir(parents=True)
    try:
        os.link(src, folder / src.name)
    except OSError:
        shutil.copy(src, folder / src.name)


@pytest.fixture(scope="module")
async def fleet(tmp_path_factory, gemma_model, llama_server):
    tmp = tmp_path_factory.mktemp("gateway-fleet")
    server = NatsServer(tmp / "nats").start()
    services = Services(server.url)
    try:
        services.start_planner()
        async with client(server.url) as nc:
            await eventually(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), what="planner up")
            demand = Demand(personas=(Persona(model=gemma_model.stem, alias=ALIAS, lanes=LANES, parallel=2,
                                              ctx_min=4096, ctx_max=4096),))  # fmt: skip
            reply = await nc.request(subjects.DEMAND_SET, encode(demand), timeout=5)
            assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
            _place_model(gemma_model, tmp / "models")
            server.agent_metrics = free_port_base(1)
            services.start_agent(agent_config(tmp, HOST, tmp / "models", llama_server,
                                              metrics_port=server.agent_metrics))  # fmt: skip
            # Reading the real file's facts (262k-token vocabulary) takes the agent a while on a busy machine.
            await eventually(lambda: _healthy_lanes(nc), timeout=300, what="both lanes healthy")
        yield server
    finally:
        await services.stop_all()
        server.stop()


async def _healthy_lanes(nc):
    status = await host_status(nc, HOST)
    healthy = [lane for lane in (status.lanes if status else ()) if lane.state == "healthy"]
    return healthy if len(healthy) == LANES else None


@asynccontextmanager
async def gateway(fleet, **settings):
    settings.setdefault("api_keys", (KEY,))
    gw = Gateway(GatewaySettings(port=0, **settings))
    stop = asyncio.Event()
    task = asyncio.create_task(run_gateway(fleet.url, stop, gateway=gw))
    try:
        await asyncio.wait_for(gw.started.wait(), 10)
        await eventually(lambda: len(gw.view.routable(ALIAS)) == LANES, timeout=60, what="both lanes routable")
        yield gw
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


def _openai(gw: Gateway, key: str = KEY, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=retries, timeout=60)


async def _open_stream(http: aiohttp.ClientSession, gw: Gateway, **body) -> aiohttp.ClientResponse:
    """A streaming chat request whose answer has begun (its first chunk read)."""
    payload = {"model": ALIAS, "messages": MESSAGES, "stream": True, "max_tokens": 1500, "ignore_eos": True} | body
    resp = await http.post(gw.url + "/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status == 200, await resp.text()
    assert (await resp.content.readany()).startswith(b"data: ")
    return resp


# ------------------------------------------------------------------ the openai client


async def test_openai_client_plain_and_streaming(fleet):
    async with gateway(fleet) as gw:
        ai = _openai(gw)
        raw = await ai.chat.completions.with_raw_response.create(model=ALIAS, messages=MESSAGES, max_tokens=16)
        answer = raw.parse()
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
        assert raw.headers["x-lanes-lane"].split("/")[0] == HOST
        text = await ai.completions.create(model=ALIAS, prompt="The capital of France is", max_tokens=8)
        assert text.choices[0].text

        # Streaming: chunks arrive while the lane is still generating, not all at the end.
        started = time.perf_counter()
        arrivals, parts = [], []
        stream = await ai.chat.completions.create(model=ALIAS, messages=MESSAGES, stream=True, max_tokens=64,
                                                  extra_body={"ignore_eos": True})  # fmt: skip
        async for chunk in stream:
            arrivals.append(time.perf_counter() - started)
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        assert len(parts) >= 32, parts
        assert arrivals[0] < 0.5 * arrivals[-1], f"first chunk at {arrivals[0]:.3f} s of {arrivals[-1]:.3f} s"

        models = await ai.models.list()
        assert [m.id for m in models.data] == [ALIAS]
        # The model's file name routes too.
        by_name = await ai.chat.completions.create(model=fleet_model_name(gw), messages=MESSAGES, max_tokens=4)
        assert by_name.choices[0].message.content is not None


async def test_a_stream_after_a_stream_to_its_lane_goes_on_the_connection_opened_for_it(fleet):
    """llama-server closes each streamed answer's connection; the gateway opens the lane's next one
    while the answer flows, and the next stream to that lane takes it (gateway/edge/lane_spares.py)."""
    async with gateway(fleet) as gw, aiohttp.ClientSession() as http:
        ai = _openai(gw)
        seen: set[str] = set()
        after_one = 0  # streams to a lane that streamed before in this test
        for _ in range(4):
            raw = await ai.chat.completions.with_raw_response.create(model=ALIAS, messages=MESSAGES, stream=True,
                                                                     max_tokens=4)  # fmt: skip
            lane = raw.headers["x-lanes-lane"]
            after_one += lane in seen
            seen.add(lane)
            chunks = [chunk async for chunk in raw.parse()]
            assert any(c.choices and c.choices[0].delta.content for c in chunks)
        got = samples(await (await http.get(gw.url + "/metrics", headers=BEARER)).text())
    how = {dict(labels)["how"]: value for (name, labels), value in got.items()
           if name == "lanes_gateway_lane_connections_total"}  # fmt: skip
    assert after_one >= 2 and how == {"spare": after_one, "new": 4 - after_one}, (after_one, how)


def fleet_model_name(gw: Gateway) -> str:
    return gw.view.lanes_for(ALIAS)[0].model


async def test_errors_come_in_openai_shape(fleet):
    async with gateway(fleet, max_body_bytes=4096) as gw:
        ai = _openai(gw)
        with pytest.raises(openai.NotFoundError) as missing:
            await ai.chat.completions.create(model="no-such-model", messages=MESSAGES)
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.AuthenticationError):
            await _openai(gw, key="sk-wrong").chat.completions.create(model=ALIAS, messages=MESSAGES)
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/v1/chat/completions", json={"model": ALIAS}) as resp:
                assert resp.status == 401  # no key at all
                body = await resp.json()
                assert set(body["error"]) == {"message", "type", "param", "code"}
            big = {"model": ALIAS, "messages": [{"role": "user", "content": "x" * 8000}]}
            async with http.post(gw.url + "/v1/chat/completions", json=big,
                                 headers={"Authorization": f"Bearer {KEY}"}) as resp:  # fmt: skip
                assert resp.status == 413
                assert (await resp.json())["error"]["type"] == "invalid_request_error"
            # No model named: the fleet serves exactly one, so it goes there (as llama-server does).
            async with http.post(gw.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2},
                                 headers={"Authorization": f"Bearer {KEY}"}) as resp:  # fmt: skip
                assert resp.status == 200, await resp.text()
                assert resp.headers["x-lanes-lane"].split("/")[0] == HOST
            async with http.get(gw.url + "/health") as resp:  # probes need no key
                assert resp.status == 200 and (await resp.json())["lanes_routable"] == 2
            async with http.get(gw.url + "/ready") as resp:
                assert resp.status == 200
    async with gateway(fleet, request_timeout=0.5) as gw:  # a request that cannot finish in time
        with pytest.raises(openai.APIStatusError) as slow:
            # long enough to time out, short enough that the lane, which finishes it anyway, is soon free
            await _openai(gw).chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=200,
                                                      extra_body={"ignore_eos": True})  # fmt: skip
        assert slow.value.status_code == 504 and slow.value.code == "timeout"


async def test_no_lanes_for_a_model(tmp_path):
    """A gateway on a bus whose fleet serves nothing: every model is unknown."""
    server = NatsServer(tmp_path / "nats").start()
    services = Services(server.url)
    services.start_planner()
    gw = Gateway(GatewaySettings(port=0))
    stop = asyncio.Event()
    task = asyncio.create_task(run_gateway(server.url, stop, gateway=gw))
    try:
        await eventually(lambda: gw.view.synced, what="gateway read the bucket")
        ai = _openai(gw, key="unused")
        assert (await ai.models.list()).data == []
        with pytest.raises(openai.NotFoundError) as missing:
            await ai.chat.completions.create(model=ALIAS, messages=MESSAGES)
        assert missing.value.code == "model_not_found" and ALIAS in missing.value.message
        with pytest.raises(openai.BadRequestError) as unnamed:
            await ai.chat.completions.create(model="", messages=MESSAGES)
        assert unnamed.value.code == "model_required" and "serves no model" in unnamed.value.message
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await services.stop_all()
        server.stop()


# ------------------------------------------------------------------ balancing and back-pressure


async def test_requests_spread_by_free_slots_then_queue_then_overflow(fleet):
    # queue_wait: long enough for a slot to be handed on (below) on a loaded machine.
    async with gateway(fleet, queue_depth=1, queue_wait=5.0) as gw, aiohttp.ClientSession() as http:
        # Slots busy with an earlier test's abandoned request count as load (the gateway reads /slots).
        await eventually(lambda: len(gw.admission.counts.reported) == LANES and not any(gw.admission.counts.reported.values()),
                         timeout=60, what="every slot idle")  # fmt: skip
        # Four slots in the fleet (two lanes, two each): four streams take one slot each.
        streams = [await _open_stream(http, gw) for _ in range(4)]
        assert sorted(Counter(r.headers["X-Lanes-Lane"] for r in streams).values()) == [2, 2]
        assert sum(gw.admission.counts.in_flight.values()) == 4
        # The fifth waits in the queue; the sixth finds the queue full at once.
        fifth = asyncio.create_task(_chat(http, gw))
        await eventually(lambda: gw.admission.counts.queued.get(ALIAS) == 1, timeout=5, what="one request queued")
        began = time.perf_counter()
        status, headers, body = await _chat(http, gw)
        assert status == 503 and body["error"]["code"] == "queue_full" and headers["Retry-After"].isdigit()
        assert time.perf_counter() - began < 0.5
        status, headers, body = await fifth  # no slot came free within queue_wait
        assert status == 503 and body["error"]["code"] == "queue_timeout" and "Retry-After" in headers
        metrics = await (await http.get(gw.url + "/metrics", headers=BEARER)).text()
        assert 'lanes_gateway_requests_total{model="chat",status="503"} 2.0' in metrics
        assert 'lanes_lane_slots_busy{host="a",lane="' in metrics
        # A waiting request gets the first slot that frees.
        waiting = asyncio.create_task(_chat(http, gw))
        await eventually(lambda: gw.admission.counts.queued.get(ALIAS) == 1, timeout=5, what="queued again")
        streams.pop().close()  # the client leaves: its slot is handed on
        status, _, body = await asyncio.wait_for(waiting, 60)
        assert status == 200 and body["choices"][0]["message"]["content"] is not None
        for resp in streams:
            resp.close()
        await eventually(lambda: not gw.admission.counts.in_flight, timeout=10, what="every slot given back")


async def _chat(http: aiohttp.ClientSession, gw: Gateway, **body):
    payload = {"model": ALIAS, "messages": MESSAGES, "max_tokens": 4} | body
    async with http.post(gw.url + "/v1/chat/completions", json=payload,
                         headers={"Authorization": f"Bearer {KEY}"}) as resp:  # fmt: skip
        return resp.status, resp.headers, await resp.json()


async def test_metrics_after_traffic(fleet):
    async with gateway(fleet) as gw, aiohttp.ClientSession() as http:
        for _ in range(3):
            assert (await _chat(http, gw))[0] == 200
        async with http.get(gw.url + "/metrics") as resp:  # behind the key, as everything but the probes
            assert resp.status == 401
        async with http.get(gw.url + "/metrics", headers=BEARER) as resp:  # as Prometheus sends it
            assert resp.status == 200
            text = await resp.text()
        assert 'lanes_gateway_requests_total{model="chat",status="200"} 3.0' in text
        assert 'lanes_gateway_time_to_first_byte_seconds_count{model="chat"} 3.0' in text
        assert 'lanes_gateway_request_duration_seconds_count{model="chat"} 3.0' in text
        for lane in gw.view.lanes_for(ALIAS):
            assert f'lanes_lane_slots{{host="{HOST}",lane="{lane.lane_id}",model="{lane.model}"}} 2.0' in text
            assert f'lanes_lane_routable{{host="{HOST}",lane="{lane.lane_id}",model="{lane.model}"}} 1.0' in text
        assert 'lanes_build_info{service="gateway",version=' in text


# ------------------------------------------------------------------ routing by what a lane holds

SYSTEMS = [f"You are assistant number {i}. " + "Answer briefly and precisely, naming the facts you rely on. " * 30
           for i in range(4)]  # fmt: skip


async def test_a_conversation_comes_back_to_its_lane_and_its_prompt_is_cached(fleet):
    """Prefix affinity with the real llama-server: each conversation's second and third turns land on
    the lane of its first, which reports most of the prompt cached; the gateway's token counters add
    up to what the lanes' answers said."""
    async with gateway(fleet) as gw, aiohttp.ClientSession() as http:
        ai = _openai(gw)
        convs = [[{"role": "system", "content": s}, {"role": "user", "content": "Say hello."}] for s in SYSTEMS]
        first, prompt_tokens = {}, 0
        for i, messages in enumerate(convs):
            raw = await ai.chat.completions.with_raw_response.create(model=ALIAS, messages=messages, max_tokens=8)
            first[i] = raw.headers["x-lanes-lane"]
            answer = raw.parse()
            prompt_tokens += answer.usage.prompt_tokens
            messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                         {"role": "user", "content": "And now say goodbye."}]  # fmt: skip
        assert len(set(first.values())) == 2  # new conversations spread over both lanes
        for i in reversed(range(len(convs))):  # the second turns, in another order
            raw = await ai.chat.completions.with_raw_response.create(model=ALIAS, messages=convs[i], max_tokens=8)
            assert raw.headers["x-lanes-lane"] == first[i]
            answer = raw.parse()
            prompt_tokens += answer.usage.prompt_tokens
            assert answer.usage.prompt_tokens_details.cached_tokens > 0.8 * answer.usage.prompt_tokens, answer.usage
            convs[i] += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                         {"role": "user", "content": "Thanks."}]  # fmt: skip
        # A streamed third turn: its lane's last chunk carries the timings the gateway counts.
        raw = await ai.chat.completions.with_raw_response.create(
            model=ALIAS, messages=convs[0], max_tokens=8, stream=True, stream_options={"include_usage": True})
        assert raw.headers["x-lanes-lane"] == first[0]
        chunks = [chunk async for chunk in raw.parse()]
        usage = next(c.usage for c in reversed(chunks) if c.usage)
        prompt_tokens += usage.prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens > 0.8 * usage.prompt_tokens
        text = await (await http.get(gw.url + "/metrics", headers=BEARER)).text()
    got = samples(text)
    lanes = {lane.lane_id for lane in gw.view.lanes_for(ALIAS)}
    counted = {lane: got.get(("lanes_gateway_prompt_tokens_total", frozenset({"model": ALIAS, "lane": f"{HOST}/{lane}"}.items())), 0)
               for lane in lanes}  # fmt: skip
    cached = {lane: got.get(("lanes_gateway_cached_prompt_tokens_total",
                             frozenset({"model": ALIAS, "lane": f"{HOST}/{lane}"}.items())), 0) for lane in lanes}  # fmt: skip
    assert sum(counted.values()) == prompt_tokens  # every answer counted once, plain and streamed
    assert all(0 < cached[lane] < counted[lane] for lane in lanes), (cached, counted)
    # Each later turn is routed by affinity. A request routed twice (a connection the lane dropped
    # before answering, retried at once, as a loaded machine sees) may add one more choice.
    choices = {dict(labels)["reason"]: value for (name, labels), value in got.items()
               if name == "lanes_gateway_route_choices_total" and dict(labels).get("model") == ALIAS}  # fmt: skip
    rerouted = sum(choices.values()) - (2 * len(convs) + 1)
    assert rerouted >= 0 and 5 <= choices["affinity"] <= 5 + rerouted, choices


async def test_a_prompt_no_window_holds_is_refused_before_any_lane(fleet):
    async with gateway(fleet) as gw, aiohttp.ClientSession() as http:
        huge = [{"role": "user", "content": "word " * 6000}]  # about 6000 tokens; windows of 4096
        with pytest.raises(openai.BadRequestError) as refused:
            await _openai(gw).chat.completions.create(model=ALIAS, messages=huge, max_tokens=4)
        assert refused.value.code == "context_length_exceeded" and "4096" in refused.value.message
        assert "x-lanes-lane" not in refused.value.response.headers  # no lane was tried
        assert not gw.admission.counts.served
        # Long, but within the window: counted by the lane, then served.
        status, _, body = await _chat(http, gw, messages=[{"role": "user", "content": "word " * 1500}])
        assert status == 200, body
        # The byte bound never under-counts the real tokenizer (SentencePiece with byte fallback).
        lane = gw.view.routable(ALIAS)[0]
        for text in ("plain words " * 200, "ünïcödé façade " * 100, "日本語のテキストです。" * 60, "🙂🚀 " * 150):
            for path, payload in (("/v1/completions", {"prompt": text}),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):  # fmt: skip
                prompt = prompts.prompt_of(path, payload)
                exact = await count_tokens(http, lane.url, prompt, encode_json(payload), auth=lane.auth)
                assert exact is not None and 0 < exact <= prompt.token_bound(), (text[:20], exact)


async def test_slots_busy_with_other_clients_count_as_load(fleet):
    """Two streams straight to one lane (not through the gateway) fill its slots: the gateway's /slots
    reading sees them, and its requests go to the other lane."""
    async with gateway(fleet) as gw, aiohttp.ClientSession() as http:
        lane = gw.view.routable(ALIAS)[0]
        direct = []
        for _ in range(2):
            resp = await http.post(lane.url + "/v1/chat/completions", headers=lane.auth, json={
                "messages": MESSAGES, "stream": True, "max_tokens": 1500, "ignore_eos": True})  # fmt: skip
            assert (await resp.content.readany()).startswith(b"data: ")
            direct.append(resp)
        await eventually(lambda: gw.admission.counts.reported.get(lane.key) == 2, timeout=10, what="/slots read")
        for _ in range(3):
            status, headers, _ = await _chat(http, gw)
            assert status == 200 and headers["X-Lanes-Lane"] != f"{lane.host_id}/{lane.lane_id}"
        text = await (await http.get(gw.url + "/metrics", headers=BEARER)).text()
        assert f'lanes_lane_slots_busy_reported{{host="{HOST}",lane="{lane.lane_id}",model="{lane.model}"}} 2.0' in text
        for resp in direct:
            resp.close()
        await eventually(lambda: gw.admission.counts.reported.get(lane.key) == 0, timeout=10, what="slots freed")


# ------------------------------------------------------------------ clients that leave


async def _lane_slots(http: aiohttp.ClientSession, lane) -> list[dict]:
    async with http.get(lane.url + "/slots", headers=lane.auth) as resp:
        return await resp.json()


async def _all_idle(http: aiohttp.ClientSession, gw: Gateway) -> bool:
    """Every slot of every lane idle, as the lanes' own /slots say."""
    for lane in gw.view.lanes_for(ALIAS):
        if any(slot["is_processing"] for slot in await _lane_slots(http, lane)):
            return False
    return True


def _queue_depth(text: str) -> float:
    return samples(text)[("lanes_gateway_queue_depth", frozenset({("model", ALIAS)}))]


async def test_queued_clients_that_hang_up_leave_the_queue_at_once(fleet):
    async with gateway(fleet, queue_depth=8, queue_wait=60.0) as gw, aiohttp.ClientSession() as http:
        await eventually(lambda: _all_idle(http, gw), timeout=60, what="every slot idle")
        streams = [await _open_stream(http, gw) for _ in range(LANES * 2)]  # every slot of the fleet
        queued = [asyncio.create_task(_chat(http, gw)) for _ in range(4)]
        await eventually(lambda: gw.admission.counts.queued.get(ALIAS) == 4, timeout=10, what="four queued")
        metrics = await (await http.get(gw.url + "/metrics", headers=BEARER)).text()
        assert _queue_depth(metrics) == 4
        for task in queued:  # the clients hang up: their connections close
            task.cancel()
        await asyncio.gather(*queued, return_exceptions=True)

        async def depth_zero() -> bool:
            return _queue_depth(await (await http.get(gw.url + "/metrics", headers=BEARER)).text()) == 0

        await eventually(depth_zero, timeout=1, what="queue depth 0 within 1 s")
        assert gw.admission.take_queue_waits(asyncio.get_running_loop().time()) == {}  # no demand left behind
        metrics = await (await http.get(gw.url + "/metrics", headers=BEARER)).text()
        assert samples(metrics)[("lanes_gateway_requests_total", frozenset({("model", ALIAS), ("status", "499")}))] == 4
        for resp in streams:
            resp.close()
        await eventually(lambda: not gw.admission.counts.in_flight, timeout=10, what="every slot given back")


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
async def test_a_client_that_leaves_mid_answer_frees_the_lanes_slot(fleet, streamed):
    async with gateway(fleet) as gw, aiohttp.ClientSession() as http:
        await eventually(lambda: _all_idle(http, gw), timeout=60, what="every slot idle")
        if streamed:
            resp = await _open_stream(http, gw)  # its first chunk read: the lane is generating
        else:  # a plain answer of 1500 tokens: nothing comes back until it is done
            pending = asyncio.create_task(_chat(http, gw, max_tokens=1500, ignore_eos=True))
        await eventually(lambda: _busy_lane(http, gw), timeout=30, what="a slot generating")
        if streamed:
            resp.close()
        else:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await eventually(lambda: _all_idle(http, gw), timeout=2, interval=0.1, what="the lane's slot idle within 2 s")
        await eventually(lambda: not gw.admission.counts.in_flight, timeout=2, what="the lease given back")


async def test_a_long_stream_past_the_request_timeout_leaves_its_lane_in_rotation(fleet):
    """The request's own time ends a stream that still flows; that says nothing against the lane."""
    async with gateway(fleet, request_timeout=4.0) as gw, aiohttp.ClientSession() as http:
        resp = await _open_stream(http, gw)
        lane = resp.headers["X-Lanes-Lane"]
        body = await asyncio.wait_for(resp.read(), 30)
        assert b"data: " in body and b"did not finish within the request timeout of 4 s" in body
        assert not gw.view.unreachable and not gw.view.stalled
        assert any(f"{r.host_id}/{r.lane_id}" == lane for r in gw.view.routable(ALIAS))


async def _busy_lane(http: aiohttp.ClientSession, gw: Gateway) -> bool:
    return not await _all_idle(http, gw)


# ------------------------------------------------------------------ failures


async def test_a_lane_killed_mid_stream(fleet):
    """The stream that was cut ends with an error the client raises; new requests go to the other lane."""
    async with gateway(fleet) as gw, client(fleet.url) as nc:
        ai = _openai(gw)
        raw = await ai.chat.completions.with_raw_response.create(model=ALIAS, messages=MESSAGES, stream=True, **LONG)
        host, lane_id = raw.headers["x-lanes-lane"].split("/")
        stream = raw.parse()
        got = 0
        with pytest.raises(openai.APIError) as broke:
            async for chunk in stream:
                got += 1
                if got == 5:
                    lane = lane_of(await host_status(nc, host), lane_id)
                    os.kill(lane.pid, signal.SIGKILL)
        assert "broke off" in str(broke.value.message)
        for _ in range(3):  # the killed lane is out of rotation at once
            answer = await ai.chat.completions.with_raw_response.create(model=ALIAS, messages=MESSAGES, max_tokens=4)
            assert answer.headers["x-lanes-lane"] != f"{host}/{lane_id}"
        # Its agent restarts it; once its /health answers, the gateway sends it requests again.
        await eventually(lambda: len(gw.view.routable(ALIAS)) == LANES, timeout=90, what="restarted lane back in rotation")
        back = lane_of(await host_status(nc, host), lane_id)
        assert back.pid != lane.pid and back.state == "healthy"


# ------------------------------------------------------------------ the agent's metrics


async def test_agent_metrics_re_export_llama_server_series(fleet):
    async with gateway(fleet) as gw, aiohttp.ClientSession() as http:
        assert (await _chat(http, gw))[0] == 200  # some tokens for the counters
        async with http.get(f"http://127.0.0.1:{fleet.agent_metrics}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    lane = gw.view.lanes_for(ALIAS)[0]
    labels = f'host="{HOST}",lane="{lane.lane_id}",model="{lane.model}"'
    assert "llamacpp:" not in text  # colons are for recording rules
    assert f"lanes_llama_prompt_tokens_total{{{labels}}}" in text
    assert f"lanes_llama_requests_processing{{{labels}}}" in text
    assert f"lanes_lane_healthy{{{labels}}} 1.0" in text
    on_cpu = frozenset({"host": HOST, "lane": lane.lane_id, "model": lane.model, "device": "cpu"}.items())
    assert samples(text)[("lanes_lane_planned_bytes", on_cpu)] > 0
    assert samples(text)[("lanes_lane_kv_bytes", on_cpu)] == samples(text)[("lanes_lane_kv_planned_bytes", on_cpu)]
    assert f"lanes_lane_restarts_total{{{labels}}}" in text
    assert 'lanes_build_info{service="agent"' in text
    served = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("lanes_llama_tokens_predicted_total{"))  # fmt: skip
    assert served > 0


# ------------------------------------------------------------------ a fleet-wide change under load (last: it changes the config)


async def test_fleet_wide_config_change_under_load_fails_no_request(fleet):
    """Both lanes restart for q8_0 KV one after the other, each drained first; clients see no error."""
    async with gateway(fleet, queue_wait=120) as gw, client(fleet.url) as nc:
        seen_draining: set[str] = set()
        gw.view.listeners.append(lambda host=None: seen_draining.update(l.lane_id for l in gw.view.lanes() if l.draining))
        before = {lane.lane_id: lane.pid for lane in await _healthy_lanes(nc)}
        ai = _openai(gw)
        done = asyncio.Event()
        results: Counter = Counter()
        errors: list[str] = []

        async def load():
            while not done.is_set():
                try:
                    stream = await ai.chat.completions.create(model=ALIAS, messages=MESSAGES, stream=True,
                                                              max_tokens=12, extra_body={"ignore_eos": True})  # fmt: skip
                    chunks = [chunk async for chunk in stream]
                    assert chunks, "empty stream"
                    results["ok"] += 1
                except Exception as exc:
                    results["failed"] += 1
                    errors.append(f"{type(exc).__name__}: {exc}")

        clients = [asyncio.create_task(load()) for _ in range(4)]
        await eventually(lambda: results["ok"] >= 4, timeout=180, what="load running")
        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q8_0",
                                                                                 "flash_attn": "on"})), timeout=5)  # fmt: skip
        assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers

        async def rolled_out():
            lanes = await _healthy_lanes(nc)
            return lanes and all("q8_0" in lane.argv and lane.pid != before[lane.lane_id] for lane in lanes)

        await eventually(rolled_out, timeout=300, what="both lanes restarted with q8_0")
        await eventually(lambda: len(gw.view.routable(ALIAS)) == LANES, timeout=30, what="both routable")
        served_before = results["ok"]
        await eventually(lambda: results["ok"] >= served_before + 2, timeout=180, what="load served after the change")
        done.set()
        await asyncio.gather(*clients)
    assert results["failed"] == 0, errors[:5]
    assert seen_draining == set(before), "every lane was drained before its restart"
