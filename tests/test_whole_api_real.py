"""The whole API through one door (issue 38): every endpoint a lane serves answers through the
gateway as it does from the lane, with the real llama-server (Gemma 3 270M) and the clients
people point at it: the `anthropic` package (Claude Code's), the `openai` package's Responses,
and plain requests for the tooling endpoints. Each answer is compared with the same request
sent straight to the lane: the same status, the same keys in the JSON, the same event types."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from fixtures_bus import free_port_base
from real_lane import lane_healthy, start_lane
from test_gateway_core import healthy, put_plan, put_status, spec
from waiting import eventually

from gateway.edge.app_keys import METRICS
from gateway.service import Gateway
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.slow

KEY = "sk-lanes-whole-api-test"
CHAT = [{"role": "user", "content": "Name three colors."}]


@asynccontextmanager
async def _gateway_before(binary: str, model, name: str):
    """(gateway URL, lane URL, the gateway): the real binary serving `model` as `name`, behind a
    gateway that needs a key."""
    port = free_port_base(1)
    proc = start_lane(binary, model, port)
    gw = Gateway(GatewaySettings(port=0, api_keys=(KEY,)))
    put_plan(gw.view, "h", spec(f"{name}-0", name, parallel=2, port=port))
    put_status(gw.view, "h", healthy(f"{name}-0", port))
    gw.view.mark_synced()
    runner = web.AppRunner(gw.app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    lane = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await lane_healthy(http, lane)
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", lane, gw
    finally:
        await runner.cleanup()
        proc.terminate()
        proc.wait(15)


@pytest.fixture(scope="module")
async def door(llama_server, gemma_model):
    async with _gateway_before(llama_server, gemma_model, "gemma") as found:
        yield found


async def _both(door, path: str, body: dict) -> tuple[tuple[int, object], tuple[int, object]]:
    """The same request through the gateway and straight to the lane: (status, JSON) of each."""
    gateway, lane, _ = door
    answers = []
    async with aiohttp.ClientSession() as http:
        for url, headers in ((gateway, {"Authorization": f"Bearer {KEY}"}), (lane, {})):
            async with http.post(url + path, json=body, headers=headers) as resp:
                answers.append((resp.status, json.loads(await resp.read())))
    return answers[0], answers[1]


def _shape(value: object) -> object:
    """The keys of a JSON answer, nested, without its values (ids and texts differ run to run)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items() if k != "timings"}
    if isinstance(value, list):
        return [_shape(v) for v in value[:1]]
    return type(value).__name__ if value is not None else None


async def _event_types(url: str, path: str, body: dict, headers: dict) -> list[str]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        text = (await resp.read()).decode()
    return [line[7:] for line in text.splitlines() if line.startswith("event: ")]


async def test_claude_codes_client_talks_to_the_fleet_as_to_a_lane(door):
    gateway, lane, gw = door
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key=KEY)  # sends x-api-key, as Claude Code does
    message = await client.messages.create(model="gemma", max_tokens=8, messages=CHAT)
    assert message.type == "message" and message.content[0].type == "text" and message.usage.output_tokens > 0
    via, direct = await _both(door, "/v1/messages", {"model": "gemma", "max_tokens": 8, "messages": CHAT})
    assert via[0] == direct[0] == 200 and _shape(via[1]) == _shape(direct[1])

    texts = []
    async with client.messages.stream(model="gemma", max_tokens=8, messages=CHAT) as stream:
        async for text in stream.text_stream:
            texts.append(text)
        final = await stream.get_final_message()
    assert texts and final.stop_reason in ("max_tokens", "end_turn")
    body = {"model": "gemma", "max_tokens": 8, "messages": CHAT, "stream": True}
    via_events = await _event_types(gateway, "/v1/messages", body, {"x-api-key": KEY})
    assert via_events == await _event_types(lane, "/v1/messages", body, {})  # the lane's events, untouched
    assert via_events[0] == "message_start" and via_events[-1] == "message_stop"

    counted = await client.messages.count_tokens(model="gemma", messages=CHAT)
    via, direct = await _both(door, "/v1/messages/count_tokens", {"model": "gemma", "messages": CHAT})
    assert counted.input_tokens == via[1]["input_tokens"] == direct[1]["input_tokens"] > 0

    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    asked = {"model": "gemma", "max_tokens": 16, "tools": tools,
             "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}  # fmt: skip
    with_tools = await client.messages.create(**asked)
    assert with_tools.type == "message" and with_tools.content
    via, direct = await _both(door, "/v1/messages", asked)
    assert via[0] == direct[0] == 200 and via[1].keys() == direct[1].keys()


async def test_anthropic_errors_come_in_anthropics_shape_and_its_client_raises_them(door):
    gateway, _, _ = door
    with pytest.raises(anthropic.AuthenticationError):
        await anthropic.AsyncAnthropic(base_url=gateway, api_key="sk-not-this").messages.create(
            model="gemma", max_tokens=4, messages=CHAT)
    client = anthropic.AsyncAnthropic(base_url=gateway, api_key=KEY)
    with pytest.raises(anthropic.NotFoundError) as caught:
        await client.messages.create(model="no-such-model", max_tokens=4, messages=CHAT)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    too_long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(anthropic.BadRequestError) as caught:  # counted by the lane's own counter, refused
        await client.messages.create(model="gemma", max_tokens=4, messages=too_long)
    refused = caught.value.body["error"]
    assert refused["code"] == "context_length_exceeded" and refused["n_prompt_tokens"] > refused["n_ctx"] == 2048
    via, direct = await _both(door, "/v1/chat/completions", {"model": "gemma", "messages": too_long})
    assert via[0] == direct[0] == 400 and direct[1]["error"]["type"] == "exceed_context_size_error"
    assert {k: via[1]["error"][k] for k in ("n_prompt_tokens", "n_ctx")} == \
        {k: direct[1]["error"][k] for k in ("n_prompt_tokens", "n_ctx")}  # fmt: skip


async def test_codex_and_the_responses_api_through_the_gateway(door):
    gateway, lane, _ = door
    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key=KEY)
    answer = await client.responses.create(model="gemma", input="Name three colors.", max_output_tokens=8)
    assert answer.object == "response" and answer.output_text
    body = {"model": "gemma", "input": "Name three colors.", "max_output_tokens": 8}
    via, direct = await _both(door, "/v1/responses", body)
    assert via[0] == direct[0] == 200 and via[1].keys() == direct[1].keys()

    kinds = []
    stream = await client.responses.create(model="gemma", input="Name three colors.", max_output_tokens=8, stream=True)
    async for event in stream:
        kinds.append(event.type)
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    streamed = body | {"stream": True}
    assert await _event_types(gateway, "/v1/responses", streamed, {"Authorization": f"Bearer {KEY}"}) == \
        await _event_types(lane, "/v1/responses", streamed, {})  # fmt: skip
    via, direct = await _both(door, "/v1/responses/input_tokens", {"model": "gemma", "input": "Name three colors."})
    assert via == direct and via[1]["input_tokens"] > 0


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"content": "Hello fleet", "with_pieces": True}),
    ("/apply-template", {"messages": CHAT}),
    ("/v1/chat/completions/input_tokens", {"messages": CHAT}),
    ("/completion", {"prompt": "The sky is", "n_predict": 4}),
    ("/infill", {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 4}),  # Gemma: no FIM
    ("/v1/messages/count_tokens", {"messages": CHAT}),
])  # fmt: skip
async def test_the_tooling_endpoints_answer_as_the_lane_does(door, path, body):
    via, direct = await _both(door, path, {"model": "gemma", **body})
    assert via[0] == direct[0], (via, direct)
    assert _shape(via[1]) == _shape(direct[1]), (via, direct)
    if path in ("/tokenize", "/apply-template", "/v1/chat/completions/input_tokens", "/v1/messages/count_tokens"):
        assert via == direct  # deterministic: the very same answer


async def test_tokenize_round_trips_through_the_gateway(door):
    text = "Lanes route every endpoint."
    (status, tokens), _ = await _both(door, "/tokenize", {"model": "gemma", "content": text})
    assert status == 200 and tokens["tokens"]
    (status, back), direct = await _both(door, "/detokenize", {"model": "gemma", "tokens": tokens["tokens"]})
    assert status == 200 and back == direct[1] and back["content"].strip() == text


async def test_messages_are_charged_what_the_lane_said(door):
    gateway, _, gw = door
    registry = gw.app[METRICS].registry
    labels = {"tenant": "default", "class": "standard"}

    def charged() -> tuple[float, float]:
        return tuple(registry.get_sample_value("lanes_gateway_tenant_tokens_total", {**labels, "kind": kind}) or 0.0
                     for kind in ("prompt", "output"))  # fmt: skip

    client = anthropic.AsyncAnthropic(base_url=gateway, api_key=KEY)
    before = charged()
    message = await client.messages.create(model="gemma", max_tokens=6, messages=CHAT)
    after = charged()
    said = message.usage
    assert after[0] - before[0] == said.input_tokens + (said.cache_read_input_tokens or 0)
    assert after[1] - before[1] == said.output_tokens
    before = charged()
    async with client.messages.stream(model="gemma", max_tokens=6, messages=CHAT) as stream:
        final = await stream.get_final_message()
    await eventually(lambda: charged() != before, timeout=10, what="the stream charged")
    after = charged()
    assert after[1] - before[1] == final.usage.output_tokens
    assert after[0] - before[0] == final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    seen = registry.get_sample_value("lanes_gateway_endpoint_requests_total", {"endpoint": "/v1/messages",
                                     "status": "200"})  # fmt: skip
    assert seen and seen >= 2


# What llama.vscode sends for a completion at the cursor (its llama_server_infill request).
VSCODE_INFILL = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n",
                 "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
                 "prompt": "    ", "n_predict": 8, "top_k": 40, "top_p": 0.99, "stream": False,
                 "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
                 "t_max_predict_ms": 1000, "response_fields": ["content", "timings/prompt_n", "timings/predicted_n",
                 "timings/predicted_ms", "truncated", "tokens_cached"]}  # fmt: skip


@pytest.fixture(scope="module")
async def fim_door(llama_server, tmp_path_factory):
    """A code model (fill-in-the-middle tokens; generated) behind a gateway: what editors talk to."""
    import tinymodels

    model = tinymodels.write_llama(tmp_path_factory.mktemp("fim") / "coder.gguf", fim=True, n_vocab=512)
    async with _gateway_before(llama_server, model, "coder") as found:
        yield found


async def test_editor_completion_at_the_cursor_through_the_gateway_is_charged(fim_door):
    gateway, lane, gw = fim_door
    registry = gw.app[METRICS].registry

    def charged() -> tuple[float, float]:
        return tuple(registry.get_sample_value("lanes_gateway_tenant_tokens_total", {"tenant": "default",
                     "class": "standard", "kind": kind}) or 0.0 for kind in ("prompt", "output"))  # fmt: skip

    before = charged()
    via, direct = await _both(fim_door, "/infill", {"model": "coder", **VSCODE_INFILL})
    assert via[0] == direct[0] == 200, (via, direct)
    # The fields it asked for, and the timings the gateway charges by (added to its response_fields).
    assert set(via[1]) == set(direct[1]) | {"timings/cache_n"}, (via, direct)
    assert charged()[1] - before[1] == via[1]["timings/predicted_n"] > 0
    assert charged()[0] - before[0] == via[1]["timings/prompt_n"] + via[1]["timings/cache_n"] > 0
    body = {"model": "coder", **VSCODE_INFILL, "stream": True, "response_fields": None}
    async with aiohttp.ClientSession() as http:
        answers = []
        for url, headers in ((gateway, {"Authorization": f"Bearer {KEY}"}), (lane, {})):
            async with http.post(url + "/infill", json=body, headers=headers) as resp:
                assert resp.status == 200
                events = [json.loads(line[6:]) for line in (await resp.read()).decode().splitlines()
                          if line.startswith("data: {")]  # fmt: skip
                answers.append([sorted(e) for e in events])
    assert answers[0] == answers[1] and len(answers[0]) > 1  # the same events, field for field


async def test_props_of_a_model_are_its_lanes_own(door):
    gateway, lane, _ = door
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway + "/props", params={"model": "gemma"},
                            headers={"Authorization": f"Bearer {KEY}"}) as resp:  # fmt: skip
            via = (resp.status, await resp.json())
        async with http.get(lane + "/props") as resp:
            direct = (resp.status, await resp.json())
    assert via[0] == direct[0] == 200 and via[1].keys() == direct[1].keys()
    assert via[1]["total_slots"] == direct[1]["total_slots"] == 2


async def test_a_control_reaches_the_lane_running_the_completion(door):
    gateway, lane, _ = door
    auth = {"Authorization": f"Bearer {KEY}"}
    ask = {"model": "gemma", "max_tokens": 120, "stream": True, "messages": CHAT}
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway + "/v1/chat/completions", json=ask, headers=auth) as resp:
            first = json.loads((await resp.content.readline()).decode()[6:])  # its first event names it
            said = []
            for body in ({"id": first["id"], "action": "reasoning_end"}, {"id": "chatcmpl-nobody", "action":
                         "reasoning_end"}, {"id": first["id"], "action": "no-such-action"}):  # fmt: skip
                async with http.post(gateway + "/v1/chat/completions/control", json=body, headers=auth) as answer:
                    said.append((answer.status, await answer.json()))
    # Gemma has no reasoning to end: the lane running it says so; another completion is nowhere.
    assert said[0] == (200, {"success": False, "message": "reasoning control not enabled for this completion"})
    assert said[1] == (200, {"success": False, "message": "no active completion for this id"})
    assert said[2][0] == 400 and said[2][1]["error"]["message"] == "unknown control action"


def _wav(seconds: float = 0.2, rate: int = 16000) -> bytes:
    import io
    import wave

    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x00\x00" * int(seconds * rate))
    return out.getvalue()


async def test_speech_to_text_is_relayed_as_a_form_to_a_lane_of_its_model(door):
    gateway, lane, gw = door
    answers = []
    async with aiohttp.ClientSession() as http:
        for url, headers in ((gateway, {"Authorization": f"Bearer {KEY}"}), (lane, {})):
            form = aiohttp.FormData()
            form.add_field("model", "gemma")
            form.add_field("file", _wav(), filename="hello.wav", content_type="audio/wav")
            async with http.post(url + "/v1/audio/transcriptions", data=form, headers=headers) as resp:
                answers.append((resp.status, await resp.json()))
    # Gemma has no audio projector: the lane's own refusal, through the gateway as straight from it.
    assert answers[0] == answers[1] and answers[0][0] == 501, answers
    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0)  # as it sends audio
    with pytest.raises(openai.APIStatusError) as caught:
        await client.audio.transcriptions.create(model="gemma", file=("hello.wav", _wav(), "audio/wav"))
    assert caught.value.status_code == 501 and caught.value.body == answers[1][1]["error"]
    seen = gw.app[METRICS].registry.get_sample_value("lanes_gateway_endpoint_requests_total",
                                                     {"endpoint": "/v1/audio/transcriptions", "status": "501"})  # fmt: skip
    assert seen == 2


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6}),
    ("/v1/completions", {"prompt": "The sky is", "max_tokens": 6}),
])  # fmt: skip
async def test_a_plain_answer_put_together_from_a_stream_has_every_field_the_lane_sends(door, path, body):
    via, direct = await _both(door, path, {"model": "gemma", **body})
    assert via[0] == direct[0] == 200
    assert _shape(via[1]) == _shape(direct[1]), (via, direct)
