"""Each serving lane's load, read once by its agent and published for every gateway.

llama-server answers /slots from its inference loop, so every read costs a busy lane a little:
with each gateway reading each lane twice a second, 20 gateways left a busy lane 0.912 of its
throughput (bench/RESULTS.md, "What gateways' reads cost a lane"). The agent reads each lane
once per interval instead and publishes a HostLoad on lanes.load.<host>: the reads no longer
grow with the gateways.

Only what a router uses is compared (busy slots, whether the loop answers and moves), and a
message goes when that changed, when a lane's loop is unanswered (its silence grows), when a
gateway asked (it just started), or whole every `refresh` seconds: an idle or steady fleet
sends little, and a lost message is mended by the next.

Pure: `LoadFeed.fold` takes one round of reads and the time and returns the message to send or
None; launcher_agent/service.py reads and publishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared import defaults
from shared.llama.endpoints import LoopWork, SlotsRead
from shared.messages.status import HostLoad, LaneLoad


@dataclass(frozen=True)
class Read:
    """One lane's /slots read: which process, when it was sent (monotonic seconds) and what it said."""

    lane_id: str
    pid: int | None
    sent: float
    said: SlotsRead


@dataclass
class LoadFeed:
    host_id: str
    refresh: float = defaults.LOAD_REFRESH
    work: dict[str, LoopWork] = field(default_factory=dict)  # lane -> its busy slots' counters at the last answer
    unanswered_since: dict[str, float] = field(default_factory=dict)  # lane -> since when /slots is silent
    sent: dict[str, tuple] = field(default_factory=dict)  # lane -> what a router uses, as last sent
    sent_at: float | None = None  # None: send everything at the next round (start, a gateway asked)

    def ask(self) -> None:
        """A gateway asked: the next round is sent whole."""
        self.sent_at = None

    def fold(self, reads: list[Read], now: float) -> HostLoad | None:
        lanes = tuple(self._lane(read, now) for read in reads)
        for gone in set(self.work) - {read.lane_id for read in reads}:
            del self.work[gone]
        for gone in set(self.unanswered_since) - {lane.lane_id for lane in lanes if not lane.answered}:
            del self.unanswered_since[gone]
        used = {lane.lane_id: (lane.pid, lane.busy, lane.answered, lane.progressing) for lane in lanes}
        due = self.sent_at is None or now - self.sent_at >= self.refresh
        if not due and used == self.sent and all(lane.answered for lane in lanes):
            return None
        self.sent, self.sent_at = used, now
        return HostLoad(host_id=self.host_id, refresh=self.refresh, lanes=lanes)

    def _lane(self, read: Read, now: float) -> LaneLoad:
        kind, busy, work = read.said
        age = round(max(0.0, now - read.sent), 4)
        if kind == "timeout":
            since = self.unanswered_since.setdefault(read.lane_id, read.sent)
            return LaneLoad(lane_id=read.lane_id, pid=read.pid, answered=False,
                            unanswered_for=round(max(0.0, now - since), 3), age=age)  # fmt: skip
        before = self.work.get(read.lane_id)
        self.work[read.lane_id] = work
        progressing = not work or work != before
        return LaneLoad(lane_id=read.lane_id, pid=read.pid, busy=busy if kind == "busy" else None,
                        progressing=progressing, age=age)  # fmt: skip
