"""Each lane's real load, as its agent read it from /slots (the input edge of routing by load).

A lane's slots also serve other gateways and clients that reach it directly; the
admission counts the larger of its own requests in flight and the busy slots read here
(gateway/admission/queue.py, LaneCounts.load), so a lane busy with someone else's work is not
taken for free. A lane that cannot say (--no-slots, an error status), or whose agent has not
said for three of its refresh intervals, keeps only the gateway's own count.

The agent reads each lane once and publishes a HostLoad for every gateway
(launcher_agent/load_feed.py): llama-server answers /slots from its inference loop, and reads
that grew with the gateways cost a busy lane 9% of its throughput at 20 gateways.

llama-server answers /slots within milliseconds even while its loop is deep in a long
prefill (bench/RESULTS.md, "A busy loop"), so a read that times out says the lane is
in trouble, not free: it counts against the lane (all its slots taken as busy). One that
stays unanswered for `stall_after` seconds takes the lane out of rotation as stalled (its
/health may still answer), until an answer shows its loop idle or moving.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import structlog

from gateway.admission import Admission
from gateway.fleet import LaneKey
from shared import subjects
from shared.messages.status import HostLoad, LaneLoad
from shared.messages.wire import decode
from shared.supervise import running

log = structlog.get_logger("lanes.gateway")

# Seconds a load message may spend between its agent and this gateway, beyond the read's own age:
# requests of ours that ended within the read's age and this margin may be counted busy in it.
TRANSIT = 0.05
STALE_AFTER = 3  # refresh intervals without a word from a host's agent: its lanes' load is not known


@dataclass(frozen=True)
class Verdict:
    reported: int | None  # busy slots to count for the lane; None: only the gateway's own requests
    unanswered_since: float | None
    stalled: str = ""  # why the lane is out of rotation as stalled; "" when it is not
    progressing: bool = False  # its loop is idle or moved since the last read: a stalled mark goes


def judge(load: LaneLoad, parallel: int, now: float, stall_after: float) -> Verdict:
    """What one read of a lane says of it (pure).

    An answer alone does not bring a stalled lane back: the binary answers /slots even while its
    loop is stuck (bench/RESULTS.md, "A busy loop"); an idle lane, or counters that moved, do.
    """
    if load.answered:
        if load.busy is None:
            return Verdict(None, None)
        return Verdict(load.busy, None, progressing=load.progressing)
    stalled = ""
    if load.unanswered_for >= stall_after:
        stalled = f"stalled: /slots unanswered for {stall_after:g} s or more (its inference loop)"
    return Verdict(parallel, now - load.unanswered_for, stalled)


def still_busy(read_busy: int, ended_meanwhile: int) -> int:
    """A lane's busy slots, from a /slots read during which `ended_meanwhile` of this gateway's
    requests to it ended (they may have been counted busy in it)."""
    return max(0, read_busy - ended_meanwhile)


@dataclass
class SlotsFeed:
    admission: Admission
    stall_after: float = 60.0
    heard: dict[str, tuple[float, float]] = field(default_factory=dict)  # host id -> (last message, its refresh)
    keys: dict[str, set[LaneKey]] = field(default_factory=dict)  # host id -> its lanes with a count in `reported`

    def take(self, data: bytes) -> None:
        """One agent's message off the bus; a bad one is logged and dropped."""
        try:
            load = decode(data, HostLoad)
        except ValueError as exc:
            log.warning("load message dropped", reason=str(exc)[:200])
            return
        self.apply(load, time.monotonic())

    def apply(self, load: HostLoad, now: float) -> None:
        view, counts = self.admission.view, self.admission.counts
        host = subjects.host_token(load.host_id)
        plan, status = view.plans.get(host), view.statuses.get(host)
        parallel = {spec.lane_id: spec.parallel for spec in plan.lanes} if plan else {}
        running_lanes = {lane.lane_id: lane for lane in status.lanes} if status else {}
        reported = counts.reported
        freed = False
        kept: set[LaneKey] = set()
        self.heard[load.host_id] = (now, load.refresh)
        for lane in load.lanes:
            key = (load.host_id, lane.lane_id)
            live = running_lanes.get(lane.lane_id)
            # Stalled lanes are read too (not routable, but their reads tell when they are back).
            if (live is None or live.state != "healthy" or live.draining or key in view.unreachable
                    or lane.lane_id not in parallel or (live.pid and lane.pid and live.pid != lane.pid)):  # fmt: skip
                continue
            verdict = judge(lane, parallel[lane.lane_id], now, self.stall_after)
            if verdict.reported is not None:
                # Requests of ours that ended while the read was on its way may be in it: their slots
                # are free now. Counted busy, a lane looked full for a whole interval after its answers
                # and a conversation's next turn went cold to another lane (test_slot_save_real, CI).
                busy = verdict.reported
                if lane.answered:
                    busy = still_busy(busy, counts.ended_since(key, now - lane.age - TRANSIT))
                freed |= busy < reported.get(key, 0)
                reported[key] = busy
                kept.add(key)
            if verdict.stalled:
                view.mark_stalled(key, verdict.stalled)
            elif verdict.progressing:
                view.mark_progressing(key)
        freed |= self._forget(load.host_id, kept)
        if freed:
            self.admission.poke()  # slots freed by other clients: hand them to waiters

    def _forget(self, host_id: str, kept: set[LaneKey]) -> bool:
        """Counts of a host's lanes its last message no longer gives; whether any was busy."""
        gone = self.keys.get(host_id, set()) - kept
        self.keys[host_id] = kept
        return any(self.admission.counts.reported.pop(key, 0) for key in gone)

    def expire(self, now: float) -> None:
        """Hosts whose agent has not said for STALE_AFTER refresh intervals: their load is not known."""
        silent = [host for host, (at, refresh) in self.heard.items() if now - at > STALE_AFTER * refresh]
        for host in silent:
            del self.heard[host]
            if self._forget(host, set()):
                self.admission.poke()

    async def forever(self, stop: asyncio.Event, every: float = 1.0) -> None:
        while running(stop):
            self.expire(time.monotonic())
            try:
                await asyncio.wait_for(stop.wait(), every)
            except asyncio.TimeoutError:
                pass
