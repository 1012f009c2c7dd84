"""Supervision of one host's lanes: apply plans, watch processes, act on the difference.

Level-triggered: every tick compares the applied plan with what runs and acts on
the difference. Decisions are pure and live beside it (reconcile.py: is a plan
acceptable, what must change; health.py: what a lane's process did; drain.py: may a
serving lane go); the supervisor looks, asks them, and applies what they say through
lifecycle.py (processes), feedback.py (what the plan got wrong) and persistence.py
(the state file a restarted agent adopts its lanes from). No NATS here: events leave
through the `emit` callback, status through `status()`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path

import msgspec
import structlog

from launcher_agent import health, load_feed
from launcher_agent.config import AgentConfig
from launcher_agent.drain import Drains
from launcher_agent.feedback import Feedback
from launcher_agent.lane import Emit, Lane, no_event
from launcher_agent.lifecycle import Lifecycle
from launcher_agent.persistence import StateFile
from launcher_agent.process import LogLimits
from launcher_agent.reconcile import Observed, decide, typed_only, validate_plan
from launcher_agent.slot_store import SlotStore
from shared.lane_key import lane_key
from shared.lane_secrets import fingerprint
from shared.llama.endpoints import WILDCARD_BINDS
from shared.messages.plans import HostPlan
from shared.messages.status import HostStatus, LaneStatus
from shared.span_check import span_problem

log = structlog.get_logger("lanes.agent")
STARTING_TICK = 0.02  # seconds between control passes while a lane comes up or a drain asks its lane


@dataclass
class Supervisor:
    cfg: AgentConfig
    emit: Emit = no_event
    plan: HostPlan | None = None
    halted: tuple[int, str] | None = None  # (config revision, why) of a rollout a change broke
    rollouts_halted: int = 0  # how often a change broke a lane here (lanes_rollouts_halted_total)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # Changes each time the agent starts: tells a fresh status from one a dead agent left.
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    feedback: Feedback = field(default_factory=Feedback)
    procs: Lifecycle = field(init=False)
    rules: health.Rules = field(init=False)
    store: StateFile = field(init=False)
    drains: Drains = field(init=False)

    def __post_init__(self) -> None:
        self.drains = Drains(self.emit)
        self.procs = Lifecycle(self.cfg, self.emit, self.feedback, on_change=self._save)
        if not self.cfg.dry_run and self.cfg.caps.has_slot_save:
            self.procs.slots = SlotStore(self.cfg.data_dir / "slots", self.emit, build=self.cfg.caps.version)
            if self.cfg.lane_user is not None:  # llama-server writes the saved slots there
                self.cfg.lane_user.give(self.procs.slots.folder)
        if not self.cfg.dry_run and self.cfg.lane_user is not None:  # and reads its key file in lanes/
            self.cfg.lane_user.may_pass(self.cfg.data_dir, self.cfg.data_dir / "lanes")
        self.rules = health.Rules(self.cfg.backoff_base, self.cfg.probe_interval, self.cfg.probe_failures,
                                  self.cfg.stall_seconds)  # fmt: skip
        self.store = StateFile(self.cfg.data_dir / "agent-state.json")

    @property
    def lanes(self) -> dict[str, Lane]:
        return self.procs.lanes

    def accept_plan(self, plan: HostPlan) -> str | None:
        """Apply a plan, or say why it must not be applied (then nothing changes)."""
        applied = self.plan.plan_revision if self.plan else 0
        reason = validate_plan(
            plan,
            host_id=self.cfg.host_id,
            model_dirs=self.cfg.model_dirs,
            port_range=range(self.cfg.port_base, self.cfg.port_base + self.cfg.port_count),
            caps=self.cfg.caps,
            applied_revision=applied,
            model_exists=model_file_exists,
            bind=self.cfg.bind,
        )
        if reason:
            return reason
        plan = typed_only(plan)  # launched as this agent renders the spec (lifecycle.start)
        if plan == self.plan:
            return None
        log.info("plan applied", plan_revision=plan.plan_revision, lanes=[s.lane_id for s in plan.lanes])
        self.plan = plan
        self._follow_buddies(plan)
        self.procs.log_limits = log_limits(plan)
        if self.procs.slots is not None:
            self.procs.slots.budget = plan.slot_cache_bytes
        self._save()
        self.wake.set()
        return None

    async def supervise(self, now: float) -> None:
        """Fold what each process did since the last tick into its lane state."""
        if self.feedback.expire(self.cfg.feedback_ttl):
            self._save()
        watched = [lane for lane in self.lanes.values() if lane.process is not None]
        # Looked at side by side: one wedged lane must not slow the others' checks.
        probes = await asyncio.gather(*(self._look(lane, now) for lane in watched))
        for lane, probe in zip(watched, probes):
            outcome = health.transition(health_of(lane), probe, now=now, rules=self.rules)
            await self._apply(lane, outcome, now)
            if lane.restore_pending and lane.state == "healthy" and self.procs.slots is not None:
                lane.restore_pending = False  # before the status that tells gateways it serves
                await self.procs.slots.restore(lane)
            if outcome.halts and self.plan is not None:
                if self.halted is None or self.halted[0] != self.plan.config_revision:
                    self.rollouts_halted += 1
                self.halted = (self.plan.config_revision, outcome.halts)
                log.warning("rollout halted", config_revision=self.plan.config_revision, reason=outcome.halts)
        self._save()  # exits, new feedback (written only when something changed)

    async def _look(self, lane: Lane, now: float) -> health.Probe:
        """Ask the lane what health.what_to_probe says, then read its log and exit (a lane that
        printed its buffers before it listened reports them with "healthy")."""
        proc = lane.process
        assert proc is not None
        ask = health.what_to_probe(health_of(lane), now) if proc.returncode is None else None
        ready = await proc.probe_health(lane.api_key) if ask == "ready" else None
        alive, loop = None, "unasked"
        if ask == "alive":  # /health (its HTTP thread) and /slots (its inference loop) side by side
            timeout = self.cfg.probe_timeout
            alive, loop = await asyncio.gather(proc.alive(lane.api_key, timeout), proc.loop_work(lane.api_key, timeout))
        if proc.returncode is not None:
            await proc.drained()  # its last lines say why it exited
        proc.read_log()
        if ready is not None and ready[0] == "healthy" and lane.spec.workers:
            problem = span_problem(lane.spec, proc.buffer_lines)
            if problem:  # it serves, but not across its hosts as planned: fail it, tell the planner
                log.warning("span lane failed its check", lane=lane.spec.lane_id, reason=problem)
                self.feedback.failure(lane, "other", problem)
                ready = ("mismatch", problem)
        return health.Probe(proc.returncode, tuple(proc.tail), ready, alive, loop)

    async def _apply(self, lane: Lane, outcome: health.Outcome, now: float = 0.0) -> None:
        for f in _HEALTH_FIELDS:
            setattr(lane, f, getattr(outcome.health, f))
        for note in outcome.feedback:
            if isinstance(note, health.CheckUse):
                self.feedback.check_against_plan(lane)
            elif isinstance(note, health.PortBusy):
                self.feedback.port_busy(lane, note.detail)
            elif isinstance(note, health.Failed):
                self.feedback.failure(lane, note.kind, note.detail)
        if outcome.kill and lane.process is not None:
            await lane.process.kill()
        if any(e == "healthy" for e, _ in outcome.events) and lane.started_mono is not None and lane.load_seconds is None:
            lane.load_seconds = round(max(0.0, now - lane.started_mono), 3)
        for event, detail in outcome.events:
            await self.emit(lane, event, detail)

    def observed(self) -> dict[str, Observed]:
        return {
            lane_id: Observed(
                lane.spec, lane.state, lane.failures, lane.retry_at, lane_key(lane.last_good) if lane.last_good else None
            )
            for lane_id, lane in self.lanes.items()
        }

    async def reconcile(self, now: float) -> None:
        if self.plan is None:
            return  # never act on "no plan yet": that would stop adopted lanes
        if self.halted and self.halted[0] != self.plan.config_revision:
            log.info("rollout resumes with a new config", config_revision=self.plan.config_revision)
            self.halted = None
        actions = decide(
            self.plan.lanes,
            self.observed(),
            now=now,
            max_changes=self.plan.max_restarts,
            hold_changes=self.halted is not None,
        )
        actions = await self.drains.gate(
            actions, self.lanes, now=now, timeout=self.plan.drain_timeout, busy=lambda lane: lane.process.busy_slots(lane.api_key)
        )
        await self.procs.apply(actions, self.plan.plan_revision)
        if actions:
            self._save()
            self.wake.set()  # look at the new lanes at once rather than a tick later

    async def stop_all(self) -> None:
        await self.procs.stop_all()
        self._save()

    def _save(self) -> None:
        self.store.save(self.plan, self.lanes, list(self.feedback.sorted()))

    def load_saved(self) -> None:
        saved = self.store.load()
        if saved is None:
            return
        self.plan = saved.plan
        if saved.plan is not None:
            self.procs.log_limits = log_limits(saved.plan)
            if self.procs.slots is not None:
                self.procs.slots.budget = saved.plan.slot_cache_bytes
        self.feedback.restore(saved.feedback)
        self.procs.adopt(saved)

    # ------------------------------------------------------------ status out

    def next_look(self, now: float, idle: float) -> float:
        """Seconds until the control loop's next pass (a wake-up comes sooner): soon while a lane
        comes up or a drain asks its lane; at the end of the drains' grace while they only wait."""
        if any(lane.state in ("starting", "loading") for lane in self.lanes.values()):
            return STARTING_TICK
        if self.drains.active():
            return max(STARTING_TICK, self.drains.quiet_for(now))
        return idle

    async def read_loads(self, timeout: float) -> list[load_feed.Read]:
        """Each serving lane's /slots, read side by side (a wedged lane must not slow the others')."""
        serving = [lane for lane in self.lanes.values() if lane.state == "healthy" and lane.process is not None]

        async def read(lane: Lane) -> load_feed.Read:
            sent = time.monotonic()
            said = await lane.process.slots_read(lane.api_key, timeout)
            return load_feed.Read(lane.spec.lane_id, lane.process.pid, sent, said)

        return list(await asyncio.gather(*(read(lane) for lane in serving)))

    def lanes_rss(self) -> int:
        return sum(lane.process.rss() or 0 for lane in self.lanes.values() if lane.process)

    def _follow_buddies(self, plan: HostPlan) -> None:
        """A running lane the plan keeps as it is takes the plan's buddy for it (no launch field: it
        restarts nothing): its slots go there when it stops or restarts (launcher_agent/slot_moves.py)."""
        for spec in plan.lanes:
            lane = self.lanes.get(spec.lane_id)
            if lane is not None and (lane.spec.slot_buddy_host, lane.spec.slot_buddy_lane) != (
                    spec.slot_buddy_host, spec.slot_buddy_lane) and lane_key(lane.spec) == lane_key(spec):  # fmt: skip
                lane.spec = msgspec.structs.replace(lane.spec, slot_buddy_host=spec.slot_buddy_host,
                                                    slot_buddy_lane=spec.slot_buddy_lane)  # fmt: skip

    def serving_keys(self) -> tuple[str, ...]:
        """The lane keys of the lanes serving now (healthy: loaded, their buffers resident)."""
        return tuple(sorted(lane_key(lane.spec) for lane in self.lanes.values() if lane.state == "healthy"))

    def lane_pids(self) -> list[int]:
        return [lane.process.pid for lane in self.lanes.values() if lane.process and lane.process.pid]

    def lanes_gpu_bytes(self) -> dict[int, int]:
        """What the running lanes hold on each of the host's GPUs: their printed buffers once
        loaded, the plan's figures while loading (NVML's per-process figures win where present)."""
        held: dict[int, int] = {}
        for lane in self.lanes.values():
            if lane.process is None or lane.process.returncode is not None or not lane.spec.gpu_devices:
                continue
            printed = {d.index: d for d in lane.process.printed_devices()}
            for d in lane.spec.memory.devices:
                if d.index < 0:
                    continue
                gpu = lane.spec.gpu_devices[d.index]
                held[gpu] = held.get(gpu, 0) + (printed[d.index].total if d.index in printed else d.total)
        return held

    def status(self, nats_connected: bool = False) -> HostStatus:
        lanes = []
        for lane_id, lane in sorted(self.lanes.items()):
            p = lane.process
            lanes.append(
                LaneStatus(
                    lane_id=lane_id,
                    state=lane.state,
                    port=lane.spec.port,
                    pid=p.pid if p else None,
                    plan_revision=lane.plan_revision,
                    ctx_total=lane.spec.ctx_total,
                    planned_bytes=lane.spec.memory.total_bytes,
                    planned_kv_bytes=lane.spec.memory.kv_bytes,
                    kv_bytes=p.kv_bytes() if p else None,
                    rss_bytes=p.rss() if p and lane.state not in ("crashed", "failed", "stopped") else None,
                    restarts=lane.restarts,
                    last_error=lane.last_error,
                    stderr_tail=tuple(list(p.tail)[-12:])
                    if p and lane.state in ("crashed", "failed", "mismatch")
                    else (),
                    argv=tuple(p.argv) if p else (),
                    lane_key=lane_key(lane.spec),
                    failure=lane.failure,
                    devices=p.printed_devices() if p else (),
                    draining=lane.draining,
                    load_seconds=lane.load_seconds,
                    key_id=fingerprint(lane.api_key) if lane.api_key else "",
                )
            )
        return HostStatus(
            host_id=self.cfg.host_id,
            plan_revision=self.plan.plan_revision if self.plan else 0,
            lanes=tuple(lanes),
            feedback=self.feedback.sorted(),
            nats_connected=nats_connected,
            agent_session=self.session,
            rollout_halted=self.halted[1] if self.halted else "",
            address=self.cfg.advertise or (self.cfg.bind if self.cfg.bind not in WILDCARD_BINDS else ""),
        )


_HEALTH_FIELDS = tuple(f.name for f in fields(health.LaneHealth))


def health_of(lane: Lane) -> health.LaneHealth:
    return health.LaneHealth(**{f: getattr(lane, f) for f in _HEALTH_FIELDS})


def log_limits(plan: HostPlan) -> LogLimits:
    return LogLimits(plan.lane_log_max_bytes, plan.lane_log_files)


def model_file_exists(path: str) -> bool:
    """The file-system check validate_plan is given (OSError for a name the system cannot take)."""
    return Path(path).is_file()
