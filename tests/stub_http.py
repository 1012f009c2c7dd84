"""A small aiohttp server on a free port, for tests that stand in for a lane."""

from __future__ import annotations

from aiohttp import web


async def serve(app: web.Application, handler_cancellation: bool = False) -> tuple[web.AppRunner, int]:
    """Start `app` on 127.0.0.1 and a free port: (its runner, to clean up; the port). With
    `handler_cancellation`, a client that hangs up cancels its handler (as llama-server stops)."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def lane_app(posts: dict) -> web.Application:
    """A stand-in lane: `posts` (path -> handler) beside the /health and /slots the gateway reads."""

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def slots(_: web.Request) -> web.Response:
        return web.json_response([])  # no slot busy with another client's work

    app = web.Application()
    for path, handler in posts.items():
        app.router.add_post(path, handler)
    app.router.add_get("/health", health)
    app.router.add_get("/slots", slots)
    return app
