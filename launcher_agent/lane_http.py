"""Asking a lane over HTTP: the I/O around shared.llama.endpoints, which says what the answers mean."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable

from shared.llama import endpoints
from shared.messages.plans import LaneSpec


def port_taken(bind: str, port: int) -> bool:
    """Whether another program listens on the port (a lane could not bind it)."""
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((endpoints.connect_host(bind), port)) == 0


def key_header(key: str | None) -> str:
    """The lane's API key (launcher_agent/lane_secret.py) as a request header: llama-server asks for
    it on every path but /health. Passed with each request, never kept here: two lanes can share an
    address over time (or, in tests, two agents in one process), and only the lane knows its key."""
    return f"Authorization: Bearer {key}\r\n" if key else ""


def auth_headers(key: str | None) -> dict[str, str]:
    """The same, for an aiohttp request (the agent's scrape of /metrics)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _exchange(bind: str, port: int, request: Callable[[str], bytes], timeout: float) -> tuple[int, object]:
    """Send one HTTP/1.0 request (built for the host connected to) and read the answer to its end."""
    host = endpoints.connect_host(bind)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return 0, None
    try:
        writer.write(request(host))
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    except (OSError, asyncio.TimeoutError):
        return 0, None
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0, None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


async def http_get(bind: str, port: int, path: str, key: str | None, timeout: float = 2.0) -> tuple[int, object]:
    """A tiny HTTP/1.0 GET; (status, JSON body or None). Status 0 when nothing answers."""
    auth = key_header(key)
    return await _exchange(bind, port, lambda host: f"GET {path} HTTP/1.0\r\nHost: {host}\r\n{auth}\r\n".encode(), timeout)


async def http_post(bind: str, port: int, path: str, body: object, key: str | None, timeout: float) -> tuple[int, object]:
    """A tiny HTTP/1.0 POST of a JSON body; (status, JSON body or None). Status 0 when nothing answers."""
    data = json.dumps(body).encode()
    head = "POST {} HTTP/1.0\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{}\r\n"
    auth = key_header(key)
    return await _exchange(bind, port, lambda host: head.format(path, host, len(data), auth).encode() + data, timeout)


async def readiness(spec: LaneSpec, key: str | None) -> tuple[endpoints.Readiness, str]:
    """("loading" | "healthy" | "mismatch", detail) from /health and /props."""
    status, _ = await http_get(spec.bind, spec.port, endpoints.HEALTH, key)
    if not endpoints.is_healthy(status):
        return "loading", endpoints.answered(endpoints.HEALTH, status)
    status, props = await http_get(spec.bind, spec.port, endpoints.PROPS, key)
    return endpoints.props_readiness(status, props, ctx_per_slot=spec.ctx_per_slot, parallel=spec.parallel)


async def alive(spec: LaneSpec, key: str | None, timeout: float) -> bool:
    """Does the serving lane still answer /health? (Cheap: no request reaches the model.)"""
    status, _ = await http_get(spec.bind, spec.port, endpoints.HEALTH, key, timeout=timeout)
    return endpoints.is_healthy(status)


async def busy_slots(spec: LaneSpec, key: str | None) -> int | None:
    """Slots processing a request (llama-server's /slots); None when nothing answers."""
    return endpoints.busy_slots(*await http_get(spec.bind, spec.port, endpoints.SLOTS, key))


async def loop_work(spec: LaneSpec, key: str | None, timeout: float) -> endpoints.LoopWork | None:
    """What the lane's inference loop is doing (/slots); None when it does not answer in time."""
    return endpoints.loop_work(*await http_get(spec.bind, spec.port, endpoints.SLOTS, key, timeout=timeout))


async def slots_read(spec: LaneSpec, key: str | None, timeout: float) -> endpoints.SlotsRead:
    """The lane's load and loop (/slots) in one read, for the gateways (launcher_agent/load_feed.py)."""
    return endpoints.slots_read(*await http_get(spec.bind, spec.port, endpoints.SLOTS, key, timeout=timeout))


async def slot_contents(spec: LaneSpec, key: str | None, timeout: float = 5.0):
    """Each slot's (id, tokens, last task, busy); None when the lane does not say."""
    return endpoints.slot_contents(*await http_get(spec.bind, spec.port, endpoints.SLOTS, key, timeout=timeout))


async def slot_file(spec: LaneSpec, key: str | None, slot: int, action: str, filename: str, timeout: float) -> tuple[int, object]:
    """Save a slot to, or restore it from, a file in the lane's --slot-save-path."""
    return await http_post(spec.bind, spec.port, endpoints.slot_action(slot, action), {"filename": filename}, key, timeout)
