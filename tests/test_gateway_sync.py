"""A request that reaches a gateway before it has read the fleet from NATS (just started, or the
planner not up yet: it waits for the bucket) waits for the fleet instead of being told its
model is not served. Seen as a flaky 404 in tests/test_cli_online.py: `lanes up` printed its
try line, the lane was healthy, and the gateway read the bucket a second later."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from stub_http import serve
from test_gateway_core import healthy, put_plan, put_status, spec

from gateway.fleet.view import FleetView
from gateway.edge.app import build_app
from shared import defaults


async def _stub_lane() -> tuple[web.AppRunner, int]:
    async def completion(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    return await serve(app)


async def _ask(view: FleetView):
    client = TestClient(TestServer(build_app(view)))
    await client.start_server()
    return client, asyncio.create_task(client.post("/v1/completions", json={"model": "gemma", "prompt": "hi"}))


async def test_a_request_before_the_fleet_is_read_waits_for_it():
    runner, port = await _stub_lane()
    view = FleetView()  # not synced: what it holds may be half the bucket
    client, asked = await _ask(view)
    try:
        await asyncio.sleep(0.3)
        assert not asked.done()  # held, not answered 404
        put_plan(view, "h1", spec("gemma-0", port=port))
        put_status(view, "h1", healthy("gemma-0", port))
        view.mark_synced()
        resp = await asyncio.wait_for(asked, 10)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["choices"][0]["text"] == "ok"
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_fleet_never_read_answers_503_not_404(monkeypatch):
    monkeypatch.setattr(defaults, "FLEET_SYNC_WAIT", 0.2)
    client, asked = await _ask(FleetView())
    try:
        resp = await asyncio.wait_for(asked, 10)
        body = await resp.json()
        assert resp.status == 503 and body["error"]["code"] == "fleet_not_read", body
        assert resp.headers.get("Retry-After")
    finally:
        await client.close()
