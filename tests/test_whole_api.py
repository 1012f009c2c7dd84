"""The whole API through one door (issue 38), fast: every endpoint llama-server serves is routed
to a lane of the model its body names, each API's key header is taken, and the gateway's own
errors come in the API's own shape (Anthropic's under /v1/messages), as JSON on every path.
The real binary and the real client packages: tests/test_whole_api_real.py."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web
from stub_http import lane_app, serve
from test_gateway_core import healthy, put_plan, put_status, spec

from gateway import routing
from gateway.edge import conversations, cors
from gateway.edge.endpoints import ENDPOINTS
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from gateway.tenants import Tenant

KEY = "sk-lanes-fast-whole-api"


@pytest.fixture
async def door():
    """(gateway URL, what each lane was asked): two models, one lane each, a stub that echoes."""
    asked: list[tuple[str, str, dict]] = []

    def lane(name: str, window_tokens: int):
        async def answer(request: web.Request) -> web.Response:
            body = dict(await request.post()) if ENDPOINTS[request.path].form else await request.json()
            asked.append((name, request.path, body))
            if request.path in routing.prompts.OWN_COUNTERS.values():
                return web.json_response({"input_tokens": window_tokens})
            return web.json_response({"lane": name, "path": request.path})

        return lane_app(dict.fromkeys(ENDPOINTS, answer))

    runners = [await serve(lane("alpha", 50)), await serve(lane("beta", 100_000))]
    gw = Gateway(GatewaySettings(port=0, api_keys=(KEY,)))
    for name, (_, port) in zip(("alpha", "beta"), runners):
        put_plan(gw.view, name, spec(f"{name}-0", name, port=port))
        put_status(gw.view, name, healthy(f"{name}-0", port))
    gw.view.mark_synced()
    front, port = await serve(gw.app)
    try:
        yield f"http://127.0.0.1:{port}", asked
    finally:
        await front.cleanup()
        for runner, _ in runners:
            await runner.cleanup()


async def _gateway_to(lane_port: int, settings: GatewaySettings) -> tuple[Gateway, web.AppRunner, str]:
    """A gateway whose fleet is one lane of model `m` at lane_port: (it, its runner, its URL)."""
    gw = Gateway(settings)
    put_plan(gw.view, "h", spec("a", "m", port=lane_port))
    put_status(gw.view, "h", healthy("a", lane_port))
    gw.view.mark_synced()
    front, port = await serve(gw.app)
    return gw, front, f"http://127.0.0.1:{port}"


async def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as resp:
        return resp.status, json.loads(await resp.read())


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
async def test_every_endpoint_reaches_a_lane_of_the_model_its_body_names(door, path):
    url, asked = door
    for model in ("alpha", "beta"):
        headers = {"Authorization": f"Bearer {KEY}"}
        if ENDPOINTS[path].form:  # a file and its fields, as the openai client sends audio
            form = aiohttp.FormData({"model": model})
            form.add_field("file", b"RIFF....WAVE", filename="a.wav", content_type="audio/wav")
            async with aiohttp.ClientSession() as http, http.post(url + path, data=form, headers=headers) as resp:
                status, answer = resp.status, await resp.json()
        else:
            status, answer = await _post(url + path, {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                      "input": "hi", "prompt": "hi"}, headers)  # fmt: skip
        counted = path in routing.prompts.OWN_COUNTERS.values()
        expected = {"input_tokens": {"alpha": 50, "beta": 100_000}[model]} if counted else {"lane": model, "path": path}
        assert (status, answer) == (200, expected)
        assert asked[-1][:2] == (model, path)


async def test_a_request_naming_no_model_in_a_fleet_of_two_is_refused_in_its_apis_shape(door):
    url, _ = door
    status, answer = await _post(url + "/v1/messages", {"messages": []}, {"x-api-key": KEY})
    assert status == 400 and answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["code"] == "model_required" and "names no model" in answer["error"]["message"]
    status, answer = await _post(url + "/tokenize", {"content": "hi"}, {"Authorization": f"Bearer {KEY}"})
    assert status == 400 and answer["error"]["code"] == "model_required"  # OpenAI's shape elsewhere


async def test_anthropics_key_header_opens_the_door_and_a_wrong_one_is_refused_its_way(door):
    url, _ = door
    body = {"model": "beta", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert (await _post(url + "/v1/messages", body, {"x-api-key": KEY}))[0] == 200
    status, answer = await _post(url + "/v1/messages", body, {"x-api-key": "sk-wrong"})
    assert status == 401 and answer == {"type": "error", "error": {
        "type": "authentication_error", "message": "missing or invalid API key (Authorization: Bearer ...)",
        "code": "invalid_api_key"}}  # fmt: skip
    status, answer = await _post(url + "/v1/chat/completions", body, {"x-api-key": "sk-wrong"})
    assert status == 401 and answer["error"]["code"] == "invalid_api_key" and "type" not in answer


async def test_a_prompt_past_every_window_is_counted_by_the_lanes_own_counter_and_refused(door):
    url, asked = door
    long = [{"role": "user", "content": "word " * 3000}]  # its byte bound passes the 4096-token window
    status, answer = await _post(url + "/v1/messages", {"model": "alpha", "max_tokens": 4, "messages": long},
                                 {"x-api-key": KEY})  # fmt: skip
    assert status == 200  # alpha's counter says 50 tokens: forwarded
    assert [p for _, p, _ in asked] == ["/v1/messages/count_tokens", "/v1/messages"]
    status, answer = await _post(url + "/v1/messages", {"model": "beta", "max_tokens": 4, "messages": long},
                                 {"x-api-key": KEY})  # fmt: skip
    assert status == 400 and answer["type"] == "error" and answer["error"]["code"] == "context_length_exceeded"
    assert (answer["error"]["n_prompt_tokens"], answer["error"]["n_ctx"]) == (100_000, 2048)  # the lane's fields
    status, answer = await _post(url + "/v1/responses", {"model": "beta", "input": "word " * 3000},
                                 {"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert asked[-1][1] == "/v1/responses/input_tokens"


async def test_every_error_the_gateway_answers_itself_is_json(door):
    url, _ = door
    async with aiohttp.ClientSession() as http:
        for path in ("/nope", "/v1/nope", "/props/x"):
            async with http.get(url + path, headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 404 and resp.content_type == "application/json", path
                assert (await resp.json())["error"]["code"] == "not_found"


def test_messages_and_responses_prompts_are_rendered_for_affinity():
    messages = routing.prompt_of("/v1/messages", {"system": "Be brief.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})  # fmt: skip
    assert messages.kind == "/v1/messages" and "Be brief." in messages.text and "hi" in messages.text
    responses = routing.prompt_of("/v1/responses", {"instructions": "Be brief.", "input": "hi"})
    assert responses.kind == "/v1/responses" and responses.text.startswith("Be brief.")
    assert routing.prompt_of("/completion", {"prompt": "The sky"}).text == "The sky"
    assert routing.prompt_of("/v1/messages", {"messages": "not a list"}) is None


@pytest.mark.parametrize(("setting", "origin", "answered"), [
    ("*", "http://example.com", True), ("localhost", "http://localhost:3000", True),
    ("localhost", "http://[::1]:8080", True), ("localhost", "http://example.com", False),
    ("https://app.example, https://b.example", "https://b.example", True),
    ("https://app.example", "https://b.example", False),
])  # fmt: skip
def test_cors_origins_as_llama_server_reads_them(setting, origin, answered):
    assert cors.allowed(origin, setting) is answered


async def test_a_preflight_is_answered_without_a_key_as_the_lane_answers_it(door):
    url, _ = door
    asked = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    async with aiohttp.ClientSession() as http:
        async with http.options(url + "/v1/chat/completions", headers=asked) as resp:
            assert resp.status == 200
            # What llama-server b11434 answers to the same preflight (its defaults), measured with curl:
            assert {k: resp.headers.get(k) for k in ("Access-Control-Allow-Origin", "Access-Control-Allow-Credentials",
                    "Access-Control-Allow-Methods", "Access-Control-Allow-Headers")} == {
                "Access-Control-Allow-Origin": "http://localhost:3000", "Access-Control-Allow-Credentials": "true",
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS", "Access-Control-Allow-Headers": "*"}  # fmt: skip
        body = {"model": "beta", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Origin": "http://localhost:3000", "Authorization": f"Bearer {KEY}"}
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        async with http.post(url + "/v1/chat/completions", json=body, headers={"Origin": "http://x.example"}) as resp:
            assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == "http://x.example"


@pytest.mark.slow
async def test_a_web_page_on_another_origin_calls_the_fleet_from_headless_chromium(door):
    from playwright.async_api import async_playwright
    from test_dashboard_browser import CHROMIUM_FLAGS, _chromium

    url, asked = door
    page_html = f"""<!doctype html><script>
      window.answer = fetch("{url}/v1/chat/completions", {{method: "POST",
        headers: {{"Content-Type": "application/json", "Authorization": "Bearer {KEY}"}},
        body: JSON.stringify({{model: "beta", messages: [{{role: "user", content: "hi"}}]}})}})
        .then(r => r.json()).catch(e => "blocked: " + e);
    </script>"""

    async def index(_: web.Request) -> web.Response:
        return web.Response(text=page_html, content_type="text/html")

    site = web.Application()
    site.router.add_get("/", index)
    runner, port = await serve(site)  # another port: another origin
    try:
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=_chromium(), args=CHROMIUM_FLAGS)
            page = await browser.new_page()
            await page.goto(f"http://localhost:{port}/")
            answer = await page.evaluate("window.answer")
            await browser.close()
    finally:
        await runner.cleanup()
    assert answer == {"lane": "beta", "path": "/v1/chat/completions"}, answer


async def test_a_tenant_finds_and_resumes_its_own_conversations_only(tmp_path):
    """Two tenants send the same X-Conversation-Id: the lane holds two conversations, and each
    tenant's lookup and resume reach its own (the stub keeps what the lane would)."""
    held: dict[str, bytes] = {}

    async def chat(request: web.Request) -> web.Response:
        conv = request.headers["X-Conversation-Id"]
        held[conv] = f"data: {{\"for\": \"{conv}\"}}\n\n".encode()
        return web.Response(body=held[conv], content_type="text/event-stream")

    async def lookup(request: web.Request) -> web.Response:
        ids = (await request.json())["conversation_ids"]
        return web.json_response([{"conversation_id": i, "is_done": True, "total_bytes": len(held[i]),
                                   "started_at": 1, "completed_at": 2} for i in ids if i in held])  # fmt: skip

    async def stream(request: web.Request) -> web.Response:
        conv = request.query["conv_id"]
        return web.Response(body=held[conv][int(request.query.get("from", 0)):], content_type="text/event-stream")

    app = lane_app({"/v1/chat/completions": chat, "/v1/streams/lookup": lookup})
    app.router.add_get("/v1/stream", stream)
    lane, lane_port = await serve(app)
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nkey = "sk-acme-000000000001"\ntenant = "acme"\n\n'
                    '[[keys]]\nkey = "sk-beta-000000000001"\ntenant = "beta"\n')  # fmt: skip
    _, front, url = await _gateway_to(lane_port, GatewaySettings(port=0, keys_file=str(keys)))
    try:
        async with aiohttp.ClientSession() as http:
            for key in ("sk-acme-000000000001", "sk-beta-000000000001"):
                headers = {"Authorization": f"Bearer {key}", "X-Conversation-Id": "c1"}
                async with http.post(url + "/v1/chat/completions", json={"model": "m", "stream": True,
                                     "messages": [{"role": "user", "content": "hi"}]}, headers=headers) as resp:  # fmt: skip
                    assert resp.status == 200
            assert len(held) == 2  # one conversation each, apart at the lane
            for key in ("sk-acme-000000000001", "sk-beta-000000000001"):
                auth = {"Authorization": f"Bearer {key}"}
                async with http.post(url + "/v1/streams/lookup", json={"conversation_ids": ["c1", "c2"]},
                                     headers=auth) as resp:  # fmt: skip
                    (entry,) = await resp.json()
                assert entry["conversation_id"] == "c1"
                async with http.get(url + "/v1/stream", params={"conv_id": "c1"}, headers=auth) as resp:
                    mine = await resp.read()
                tenant = "acme" if "acme" in key else "beta"
                assert mine == held[conversations.scoped(Tenant(tenant), "c1")]
            async with http.get(url + "/v1/stream", params={"conv_id": "c1"}) as resp:
                assert resp.status == 401  # no key, no conversation
    finally:
        await front.cleanup()
        await lane.cleanup()


async def test_an_endpoint_a_lanes_build_lacks_is_a_501_naming_the_build_that_has_it():
    async def no_route(_: web.Request) -> web.Response:  # what b11434 answers for a path it has no route for
        return web.json_response({"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}},
                                 status=404)  # fmt: skip

    async def props(_: web.Request) -> web.Response:
        return web.json_response({"total_slots": 2, "model_path": "/m/m.gguf"})

    app = lane_app({"/v1/responses": no_route, "/v1/chat/completions": no_route})
    app.router.add_get("/props", props)
    lane, lane_port = await serve(app)
    _, front, url = await _gateway_to(lane_port, GatewaySettings(port=0))
    try:
        status, answer = await _post(url + "/v1/responses", {"model": "m", "input": "hi"})
        assert status == 501 and answer["error"]["code"] == "not_supported_by_lane"
        assert "b11434" in answer["error"]["message"] and "/v1/responses" in answer["error"]["message"]
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/props") as resp:  # the fleet's one model
                assert resp.status == 200 and (await resp.json())["total_slots"] == 2
            async with http.get(url + "/props", params={"model": "nope"}) as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
            async with http.get(url + "/models") as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == ["m"]
    finally:
        await front.cleanup()
        await lane.cleanup()
