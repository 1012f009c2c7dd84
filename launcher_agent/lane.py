"""One lane as the agent tracks it: the spec it runs, its process and its state."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from launcher_agent.process import LaneProcess
from shared.messages.plans import LaneSpec


@dataclass
class Lane:
    spec: LaneSpec
    process: LaneProcess | None = None
    state: str = "starting"
    failures: int = 0
    restarts: int = 0
    retry_at: float = 0.0
    healthy_since: float | None = None
    last_error: str = ""
    failure: str | None = None
    plan_revision: int = 0
    last_good: LaneSpec | None = None  # the spec it last ran healthy with
    next_probe: float = 0.0  # when a serving lane is next asked /health
    missed_probes: int = 0
    loop_mark: tuple = ()  # what its inference loop was last seen doing (health.py, stall detection)
    stuck_since: float | None = None  # since when it has shown no progress
    draining: bool = False  # gateways are told to send it nothing new (launcher_agent/drain.py)
    started_mono: float | None = None  # when its process was started (monotonic), for its load time
    load_seconds: float | None = None  # from its start to its first healthy answer
    restore_pending: bool = False  # started by this agent: its saved slots are restored before it serves
    restored_tokens: dict[int, int] = field(default_factory=dict)  # slot id -> tokens restored into it
    api_key: str | None = field(default=None, repr=False)  # what it answers to (launcher_agent/lane_secret.py)


Emit = Callable[[Lane, str, str], Awaitable[None]]


async def no_event(lane: Lane, event: str, detail: str = "") -> None:
    pass
