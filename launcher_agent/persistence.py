"""The agent's state file: the applied plan and which pid serves which lane.

It survives an agent restart, so a new agent adopts the lanes the last one left
running instead of starting them twice. Written atomically, and only when it changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import msgspec

from launcher_agent.lane import Lane
from shared.messages.plans import HostPlan
from shared.messages.status import LaneFeedback


class Saved(msgspec.Struct):
    plan: HostPlan | None = None
    pids: dict[str, int] = {}
    started: dict[str, float] = {}  # each pid's start time: a reused pid is not adopted
    # Each running lane's argv tail as launched; a record without it (an older agent's) has the
    # launched argv in its plan's `args`. What a lane runs is its spec's lane key, not this.
    argv: dict[str, list[str]] = {}
    feedback: list[LaneFeedback] = []  # what the plan got wrong, until it expires
    # Each lane's KV size and buffer lines: an adopted lane's log is read from its tail only.
    facts: dict[str, list[str]] = {}


class StateFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._written = b""  # what the file holds

    def save(self, plan: HostPlan | None, lanes: Mapping[str, Lane], feedback: list[LaneFeedback] = ()) -> None:
        running = {k: v.process for k, v in lanes.items() if v.process and v.process.pid}
        started = {k: t for k, p in running.items() if (t := p.started_at()) is not None}
        facts = {k: f for k, p in running.items() if (f := p.facts())}
        argv = {k: list(p.args) for k, p in running.items()}
        saved = Saved(plan=plan, pids={k: p.pid for k, p in running.items()}, started=started, argv=argv,
                      feedback=list(feedback), facts=facts)  # fmt: skip
        data = msgspec.json.encode(saved)
        if data == self._written:
            return
        if not self._written:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(self.path)
        self._written = data

    def load(self) -> Saved | None:
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=Saved)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None
