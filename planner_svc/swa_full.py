"""--swa-full for a sliding-window model's lanes: what makes their saved slots read back whole. Pure.

A sliding-window (SWA) layer keeps only the last n_swa tokens of each sequence (plus a
ubatch), so llama-server can go back to a shorter prefix of such a cache only from a context
checkpoint, which lives in the slot's memory and not in its file: a restored slot is
prefilled again in full (measured with Gemma 3 270M: cached 0 of 370 tokens after a restore).
With --swa-full those layers cache the whole window like the others, and the restored slot is
reused (337 of 370). It costs KV: the SWA layers' cells grow from n_swa + n_ubatch to the
window (for Gemma 3, 5 of every 6 layers).

The rule (Persona.swa_full): None (the default), where the windows already planned still fit
with it, so it costs no window, only what the prompt caches would have had, and only while
slots are saved at all (slot_cache_bytes > 0); True, wherever it fits at the planned window;
False, never. Decided after the windows grow and before the prompt caches take what is left.
"""

from __future__ import annotations

from collections.abc import Mapping

from planner_svc.lane_windows import PlannedLane, sum_costs
from planner_svc.layouts import Resource
from shared.messages.config import FleetConfig
from shared.messages.hosts import ServerCaps

MIB = 1024 * 1024


def has_sliding_window(lane: PlannedLane, caps: ServerCaps) -> bool:
    """A lane whose cache has sliding-window layers that --swa-full would make whole."""
    return caps.kv_layout == "streams" and lane.facts.n_swa > 0 and any(lane.facts.swa_layers)


def choose_swa_full(pool: list[PlannedLane], budget: Mapping[Resource, int], cost, config: FleetConfig,
                    caps: ServerCaps) -> None:  # fmt: skip
    """Set each sliding-window lane's swa_full, with the reason `lanes explain` gives."""
    for lane in pool:
        if not has_sliding_window(lane, caps):
            continue
        wanted = lane.persona.swa_full
        lost = "its conversations start cold after a restart (slots not saved: a sliding-window cache"
        if wanted is False:
            lane.reasons.append(f"{lost} without --swa-full; the persona sets swa_full=false)")
            continue
        if not caps.has_swa_full:
            lane.reasons.append(f"{lost}; this llama-server has no --swa-full)")
            continue
        if wanted is None and config.slot_cache_bytes <= 0:
            lane.reasons.append(f"{lost}, and slot_cache_bytes=0 saves none)")
            continue
        before = cost(lane, lane.window)
        lane.swa_full = True
        total = sum_costs(cost(x, x.window) for x in pool)
        extra = sum(cost(lane, lane.window).values()) - sum(before.values())
        if any(b > budget.get(r, 0) for r, b in total.items()):
            lane.swa_full = False
            lane.reasons.append(f"{lost}: --swa-full would need {extra / MIB:.0f} MiB more than the host has left "
                                "at this window)")  # fmt: skip
            continue
        lane.reasons.append(f"--swa-full: {extra / MIB:.0f} MiB more KV, so its saved slots read back whole "
                            "(its conversations keep their cache across a restart)")  # fmt: skip
