"""The real llama-server started by hand as one lane (Gemma 3 270M, 2 slots), for tests that put
a gateway in front of it without the agent."""

from __future__ import annotations

import subprocess

import aiohttp
from waiting import eventually


def start_lane(binary: str, model, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "4096",
                             "-np", "2", "-t", "2", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


async def lane_healthy(http: aiohttp.ClientSession, url: str) -> None:
    """Until the lane at `url` says it is healthy (its model loaded)."""

    async def up() -> bool:
        try:
            async with http.get(url + "/health") as resp:
                return resp.status == 200
        except aiohttp.ClientError:
            return False

    await eventually(up, timeout=120, what="llama-server healthy")
