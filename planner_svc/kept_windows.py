"""A running lane keeps its window when a replan would move it by less than min_gain (a restart
is not worth it), if the lane is still the same shape. Pure; planner_svc/planner.py calls it."""

from __future__ import annotations

from collections.abc import Mapping

from planner_svc.lane_windows import PlannedLane, spec_n_gpu_layers, sum_costs
from planner_svc.layouts import Resource
from shared.messages.config import FleetConfig
from shared.messages.plans import HostPlan, LaneSpec


def keep_stable_windows(
    pool: list[PlannedLane], budget: Mapping[Resource, int], cost, prev: HostPlan | None, config: FleetConfig,
    has_kv_unified: bool = True,
) -> None:
    """Keep a running lane's window when the replan would move it by less than min_gain."""
    if prev is None:
        return
    old = {s.lane_id: s for s in prev.lanes}
    for lane in pool:
        before = old.get(lane.lane_id)
        if before is None or not _same_shape(before, lane, has_kv_unified):
            continue
        old_window = before.ctx_total // before.parallel
        if old_window == lane.window or not lane.floor <= old_window <= lane.ceiling:
            continue
        change = abs(lane.window - old_window) / old_window
        if change >= config.min_gain_fraction:
            continue
        proposed = lane.window
        lane.window = old_window
        total = sum_costs(cost(x, x.window) for x in pool)
        if any(b > budget.get(r, 0) for r, b in total.items()):
            lane.window = proposed
            continue
        lane.reasons.append(
            f"kept window {old_window}: the replan's {proposed} differs by {change:.0%},"
            f" under the {config.min_gain_fraction:.0%} worth a restart"
        )


def _same_shape(spec: LaneSpec, lane: PlannedLane, has_kv_unified: bool = True) -> bool:
    return (
        spec.model_path == lane.facts.path
        and spec.parallel == lane.persona.parallel
        and spec.kv_unified == (lane.persona.kv_unified and has_kv_unified)  # as lane_spec renders it
        and spec.cache_type_k == lane.flags.cache_type_k
        and spec.cache_type_v == lane.flags.cache_type_v
        and spec.flash_attn == lane.flags.flash_attn
        and spec.gpu_devices == lane.layout.gpus
        and spec.n_gpu_layers == spec_n_gpu_layers(lane)
        and spec.n_cpu_moe == lane.layout.n_cpu_moe
        and spec.spec_type == (lane.speculation.spec_type if lane.speculation else None)
    )
