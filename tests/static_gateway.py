"""A real gateway process over a fixed fleet, no NATS: one lane of model `gemma` at LANE_PORT.
For tests that kill a gateway (SIGKILL) and go on through another: `python tests/static_gateway.py
LANE_PORT PORT`; it prints `serving` once it listens."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_gateway_core import healthy, put_plan, put_status, spec  # noqa: E402

from gateway.service import Gateway  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402


async def main(lane_port: int, port: int) -> None:
    gw = Gateway(GatewaySettings(port=port))
    put_plan(gw.view, "h", spec("a", "gemma", parallel=2, port=lane_port))
    put_status(gw.view, "h", healthy("a", lane_port))
    gw.view.mark_synced()
    runner = web.AppRunner(gw.app, handler_cancellation=True)  # as run_gateway serves it
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("serving", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
