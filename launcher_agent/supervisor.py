"""Supervision of one host's lanes: apply plans, watch processes, act on the difference.

Level-triggered: every tick compares the applied plan with what runs and acts on
the difference (launcher_agent.reconcile.decide). No NATS here: events leave through
the `emit` callback, status through `status()`. The applied plan and the lanes' pids
are kept on disk, so a restarted agent adopts its running lanes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog

from launcher_agent.process import DryRunLane, LaneProcess
from launcher_agent.reconcile import (
    MAX_FAILURES,
    Observed,
    Restart,
    Start,
    Stop,
    backoff,
    classify_failure,
    decide,
    validate_plan,
)
from shared.messages import (
    HostPlan,
    HostStatus,
    LaneFeedback,
    LaneSpec,
    LaneStatus,
    ServerCaps,
)

log = structlog.get_logger("lanes.agent")
HEALTHY_RESETS_FAILURES_AFTER = 30.0
OVER_PLAN_TOLERANCE = 0.02
RSS_TOLERANCE = 0.15


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


class _Saved(msgspec.Struct):
    """What survives an agent restart: the applied plan and which pid serves which lane."""

    plan: HostPlan | None = None
    pids: dict[str, int] = {}


@dataclass
class AgentConfig:
    host_id: str
    model_dirs: list[str]
    binary: str
    caps: ServerCaps
    data_dir: Path
    port_base: int = 8080
    port_count: int = 16
    bind: str = "127.0.0.1"
    report_interval: float = 30.0
    tick: float = 0.5
    max_ram: int | None = None  # an operator's cap on what lanes may plan for here
    backoff_base: float = 1.0
    dry_run: bool = False  # log the argv of each lane instead of launching it


async def _no_event(lane: Lane, event: str, detail: str = "") -> None:
    pass


@dataclass
class Supervisor:
    cfg: AgentConfig
    emit: Callable[[Lane, str, str], Awaitable[None]] = _no_event
    lanes: dict[str, Lane] = field(default_factory=dict)
    plan: HostPlan | None = None
    feedback: dict[tuple, LaneFeedback] = field(default_factory=dict)
    halted: tuple[int, str] | None = None  # (config revision, why) of a rollout a change broke
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # Changes each time the agent starts: tells a fresh status from one a dead agent left.
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    _saved: bytes = b""  # what the state file holds

    @property
    def state_file(self) -> Path:
        return self.cfg.data_dir / "agent-state.json"

    def accept_plan(self, plan: HostPlan) -> str | None:
        """Apply a plan, or say why it must not be applied (then nothing changes)."""
        applied = self.plan.plan_revision if self.plan else 0
        if self.plan is not None and plan == self.plan:
            return None
        reason = validate_plan(
            plan,
            host_id=self.cfg.host_id,
            model_dirs=self.cfg.model_dirs,
            port_range=range(self.cfg.port_base, self.cfg.port_base + self.cfg.port_count),
            caps=self.cfg.caps,
            applied_revision=applied,
            bind=self.cfg.bind,
        )
        if reason:
            return reason
        log.info("plan applied", plan_revision=plan.plan_revision, lanes=[s.lane_id for s in plan.lanes])
        self.plan = plan
        self._save()
        self.wake.set()
        return None

    # ------------------------------------------------------------ supervision

    async def supervise(self, now: float) -> None:
        """Fold what each process did since the last tick into its lane state."""
        for lane in self.lanes.values():
            proc = lane.process
            if proc is None:
                continue
            proc.read_log()
            if proc.returncode is not None and lane.state not in ("crashed", "failed", "stopped"):
                await self._on_exit(lane, now)
                continue
            if lane.state in ("starting", "loading"):
                state, detail = await proc.probe_health()
                if state == "healthy":
                    lane.state, lane.healthy_since, lane.last_error = "healthy", now, ""
                    lane.last_good = lane.spec
                    await self.emit(lane, "healthy")
                    self._check_against_plan(lane)
                elif state == "mismatch":
                    lane.state, lane.last_error = "mismatch", detail
                    await self.emit(lane, "mismatch", detail)
                else:
                    lane.state = "loading"
            elif lane.state == "healthy":
                if lane.failures and lane.healthy_since and now - lane.healthy_since > HEALTHY_RESETS_FAILURES_AFTER:
                    lane.failures = 0
                self._check_against_plan(lane)

    async def _on_exit(self, lane: Lane, now: float) -> None:
        proc = lane.process
        assert proc is not None
        lines = list(proc.tail)
        kind, line = classify_failure(lines)
        died_at_start = lane.state in ("starting", "loading")
        broken_by_change = lane.last_good is not None and lane.last_good.args != lane.spec.args
        lane.failures += 1
        lane.last_error = f"exit {proc.returncode}: {line}"
        if broken_by_change and self.plan is not None:
            self.halted = (self.plan.config_revision, f"{lane.spec.lane_id} failed with the change: {line}")
            log.warning("rollout halted", config_revision=self.plan.config_revision, reason=self.halted[1])
        if died_at_start and (kind in ("unsupported", "oom") or broken_by_change):
            # llama-server refused this spec (or a change broke a lane that ran): restarting
            # the same argv cannot help; the planner corrects or reverts it.
            lane.state, lane.failure = "failed", kind
            self._feedback(lane, kind, line)
            await self.emit(lane, "failed", lane.last_error)
        elif lane.failures >= MAX_FAILURES:
            lane.state, lane.failure = "failed", "crash_loop"
            self._feedback(lane, "crash_loop", line)
            await self.emit(lane, "failed", f"crash loop: {lane.failures} failures; {lane.last_error}")
        else:
            lane.state, lane.failure = "crashed", kind
            lane.retry_at = now + backoff(lane.failures, self.cfg.backoff_base)
            await self.emit(lane, "crashed", lane.last_error)
        self._save()

    def _check_against_plan(self, lane: Lane) -> None:
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
            if actual is None or not planned or actual <= planned * (1 + tolerance) or key in self.feedback:
                continue
            log.warning(
                "lane uses more than planned", lane=lane.spec.lane_id, what=what, actual=actual, planned=planned
            )
            # Scale the whole lane by the KV overshoot ratio; RSS compares against the total.
            self.feedback[key] = LaneFeedback(
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

    def _feedback(self, lane: Lane, kind: str, detail: str) -> None:
        s = lane.spec
        changed = lane.last_good is not None and lane.last_good.args != s.args
        self.feedback[(s.model, kind, s.cache_type_k, s.cache_type_v)] = LaneFeedback(
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

    # ------------------------------------------------------------ acting

    def observed(self) -> dict[str, Observed]:
        return {
            lane_id: Observed(
                lane.spec, lane.state, lane.failures, lane.retry_at, lane.last_good.args if lane.last_good else None
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
        for action in actions:
            if isinstance(action, Stop):
                await self._stop(action.lane_id, action.reason)
            elif isinstance(action, Restart):
                old = self.lanes.get(action.spec.lane_id)
                await self._stop(action.spec.lane_id, action.reason, keep_counts=True)
                await self._start(action.spec, previous=old)
            elif isinstance(action, Start):
                await self._start(action.spec)
        if actions:
            self._save()
            self.wake.set()  # look at the new lanes at once rather than a tick later

    async def _start(self, spec: LaneSpec, previous: Lane | None = None) -> None:
        log_path = self.cfg.data_dir / "lanes" / f"{spec.lane_id}.log"
        process = (DryRunLane if self.cfg.dry_run else LaneProcess)(spec, self.cfg.binary, log_path)
        lane = Lane(spec=spec, process=process, plan_revision=self.plan.plan_revision if self.plan else 0)
        if previous is not None:
            lane.last_good = previous.last_good
            if previous.spec.args == spec.args:
                lane.failures, lane.restarts = previous.failures, previous.restarts + 1
        try:
            await process.start()
        except OSError as exc:
            lane.state, lane.last_error, lane.failure = "failed", f"cannot start {self.cfg.binary}: {exc}", "other"
            self.lanes[spec.lane_id] = lane
            await self.emit(lane, "failed", lane.last_error)
            return
        self.lanes[spec.lane_id] = lane
        log.info("lane started", lane=spec.lane_id, pid=process.pid, argv=process.argv)
        await self.emit(lane, "started", " ".join(process.argv))

    async def _stop(self, lane_id: str, reason: str, keep_counts: bool = False) -> None:
        lane = self.lanes.pop(lane_id, None)
        if lane is None or lane.process is None:
            return
        await lane.process.stop()
        log.info("lane stopped", lane=lane_id, reason=reason)
        if not keep_counts:
            lane.state = "stopped"
            await self.emit(lane, "stopped", reason)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self._stop(lane_id, "agent shutting down") for lane_id in list(self.lanes)))
        self._save()

    # ------------------------------------------------------------ persistence (restart adoption)

    def _save(self) -> None:
        """Write the applied plan and the lanes' pids, when they changed (atomically)."""
        saved = _Saved(
            plan=self.plan, pids={k: v.process.pid for k, v in self.lanes.items() if v.process and v.process.pid}
        )
        data = msgspec.json.encode(saved)
        if data == self._saved:
            return
        if not self._saved:
            self.cfg.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(self.state_file)
        self._saved = data

    def load_saved(self) -> None:
        try:
            saved = msgspec.json.decode(self.state_file.read_bytes(), type=_Saved)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return
        self.plan = saved.plan
        specs = {s.lane_id: s for s in (saved.plan.lanes if saved.plan else ())}
        for lane_id, pid in saved.pids.items():
            spec = specs.get(lane_id)
            log_path = self.cfg.data_dir / "lanes" / f"{lane_id}.log"
            proc = LaneProcess.adopt(spec, self.cfg.binary, log_path, pid) if spec and not self.cfg.dry_run else None
            if proc is not None:
                self.lanes[lane_id] = Lane(spec=spec, process=proc, state="loading")
                log.info("adopted running lane", lane=lane_id, pid=pid)

    # ------------------------------------------------------------ status out

    def starting(self) -> bool:
        return any(lane.state in ("starting", "loading") for lane in self.lanes.values())

    def lanes_rss(self) -> int:
        return sum(lane.process.rss() or 0 for lane in self.lanes.values() if lane.process)

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
                    failure=lane.failure,
                )
            )
        return HostStatus(
            host_id=self.cfg.host_id,
            plan_revision=self.plan.plan_revision if self.plan else 0,
            lanes=tuple(lanes),
            feedback=tuple(self.feedback[k] for k in sorted(self.feedback, key=str)),
            nats_connected=nats_connected,
            agent_session=self.session,
            rollout_halted=self.halted[1] if self.halted else "",
        )
