"""A /metrics endpoint (aiohttp + prometheus_client) for the services that serve nothing else."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = structlog.get_logger("lanes.metrics")


async def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    stop: asyncio.Event,
    *,
    before_scrape: Callable[[], Awaitable[None]] | None = None,
    bound: Callable[[int], None] | None = None,
) -> None:
    """Serve `registry` on http://host:port/metrics until `stop`; `before_scrape` refreshes what it reads."""

    async def metrics(request: web.Request) -> web.Response:
        if before_scrape is not None:
            await before_scrape()
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        actual = runner.addresses[0][1]
        log.info("metrics serving", url=f"http://{host}:{actual}/metrics")
        if bound is not None:
            bound(actual)
        await stop.wait()
    finally:
        await runner.cleanup()
