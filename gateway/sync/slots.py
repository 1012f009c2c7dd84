"""Each lane's real load, read from its /slots at a short interval (the I/O edge of routing by load).

A lane's slots also serve other gateways and clients that reach it directly; the
admission counts the larger of its own requests in flight and the busy slots read here
(gateway/admission/queue.py, LaneCounts.load), so a lane busy with someone else's work is not
taken for free. A lane that cannot say (--no-slots, an error status) keeps only the
gateway's own count.

llama-server answers /slots within milliseconds even while its loop is deep in a long
prefill (bench/RESULTS.md, "A busy loop"), so a /slots read that times out says the lane is
in trouble, not free: it counts against the lane (all its slots taken as busy). One that
stays unanswered for `stall_after` seconds takes the lane out of rotation as stalled (its
/health may still answer), until its /slots answers again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import msgspec

from gateway.admission import Admission
from gateway.fleet import LaneKey, LaneRoute
from shared.llama.endpoints import SLOTS, LoopWork, busy_slots, loop_work
from shared.supervise import running

# ("busy", busy slots, their counters), ("timeout", 0, ()), ("unknown", 0, ())
SlotsRead = tuple[Literal["busy", "timeout", "unknown"], int, LoopWork]


@dataclass(frozen=True)
class Verdict:
    reported: int | None  # busy slots to count for the lane; None: only the gateway's own requests
    unanswered_since: float | None
    stalled: str = ""  # why the lane is out of rotation as stalled; "" when it is not
    progressing: bool = False  # its loop is idle or moved since the last read: a stalled mark goes


def judge(
    read: SlotsRead, parallel: int, unanswered_since: float | None, now: float, stall_after: float,
    before: LoopWork | None = None,
) -> Verdict:
    """What one /slots read says of a lane (pure). `before`: its busy slots' counters at the last read.

    An answer alone does not bring a stalled lane back: the binary answers /slots even while its
    loop is stuck (bench/RESULTS.md, "A busy loop"); an idle lane, or counters that moved, do.
    """
    kind, busy, work = read
    if kind == "busy":
        return Verdict(busy, None, progressing=not work or work != before)
    if kind == "unknown":
        return Verdict(None, None)
    since = now if unanswered_since is None else unanswered_since
    stalled = ""
    if now - since >= stall_after:
        stalled = f"stalled: /slots unanswered for {stall_after:g} s or more (its inference loop)"
    return Verdict(parallel, since, stalled)


def still_busy(read_busy: int, ended_meanwhile: int) -> int:
    """A lane's busy slots, from a /slots read during which `ended_meanwhile` of this gateway's
    requests to it ended (they may have been counted busy in it)."""
    return max(0, read_busy - ended_meanwhile)


async def read_slots(session: aiohttp.ClientSession, lane: LaneRoute, timeout: float) -> SlotsRead:
    try:
        async with session.get(lane.url + SLOTS, headers=lane.auth,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as resp:  # fmt: skip
            if resp.status != 200:
                return ("unknown", 0, ())
            slots = msgspec.json.decode(await resp.read())
            busy, work = busy_slots(200, slots), loop_work(200, slots)
            return ("unknown", 0, ()) if busy is None else ("busy", busy, work or ())
    except asyncio.TimeoutError:
        return ("timeout", 0, ())
    except (aiohttp.ClientError, msgspec.DecodeError):
        return ("unknown", 0, ())  # not reached at all: the /health probe takes it out of rotation


@dataclass
class SlotsPoll:
    admission: Admission
    timeout: float = 1.0
    stall_after: float = 60.0
    unanswered: dict[LaneKey, float] = field(default_factory=dict)  # lane -> loop time its /slots went silent
    work: dict[LaneKey, LoopWork] = field(default_factory=dict)  # lane -> its busy slots' counters, last read

    async def once(self, session: aiohttp.ClientSession) -> None:
        view = self.admission.view
        # Stalled lanes are read too (not routable, but their /slots tells when they are back).
        lanes = [lane for lane in view.lanes()
                 if lane.state == "healthy" and not lane.draining and lane.key not in view.unreachable]  # fmt: skip
        counts = self.admission.counts
        served = dict(counts.served)
        found = await asyncio.gather(*(read_slots(session, lane, self.timeout) for lane in lanes))
        now = asyncio.get_running_loop().time()
        reported = counts.reported
        before = dict(reported)
        reported.clear()
        for lane, read in zip(lanes, found):
            verdict = judge(read, lane.parallel, self.unanswered.get(lane.key), now, self.stall_after,
                            self.work.get(lane.key))  # fmt: skip
            if read[0] == "busy":
                self.work[lane.key] = read[2]
            if verdict.reported is not None:
                # Requests of ours that ended while the read was on its way may be in it: their slots
                # are free now. Counted busy, a lane looked full for a whole interval after its answers
                # and a conversation's next turn went cold to another lane (test_slot_save_real, CI).
                ended = counts.served.get(lane.key, 0) - served.get(lane.key, 0)
                reported[lane.key] = still_busy(verdict.reported, ended) if read[0] == "busy" else verdict.reported
            if verdict.unanswered_since is None:
                self.unanswered.pop(lane.key, None)
            else:
                self.unanswered[lane.key] = verdict.unanswered_since
            if verdict.stalled:
                view.mark_stalled(lane.key, verdict.stalled)
            elif verdict.progressing:
                view.mark_progressing(lane.key)
        if any(reported.get(key, 0) < n for key, n in before.items()):
            self.admission.poke()  # slots freed by other clients: hand them to waiters

    async def forever(self, interval: float, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            while running(stop):
                await self.once(session)
                try:
                    await asyncio.wait_for(stop.wait(), interval)
                except asyncio.TimeoutError:
                    pass
