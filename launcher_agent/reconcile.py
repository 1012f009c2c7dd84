"""The agent's pure decisions: is a plan acceptable, and what must change to reach it.

No processes, no NATS, no clock, no file system: `now` is passed in, and so is the
check whether a model file exists. The supervisor executes the actions this module
returns, so a lost message or a restart converges.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import msgspec

from shared import subjects
from shared.lane_key import lane_key
from shared.llama.flags import args_problem, needs_flash_attn
from shared.messages.hosts import ServerCaps
from shared.messages.plans import HostPlan, LaneSpec
from shared.messages.status import LaneState
from shared.messages.wire import schema_problem

MAX_FAILURES = 5
BACKOFF_BASE = 1.0
BACKOFF_MAX = 60.0


# ------------------------------------------------------------------ plan validation


def validate_plan(
    plan: HostPlan,
    *,
    host_id: str,
    model_dirs: Sequence[str],
    port_range: range,
    caps: ServerCaps,
    applied_revision: int,
    model_exists: Callable[[str], bool],
    bind: str | None = None,
) -> str | None:
    """Why this plan must not be applied, or None. A rejected plan starts nothing.

    `model_exists(path)` says whether a model file is there (the agent passes one that
    looks); it may raise OSError for a path the file system cannot take.
    """
    if (problem := schema_problem(plan)) is not None:
        return f"plan {problem}"
    if subjects.host_token(plan.host_id) != subjects.host_token(host_id):
        return f"plan is for host {plan.host_id!r}, not {host_id!r}"
    if plan.plan_revision < applied_revision:
        return f"plan r{plan.plan_revision} is older than the applied r{applied_revision}"
    seen_ports: set[int] = set()
    seen_ids: set[str] = set()
    for spec in plan.lanes:
        where = f"lane {spec.lane_id}"
        if spec.lane_id in seen_ids:
            return f"{where}: duplicate lane id"
        seen_ids.add(spec.lane_id)
        try:
            inside = in_model_folders(spec.model_path, model_dirs)
            exists = inside and model_exists(spec.model_path)
        except (ValueError, OSError) as exc:  # a NUL byte, a name too long for the file system
            return f"{where}: unusable model path ({exc})"
        if not inside:
            return f"{where}: model {spec.model_path!r} is outside the model folders"
        if not exists:
            return f"{where}: model {spec.model_path!r} does not exist"
        if bind is not None and spec.bind != bind:
            return f"{where}: binds {spec.bind!r}; this agent serves lanes on {bind!r}"
        if spec.port not in port_range:
            return f"{where}: port {spec.port} outside {port_range.start}..{port_range.stop - 1}"
        if spec.port in seen_ports:
            return f"{where}: port {spec.port} used twice"
        seen_ports.add(spec.port)
        for t in (spec.cache_type_k, spec.cache_type_v):
            if t is not None and t not in caps.cache_types:
                return f"{where}: cache type {t} is not supported by this llama-server"
        if needs_flash_attn(spec.cache_type_v) and spec.flash_attn != "on":
            return f"{where}: quantized V cache without flash attention on would be refused"
        if (problem := devices_problem(spec)) is not None:
            return f"{where}: {problem}"
        if spec.args and (problem := args_problem(spec, caps)) is not None:  # an older planner's args
            return f"{where}: args disagree with the lane spec: {problem}"
    return None


def devices_problem(spec: LaneSpec) -> str | None:
    """Why a lane's --rpc and --device values must not be launched, or None. Their shape
    (host:port, a device name, how many) is checked when the plan is decoded (shared.messages.wire)."""
    ports = [int(endpoint.rsplit(":", 1)[1]) for endpoint in spec.rpc_servers]
    if any(not 1 <= port <= 65535 for port in ports):
        return f"rpc server port outside 1..65535 in {list(spec.rpc_servers)}"
    if len(set(spec.rpc_servers)) != len(spec.rpc_servers):
        return f"rpc server named twice in {list(spec.rpc_servers)}"
    if missing := [w.endpoint for w in spec.workers if w.endpoint not in spec.rpc_servers]:
        return f"span workers {missing} are not among its rpc servers"
    if len(set(spec.device_names)) != len(spec.device_names):
        return f"device named twice in {list(spec.device_names)}"
    if spec.device_names and len(spec.device_names) != len(spec.gpu_devices):
        return f"{len(spec.device_names)} device names for {len(spec.gpu_devices)} devices"
    return None


def in_model_folders(path: str, model_dirs: Sequence[str]) -> bool:
    """Whether the path, as written, lies in a model folder.

    Symlinks the operator put in a folder are followed (a Hugging Face snapshots/
    folder links into blobs/), so the path is compared as written, not resolved; a
    path with `..` in it could climb out through a link and is refused.
    """
    if "\0" in path:
        raise ValueError("embedded NUL byte")
    written = PurePosixPath(path)
    if not written.is_absolute() or ".." in written.parts:
        return False
    for folder in model_dirs:
        for root in {os.path.abspath(folder), str(Path(folder).resolve())}:
            if written.is_relative_to(root) and written != PurePosixPath(root):
                return True
    return False


def typed_only(plan: HostPlan) -> HostPlan:
    """The plan as the agent keeps it: the typed specs. An older planner's `args`, checked by
    meaning in validate_plan, are dropped; the agent renders argv itself when it launches a lane."""
    if not any(s.args for s in plan.lanes):
        return plan
    return msgspec.structs.replace(plan, lanes=tuple(msgspec.structs.replace(s, args=()) for s in plan.lanes))


# ------------------------------------------------------------------ what runs


@dataclass(frozen=True)
class Observed:
    spec: LaneSpec
    state: LaneState
    failures: int = 0
    retry_at: float = 0.0  # when a crashed lane may start again
    last_good_key: str | None = None  # lane key of the spec it last ran healthy with

    @property
    def broken_by_change(self) -> bool:
        """Down with a spec other than the one it last ran healthy with."""
        return (
            self.state in ("crashed", "failed")
            and self.last_good_key is not None
            and self.last_good_key != lane_key(self.spec)
        )


@dataclass(frozen=True)
class Start:
    spec: LaneSpec
    reason: str


@dataclass(frozen=True)
class Stop:
    lane_id: str
    reason: str


@dataclass(frozen=True)
class Restart:
    spec: LaneSpec
    reason: str


Action = Start | Stop | Restart
_IN_TRANSITION = ("starting", "loading")


def backoff(failures: int, base: float = BACKOFF_BASE) -> float:
    """Seconds before a crashed lane's next start: base, 2x, 4x ... capped."""
    return min(BACKOFF_MAX, base * 2 ** max(0, failures - 1))


def decide(
    desired: Sequence[LaneSpec],
    observed: Mapping[str, Observed],
    *,
    now: float,
    max_changes: int = 1,
    hold_changes: bool = False,
) -> list[Action]:
    """Actions that move what runs toward the plan: stops first, then restarts, then starts.

    A rollout: changed lanes that are serving restart at most `max_changes` at a
    time, the next only once the last is up (lanes still starting count), and none
    while a lane a change broke is down (the rollout halts until the planner reverts
    it). Lanes that are down anyway take their new spec at once. A start never takes
    a port another kept lane holds.
    """
    wanted = {s.lane_id: s for s in desired}
    actions: list[Action] = [
        Stop(lane_id, "no longer in the plan") for lane_id in sorted(observed) if lane_id not in wanted
    ]
    freed = {a.lane_id for a in actions}
    halted = hold_changes or any(o.broken_by_change for o in observed.values())
    budget = 0 if halted else max_changes - sum(1 for o in observed.values() if o.state in _IN_TRANSITION)
    restarts: list[Restart] = []
    for spec in desired:
        obs = observed.get(spec.lane_id)
        if obs is None:
            continue
        if lane_key(obs.spec) != lane_key(spec):
            if obs.state in ("crashed", "failed", "mismatch", "unresponsive"):
                restarts.append(Restart(spec, "spec changed (lane was down)"))
            elif budget > 0:
                restarts.append(Restart(spec, "spec changed"))
                budget -= 1
        elif obs.state == "crashed" and obs.failures < MAX_FAILURES and now >= obs.retry_at:
            restarts.append(Restart(spec, f"crashed; retry {obs.failures} after backoff"))
    actions += restarts
    freed |= {r.spec.lane_id for r in restarts}
    busy = {o.spec.port for lane_id, o in observed.items() if lane_id not in freed}
    for spec in desired:
        if spec.lane_id not in observed:
            if spec.port in busy:
                continue  # its port frees up once the lane holding it restarts
            actions.append(Start(spec, "new in the plan"))
            busy.add(spec.port)
    return actions
