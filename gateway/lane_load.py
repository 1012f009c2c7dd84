"""Each lane's real load, read from its /slots at a short interval (the I/O edge of routing by load).

A lane's slots also serve other gateways and clients that reach it directly; the
admission counts the larger of its own requests in flight and the busy slots read here
(gateway/admission.py, LaneCounts.load), so a lane busy with someone else's work is not
taken for free. A lane that cannot say (no answer, --no-slots) keeps only the gateway's
own count.
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec

from gateway.admission import Admission
from gateway.fleet import LaneRoute
from shared.llama.endpoints import SLOTS, busy_slots


async def read_busy(session: aiohttp.ClientSession, lane: LaneRoute, timeout: float) -> int | None:
    try:
        async with session.get(lane.url + SLOTS, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                return None
            return busy_slots(200, msgspec.json.decode(await resp.read()))
    except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError):
        return None


async def poll_once(session: aiohttp.ClientSession, admission: Admission, timeout: float) -> None:
    lanes = [lane for lane in admission.view.lanes() if lane.routable]
    found = await asyncio.gather(*(read_busy(session, lane, timeout) for lane in lanes))
    reported = admission.counts.reported
    before = dict(reported)
    reported.clear()
    reported.update({lane.key: busy for lane, busy in zip(lanes, found) if busy is not None})
    if any(reported.get(key, 0) < n for key, n in before.items()):
        admission.poke()  # slots freed by other clients: hand them to waiters


async def poll_forever(admission: Admission, interval: float, timeout: float, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            await poll_once(session, admission, timeout)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass
