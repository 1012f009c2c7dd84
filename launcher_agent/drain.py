"""Draining a serving lane before a plan change restarts or stops it.

The lane is marked draining in the host status first, so gateways send it nothing new;
its requests in flight finish (llama-server's /slots says when no slot is processing, and
that must hold for IDLE_SETTLE: a slot is released a moment before its answer's last bytes
are sent, and a request just received waits a moment for its slot), bounded by the plan's
drain_timeout; only then does the restart or stop go ahead.
Level-triggered like the rest of the agent: a lane the plan no longer wants changed is
un-drained, and a drain that ran out of time proceeds anyway.

`decide` is pure; `Drains` holds when each drain began, asks the lanes and applies it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import structlog

from launcher_agent.lane import Emit, Lane
from launcher_agent.reconcile import Action, Restart, Start, Stop

log = structlog.get_logger("lanes.agent")

# Between telling gateways and the first idle check: a request a gateway routed just
# before it saw the mark is still on its way to the lane.
DRAIN_GRACE = 0.5
# How long /slots must keep saying "idle" before the lane goes (the agent asks every 20 ms
# while it drains): one idle answer can fall between a slot's release and its last bytes.
IDLE_SETTLE = 0.25

Verdict = Literal["go", "begin", "wait", "done", "timed_out"]


def verdict(
    *,
    serving: bool,
    since: float | None,
    now: float,
    busy: int | None,
    timeout: float,
    idle_since: float | None = None,
    grace: float = DRAIN_GRACE,
    settle: float = IDLE_SETTLE,
) -> Verdict:
    """One lane a restart or stop targets: go (nothing serves), begin its drain, wait, or
    go at last (idle since `idle_since` for `settle`, after the grace period; or out of
    time). busy None: nothing answers, so nothing serves."""
    if since is None:
        return "begin" if serving else "go"
    waited = now - since
    if waited >= timeout:
        return "timed_out"
    if waited < grace or busy:
        return "wait"
    if busy is None:
        return "done"
    return "done" if idle_since is not None and now - idle_since >= settle else "wait"


def idle_after(idle_since: float | None, busy: int | None, now: float) -> float | None:
    """When the lane was first seen idle in its current idle stretch (None: busy now)."""
    if busy:
        return None
    return now if idle_since is None else idle_since


def _target(action: Action) -> str | None:
    if isinstance(action, Stop):
        return action.lane_id
    if isinstance(action, Restart):
        return action.spec.lane_id
    return None


@dataclass(frozen=True)
class Decision:
    ready: tuple[Action, ...]  # may run now
    begun: tuple[str, ...] = ()  # lanes to mark draining (gateways are told)
    finished: tuple[tuple[str, Verdict, float], ...] = ()  # (lane, done | timed_out, seconds waited)
    dropped: tuple[str, ...] = ()  # drains the plan no longer asks for: un-mark them
    since: Mapping[str, float] = field(default_factory=dict)  # drains under way after this pass
    idle: Mapping[str, float] = field(default_factory=dict)  # draining lanes idle since, after this pass


def to_ask(actions: Sequence[Action], since: Mapping[str, float]) -> list[str]:
    """Lanes whose requests in flight `decide` needs: the draining ones an action targets."""
    return [lane_id for a in actions if (lane_id := _target(a)) is not None and lane_id in since]


def decide(
    actions: Sequence[Action],
    states: Mapping[str, str],
    since: Mapping[str, float],
    busy: Mapping[str, int | None],
    *,
    now: float,
    timeout: float,
    idle: Mapping[str, float] | None = None,
    ports: Mapping[str, int] | None = None,
) -> Decision:
    """The actions that may run now; restarts and stops of serving lanes wait for their drain.

    `ports`: lane id -> port of the lanes that run. A start on the port of a lane whose stop
    still waits for its drain waits too (a lane evicted for another gets its port freed only
    once its requests are done; starting beside it would fail to bind).

    `states`: lane id -> state of the lanes that run; `busy`: requests in flight of the
    lanes `to_ask` named (None: nothing answered); `idle`: since when each draining lane
    has been seen idle (the previous pass's Decision.idle).
    """
    under_way = dict(since)
    idle_now = {lane_id: t for lane_id, t in (idle or {}).items() if lane_id in under_way}
    ready: list[Action] = []
    begun: list[str] = []
    finished: list[tuple[str, Verdict, float]] = []
    wanted: set[str] = set()
    for action in actions:
        lane_id = _target(action)
        if lane_id is None or lane_id not in states:
            ready.append(action)  # a start, or a lane that does not run: nothing to drain
            continue
        serving = states[lane_id] == "healthy"
        if lane_id in under_way and lane_id in busy:
            seen = idle_after(idle_now.pop(lane_id, None), busy[lane_id], now)
            if seen is not None:
                idle_now[lane_id] = seen
        v = verdict(
            serving=serving, since=under_way.get(lane_id), now=now, busy=busy.get(lane_id), timeout=timeout,
            idle_since=idle_now.get(lane_id),
        )  # fmt: skip
        if v == "go":
            ready.append(action)
            continue
        wanted.add(lane_id)
        if v == "begin":
            under_way[lane_id] = now
            begun.append(lane_id)
        elif v in ("done", "timed_out"):
            finished.append((lane_id, v, now - under_way.pop(lane_id)))
            idle_now.pop(lane_id, None)
            ready.append(action)
    stopping = {a.lane_id for a in actions if isinstance(a, Stop)}
    held_ports = {(ports or {}).get(lane_id) for lane_id in wanted & stopping if lane_id in under_way}
    held_ports.discard(None)
    ready = [a for a in ready if not (isinstance(a, Start) and a.spec.port in held_ports)]
    dropped = tuple(lane_id for lane_id in under_way if lane_id not in wanted)
    for lane_id in dropped:
        del under_way[lane_id]
        idle_now.pop(lane_id, None)
    return Decision(tuple(ready), tuple(begun), tuple(finished), dropped, under_way, idle_now)


@dataclass
class Drains:
    emit: Emit
    since: dict[str, float] = field(default_factory=dict)  # lane id -> when its drain began
    idle: dict[str, float] = field(default_factory=dict)  # lane id -> since when it was seen idle

    def active(self) -> bool:
        return bool(self.since)

    def quiet_for(self, now: float, grace: float = DRAIN_GRACE) -> float:
        """Seconds no drain needs a look: until the first grace ends, while every drain is in its
        grace (nothing is asked then); 0 once one is past it (its /slots is asked each pass).
        Polled every 20 ms through the grace, 1,000 agents of a simulated fleet spent the
        change's 0.5 s on passes that could only wait (bench/convergence_bench.py)."""
        return max(0.0, min((since + grace - now for since in self.since.values()), default=0.0))

    async def gate(
        self,
        actions: Sequence[Action],
        lanes: Mapping[str, Lane],
        *,
        now: float,
        timeout: float,
        busy: Callable[[Lane], Awaitable[int | None]],
    ) -> list[Action]:
        """`decide`, with the lanes asked for their requests in flight first and its marks applied."""
        ask = [lane_id for lane_id in to_ask(actions, self.since) if lane_id in lanes]
        counts = dict(zip(ask, await asyncio.gather(*(busy(lanes[lane_id]) for lane_id in ask))))
        states = {lane_id: lane.state for lane_id, lane in lanes.items()}
        ports = {lane_id: lane.spec.port for lane_id, lane in lanes.items()}
        decision = decide(actions, states, self.since, counts, now=now, timeout=timeout, idle=self.idle, ports=ports)
        self.since, self.idle = dict(decision.since), dict(decision.idle)
        for lane_id in decision.begun:
            lanes[lane_id].draining = True
            log.info("lane draining", lane=lane_id, timeout=timeout)
            await self.emit(lanes[lane_id], "draining", f"waiting up to {timeout:g} s for requests in flight")
        for lane_id, how, waited in decision.finished:
            log.info("lane drained", lane=lane_id, waited=round(waited, 3), in_flight=counts.get(lane_id), how=how)
        for lane_id in decision.dropped:
            if lane_id in lanes:
                lanes[lane_id].draining = False
        return list(decision.ready)
