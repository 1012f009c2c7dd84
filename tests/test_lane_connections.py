"""The gateway's connections to a lane: a streamed answer's is not kept, a plain answer's is.

llama-server closes the connection after a streamed answer's last chunk although its headers say
keep-alive (measured on b11434: `Keep-Alive: timeout=5, max=100`, then EOF). A gateway that
pooled it sent the next request down a dead socket (ServerDisconnectedError, a retry and a
warning: seen in test_slot_save_real). This server keeps every connection open unless asked
not to, so the connection the second request arrives on shows what the gateway kept."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from stub_http import serve

from gateway.edge.forward import lane_headers


async def _server() -> tuple[web.AppRunner, str, list[int]]:
    peers: list[int] = []  # the client port each request came from: one per connection

    async def stream(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername")[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"content": "hi"}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def plain(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"content": "hi"})

    app = web.Application()
    app.router.add_post("/stream", stream)
    app.router.add_post("/plain", plain)
    runner, port = await serve(app)
    return runner, f"http://127.0.0.1:{port}", peers


async def _twice(path: str, streamed: bool) -> list[int]:
    runner, url, peers = await _server()
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                async with session.post(url + path, data=b"{}", headers=lane_headers("*/*", streamed)) as upstream:
                    await upstream.read()
        return peers
    finally:
        await runner.cleanup()


async def test_a_streamed_answers_connection_is_not_reused():
    first, second = await _twice("/stream", streamed=True)
    assert first != second


async def test_a_plain_answers_connection_is_reused():
    first, second = await _twice("/plain", streamed=False)
    assert first == second
