"""Where one lane goes: its flags and window bounds on each candidate host, the layout that fits
there at its floor window (the previous one first, so steady inputs never alternate), and the
best host. Pure; planner_svc/planner.py places every lane through `place_lane`.
"""

from __future__ import annotations

from planner_svc.adapters import lane_adapters
from planner_svc import speculative
from planner_svc.lane_windows import PlannedLane, lane_cost, lane_id_for
from planner_svc.layouts import (
    CPU_RESOURCE,
    Layout,
    Resource,
    candidates,
    describe,
    expert_layout,
    fits,
    partial_layout,
    rank,
)
from planner_svc.policy import (
    Flags,
    chat_template_for,
    correction,
    decide_flags,
    flash_attn_for,
    revert_target,
    window_bounds,
)
from shared.memory import CTX_PAD, MemoryModelError, PlacementError
from shared.messages.plans import HostPlan

GIB = 1024**3
_F16 = Flags(None, None, None, ())  # the flags a layout is chosen with


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _previous_layout(prev: HostPlan | None, lane_id: str) -> Layout | None:
    spec = next((s for s in prev.lanes if s.lane_id == lane_id), None) if prev else None
    if spec is None:
        return None
    if spec.layout is not None:
        return spec.layout
    # A spec from an older planner carries no layout: rebuild it from the device fields.
    if not spec.gpu_devices:
        return Layout("cpu")
    full = spec.memory.devices and all(d.layers == 0 for d in spec.memory.devices if d.index < 0)
    kind = ("gpu" if len(spec.gpu_devices) == 1 else "split") if full else "partial"
    shares = spec.tensor_split
    if shares and len(shares) != len(spec.gpu_devices):
        shares = tuple(shares[g] for g in spec.gpu_devices if g < len(shares))
    return Layout(kind, spec.gpu_devices, shares, "all" if full else spec.n_gpu_layers)


def _choose_layout(lane_at, report, remaining, config, prev_layout) -> tuple[Layout, dict] | None:
    """The first layout that fits at the floor window: the previous one if it still does
    (steady inputs never alternate layouts), else the fastest."""

    seen: dict[Layout, dict[Resource, int]] = {}

    def cost(layout: Layout) -> dict[Resource, int]:
        if layout not in seen:
            seen[layout] = layout_cost(layout)
        return seen[layout]

    def layout_cost(layout: Layout) -> dict[Resource, int]:
        lane = lane_at(layout)
        floor_cost = lane_cost(lane, lane.floor, report, config.n_ubatch)
        # The layout is chosen with f16 costs, so the cache type only moves the window.
        f16 = lane_cost(lane_at(layout, f16=True), lane.floor, report, config.n_ubatch)
        return {r: max(b, f16.get(r, 0)) for r, b in floor_cost.items()}

    tried = []
    if prev_layout is not None and all(("gpu", g) in remaining for g in prev_layout.gpus):
        tried.append(prev_layout)
    tried += candidates(report, remaining, config.use_gpu)
    for layout in tried:
        c = cost(layout)
        if fits(c, remaining):
            return layout, c
    facts = lane_at(Layout("cpu")).facts
    for search in (expert_layout, partial_layout):
        layout = search(facts, report, remaining, cost, config.use_gpu)
        if layout is not None:
            return layout, cost(layout)
    c = cost(Layout("cpu"))
    return (Layout("cpu"), c) if fits(c, remaining) else None


def place_lane(persona, candidates_, config, lanes, remaining, previous, feedback) -> tuple[bool, str]:
    """Put one lane of persona on the best candidate host where it fits at its floor."""
    options = []
    why = "does not fit"
    for report, facts in candidates_:
        host = report.host_id
        fb = [f for f in feedback.get(host, ()) if f.model == persona.model]
        index = sum(1 for lane in lanes[host] if lane.persona.model == persona.model)
        lane_id = lane_id_for(persona.model, index)
        revert = revert_target(config, report, facts, persona, lane_id, fb)
        if revert is not None:
            flags, floor, ceiling, bound_reasons = revert
            factor, factor_reasons = 1.0, []
        else:
            flags = decide_flags(config, report, facts, fb)
            looping = [
                f
                for f in fb
                if f.kind == "crash_loop"
                and (f.cache_type_k, f.cache_type_v) == (flags.cache_type_k, flags.cache_type_v)
            ]
            if looping:
                why = f"llama-server keeps failing on {host} with this spec: {looping[0].detail}"
                continue
            floor, ceiling, bound_reasons = window_bounds(persona, facts, fb)
            if ceiling < CTX_PAD:
                why = f"trained context {facts.n_ctx_train} is below {CTX_PAD}"
                continue
            factor, factor_reasons = correction(fb)

        adapters, adapter_reasons = lane_adapters(persona, report, facts)
        device = "gpu" if report.gpus and config.use_gpu else "cpu"
        speculation, spec_reasons = speculative.decide(persona, config, facts, report.models, report.server, device)
        built: dict[tuple[Layout, bool], PlannedLane] = {}  # one lane per layout: its cost key is reused

        def lane_at(layout: Layout, f16: bool = False) -> PlannedLane:
            if (layout, f16) not in built:
                f = _F16 if f16 else flags
                built[layout, f16] = PlannedLane(host, persona, facts, index, f, layout, floor, ceiling, factor,
                                                 adapters=adapters, speculation=speculation)  # fmt: skip
            return built[layout, f16]

        try:
            chosen = _choose_layout(lane_at, report, remaining[host], config, _previous_layout(previous.get(host), lane_id))
        except (MemoryModelError, PlacementError) as exc:
            why = str(exc)
            continue
        if chosen is None:
            at_floor = lane_cost(lane_at(Layout("cpu")), floor, report, config.n_ubatch)[CPU_RESOURCE]
            why = (
                f"does not fit at its floor of {floor} tokens per slot: needs {_gib(at_floor)} on the CPU,"
                f" {_gib(remaining[host][CPU_RESOURCE])} RAM left"
                + (f", and no layer fits the GPUs' {_gib(sum(b for r, b in remaining[host].items() if r[0] == 'gpu'))}"
                   if report.gpus and config.use_gpu else "")
            )  # fmt: skip
            continue
        layout, floor_cost = chosen
        lane = lane_at(layout)
        lane.reasons = list(flags.reasons) + bound_reasons + factor_reasons
        lane.reasons.append(f"layout: {describe(layout, facts.n_layer)}")
        lane.reasons += adapter_reasons
        lane.reasons += spec_reasons
        template_reason = chat_template_for(facts, report.server)[1]
        if template_reason:
            lane.reasons.append(template_reason)
        if flags.flash_attn in (None, "auto") and layout.gpus:  # on the CPU auto is always on
            lane.reasons.append(flash_attn_for(flags, report, layout.gpus, facts).reason)
        prev = previous.get(host)
        had_before = prev is not None and any(s.lane_id == lane_id for s in prev.lanes)
        slack = sum(remaining[host].get(r, 0) - b for r, b in floor_cost.items())
        # A host that holds fewer of the persona's adapters comes after one that holds more: a
        # request for an adapter goes only to lanes that load it.
        missing = len(set(persona.adapters)) - len(adapters)
        options.append((not had_before, missing, rank(layout), -slack, host, lane, floor_cost))
    if not options:
        return False, why
    options.sort(key=lambda o: o[:5])
    *_, host, lane, floor_cost = options[0]
    for r, b in floor_cost.items():
        remaining[host][r] = remaining[host].get(r, 0) - b
    lanes[host].append(lane)
    return True, ""
