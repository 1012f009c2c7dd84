"""Each lane's prompt cache (--cache-ram): host RAM for past prompts' states, planned like any buffer. Pure.

llama-server keeps the states of prompts its slots moved on from in host RAM, up to
--cache-ram MiB (8192 by default, per process), and restores one when a new prompt
shares its prefix: what makes a conversation's next turn cheap once its slot served
someone else. Left to its default, four lanes on a host can grow 32 GiB past their plan.

So every lane gets an explicit limit, counted in the host's RAM budget: llama-server's
default where the host has it, else an equal share of the RAM left after every lane's
buffers (the windows grow first: a window is what a lane can serve at all, the cache
only makes it faster), in steps of CACHE_STEP_MIB, and 0 (off) where nothing is left.
A lane keeps its previous limit while the new share is not min_gain_fraction larger, so
budgets drifting with every report do not restart lanes; a limit above the new share is kept
too while the host is not pressed (its free RAM above the headroom): the limit is a ceiling
llama-server fills lazily, and lowering it restarts the lane and throws away every cached
conversation for memory nobody used. Another program taking RAM on a workstation, or the
reported free RAM moving, then restarts nothing; the limits come down when the RAM really runs
short (each lane's restart paced by the rollout).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

MIB = 1024 * 1024
DEFAULT_CACHE_RAM_MIB = 8192  # llama-server's own default
CACHE_STEP_MIB = 256


def plan_cache_ram(
    lane_ids: Sequence[str],
    ram_left: int,
    previous: Mapping[str, int | None],
    min_gain_fraction: float,
    factor: float = 1.0,
    pressed: bool = True,
) -> dict[str, tuple[int, str]]:
    """{lane id: (--cache-ram MiB, the reason)} for the lanes of one host.

    `ram_left`: the host's RAM budget less every lane's buffers at its window; `factor`:
    the largest correction the host's lanes carry (a lane that used more than planned
    would use more here too); `previous`: each lane's limit in the plan it runs; `pressed`:
    the host's free RAM is below its headroom (planner_svc/policy.py, ram_pressed).
    """
    if not lane_ids:
        return {}
    share = max(0, ram_left) / len(lane_ids) / max(1.0, factor)
    fair = min(DEFAULT_CACHE_RAM_MIB, int(share // MIB) // CACHE_STEP_MIB * CACHE_STEP_MIB)
    out = {}
    for lane_id in lane_ids:
        before = previous.get(lane_id)
        keep = before is not None and before != fair and (before <= share // MIB or not pressed)
        if keep and fair < before * (1 + min_gain_fraction) + CACHE_STEP_MIB:
            mib = before
            if before <= share // MIB:
                why = f"kept its {before} MiB: still fits, and {fair} MiB would gain under {min_gain_fraction:.0%}"
            else:
                why = (f"kept its {before} MiB over a share of {fair} MiB: the host's free RAM is above its "
                       "headroom (a ceiling filled lazily; lowered when RAM runs short)")  # fmt: skip
        else:
            mib = fair
            if fair == DEFAULT_CACHE_RAM_MIB:
                why = "llama-server's default, counted in the host's RAM"
            elif fair == 0:
                why = "off: no RAM left after the lanes' buffers"
            else:
                why = f"an equal share of the {ram_left / 2**30:.2f} GiB RAM left after the lanes' buffers"
        out[lane_id] = (mib, f"prompt cache --cache-ram {mib} MiB: {why}")
    return out
