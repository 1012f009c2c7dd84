"""The pure lane planner: host reports + fleet config + demand -> one plan per host.

Deterministic (same inputs, byte-identical plans), no I/O, no clock. Every flag
llama-server gets is decided here and nowhere else; each decision leaves a reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from planner_svc.policy import (
    Flags,
    correction,
    decide_flags,
    gpu_budget,
    ram_budget,
    revert_target,
    window_bounds,
)
from shared.argv import lane_args
from shared.capabilities import flash_attn_effective
from shared.memory import CTX_PAD, MemoryModelError, estimate
from shared.messages import (
    Demand,
    Device,
    FleetConfig,
    FleetPlan,
    HostPlan,
    HostReport,
    LaneFeedback,
    LaneSpec,
    MemoryBreakdown,
    ModelFacts,
    Persona,
    ServerCaps,
    Unplaced,
)

GIB = 1024**3
_T_SCALE = 1 << 16


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


# ------------------------------------------------------------------ lanes and their cost


def lane_id_for(model: str, index: int) -> str:
    return f"{model[:120]}-{index}"  # a Name holds 128 characters


@dataclass
class _Lane:
    host_id: str
    persona: Persona
    facts: ModelFacts
    index: int
    flags: Flags
    device: Device
    floor: int  # per-slot window
    ceiling: int
    factor: float  # >1 when the host reported more use than planned
    reasons: list[str] = field(default_factory=list)
    window: int = 0

    @property
    def lane_id(self) -> str:
        return lane_id_for(self.persona.model, self.index)

    def total_ctx(self, window: int) -> int:
        return window * self.persona.parallel

    def memory(self, window: int, caps: ServerCaps, n_ubatch: int) -> MemoryBreakdown:
        return estimate(
            self.facts,
            ctx=self.total_ctx(window),
            parallel=self.persona.parallel,
            kv_unified=self.persona.kv_unified,
            type_k=self.flags.cache_type_k or "f16",
            type_v=self.flags.cache_type_v or "f16",
            flash_attn=flash_attn_effective(self.flags.flash_attn, caps, self.device),
            layout=caps.kv_layout,
            n_ubatch=n_ubatch,
            device=self.device,
        )


def _cost(lane: _Lane, window: int, caps: ServerCaps, n_ubatch: int) -> int:
    return int(lane.memory(window, caps, n_ubatch).total_bytes * lane.factor + 0.999)


def _grow(lanes: list[_Lane], budget: int, cost: Callable[[_Lane, int], int]) -> None:
    """Elastic windows: one common growth fraction t for every lane in a pool.

    Each lane's window is monotone in t and the largest feasible t is monotone in the
    budget, so more memory, or a cheaper cache type, never gives any lane a smaller window.
    """
    if not lanes:
        return
    steps = [(lane.ceiling - lane.floor) // CTX_PAD for lane in lanes]

    def windows(t: int) -> list[int]:
        return [lane.floor + CTX_PAD * (s * t // _T_SCALE) for lane, s in zip(lanes, steps)]

    def fits(t: int) -> bool:
        return sum(cost(lane, w) for lane, w in zip(lanes, windows(t))) <= budget

    lo, hi = 0, _T_SCALE
    if fits(hi):
        lo = hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    for lane, w in zip(lanes, windows(lo)):
        lane.window = w


# ------------------------------------------------------------------ the planner


def default_demand(reports: Sequence[HostReport]) -> Demand:
    """No demand given: every model found is served, one lane on each host holding it."""
    names = sorted({m.name for r in reports for m in r.models})
    return Demand(personas=tuple(Persona(model=n) for n in names))


def plan(
    reports: Sequence[HostReport],
    config: FleetConfig,
    demand: Demand | None = None,
    *,
    previous: Mapping[str, HostPlan] | None = None,
    feedback: Mapping[str, Sequence[LaneFeedback]] | None = None,
    config_revision: int = 0,
) -> FleetPlan:
    previous = previous or {}
    feedback = feedback or {}
    reports = sorted({r.host_id: r for r in reports}.values(), key=lambda r: r.host_id)
    if demand is None or not demand.personas:
        demand = default_demand(reports)
    personas = sorted(demand.personas, key=lambda p: (-p.priority, p.model, p.alias or ""))

    host_reasons: dict[str, list[str]] = {r.host_id: [] for r in reports}
    host_unplaced: dict[str, list[Unplaced]] = {r.host_id: [] for r in reports}
    fleet_unplaced: list[Unplaced] = []
    remaining: dict[tuple[str, Device], int] = {}
    for r in reports:
        remaining[(r.host_id, "cpu")] = ram_budget(r, config)
        remaining[(r.host_id, "gpu")] = gpu_budget(r, config)
        if r.server is None:
            host_reasons[r.host_id].append("no lanes: no usable llama-server binary on this host")
    lanes: dict[str, list[_Lane]] = {r.host_id: [] for r in reports}

    for persona in personas:
        holders = [(r, m) for r in reports if r.server is not None for m in r.models if m.name == persona.model]
        if not holders:
            fleet_unplaced.append(Unplaced(model=persona.model, reason="no host with a llama-server holds this model"))
            continue
        wanted = len(holders) if persona.lanes is None else persona.lanes
        for _ in range(wanted):
            candidates = holders if persona.lanes is not None else [holders.pop(0)]
            placed, why = _place(persona, candidates, config, lanes, remaining, previous, feedback)
            if not placed:
                target = candidates[0][0].host_id if len(candidates) == 1 else None
                entry = Unplaced(model=persona.model, reason=why)
                (host_unplaced[target] if target else fleet_unplaced).append(entry)
                if persona.lanes is not None:
                    break

    plans = []
    for r in reports:
        plans.append(
            _host_plan(
                r,
                config,
                lanes[r.host_id],
                host_reasons[r.host_id],
                host_unplaced[r.host_id],
                previous.get(r.host_id),
                config_revision,
            )
        )
    return FleetPlan(hosts=tuple(plans), unplaced=tuple(fleet_unplaced))


def _place(persona, candidates, config, lanes, remaining, previous, feedback) -> tuple[bool, str]:
    """Put one lane of persona on the best candidate host where it fits at its floor."""
    options = []
    why = "does not fit"
    for report, facts in candidates:
        host = report.host_id
        fb = [f for f in feedback.get(host, ()) if f.model == persona.model]
        index = sum(1 for lane in lanes[host] if lane.persona.model == persona.model)
        revert = revert_target(config, report, facts, persona, lane_id_for(persona.model, index), fb)
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
        caps = report.server
        for device in ("gpu", "cpu"):
            lane = _Lane(host, persona, facts, index, flags, device, floor, ceiling, factor)
            if device == "gpu" and remaining[(host, "gpu")] <= 0:
                continue
            try:
                floor_cost = _cost(lane, floor, caps, config.n_ubatch)
                # The device is chosen with f16 costs, so the cache type only moves the window.
                f16 = _Lane(host, persona, facts, index, Flags(None, None, None, ()), device, floor, ceiling, factor)
                device_cost = max(floor_cost, _cost(f16, floor, caps, config.n_ubatch))
            except MemoryModelError as exc:
                why = str(exc)
                break
            if device_cost <= remaining[(host, device)]:
                lane.reasons = list(flags.reasons) + bound_reasons + factor_reasons
                had_before = any(
                    s.lane_id == lane.lane_id for s in (previous.get(host).lanes if previous.get(host) else ())
                )
                options.append(
                    (not had_before, -remaining[(host, device)] + floor_cost, host, device, lane, floor_cost)
                )
                break
            why = (
                f"does not fit at its floor of {floor} tokens per slot: needs {_gib(floor_cost)},"
                f" {_gib(remaining[(host, 'cpu')])} RAM left"
            )
    if not options:
        return False, why
    options.sort(key=lambda o: o[:4])
    *_, host, device, lane, floor_cost = options[0]
    remaining[(host, device)] -= floor_cost
    lanes[host].append(lane)
    return True, ""


def _host_plan(report, config, lanes, reasons, unplaced, prev: HostPlan | None, config_revision) -> HostPlan:
    budgets = {"cpu": ram_budget(report, config), "gpu": gpu_budget(report, config)}
    specs: list[LaneSpec] = []
    if report.server is not None:

        def cost(lane: _Lane, window: int) -> int:
            return _cost(lane, window, report.server, config.n_ubatch)

        for device in ("gpu", "cpu"):
            pool = [lane for lane in lanes if lane.device == device]
            _grow(pool, budgets[device], cost)
            _keep_stable(pool, budgets[device], cost, prev, config, report.server.has_kv_unified)
        specs, no_port = _assign_ports(report, [_spec(report, config, lane) for lane in lanes], prev)
        unplaced = list(unplaced) + [
            Unplaced(
                model=s.model, reason=f"no free port in {report.port_base}..{report.port_base + report.port_count - 1}"
            )
            for s in no_port
        ]
    draft = HostPlan(
        host_id=report.host_id,
        plan_revision=0,
        config_revision=config_revision,
        budget_ram=budgets["cpu"],
        budget_gpu=budgets["gpu"],
        max_restarts=config.max_restarts_per_host,
        drain_timeout=config.drain_timeout,
        lanes=tuple(specs),
        unplaced=tuple(unplaced),
        reasons=tuple(reasons),
    )
    if prev is None:
        return msgspec.structs.replace(draft, plan_revision=1)
    # Budgets drift with every report; a plan is rewritten only when what it asks for changes.
    comparable = msgspec.structs.replace(
        prev, plan_revision=0, config_revision=config_revision, budget_ram=draft.budget_ram, budget_gpu=draft.budget_gpu
    )
    if comparable == draft:
        return (
            prev
            if prev.config_revision == config_revision
            else msgspec.structs.replace(prev, config_revision=config_revision)
        )
    return msgspec.structs.replace(draft, plan_revision=prev.plan_revision + 1)


def _keep_stable(
    pool: list[_Lane], budget: int, cost, prev: HostPlan | None, config: FleetConfig, has_kv_unified: bool = True
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
        if sum(cost(x, x.window) for x in pool) > budget:
            lane.window = proposed
            continue
        lane.reasons.append(
            f"kept window {old_window}: the replan's {proposed} differs by {change:.0%},"
            f" under the {config.min_gain_fraction:.0%} worth a restart"
        )


def _same_shape(spec: LaneSpec, lane: _Lane, has_kv_unified: bool = True) -> bool:
    return (
        spec.model_path == lane.facts.path
        and spec.parallel == lane.persona.parallel
        and spec.kv_unified == (lane.persona.kv_unified and has_kv_unified)  # as _spec renders it
        and spec.cache_type_k == lane.flags.cache_type_k
        and spec.cache_type_v == lane.flags.cache_type_v
        and spec.flash_attn == lane.flags.flash_attn
        and (spec.n_gpu_layers > 0) == (lane.device == "gpu")
    )


def _spec(report: HostReport, config: FleetConfig, lane: _Lane) -> LaneSpec:
    caps = report.server
    memory = lane.memory(lane.window, caps, config.n_ubatch)
    window_reason = f"window {lane.window} tokens per slot x {lane.persona.parallel} on {lane.device}: " + (
        "the ceiling" if lane.window == lane.ceiling else "the largest multiple of 256 that fits the budget"
    )
    reasons = [window_reason, *lane.reasons]
    return LaneSpec(
        lane_id=lane.lane_id,
        model=lane.persona.model,
        model_path=lane.facts.path,
        alias=lane.persona.alias or lane.persona.model,
        port=report.port_base,  # placeholder until ports are assigned
        bind=report.lane_bind,
        ctx_total=lane.total_ctx(lane.window),
        ctx_per_slot=lane.window if not lane.persona.kv_unified else lane.total_ctx(lane.window),
        parallel=lane.persona.parallel,
        kv_unified=lane.persona.kv_unified and caps.has_kv_unified,
        n_gpu_layers=lane.facts.n_layer + 1 if lane.device == "gpu" else 0,
        cache_type_k=lane.flags.cache_type_k,
        cache_type_v=lane.flags.cache_type_v,
        flash_attn=lane.flags.flash_attn,
        fit_off=caps.has_fit,
        n_ubatch=config.n_ubatch,
        memory=memory,
        reasons=tuple(reasons),
    )


def _assign_ports(
    report: HostReport, specs: list[LaneSpec], prev: HostPlan | None
) -> tuple[list[LaneSpec], list[LaneSpec]]:
    """Keep each lane's previous port; give new lanes the lowest free port in the host's range."""
    allowed = range(report.port_base, min(report.port_base + report.port_count, 65536))  # ports end at 65535
    before = {s.lane_id: s.port for s in prev.lanes} if prev else {}
    taken: set[int] = set()
    ports: dict[str, int] = {}
    for spec in specs:
        port = before.get(spec.lane_id)
        if port in allowed and port not in taken:
            ports[spec.lane_id] = port
            taken.add(port)
    out, dropped = [], []
    for spec in specs:
        port = ports.get(spec.lane_id)
        if port is None:
            port = next((p for p in allowed if p not in taken), None)
            if port is None:
                dropped.append(spec)
                continue
            taken.add(port)
        spec = msgspec.structs.replace(spec, port=port)
        out.append(msgspec.structs.replace(spec, args=lane_args(spec, report.server)))
    return out, dropped
