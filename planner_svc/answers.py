"""The pure answers behind the planner's endpoints (planner_svc/endpoints.py): the config a
`config set` asks for, why the planner refuses a config, and a host plan explained line by line.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from shared.llama.printed import device_lines
from shared.messages.config import FleetConfig
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan
from shared.messages.replies import ConfigSet
from shared.messages.status import HostStatus


def merged_config(current: FleetConfig, change: ConfigSet, revision: int) -> FleetConfig | None:
    """The config a `config set` asks for, numbered `revision`; None when nothing changes.

    Raises msgspec.ValidationError with the reason for a change that is not a valid config.
    """
    if "revision" in change.changes or "schema" in change.changes:
        raise msgspec.ValidationError("revision and schema are set by the planner")
    merged = msgspec.structs.asdict(current) | dict(change.changes)
    for own in ("kind", "schema", "revision"):
        merged.pop(own, None)
    new = msgspec.convert(merged, FleetConfig, strict=False)
    if new == msgspec.structs.replace(current, revision=0, schema=new.schema):
        return None
    return msgspec.structs.replace(new, revision=revision)


def config_problem(config: FleetConfig, reports: Mapping[str, HostReport]) -> str | None:
    """Why the planner refuses a config it could store, or None: a `host_lost_after` at or
    below a host's report interval would call that host lost between every two reports."""
    if config.host_lost_after is None:
        return None
    slow = [r for r in reports.values() if r.report_interval >= config.host_lost_after]
    if not slow:
        return None
    worst = max(slow, key=lambda r: (r.report_interval, r.host_id))
    return (
        f"host_lost_after {config.host_lost_after:g} s is not above host {worst.host_id}'s report interval of"
        f" {worst.report_interval:g} s: every such host would be lost between two reports"
    )


def explain_lines(found: HostPlan, status: HostStatus | None) -> list[str]:
    """Every decision in a host's plan with its reason, and per device planned vs printed buffers."""
    lines = [f"host {found.host_id} plan r{found.plan_revision} (config r{found.config_revision})"]
    lines += [f"{s.lane_id}: " + "; ".join(s.reasons) for s in found.lanes]
    printed: Mapping[str, tuple] = {lane.lane_id: lane.devices for lane in status.lanes} if status else {}
    for s in found.lanes:
        lines += device_lines(s, printed.get(s.lane_id, ()))
    lines += [f"unplaced {u.model}: {u.reason}" for u in found.unplaced]
    lines += [f"note: {r}" for r in found.reasons]
    return lines
