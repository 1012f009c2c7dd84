"""The planner's span step: lanes of models that fit no single host, placed over workers.

The glue between the planner's lanes and planner_svc.spans (the pure span search): which
holder serves, at which floor, with which flags (the planner's own policy), what each span
reserves on its hosts, and the workers' plans. Called by planner.plan after every persona's
single-host lanes; `LaneKit` hands in the planner's lane type and cost, so this module does
not import the planner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from planner_svc import spans
from planner_svc.layouts import CPU_RESOURCE, Layout, Resource, describe, layout_placement, with_layers
from planner_svc.policy import correction, decide_flags, window_bounds
from shared.memory import CTX_PAD, MemoryModelError, PlacementError
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan, RpcWorkerSpec

GIB = 1024**3


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class LaneKit:
    """The planner's lane constructor, its cost (lane, window, report, n_ubatch) and lane ids."""

    make: Callable
    cost: Callable
    lane_id: Callable[[str, int], str]




@dataclass
class SpanBook:
    """What this planning pass's span lanes took from their workers."""

    lent: dict[str, int] = field(default_factory=dict)  # worker host -> bytes reserved there
    ports: dict[str, set[int]] = field(default_factory=dict)  # worker host -> ports given out
    specs: dict[str, list[RpcWorkerSpec]] = field(default_factory=dict)  # worker host -> its servers
    models: set[str] = field(default_factory=set)
    placed: list[tuple[object, HostReport, Callable, object]] = field(default_factory=list)

    def has(self, model: str) -> bool:
        return model in self.models


def previous_span(prev: HostPlan | None, lane_id: str) -> tuple[tuple[tuple[str, ...], int] | None, dict[str, int]]:
    spec = next((s for s in prev.lanes if s.lane_id == lane_id), None) if prev else None
    if spec is None or not spec.workers:
        return None, {}
    ports = {w.host_id: int(w.endpoint.rsplit(":", 1)[1]) for w in spec.workers}
    return (tuple(w.host_id for w in spec.workers), spec.ctx_total // spec.parallel), ports


def span_cost(kit: LaneKit, lane, window: int, view: HostReport, n_ubatch: int) -> dict[Resource, int]:
    """The lane's cost on the serving host's view of its span, each RPC device's with the largest
    tensor its ggml-rpc-server receives while loading (spans.receive_bytes)."""
    cost = dict(kit.cost(lane, window, view, n_ubatch))
    placement = layout_placement(lane.facts.n_layer, lane.layout, view)
    for d, extra in spans.receive_bytes(with_layers(lane.facts), placement).items():
        resource = ("gpu", lane.layout.gpus[d])
        cost[resource] = cost.get(resource, 0) + extra
    return cost


def _span_take(lane, remaining, config, sign: int, kit) -> None:
    """Reserve (sign 1) or give back (-1) what a span lane uses on its serving host and workers."""
    span = lane.span
    cost = span_cost(kit, lane, lane.window, span.report, config.n_ubatch)
    first = len(span.report.gpus) - len(span.workers)
    remaining[lane.host_id][CPU_RESOURCE] -= sign * cost.get(CPU_RESOURCE, 0)
    for k, w in enumerate(span.workers):
        remaining[w.host_id][CPU_RESOURCE] -= sign * (cost.get(("gpu", first + k), 0) + spans.RPC_SERVER_OVERHEAD)


def place_span(persona, candidates_, reports, config, lanes, remaining, previous, feedback, book, kit) -> tuple[bool, str]:
    """A model that fits no single host: one lane on a holder of it, with layers on the fewest
    workers (planner_svc.spans), at its floor window (grow_spans widens it once every span has
    its floor). (False, why) when no span fits either; why is "" when no host offers itself as a worker."""
    if not any(r.rpc_worker is not None for r in reports):
        return False, ""
    options = []
    why = "no span over the workers fits it either"
    for report, facts in candidates_:
        host = report.host_id
        fb = [f for f in feedback.get(host, ()) if f.model == persona.model]
        blocked = spans.span_blocked(fb, persona.model)
        if report.server is not None and not report.server.has_rpc:
            blocked = "its llama-server is built without the RPC backend (lanes install-llama --rpc)"
        if blocked:
            why = f"no span from {host}: {blocked}"
            continue
        flags = decide_flags(config, report, facts, fb)
        floor, ceiling, bound_reasons = window_bounds(persona, facts, fb)
        if ceiling < CTX_PAD:
            continue
        factor, factor_reasons = correction(fb)
        index = sum(1 for lane in lanes[host] if lane.persona.model == persona.model)
        lane_id = kit.lane_id(persona.model, index)
        prev_span, prev_ports = previous_span(previous.get(host), lane_id)
        workers = spans.worker_candidates(host, reports, remaining, book.ports, prev_ports)

        def lane_at(layout: Layout, host=host, facts=facts, index=index, flags=flags, floor=floor,
                    ceiling=ceiling, factor=factor):  # fmt: skip
            return kit.make(host, persona, facts, index, flags, layout, floor, ceiling, factor)

        def cost_at(view: HostReport, layout: Layout, window: int, lane_at=lane_at) -> dict[Resource, int]:
            return span_cost(kit, lane_at(layout), window, view, config.n_ubatch)

        try:
            span = spans.find_span(report, remaining[host], workers, facts.n_layer, cost_at, floor, floor, CTX_PAD,
                                   prev_span)  # fmt: skip
        except (MemoryModelError, PlacementError) as exc:
            why = str(exc)
            continue
        if span is None:
            continue
        lane = lane_at(span.layout)
        lane.window, lane.span = span.window, span
        lane.reasons = list(flags.reasons) + bound_reasons + factor_reasons
        options.append((len(span.workers), host, lane, report, cost_at, prev_span))
    if not options:
        return False, why
    options.sort(key=lambda o: o[:2])
    _, host, lane, report, cost_at, prev_span = options[0]
    _span_take(lane, remaining, config, 1, kit)
    for w in lane.span.workers:
        book.ports.setdefault(w.host_id, set()).add(w.port)
    book.models.add(persona.model)
    book.placed.append((lane, report, cost_at, prev_span))
    lanes[host].append(lane)
    return True, ""


def grow_spans(book: SpanBook, remaining, config, kit) -> None:
    """Every span has its floor: each, in the order placed, widens its window into what its devices
    have left (keeping its previous window under min_gain), then its workers' plans are written."""
    for lane, report, cost_at, prev_span in book.placed:
        _span_take(lane, remaining, config, -1, kit)
        workers = [
            spans.Worker(w.host_id, w.address, w.port, w.device,
                         remaining[w.host_id][CPU_RESOURCE] - spans.RPC_SERVER_OVERHEAD)
            for w in lane.span.workers
        ]  # fmt: skip
        grown = spans.find_span(
            report, remaining[lane.host_id], workers, lane.facts.n_layer, cost_at, lane.floor, lane.ceiling, CTX_PAD,
            (tuple(w.host_id for w in workers), prev_span[1] if prev_span else lane.floor), config.min_gain_fraction,
        )
        if grown is not None and len(grown.workers) == len(workers):
            lane.layout, lane.window, lane.span = grown.layout, grown.window, grown
        _span_take(lane, remaining, config, 1, kit)
        span = lane.span
        cost = span_cost(kit, lane, lane.window, span.report, config.n_ubatch)
        memory = lane.memory(lane.window, span.report, config.n_ubatch)
        lane.span_workers = spans.span_workers(span, memory, cost)
        for w, spec in zip(span.workers, spans.worker_specs(lane.lane_id, lane.host_id, span, lane.span_workers)):
            book.lent[w.host_id] = book.lent.get(w.host_id, 0) + spec.reserved_bytes
            book.specs.setdefault(w.host_id, []).append(spec)
        on = ", ".join(f"{w.host_id} ({_gib(w.reserved_bytes)} at {w.endpoint})" for w in lane.span_workers)
        on_cpu = sum(d.layers for d in memory.devices if d.index < 0)
        lane.reasons.append(
            f"span: fits no single host at its floor of {lane.floor} tokens per slot; layers on {on}"
            f" and {on_cpu} on {lane.host_id}'s CPU"
        )
        lane.reasons.append(f"layout: {describe(lane.layout, lane.facts.n_layer)} (RPC devices)")

