"""Draining a serving lane before a plan change restarts or stops it.

The lane is marked draining in the host status first, so gateways send it nothing new;
its requests in flight finish (llama-server's /slots says when no slot is processing),
bounded by the plan's drain_timeout; only then does the restart or stop go ahead.
Level-triggered like the rest of the agent: a lane the plan no longer wants changed is
un-drained, and a drain that ran out of time proceeds anyway.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from launcher_agent.lane import Emit, Lane
from launcher_agent.reconcile import Action, Restart, Stop

log = structlog.get_logger("lanes.agent")

# Between telling gateways and the first idle check: a request a gateway routed just
# before it saw the mark is still on its way to the lane.
DRAIN_GRACE = 0.5


def drain_done(*, since: float, now: float, busy: int | None, timeout: float, grace: float = DRAIN_GRACE) -> bool:
    """May the lane go? Idle after the grace period, or out of time. busy None: nothing answers, so nothing serves."""
    waited = now - since
    if waited >= timeout:
        return True
    return waited >= min(grace, timeout) and not busy


def _target(action: Action) -> str | None:
    if isinstance(action, Stop):
        return action.lane_id
    if isinstance(action, Restart):
        return action.spec.lane_id
    return None


@dataclass
class Drains:
    emit: Emit
    since: dict[str, float] = field(default_factory=dict)  # lane id -> when its drain began

    def active(self) -> bool:
        return bool(self.since)

    async def gate(
        self,
        actions: Sequence[Action],
        lanes: Mapping[str, Lane],
        *,
        now: float,
        timeout: float,
        busy: Callable[[Lane], Awaitable[int | None]],
    ) -> list[Action]:
        """The actions that may run now; restarts and stops of serving lanes wait for their drain."""
        ready: list[Action] = []
        wanted: set[str] = set()
        for action in actions:
            lane_id = _target(action)
            lane = lanes.get(lane_id) if lane_id else None
            if lane is None or (lane.state != "healthy" and lane_id not in self.since):
                ready.append(action)  # not serving: nothing to drain
                continue
            wanted.add(lane_id)
            if lane_id not in self.since:
                self.since[lane_id] = now
                lane.draining = True
                log.info("lane draining", lane=lane_id, timeout=timeout)
                await self.emit(lane, "draining", f"waiting up to {timeout:g} s for requests in flight")
                continue
            in_flight = await busy(lane)
            if drain_done(since=self.since[lane_id], now=now, busy=in_flight, timeout=timeout):
                waited = now - self.since.pop(lane_id)
                log.info("lane drained", lane=lane_id, waited=round(waited, 3), in_flight=in_flight)
                ready.append(action)
        for lane_id in [lane_id for lane_id in self.since if lane_id not in wanted]:
            del self.since[lane_id]  # the plan no longer asks to change it (or it is gone)
            if lane_id in lanes:
                lanes[lane_id].draining = False
        return ready
