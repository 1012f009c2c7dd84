"""Starting, stopping and adopting lane processes, as reconcile.decide's actions say."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import structlog

from launcher_agent.config import AgentConfig
from launcher_agent.feedback import Feedback
from launcher_agent.lane import Emit, Lane
from launcher_agent import lane_secret
from launcher_agent.lane_http import port_taken
from launcher_agent.persistence import Saved
from launcher_agent.process import DryRunLane, LaneProcess, LogLimits
from launcher_agent.reconcile import Action, Restart, Start, Stop
from launcher_agent.slot_store import SlotStore, model_layout
from shared.lane_key import lane_key
from shared.llama.flags import lane_args
from shared.messages.plans import LaneSpec

log = structlog.get_logger("lanes.agent")


@dataclass
class Lifecycle:
    cfg: AgentConfig
    emit: Emit
    feedback: Feedback = field(default_factory=Feedback)
    # Called after each start and stop: the state file records a pid before the next
    # action can leave it orphaned (an agent killed mid-rollout).
    on_change: Callable[[], None] = lambda: None
    lanes: dict[str, Lane] = field(default_factory=dict)
    log_limits: LogLimits = LogLimits()  # the plan's; a lane started after a change follows it
    slots: SlotStore | None = None  # saved slots (--slot-save-path); None: a dry run, or a binary without it
    # Sends a going lane's saved slots to its buddy (launcher_agent/slot_moves.py); None: no NATS yet.
    send_slots: Callable[[Lane, list, bool], Awaitable[object]] | None = None

    async def apply(self, actions: Sequence[Action], plan_revision: int) -> None:
        for action in actions:
            if isinstance(action, Stop):
                await self._keep_slots(self.lanes.get(action.lane_id), None)
                await self.stop(action.lane_id, action.reason)
            elif isinstance(action, Restart):
                old = self.lanes.get(action.spec.lane_id)
                await self._keep_slots(old, action.spec)
                await self.stop(action.spec.lane_id, action.reason, keep_counts=True)
                await self.start(action.spec, plan_revision, previous=old)
            elif isinstance(action, Start):
                await self.start(action.spec, plan_revision)

    async def _keep_slots(self, lane: Lane | None, new: LaneSpec | None) -> None:
        """A serving lane about to go (it has drained): save its hot slots, unless its next spec
        has another KV layout, where they could never be restored (then they are discarded)."""
        if lane is None or self.slots is None:
            return
        if new is not None and model_layout(lane.spec) != model_layout(new):
            await self.slots.discard_for_change(lane, new)
            return
        try:
            saved = await self.slots.save(lane)
        except OSError as exc:  # a full or unwritable disk: the lane goes anyway
            log.warning("slots not saved", lane=lane.spec.lane_id, error=str(exc))
            return
        if saved and self.send_slots is not None:
            try:  # its conversations go to its buddy meanwhile: their caches go first
                await self.send_slots(lane, saved, new is None)  # leaving: no next spec
            except Exception as exc:  # NATS away, the stream full or missing: the lane goes anyway
                log.warning("slots not sent", lane=lane.spec.lane_id, error=str(exc) or type(exc).__name__)

    async def start(self, spec: LaneSpec, plan_revision: int, previous: Lane | None = None) -> None:
        slot_dir = str(self.slots.folder) if self.slots is not None else None
        key = None if self.cfg.dry_run else lane_secret.new_key()  # a new one at every start
        key_file = self._key_path(spec.lane_id)
        # the one rendering of a lane's argv, by the agent that runs it
        args = lane_args(spec, self.cfg.caps, slot_dir, key_file=str(key_file) if key else None)
        kind = DryRunLane if self.cfg.dry_run else LaneProcess
        process = kind(spec, self.cfg.binary, self._log_path(spec.lane_id), args, env_names=self.cfg.lane_env,
                       log_limits=self.log_limits, run_as=self.cfg.lane_user)  # fmt: skip
        lane = Lane(spec=spec, process=process, plan_revision=plan_revision, restore_pending=self.slots is not None)
        if previous is not None:
            lane.last_good = previous.last_good
            if lane_key(previous.spec) == lane_key(spec):
                lane.failures, lane.restarts = previous.failures, previous.restarts + 1
            elif previous.last_good is not None and lane_key(previous.last_good) == lane_key(spec):
                await self.emit(lane, "rolled_back", "back to the spec it last ran healthy with")
        if not self.cfg.dry_run and await asyncio.to_thread(port_taken, spec.bind, spec.port):
            # Another program holds the port: fed back, and the planner moves the lane.
            lane.state, lane.failure = "failed", "port_busy"
            lane.last_error = f"port {spec.port} is taken by another program on this host"
            self.feedback.port_busy(lane, lane.last_error)
            self.lanes[spec.lane_id] = lane
            await self.emit(lane, "failed", lane.last_error)
            return
        try:
            if key:
                user = self.cfg.lane_user  # the lane reads its key: the file is that user's, 0600
                await asyncio.to_thread(lane_secret.write_key, key_file, key, (user.uid, user.gid) if user else None)
            await process.start()
            lane.started_mono = time.monotonic()
            lane.api_key = key
        except OSError as exc:
            lane.state, lane.last_error, lane.failure = "failed", f"cannot start {self.cfg.binary}: {exc}", "other"
            self.lanes[spec.lane_id] = lane
            await self.emit(lane, "failed", lane.last_error)
            return
        self.lanes[spec.lane_id] = lane
        self.on_change()
        log.info("lane started", lane=spec.lane_id, pid=process.pid, argv=process.argv)
        await self.emit(lane, "started", " ".join(process.argv))

    async def stop(self, lane_id: str, reason: str, keep_counts: bool = False) -> None:
        lane = self.lanes.pop(lane_id, None)
        if lane is None or lane.process is None:
            return
        await lane.process.stop()
        lane.process.close_log()
        lane_secret.remove_key(self._key_path(lane_id))  # a stopped lane's key opens nothing again
        self.on_change()
        log.info("lane stopped", lane=lane_id, reason=reason)
        if not keep_counts:
            lane.state = "stopped"
            await self.emit(lane, "stopped", reason)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(lane_id, "agent shutting down") for lane_id in list(self.lanes)))

    def adopt(self, saved: Saved) -> None:
        """Take over the lanes a previous agent left running, if they still are those processes.

        Each keeps its saved spec, so reconcile compares lane keys and restarts none whose
        spec the plan still asks for, however this agent version would spell its argv."""
        specs = {s.lane_id: s for s in (saved.plan.lanes if saved.plan else ())}
        for lane_id, pid in saved.pids.items():
            spec = specs.get(lane_id)
            if spec is None or self.cfg.dry_run:
                continue
            args = saved.argv.get(lane_id) or spec.args  # an older agent's record: its plan holds them
            proc = LaneProcess.adopt(spec, args, self.cfg.binary, self._log_path(lane_id), pid, saved.started.get(lane_id),
                                     facts=saved.facts.get(lane_id, ()), env_names=self.cfg.lane_env,
                                     log_limits=self.log_limits)  # fmt: skip
            if proc is not None:
                key = lane_secret.read_key(self._key_path(lane_id))  # None: started before lanes had keys
                self.lanes[lane_id] = Lane(spec=spec, process=proc, state="loading", api_key=key)
                log.info("adopted running lane", lane=lane_id, pid=pid)

    def _key_path(self, lane_id: str):
        return lane_secret.key_path(self.cfg.data_dir / "lanes", lane_id)

    def _log_path(self, lane_id: str):
        return self.cfg.data_dir / "lanes" / f"{lane_id}.log"
