"""What each lane's process did since the last look: came up, serves the wrong shape, died.

A death is classified from llama-server's own log lines: a refusal or an
out-of-memory at start fails the lane (restarting the same argv cannot help), other
crashes back off and retry until they loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from launcher_agent.feedback import Feedback
from launcher_agent.lane import Emit, Lane
from launcher_agent.reconcile import MAX_FAILURES, backoff, classify_failure

HEALTHY_RESETS_FAILURES_AFTER = 30.0


@dataclass
class Exit:
    """A lane whose process ended; `halts` says why the rollout must stop, when a change broke it."""

    lane: Lane
    halts: str | None = None


@dataclass
class Health:
    emit: Emit
    feedback: Feedback
    backoff_base: float = 1.0
    probe_interval: float = 5.0
    probe_failures: int = 3
    probe_timeout: float = 2.0

    async def observe(self, lanes: Iterable[Lane], now: float) -> list[Exit]:
        """Fold what each process did since the last tick into its lane state."""
        exits: list[Exit] = []
        due: list[Lane] = []
        for lane in lanes:
            proc = lane.process
            if proc is None:
                continue
            proc.read_log()
            if proc.returncode is not None and lane.state not in ("crashed", "failed", "stopped"):
                exits.append(await self._on_exit(lane, now))
                continue
            if lane.state in ("starting", "loading"):
                state, detail = await proc.probe_health()
                if state == "healthy":
                    proc.read_log()  # it printed its buffers before it listened: report them with "healthy"
                    lane.state, lane.healthy_since, lane.last_error = "healthy", now, ""
                    lane.last_good = lane.spec
                    await self.emit(lane, "healthy")
                    self.feedback.check_against_plan(lane)
                elif state == "mismatch":
                    lane.state, lane.last_error = "mismatch", detail
                    await self.emit(lane, "mismatch", detail)
                else:
                    lane.state = "loading"
            elif lane.state == "healthy":
                if lane.failures and lane.healthy_since and now - lane.healthy_since > HEALTHY_RESETS_FAILURES_AFTER:
                    lane.failures = 0
                self.feedback.check_against_plan(lane)
                if now >= lane.next_probe:
                    due.append(lane)
            elif lane.state == "unresponsive":
                await proc.kill()  # its exit is seen on the next look, and handled like a crash
        # Serving lanes are probed side by side: one wedged lane must not slow the others' checks.
        await asyncio.gather(*(self._probe(lane, now) for lane in due))
        return exits

    async def _probe(self, lane: Lane, now: float) -> None:
        assert lane.process is not None
        lane.next_probe = now + self.probe_interval
        if await lane.process.alive(self.probe_timeout):
            lane.missed_probes = 0
            return
        lane.missed_probes += 1
        if lane.missed_probes >= self.probe_failures and lane.process.returncode is None:
            lane.state = "unresponsive"
            lane.last_error = f"unresponsive: no answer to {lane.missed_probes} /health probes in a row"
            await self.emit(lane, "unresponsive", lane.last_error)

    async def _on_exit(self, lane: Lane, now: float) -> Exit:
        proc = lane.process
        assert proc is not None
        lines = list(proc.tail)
        kind, line = classify_failure(lines)
        if lane.state == "unresponsive":  # killed by the agent: the restart is reported like a crash
            kind, line = "unresponsive", lane.last_error
        died_at_start = lane.state in ("starting", "loading")
        broken_by_change = lane.last_good is not None and lane.last_good.args != lane.spec.args
        lane.failures += 1
        lane.last_error = f"exit {proc.returncode}: {line}"
        halts = f"{lane.spec.lane_id} failed with the change: {line}" if broken_by_change else None
        if died_at_start and kind == "port_busy":  # taken between the agent's look and the bind
            lane.state, lane.failure = "failed", kind
            self.feedback.port_busy(lane, line)
            await self.emit(lane, "failed", lane.last_error)
        elif died_at_start and (kind in ("unsupported", "oom") or broken_by_change):
            # llama-server refused this spec (or a change broke a lane that ran): restarting
            # the same argv cannot help; the planner corrects or reverts it.
            lane.state, lane.failure = "failed", kind
            self.feedback.failure(lane, kind, line)
            await self.emit(lane, "failed", lane.last_error)
        elif lane.failures >= MAX_FAILURES:
            lane.state, lane.failure = "failed", "crash_loop"
            self.feedback.failure(lane, "crash_loop", line)
            await self.emit(lane, "failed", f"crash loop: {lane.failures} failures; {lane.last_error}")
        else:
            lane.state, lane.failure = "crashed", kind
            lane.retry_at = now + backoff(lane.failures, self.backoff_base)
            await self.emit(lane, "crashed", lane.last_error)
        return Exit(lane, halts)
