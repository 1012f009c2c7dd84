"""The pure lane planner: host reports + fleet config + demand -> one plan per host.

Deterministic (same inputs, byte-identical plans), no I/O, no clock. Every flag
llama-server gets is decided here and nowhere else; each decision leaves a reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
import dataclasses
import itertools
from dataclasses import dataclass, field

import msgspec

from planner_svc.layouts import (
    CPU_RESOURCE,
    Layout,
    Resource,
    candidates,
    cost_vector,
    describe,
    expert_layout,
    fits,
    largest,
    layout_memory,
    partial_layout,
    pins_for,
    rank,
)
from planner_svc.policy import (
    Flags,
    correction,
    chat_template_for,
    decide_flags,
    flash_attn_for,
    gpu_budgets,
    ram_budget,
    revert_target,
    window_bounds,
)
from planner_svc.prompt_cache import MIB, plan_cache_ram
from planner_svc import spans
from planner_svc.span_lanes import LaneKit, SpanBook, grow_spans, place_span
from planner_svc.threads import with_threads
from shared.llama.flags import effective_cache_type, lane_args
from shared.memory import (
    CTX_PAD,
    LaneShape,
    MemoryModelError,
    PlacementError,
    ngl_count,
)
from shared.messages import (
    Demand,
    FleetConfig,
    FleetPlan,
    HostPlan,
    HostReport,
    LaneFeedback,
    LaneSpec,
    MemoryBreakdown,
    ModelFacts,
    Persona,
    SpanWorker,
    Unplaced,
)

GIB = 1024**3
_T_SCALE = 1 << 16


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


# ------------------------------------------------------------------ lanes and their cost


def lane_id_for(model: str, index: int) -> str:
    return f"{model[:120]}-{index}"  # a Name holds 128 characters


@dataclass(slots=True)
class _Lane:
    host_id: str
    persona: Persona
    facts: ModelFacts
    index: int
    flags: Flags
    layout: Layout
    floor: int  # per-slot window
    ceiling: int
    factor: float  # >1 when the host reported more use than planned
    reasons: list[str] = field(default_factory=list)
    window: int = 0
    cache_ram: int = 0  # bytes of prompt cache (--cache-ram), decided once the windows are
    # A span lane (one lane across hosts): its workers and the serving host's view of them.
    span: spans.Span | None = None
    span_workers: tuple[SpanWorker, ...] = ()
    # (report, n_ubatch, cache_ram, number) of the last _CostKeys.key of this lane
    cost_key: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def lane_id(self) -> str:
        return lane_id_for(self.persona.model, self.index)

    @property
    def device(self) -> str:
        return "gpu" if self.layout.gpus else "cpu"

    def total_ctx(self, window: int) -> int:
        return window * self.persona.parallel

    def shape(self, report: HostReport, n_ubatch: int) -> LaneShape:
        """What the lane's memory depends on besides its window, the model and the layout
        (ctx 0: memory() sets it from the window)."""
        caps = report.server
        return LaneShape(
            ctx=0,
            parallel=self.persona.parallel,
            kv_unified=self.persona.kv_unified,
            type_k=effective_cache_type(self.flags.cache_type_k),
            type_v=effective_cache_type(self.flags.cache_type_v),
            # `auto` resolved per backend as llama-server does (RPC devices run the CPU's kernels)
            flash_attn=flash_attn_for(self.flags, report, self.layout.gpus, self.facts).on,
            layout=caps.kv_layout,
            n_ubatch=n_ubatch,
            cache_ram=self.cache_ram,
        )

    def memory(self, window: int, report: HostReport, n_ubatch: int) -> MemoryBreakdown:
        key = (_COST_KEYS.key(self, report, n_ubatch), window)
        memory = _MEMORY.get(key)
        if memory is None:
            base = dataclasses.replace(self.shape(report, n_ubatch), ctx=self.total_ctx(window))
            memory = _remember(_MEMORY, key, layout_memory(self.facts, self.layout, report, base))
        return memory


def _cost(lane: _Lane, window: int, report: HostReport, n_ubatch: int) -> Mapping[Resource, int]:
    """Bytes per resource (layouts.cost_vector), shared with every lane of the same key: read it, never change it."""
    key = (_COST_KEYS.key(lane, report, n_ubatch), window)
    cost = _COSTS.get(key)
    if cost is None:
        memory = lane.memory(window, report, n_ubatch)
        cost = _remember(_COSTS, key, cost_vector(memory, lane.layout, report, lane.factor))
    return cost


class _CostKeys:
    """A small number for everything a lane's memory and cost depend on besides its window, so
    lanes of the same model, flags and layout on hosts of the same hardware share one figure per
    window: the window search asks for thousands of them per replan (bench/planner_bench.py)."""

    def __init__(self) -> None:
        self.numbers: dict[object, int] = {}
        self.by_id: dict[int, tuple[object, int]] = {}
        self.counter = itertools.count()  # never reused, even after a clear: a lane may hold an old one

    def key(self, lane: _Lane, report: HostReport, n_ubatch: int) -> int:
        last = lane.cost_key
        if last is not None and last[0] is report and last[1] == n_ubatch and last[2] == lane.cache_ram:
            return last[3]
        devices = tuple((report.gpus[g].backend, report.gpus[g].unified) for g in lane.layout.gpus)
        # Every input of shape() and flash_attn_for, cheaper to hash than the shape it gives.
        flags = lane.flags
        inputs = (
            self.number(lane.facts), lane.layout, lane.persona.parallel, lane.persona.kv_unified, flags.cache_type_k,
            flags.cache_type_v, flags.flash_attn, self.number(report.server), devices, report.cpu_repack, lane.factor,
            n_ubatch, lane.cache_ram,
        )  # fmt: skip
        number = self.number(inputs, by_id=False)
        lane.cost_key = (report, n_ubatch, lane.cache_ram, number)
        return number

    def number(self, value, by_id: bool = True) -> int:
        """value's number; the same object's is found by its id (model facts and binary caps are
        large to hash, and every lane of a host shares its report's)."""
        if by_id:
            seen = self.by_id.get(id(value))
            if seen is not None and seen[0] is value:
                return seen[1]
        number = self.numbers.get(value)
        if number is None:
            if len(self.numbers) >= _MEMO_MAX:
                self.numbers.clear()
                self.by_id.clear()
            number = self.numbers[value] = next(self.counter)
        if by_id:
            self.by_id[id(value)] = (value, number)  # holds value: its id is not reused meanwhile
        return number


def _remember(memo: dict, key, value):
    if len(memo) >= _MEMO_MAX:
        memo.clear()
    memo[key] = value
    return value


_MEMO_MAX = 1 << 15  # entries per memo: a few MiB of figures; cleared whole when full
_COSTS: dict[tuple[int, int], dict[Resource, int]] = {}
_MEMORY: dict[tuple[int, int], MemoryBreakdown] = {}
_GROWN: dict[tuple, list[int]] = {}
_COST_KEYS = _CostKeys()


def _sum_costs(costs) -> dict[Resource, int]:
    total: dict[Resource, int] = {}
    for c in costs:
        for r, b in c.items():
            total[r] = total.get(r, 0) + b
    return total


def _grow(lanes: list[_Lane], budget: Mapping[Resource, int], cost: Callable[[_Lane, int], dict]) -> None:
    """Elastic windows: one common growth fraction t for every lane of a host.

    Each lane's window is monotone in t and the largest feasible t is monotone in the
    budgets, so more memory, or a cheaper cache type, never gives any lane a smaller
    window; a window is the largest that fits every device its lane touches.
    """
    if not lanes:
        return
    steps = [(lane.ceiling - lane.floor) // CTX_PAD for lane in lanes]

    def windows(t: int) -> list[int]:
        return [lane.floor + CTX_PAD * (s * t // _T_SCALE) for lane, s in zip(lanes, steps)]

    def fits(t: int) -> bool:
        total = _sum_costs(cost(lane, w) for lane, w in zip(lanes, windows(t)))
        return all(b <= budget.get(r, 0) for r, b in total.items())

    for lane, w in zip(lanes, windows(largest(fits, 0, _T_SCALE))):
        lane.window = w


def _grow_memo(lanes: list[_Lane], budget: Mapping[Resource, int], cost, keys: list[int]) -> None:
    """_grow, remembered: hosts with the same lanes (cost keys, floors, ceilings) and budgets get
    the same windows, so a fleet of alike hosts searches once per kind of host."""
    key = (tuple(zip(keys, [lane.floor for lane in lanes], [lane.ceiling for lane in lanes])),
           tuple(sorted(budget.items())))  # fmt: skip
    windows = _GROWN.get(key)
    if windows is None:
        _grow(lanes, budget, cost)
        windows = _remember(_GROWN, key, [lane.window for lane in lanes])
    for lane, window in zip(lanes, windows):
        lane.window = window



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
    first: Sequence[str] = (),
) -> FleetPlan:
    """`first`: models placed before all others, in this order (on demand: the lanes that run,
    then the woken models), so a newcomer never takes a running lane's room unasked."""
    previous = previous or {}
    feedback = feedback or {}
    reports = sorted({r.host_id: r for r in reports}.values(), key=lambda r: r.host_id)
    if demand is None or not demand.personas:
        demand = default_demand(reports)
    rank = {m: i for i, m in reversed(list(enumerate(first)))}
    personas = sorted(demand.personas, key=lambda p: (rank.get(p.model, len(first)), -p.priority, p.model, p.alias or ""))

    host_reasons: dict[str, list[str]] = {r.host_id: [] for r in reports}
    host_unplaced: dict[str, list[Unplaced]] = {r.host_id: [] for r in reports}
    fleet_unplaced: list[Unplaced] = []
    remaining: dict[str, dict[Resource, int]] = {}
    for r in reports:
        remaining[r.host_id] = _budgets(r, config)
        if r.server is None:
            host_reasons[r.host_id].append("no lanes: no usable llama-server binary on this host")
    lanes: dict[str, list[_Lane]] = {r.host_id: [] for r in reports}
    span_book = SpanBook()
    deferred = []  # (persona, candidates, why, target host) of lanes that fit no single host

    for persona in personas:
        holders = [(r, m) for r in reports if r.server is not None for m in r.models if m.name == persona.model]
        if not holders:
            fleet_unplaced.append(Unplaced(model=persona.model, reason="no host with a llama-server holds this model"))
            continue
        wanted = len(holders) if persona.lanes is None else persona.lanes
        for i in range(wanted):
            candidates = holders if persona.lanes is not None else [holders[i]]
            placed, why = _place(persona, candidates, config, lanes, remaining, previous, feedback)
            if not placed:
                target = candidates[0][0].host_id if len(candidates) == 1 else None
                deferred += [(persona, candidates, why, target)] * (wanted - i if persona.lanes is not None else 1)
                if persona.lanes is not None:
                    break

    # Spans last: a lane across hosts takes what the single-host lanes left at their floors.
    failed_spans: set[str] = set()
    for persona, candidates, why, target in deferred:
        if persona.model in failed_spans:
            continue  # one unplaced entry for the lanes of a persona no span takes
        if persona.lanes is not None or not span_book.has(persona.model):
            placed, span_why = place_span(
                persona, candidates, reports, config, lanes, remaining, previous, feedback, span_book, _KIT
            )
            if placed:
                continue
            why = f"{why}; {span_why}" if span_why else why
            if persona.lanes is not None:
                failed_spans.add(persona.model)
        entry = Unplaced(model=persona.model, reason=why)
        (host_unplaced[target] if target else fleet_unplaced).append(entry)
    grow_spans(span_book, remaining, config, _KIT)

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
                feedback.get(r.host_id, ()),
                span_book,
            )
        )
    return FleetPlan(hosts=tuple(plans), unplaced=tuple(fleet_unplaced))


def _budgets(report: HostReport, config: FleetConfig) -> dict[Resource, int]:
    budgets = {CPU_RESOURCE: ram_budget(report, config)}
    budgets.update({("gpu", i): b for i, b in gpu_budgets(report, config).items()})
    return budgets


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
        floor_cost = _cost(lane, lane.floor, report, config.n_ubatch)
        # The layout is chosen with f16 costs, so the cache type only moves the window.
        f16 = _cost(lane_at(layout, f16=True), lane.floor, report, config.n_ubatch)
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


def _place(persona, candidates_, config, lanes, remaining, previous, feedback) -> tuple[bool, str]:
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

        built: dict[tuple[Layout, bool], _Lane] = {}  # one lane per layout: its cost key is reused

        def lane_at(layout: Layout, f16: bool = False) -> _Lane:
            if (layout, f16) not in built:
                f = Flags(None, None, None, ()) if f16 else flags
                built[layout, f16] = _Lane(host, persona, facts, index, f, layout, floor, ceiling, factor)
            return built[layout, f16]

        try:
            chosen = _choose_layout(lane_at, report, remaining[host], config, _previous_layout(previous.get(host), lane_id))
        except (MemoryModelError, PlacementError) as exc:
            why = str(exc)
            continue
        if chosen is None:
            at_floor = _cost(lane_at(Layout("cpu")), floor, report, config.n_ubatch)[CPU_RESOURCE]
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
        template_reason = chat_template_for(facts, report.server)[1]
        if template_reason:
            lane.reasons.append(template_reason)
        if flags.flash_attn in (None, "auto") and layout.gpus:  # on the CPU auto is always on
            lane.reasons.append(flash_attn_for(flags, report, layout.gpus, facts).reason)
        had_before = any(s.lane_id == lane.lane_id for s in (previous.get(host).lanes if previous.get(host) else ()))
        slack = sum(remaining[host].get(r, 0) - b for r, b in floor_cost.items())
        options.append((not had_before, rank(layout), -slack, host, lane, floor_cost))
    if not options:
        return False, why
    options.sort(key=lambda o: o[:4])
    *_, host, lane, floor_cost = options[0]
    for r, b in floor_cost.items():
        remaining[host][r] = remaining[host].get(r, 0) - b
    lanes[host].append(lane)
    return True, ""


def _host_plan(
    report, config, lanes, reasons, unplaced, prev: HostPlan | None, config_revision, feedback=(), span_book=None
) -> HostPlan:
    budgets = _budgets(report, config)
    span_book = span_book or SpanBook()
    # Memory lent to other hosts' span lanes, and this host's own span lanes (their windows were
    # chosen when they were placed), come off before the other lanes grow.
    grow_budget = dict(budgets)
    grow_budget[CPU_RESOURCE] = grow_budget.get(CPU_RESOURCE, 0) - span_book.lent.get(report.host_id, 0)
    for lane in lanes:
        if lane.span is not None:
            used = _cost(lane, lane.window, lane.span.report, config.n_ubatch)
            grow_budget[CPU_RESOURCE] -= used.get(CPU_RESOURCE, 0)
    single = [lane for lane in lanes if lane.span is None]
    specs: list[LaneSpec] = []
    if report.server is not None:

        def cost(lane: _Lane, window: int) -> dict[Resource, int]:
            return _cost(lane, window, report, config.n_ubatch)

        _grow_memo(single, grow_budget, cost, [_COST_KEYS.key(lane, report, config.n_ubatch) for lane in single])
        _keep_stable(single, grow_budget, cost, prev, config, report.server.has_kv_unified)
        # A span lane's cache stays 0: its host's RAM went to the lanes and what it lends.
        _prompt_caches(single, grow_budget, cost, prev, config, report.server.has_cache_ram)
        busy = {fb.port: fb.detail for fb in feedback if fb.kind == "port_busy" and fb.port}
        specs, no_port = _assign_ports(report, [_spec(report, config, lane) for lane in lanes], prev, busy)
        specs = with_threads(report, config, specs, prev)
        reasons = list(reasons) + [
            f"port {port} is given to no lane: taken by another program on this host" for port in sorted(busy)
        ]
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
        budget_ram=budgets[CPU_RESOURCE],
        budget_gpu=sum(b for r, b in budgets.items() if r[0] == "gpu"),
        budget_gpus=tuple(budgets.get(("gpu", i), 0) for i in range(len(report.gpus))),
        max_restarts=config.max_restarts_per_host,
        drain_timeout=config.drain_timeout,
        lanes=tuple(specs),
        unplaced=tuple(unplaced),
        reasons=tuple(reasons),
        rpc_workers=tuple(sorted(span_book.specs.get(report.host_id, ()), key=lambda w: (w.port, w.lane_id))),
    )
    if prev is None:
        return msgspec.structs.replace(draft, plan_revision=1)
    # Budgets drift with every report; a plan is rewritten only when what it asks for changes.
    comparable = msgspec.structs.replace(
        prev,
        plan_revision=0,
        config_revision=config_revision,
        budget_ram=draft.budget_ram,
        budget_gpu=draft.budget_gpu,
        budget_gpus=draft.budget_gpus,
        planned_by="",
    )
    if _asked(comparable) == _asked(draft):
        return (
            prev
            if prev.config_revision == config_revision
            else msgspec.structs.replace(prev, config_revision=config_revision)
        )
    return msgspec.structs.replace(draft, plan_revision=prev.plan_revision + 1)


def _asked(plan: HostPlan) -> HostPlan:
    """The plan without what follows from the rest of it (each lane's layout, each device's
    backend): a plan an older planner wrote, which lacks them, asks for the same."""
    lanes = tuple(
        msgspec.structs.replace(
            s, layout=None,
            memory=msgspec.structs.replace(
                s.memory, devices=tuple(msgspec.structs.replace(d, backend="") for d in s.memory.devices)
            ),
        )
        for s in plan.lanes
    )  # fmt: skip
    return msgspec.structs.replace(plan, lanes=lanes)


def _keep_stable(
    pool: list[_Lane], budget: Mapping[Resource, int], cost, prev: HostPlan | None, config: FleetConfig,
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
        total = _sum_costs(cost(x, x.window) for x in pool)
        if any(b > budget.get(r, 0) for r, b in total.items()):
            lane.window = proposed
            continue
        lane.reasons.append(
            f"kept window {old_window}: the replan's {proposed} differs by {change:.0%},"
            f" under the {config.min_gain_fraction:.0%} worth a restart"
        )


def _prompt_caches(pool: list[_Lane], budget: Mapping[Resource, int], cost, prev: HostPlan | None,
                   config: FleetConfig, has_cache_ram: bool) -> None:  # fmt: skip
    """Each lane's --cache-ram from the host RAM its buffers leave (planner_svc/prompt_cache.py)."""
    if not pool or not has_cache_ram:
        return
    used = sum(cost(lane, lane.window).get(CPU_RESOURCE, 0) for lane in pool)
    before = {s.lane_id: s.cache_ram_mib for s in prev.lanes} if prev else {}
    factor = max(lane.factor for lane in pool)
    planned = plan_cache_ram([lane.lane_id for lane in pool], budget.get(CPU_RESOURCE, 0) - used, before,
                             config.min_gain_fraction, factor)  # fmt: skip
    for lane in pool:
        mib, reason = planned[lane.lane_id]
        lane.cache_ram = mib * MIB
        lane.reasons.append(reason)


def _same_shape(spec: LaneSpec, lane: _Lane, has_kv_unified: bool = True) -> bool:
    return (
        spec.model_path == lane.facts.path
        and spec.parallel == lane.persona.parallel
        and spec.kv_unified == (lane.persona.kv_unified and has_kv_unified)  # as _spec renders it
        and spec.cache_type_k == lane.flags.cache_type_k
        and spec.cache_type_v == lane.flags.cache_type_v
        and spec.flash_attn == lane.flags.flash_attn
        and spec.gpu_devices == lane.layout.gpus
        and spec.n_gpu_layers == _n_gpu_layers(lane)
        and spec.n_cpu_moe == lane.layout.n_cpu_moe
    )


def _n_gpu_layers(lane: _Lane) -> int:
    """-ngl as the spec carries it (the wire's int)."""
    return ngl_count(lane.layout.n_gpu_layers, lane.facts.n_layer) if lane.layout.gpus else 0


def _spec(report: HostReport, config: FleetConfig, lane: _Lane) -> LaneSpec:
    caps = report.server
    report = lane.span.report if lane.span is not None else report  # a span sees its workers as devices
    memory = lane.memory(lane.window, report, config.n_ubatch)
    pins = pins_for(lane.layout, report)
    window_reason = f"window {lane.window} tokens per slot x {lane.persona.parallel} on {lane.device}: " + (
        "the ceiling" if lane.window == lane.ceiling else "the largest multiple of 256 that fits the budget"
    )
    reasons = [window_reason, *lane.reasons]
    embeddings = lane.persona.embeddings if lane.persona.embeddings is not None else bool(lane.facts.pooling)
    pooling = "mean" if embeddings and not lane.facts.pooling else None
    if embeddings:
        asked = "the persona asks for them" if lane.persona.embeddings else f"the model declares {lane.facts.pooling} pooling"
        reasons.append(f"embeddings only (--embeddings): {asked}" + ("; --pooling mean: the model declares none" if pooling else ""))
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
        n_gpu_layers=_n_gpu_layers(lane),
        gpu_devices=pins.gpu_devices,
        device_names=pins.device_names,
        split_mode=pins.split_mode,
        main_gpu=pins.main_gpu,
        tensor_split=pins.tensor_split,
        rpc_servers=pins.rpc_servers,
        cache_type_k=lane.flags.cache_type_k,
        cache_type_v=lane.flags.cache_type_v,
        flash_attn=lane.flags.flash_attn,
        fit_off=caps.has_fit,
        n_ubatch=config.n_ubatch,
        memory=memory,
        reasons=tuple(reasons),
        layout=lane.layout,
        n_cpu_moe=lane.layout.n_cpu_moe,
        chat_template=chat_template_for(lane.facts, caps)[0],
        cache_ram_mib=lane.cache_ram // MIB if caps.has_cache_ram else None,
        embeddings=embeddings,
        pooling=pooling,
        workers=lane.span_workers,
    )


def _assign_ports(
    report: HostReport, specs: list[LaneSpec], prev: HostPlan | None, busy: Mapping[int, str] | None = None
) -> tuple[list[LaneSpec], list[LaneSpec]]:
    """Keep each lane's previous port; give new lanes the lowest free port in the host's range.

    Ports the host said another program holds (`busy`) are given to no lane: a lane
    that had one moves to a free port (the host plan's reasons say why).
    """
    busy = busy or {}
    allowed = range(report.port_base, min(report.port_base + report.port_count, 65536))  # ports end at 65535
    before = {s.lane_id: s.port for s in prev.lanes} if prev else {}
    taken: set[int] = set(busy)
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


_KIT = LaneKit(_Lane, _cost, lane_id_for)  # what the span step (planner_svc.span_lanes) builds lanes with
