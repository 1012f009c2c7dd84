"""How long a model takes to load: predicted from its file size and the rate its host has shown.

Pure. Each lane's agent measures its load (process start to first healthy answer,
LaneStatus.load_seconds); a host's read rate is the bytes of the model files its lanes loaded
over the seconds they took, so it counts everything a load does on that host (reading or
mapping the file, building the KV cache, the warm-up), warm page cache or cold as it happened.
A host that has loaded nothing yet gets DEFAULT_READ_RATE. The page cache is not inspected:
a file read just before loads faster than predicted (docs/on-demand.md, known limits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan
from shared.messages.status import HostStatus

MIB = 1 << 20
DEFAULT_READ_RATE = 200 * MIB  # bytes per second, before a host has measured a load
MIN_SECONDS = 0.5  # a process start costs this much whatever the file


def read_rates(
    reports: Sequence[HostReport], plans: Mapping[str, HostPlan], statuses: Mapping[str, HostStatus]
) -> dict[str, float]:
    """Host id -> bytes per second its measured loads show (only hosts that measured one)."""
    sizes = {(r.host_id, m.path): m.file_bytes for r in reports for m in r.models}
    by_host = {s.host_id: s for s in statuses.values()}
    out: dict[str, float] = {}
    for plan in plans.values():
        status = by_host.get(plan.host_id)
        if status is None:
            continue
        specs = {s.lane_id: s for s in plan.lanes}
        loaded = seconds = 0.0
        for lane in status.lanes:
            spec = specs.get(lane.lane_id)
            size = sizes.get((plan.host_id, spec.model_path)) if spec else None
            if lane.load_seconds and size:
                loaded += size
                seconds += lane.load_seconds
        if seconds > 0:
            out[plan.host_id] = loaded / seconds
    return out


def predicted_seconds(file_bytes: int, rate: float | None) -> float:
    return round(max(MIN_SECONDS, file_bytes / (rate or DEFAULT_READ_RATE)), 2)


def measured_loads(plans: Mapping[str, HostPlan], statuses: Mapping[str, HostStatus]) -> dict[str, float]:
    """Persona name -> the measured load of its lanes (the slowest, where several report one)."""
    by_host = {s.host_id: s for s in statuses.values()}
    out: dict[str, float] = {}
    for plan in plans.values():
        status = by_host.get(plan.host_id)
        seconds = {lane.lane_id: lane.load_seconds for lane in status.lanes} if status else {}
        for spec in plan.lanes:
            if seconds.get(spec.lane_id) is not None:
                out[spec.alias] = max(out.get(spec.alias, 0.0), seconds[spec.lane_id])
    return out
