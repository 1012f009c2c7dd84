"""What the agent learned that the plan got wrong: over-plan use, refusals, crash loops.

Sent to the planner in the host status; one entry per (model, kind, cache types), or
per port for a port another program holds. Kept in the agent's state file, so a
restarted agent still says it, and dropped after a time-to-live: a host that was
short of memory once, or a port that was busy, gets another try later.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec
import structlog

from launcher_agent.lane import Lane
from shared.lane_key import lane_key
from shared.messages.status import LaneFeedback

log = structlog.get_logger("lanes.agent")
OVER_PLAN_TOLERANCE = 0.02
RSS_TOLERANCE = 0.15


def _key(fb: LaneFeedback) -> tuple:
    if fb.kind == "port_busy":
        return ("port_busy", fb.port)
    return (fb.model, fb.kind, fb.cache_type_k, fb.cache_type_v)


@dataclass
class Feedback:
    entries: dict[tuple, LaneFeedback] = field(default_factory=dict)
    clock: Callable[[], float] = time.time  # wall time: entries outlive the agent's process

    def _note(self, fb: LaneFeedback) -> None:
        self.entries[_key(fb)] = msgspec.structs.replace(fb, noted_at=self.clock())

    def restore(self, saved: Iterable[LaneFeedback]) -> None:
        for fb in saved:
            self.entries[_key(fb)] = fb

    def expire(self, ttl: float) -> bool:
        """Drop entries older than ttl seconds. True when any went."""
        now = self.clock()
        old = [k for k, fb in self.entries.items() if now - fb.noted_at > ttl]
        for k in old:
            log.info("feedback expired", kind=self.entries[k].kind, model=self.entries[k].model)
            del self.entries[k]
        return bool(old)

    def port_busy(self, lane: Lane, detail: str) -> None:
        s = lane.spec
        self._note(LaneFeedback(lane_id=s.lane_id, model=s.model, kind="port_busy", port=s.port, detail=detail[:300]))

    def check_against_plan(self, lane: Lane) -> None:
        """Use above the plan (KV as llama-server reports it, or RSS) is fed back to the planner."""
        if lane.process is None:
            return
        memory = lane.spec.memory
        checks = (
            (lane.process.kv_bytes(), memory.kv_bytes, OVER_PLAN_TOLERANCE, "KV reported by llama-server"),
            (lane.process.rss(), memory.total_bytes, RSS_TOLERANCE, "resident memory of the process"),
        )
        for actual, planned, tolerance, what in checks:
            key = (lane.spec.model, "over_plan", lane.spec.cache_type_k, lane.spec.cache_type_v)
            if actual is None or not planned or actual <= planned * (1 + tolerance) or key in self.entries:
                continue
            log.warning(
                "lane uses more than planned", lane=lane.spec.lane_id, what=what, actual=actual, planned=planned
            )
            # Scale the whole lane by the KV overshoot ratio; RSS compares against the total.
            self._note(
                LaneFeedback(
                    lane_id=lane.spec.lane_id,
                    model=lane.spec.model,
                    kind="over_plan",
                    cache_type_k=lane.spec.cache_type_k,
                    cache_type_v=lane.spec.cache_type_v,
                    ctx_total=lane.spec.ctx_total,
                    planned_bytes=planned,
                    actual_bytes=actual,
                    detail=what,
                )
            )

    def failure(self, lane: Lane, kind: str, detail: str) -> None:
        s = lane.spec
        changed = lane.last_good is not None and lane_key(lane.last_good) != lane_key(s)
        self._note(
            LaneFeedback(
                last_good=lane.last_good if changed else None,
                lane_id=s.lane_id,
                model=s.model,
                kind=kind,
                cache_type_k=s.cache_type_k,
                cache_type_v=s.cache_type_v,
                ctx_total=s.ctx_total,
                planned_bytes=s.memory.total_bytes,
                detail=detail[:300],
            )
        )

    def sorted(self) -> tuple[LaneFeedback, ...]:
        return tuple(self.entries[k] for k in sorted(self.entries, key=str))
