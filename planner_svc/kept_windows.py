"""A running lane keeps its window when a replan would move it by less than min_gain (a restart
is not worth it), if the lane is still the same shape; and a window that would merely shrink is
kept while the host is not pressed. Pure; planner_svc/planner.py calls it."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from planner_svc.lane_windows import PlannedLane, spec_n_gpu_layers, sum_costs
from planner_svc.layouts import CPU_RESOURCE, Resource
from shared.lane_key import lane_key
from shared.messages.config import FleetConfig
from shared.messages.plans import HostPlan, LaneSpec


def keep_stable_windows(
    pool: list[PlannedLane], budget: Mapping[Resource, int], cost, prev: HostPlan | None, config: FleetConfig,
    has_kv_unified: bool = True, pressed: bool = False, serving: Collection[str] = (),
) -> None:
    """Keep a running lane's window when the replan would move it by less than min_gain.

    Also, when every lane of the pool was planned before and the host is not pressed (its free RAM
    above the headroom), the window of a lane serving with its planned spec (its key in
    `serving`, from the host's report) that the replan would shrink is kept whatever the change:
    its KV is resident already and the host still has its headroom, so a smaller free RAM
    (another program grew, a restarted control plane read it busier) restarts no lane. RAM then
    may exceed the new budget, never what the previous plan's windows take; each GPU stays within
    its budget. Under pressure, with a lane to add, or for a lane not yet serving, the rule above
    alone holds, and shrinking lanes restart through the rollout."""
    if prev is None:
        return
    old = {s.lane_id: s for s in prev.lanes}
    holding = not pressed and all(lane.lane_id in old for lane in pool)
    running_ram = sum_costs(cost(x, _window(old[x.lane_id])) for x in pool).get(CPU_RESOURCE, 0) if holding else 0
    for lane in pool:
        before = old.get(lane.lane_id)
        if before is None or not _same_shape(before, lane, has_kv_unified):
            continue
        old_window = _window(before)
        if old_window == lane.window or not lane.floor <= old_window <= lane.ceiling:
            continue
        change = abs(lane.window - old_window) / old_window
        held = holding and old_window > lane.window and lane_key(before) in serving
        if change >= config.min_gain_fraction and not held:
            continue
        proposed = lane.window
        lane.window = old_window
        total = sum_costs(cost(x, x.window) for x in pool)
        ram_cap = max(budget.get(CPU_RESOURCE, 0), running_ram) if held else budget.get(CPU_RESOURCE, 0)
        if any(b > (ram_cap if r == CPU_RESOURCE else budget.get(r, 0)) for r, b in total.items()):
            lane.window = proposed
            continue
        if change >= config.min_gain_fraction:
            lane.reasons.append(f"kept window {old_window}: the replan's {proposed} would only shrink it, and the "
                                "host is not short of RAM (free above the headroom): what runs stays")  # fmt: skip
        else:
            lane.reasons.append(f"kept window {old_window}: the replan's {proposed} differs by {change:.0%},"
                                f" under the {config.min_gain_fraction:.0%} worth a restart")  # fmt: skip


def _window(spec: LaneSpec) -> int:
    return spec.ctx_total // spec.parallel


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
