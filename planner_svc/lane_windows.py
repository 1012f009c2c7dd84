"""A lane as the planner sizes it: its cost per device at a window, and the windows of a host's
lanes (elastic growth, the prompt cache from the RAM the lanes leave; a running lane's window
kept when a change is not worth a restart: planner_svc/kept_windows.py). Pure; planner_svc/planner.py
drives it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from planner_svc import spans
from planner_svc.adapters import pooled
from planner_svc.layouts import CPU_RESOURCE, Layout, Resource, cost_vector, largest, layout_memory
from planner_svc.policy import Flags, flash_attn_for
from planner_svc.prompt_cache import MIB, plan_cache_ram
from planner_svc.speculative import Speculation
from shared.llama.flags import effective_cache_type
from shared.memory import CTX_PAD, LaneShape, ngl_count
from shared.memory.speculative import draft_shape, speculator_host_bytes, target_shape, with_speculation
from shared.messages.config import FleetConfig, Persona
from shared.messages.hosts import AdapterFacts, HostReport, ModelFacts
from shared.messages.plans import HostPlan, MemoryBreakdown, SpanWorker

_T_SCALE = 1 << 16


def lane_id_for(model: str, index: int) -> str:
    return f"{model[:120]}-{index}"  # a Name holds 128 characters


@dataclass(slots=True)
class PlannedLane:
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
    swa_full: bool = False  # --swa-full (planner_svc/swa_full.py), decided once the windows are
    # A span lane (one lane across hosts): its workers and the serving host's view of them.
    span: spans.Span | None = None
    span_workers: tuple[SpanWorker, ...] = ()
    # (report, n_ubatch, cache_ram, swa_full, number) of the last _CostKeys.key of this lane
    cost_key: tuple | None = field(default=None, repr=False, compare=False)
    adapters: tuple[AdapterFacts, ...] = ()  # LoRA adapters it loads (planner_svc/adapters.py)
    speculation: Speculation | None = None  # speculative decoding (planner_svc/speculative.py)

    @property
    def lane_id(self) -> str:
        return lane_id_for(self.persona.model, self.index)

    @property
    def device(self) -> str:
        return "gpu" if self.layout.gpus else "cpu"

    def total_ctx(self, window: int) -> int:
        return window * self.persona.parallel

    def shape(self, report: HostReport, n_ubatch: int, ctx: int = 0) -> LaneShape:
        """What the lane's memory depends on besides the model and the layout (ctx: the whole
        context of its window, memory() gives it)."""
        caps = report.server
        return LaneShape(
            ctx=ctx,
            parallel=self.persona.parallel,
            kv_unified=self.persona.kv_unified,
            swa_full=self.swa_full,
            type_k=effective_cache_type(self.flags.cache_type_k),
            type_v=effective_cache_type(self.flags.cache_type_v),
            # `auto` resolved per backend as llama-server does (RPC devices run the CPU's kernels)
            flash_attn=flash_attn_for(self.flags, report, self.layout.gpus, self.facts).on,
            layout=caps.kv_layout,
            n_ubatch=n_ubatch,
            cache_ram=self.cache_ram,
            adapters=self.adapters,
            pooled=pooled(self.persona, self.facts, caps.has_reranking),
            mmproj=self.loads_projector and caps.has_mmproj,
            mmproj_offload=bool(self.layout.gpus),
        )

    @property
    def loads_projector(self) -> bool:
        """--mmproj: the model has a projector and the persona does not turn it off."""
        return self.facts.mmproj is not None and self.persona.vision is not False

    def memory(self, window: int, report: HostReport, n_ubatch: int) -> MemoryBreakdown:
        key = (_COST_KEYS.key(self, report, n_ubatch), window)
        memory = _MEMORY.get(key)
        if memory is None:
            base = self.shape(report, n_ubatch, self.total_ctx(window))
            memory = _remember(_MEMORY, key, self._with_speculation(base, report))
        return memory

    def _with_speculation(self, base: LaneShape, report: HostReport) -> MemoryBreakdown:
        """The target's buffers, plus the draft's on the devices it lands on and the speculator's
        host bytes (shared/memory/speculative.py)."""
        sp = self.speculation
        if sp is None:
            return layout_memory(self.facts, self.layout, report, base)
        target = layout_memory(self.facts, self.layout, report, target_shape(base, sp.spec_type))
        draft = None
        if sp.draft is not None:
            draft = layout_memory(sp.draft, draft_layout(self.layout), report, draft_shape(base))
        host = speculator_host_bytes(sp.spec_type, self.facts.n_vocab, base.parallel, base.n_ubatch)
        return with_speculation(target, draft, host)


def draft_layout(layout: Layout) -> Layout:
    """Where the draft goes: every layer on the lane's GPUs when the target's are (the draft's
    --spec-draft-ngl all, on the devices the lane is pinned to), else on the CPU (-ngld 0)."""
    if layout.kind in ("gpu", "split") and not layout.n_cpu_moe:
        return Layout(layout.kind, layout.gpus, layout.shares, "all")
    return Layout("cpu")


def lane_cost(lane: PlannedLane, window: int, report: HostReport, n_ubatch: int) -> Mapping[Resource, int]:
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

    def key(self, lane: PlannedLane, report: HostReport, n_ubatch: int) -> int:
        last = lane.cost_key
        if last is not None and last[0] is report and last[1:4] == (n_ubatch, lane.cache_ram, lane.swa_full):
            return last[4]
        gpus = lane.layout.gpus
        devices = tuple((report.gpus[g].backend, report.gpus[g].unified) for g in gpus) if gpus else ()
        # Every input of shape() and flash_attn_for, cheaper to hash than the shape it gives.
        flags = lane.flags
        inputs = (
            self.number(lane.facts), lane.layout, lane.persona.parallel, lane.persona.kv_unified, flags.cache_type_k,
            flags.cache_type_v, flags.flash_attn, self.number(report.server), devices, report.cpu_repack, lane.factor,
            n_ubatch, lane.cache_ram, lane.swa_full, lane.adapters, lane.persona.embeddings, lane.persona.reranking,
            lane.persona.vision,
            lane.speculation and (lane.speculation.spec_type, lane.speculation.draft and self.number(lane.speculation.draft)),
        )  # fmt: skip
        number = self.number(inputs, by_id=False)
        lane.cost_key = (report, n_ubatch, lane.cache_ram, lane.swa_full, number)
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
_COSTS: dict[tuple[int, int], Mapping[Resource, int]] = {}
_MEMORY: dict[tuple[int, int], MemoryBreakdown] = {}
_GROWN: dict[tuple, list[int]] = {}
_COST_KEYS = _CostKeys()


def cost_key(lane: PlannedLane, report: HostReport, n_ubatch: int) -> int:
    """The small number for what the lane's memory and cost depend on besides its window (_CostKeys)."""
    return _COST_KEYS.key(lane, report, n_ubatch)


def sum_costs(costs) -> dict[Resource, int]:
    total: dict[Resource, int] = {}
    for c in costs:
        for r, b in c.items():
            total[r] = total.get(r, 0) + b
    return total


def _grow(lanes: list[PlannedLane], budget: Mapping[Resource, int], cost: Callable[[PlannedLane, int], dict]) -> None:
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
        total = sum_costs(cost(lane, w) for lane, w in zip(lanes, windows(t)))
        return all(b <= budget.get(r, 0) for r, b in total.items())

    for lane, w in zip(lanes, windows(largest(fits, 0, _T_SCALE))):
        lane.window = w


def grow_windows(lanes: list[PlannedLane], budget: Mapping[Resource, int], cost, keys: list[int]) -> None:
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


def size_prompt_caches(pool: list[PlannedLane], budget: Mapping[Resource, int], cost, prev: HostPlan | None,
                       config: FleetConfig, has_cache_ram: bool, pressed: bool = True) -> None:  # fmt: skip
    """Each lane's --cache-ram from the host RAM its buffers leave (planner_svc/prompt_cache.py);
    `pressed`: the host's free RAM is below its headroom (a larger limit is kept only when not)."""
    if not pool or not has_cache_ram:
        return
    used = sum(cost(lane, lane.window).get(CPU_RESOURCE, 0) for lane in pool)
    before = {s.lane_id: s.cache_ram_mib for s in prev.lanes} if prev else {}
    factor = max(lane.factor for lane in pool)
    planned = plan_cache_ram([lane.lane_id for lane in pool], budget.get(CPU_RESOURCE, 0) - used, before,
                             config.min_gain_fraction, factor, pressed)  # fmt: skip
    for lane in pool:
        mib, reason = planned[lane.lane_id]
        lane.cache_ram = mib * MIB
        lane.reasons.append(reason)


def spec_n_gpu_layers(lane: PlannedLane) -> int:
    """-ngl as the spec carries it (the wire's int)."""
    return ngl_count(lane.layout.n_gpu_layers, lane.facts.n_layer) if lane.layout.gpus else 0
