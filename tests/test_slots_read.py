"""A /slots read answered while this gateway's own requests to the lane end: the slots they held
are free, not busy until the next read (gateway/sync/slots.py). A lane that looked full for a whole
read interval after its answers sent a conversation's next turn cold to another lane: seen as
0.48 cached in CI where test_slot_save_real measures 0.94."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from stub_http import serve
from test_gateway_core import healthy, put_plan, put_status, spec

from gateway.admission.queue import Admission
from gateway.fleet.view import FleetView
from gateway.sync.slots import SlotsPoll, still_busy


def test_slots_that_ended_during_the_read_are_not_counted_busy():
    assert still_busy(2, 2) == 0 and still_busy(2, 1) == 1 and still_busy(1, 3) == 0 and still_busy(3, 0) == 3


async def test_a_read_that_saw_our_requests_busy_does_not_keep_the_lane_full():
    asked, answer = asyncio.Event(), asyncio.Event()

    async def slots(request: web.Request) -> web.Response:  # what llama-server said while both slots worked
        asked.set()
        await answer.wait()
        busy = {"id_task": 7, "is_processing": True, "next_token": [{"n_decoded": 3}]}
        return web.json_response([{"id": 0, **busy}, {"id": 1, **busy}])

    app = web.Application()
    app.router.add_get("/slots", slots)
    runner, port = await serve(app)
    view = FleetView()
    put_plan(view, "h1", spec("gemma-0", port=port, parallel=2))
    put_status(view, "h1", healthy("gemma-0", port))
    admission = Admission(view, max_wait=5)
    key = ("h1", "gemma-0")
    try:
        leases = [await admission.acquire("gemma") for _ in range(2)]
        async with aiohttp.ClientSession() as session:
            reading = asyncio.create_task(SlotsPoll(admission, timeout=5).once(session))
            await asyncio.wait_for(asked.wait(), 5)
            for lease in leases:  # both answers end while the read is on its way
                lease.release()
            answer.set()
            await asyncio.wait_for(reading, 5)
        assert admission.counts.load(key) == 0
        lease = await asyncio.wait_for(admission.acquire("gemma"), 1)  # a slot at once, no wait for the next read
        lease.release()
    finally:
        await runner.cleanup()
