"""Hot spots spread with their caches (docs/slot-cache.md, "Hot spots"): the I/O edge of one routing event.

When the router sends a request cold to another lane because the lane holding its prompt is
busier than a cold prefill is worth ("overflow", gateway/admission/queue.py), that lane is a hot
spot: the next turns of the conversations it holds would wait for it or go cold too. The
gateway asks its agent (SlotsAsk on lanes.slots.<host>.ask) to move some of its idle
conversations, with their saved slots, to the cooler lane; the agent sends them as it sends a
stopping lane's (launcher_agent/slot_moves.py) and the receiver's `slots_received` names each
moved slot's tokens, by which every gateway finds those conversations and routes them there.
One ask per hot lane every ASK_EVERY seconds, and the agent spreads a lane at most as often.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import structlog

from gateway.fleet import FleetView, LaneKey
from shared import subjects
from shared.messages.slots import SlotsAsk
from shared.messages.wire import encode

log = structlog.get_logger("lanes.gateway")
ASK_EVERY = 10.0  # seconds between two asks for one hot lane


@dataclass
class HotSpots:
    nc: object  # the gateway's NATS client
    view: FleetView
    asked: dict[LaneKey, float] = field(default_factory=dict)  # hot lane -> when this gateway last asked
    _sending: set[asyncio.Task] = field(default_factory=set)

    def overflowed(self, source: LaneKey, target: LaneKey) -> None:
        """`source` holds a prompt just sent cold to `target`: ask it to spread, once in a while."""
        now = time.monotonic()
        if now - self.asked.get(source, -ASK_EVERY) < ASK_EVERY:
            return
        lane = next((x for x in self.view.lanes() if x.key == source), None)
        if lane is None:
            return
        self.asked = {k: t for k, t in self.asked.items() if now - t < ASK_EVERY}  # bounded by the hot lanes
        self.asked[source] = now
        ask = SlotsAsk(host=source[0], lane=source[1], to_host=target[0], to_lane=target[1],
                       slots=max(1, min(64, lane.parallel // 2)))  # fmt: skip
        task = asyncio.get_running_loop().create_task(self._send(ask))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, ask: SlotsAsk) -> None:
        try:
            await self.nc.publish(subjects.slot_ask_subject(ask.host), encode(ask))
            log.info("hot lane asked to spread", lane=f"{ask.host}/{ask.lane}", to=f"{ask.to_host}/{ask.to_lane}",
                     slots=ask.slots)  # fmt: skip
        except Exception as exc:  # NATS away: the next overflow asks again
            log.info("hot lane not asked", lane=f"{ask.host}/{ask.lane}", error=str(exc) or type(exc).__name__)
