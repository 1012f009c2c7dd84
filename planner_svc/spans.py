"""One lane across hosts: the serving host's llama-server with some layers on other hosts'
ggml-rpc-servers (llama.cpp's RPC backend). Pure: the planner calls it only for a model that
fits no single host at its window floor.

A span is the serving host's report with each worker's device added as an RPC device
(`span_report`), so the one memory model plans its KV, compute and weights per remote device
as it does for any GPU-type device. The split is never llama-server's load-time default:
`split_layers` gives each worker, from the last (which takes the output layer) to the first,
the most layers whose exact cost fits its budget, the serving CPU the rest, and passes those
layer counts as --tensor-split (llama.cpp's cumulative-share rule turns counts into exactly
those layers; the placement reproduces it bit for bit). The fewest workers win (the largest last:
it takes the output layer); a worker that would take no layer is one too many.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from planner_svc.layouts import CPU_RESOURCE, Layout, Resource, fits, largest
from shared.memory import Placement
from shared.messages.hosts import GpuInfo, HostReport, ModelFacts
from shared.messages.plans import MemoryBreakdown, RpcWorkerSpec, SpanWorker
from shared.messages.status import LaneFeedback

from shared.span_check import SPAN_FAILED

MIB = 1024 * 1024
# What one ggml-rpc-server process holds beyond the buffers a lane allocates on it and the
# tensor it is receiving (its code and ggml context: about 5 MiB idle, measured); reserved on the
# worker with the buffers.
RPC_SERVER_OVERHEAD = 16 * MIB

Cost = Callable[[Layout], Mapping[Resource, int]]


@dataclass(frozen=True)
class Worker:
    """A host that may lend one device to a span: where to reach it and what it has left."""

    host_id: str
    address: str
    port: int
    device: str
    budget: int  # bytes the span may use on its device (its ggml-rpc-server's overhead taken off)

    @property
    def endpoint(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    @property
    def resource(self) -> Resource:
        return CPU_RESOURCE  # a CPU-only worker lends its RAM (the device ggml-rpc-server calls CPU)


def free_port(report: HostReport, taken: set[int], previous: int | None = None) -> int | None:
    """The previous port when still free, else the lowest free one of the worker's range."""
    offer = report.rpc_worker
    assert offer is not None
    allowed = range(offer.port_base, min(offer.port_base + offer.port_count, 65536))
    if previous in allowed and previous not in taken:
        return previous
    return next((p for p in allowed if p not in taken), None)


def worker_candidates(
    serving: str,
    reports: Sequence[HostReport],
    remaining: Mapping[str, Mapping[Resource, int]],
    ports_taken: Mapping[str, set[int]],
    previous: Mapping[str, int] | None = None,
) -> list[Worker]:
    """Every other host that offers itself as a worker and has a port and memory left, the most
    memory first (host id breaks ties). `previous`: host -> the port this lane had there."""
    previous = previous or {}
    out = []
    for r in reports:
        if r.host_id == serving or r.rpc_worker is None:
            continue
        port = free_port(r, ports_taken.get(r.host_id, set()), previous.get(r.host_id))
        budget = remaining.get(r.host_id, {}).get(CPU_RESOURCE, 0) - RPC_SERVER_OVERHEAD
        if port is None or budget <= 0:
            continue
        out.append(Worker(r.host_id, r.rpc_worker.address, port, r.rpc_worker.device, budget))
    return sorted(out, key=lambda w: (-w.budget, w.host_id))


def span_report(report: HostReport, workers: Sequence[Worker]) -> HostReport:
    """The serving host as its llama-server sees the span: its own devices, then one RPC device
    per worker in --rpc order (RPC0, RPC1 ...), each as large as the span may use there."""
    rpc = tuple(
        GpuInfo(name=f"rpc {w.host_id}", vram_total=w.budget, vram_free=w.budget, backend="rpc",
                device=f"RPC{k}", endpoint=w.endpoint)
        for k, w in enumerate(workers)
    )  # fmt: skip
    return msgspec.structs.replace(report, gpus=tuple(report.gpus) + rpc)


def span_remaining(report: HostReport, own: Mapping[Resource, int], workers: Sequence[Worker]) -> dict[Resource, int]:
    """The serving host's RAM and, as ("gpu", i) of span_report, each worker's budget. The
    serving host's own GPUs are left out: a span uses its CPU and the workers only."""
    out: dict[Resource, int] = {CPU_RESOURCE: own.get(CPU_RESOURCE, 0)}
    for k, w in enumerate(workers):
        out[("gpu", len(report.gpus) + k)] = w.budget
    return out


def counts_layout(gpus: tuple[int, ...], counts: Sequence[int], n_layer: int) -> Layout:
    """Layer counts per RPC device as a layout: -ngl their sum, -ts the counts themselves."""
    n = sum(counts)
    shares = tuple(counts) if len(gpus) > 1 else ()
    if n >= n_layer + 1:
        return Layout("split" if len(gpus) > 1 else "gpu", gpus, shares, "all")
    return Layout("partial", gpus, shares, n)


def split_layers(n_layer: int, gpus: tuple[int, ...], cost: Cost, remaining: Mapping[Resource, int]) -> Layout | None:
    """The span's layers over its devices from exact per-device costs, or None when they do not
    fit or a device would take no layer. From the last device (the output layer and the last
    blocks) to the first, each takes the most layers whose exact cost fits its budget, sized with
    every layer still unplaced offloaded to the first device (buffers such as compute depend a
    little on what the others hold); then any device still over its budget gives up layers, the
    first device's to the CPU, until all fit."""
    counts = [0] * len(gpus)
    for d in reversed(range(len(gpus))):
        left = n_layer + 1 - sum(counts)

        def device_fits(c: int, d: int = d) -> bool:
            trial = counts[:d] + [c] + counts[d + 1 :]
            if d > 0:
                trial[0] = left - c  # the rest offloaded, as it will be when the earlier devices fit them
            resource = ("gpu", gpus[d])
            return cost(counts_layout(gpus, trial, n_layer)).get(resource, 0) <= remaining.get(resource, 0)

        c = largest(device_fits, 0, left) if left > 0 else 0
        if c == 0:
            return None
        counts[d] = c
    for _ in range(n_layer + 1):
        layout = counts_layout(gpus, counts, n_layer)
        used = cost(layout)
        over = [d for d in range(len(gpus)) if used.get(("gpu", gpus[d]), 0) > remaining.get(("gpu", gpus[d]), 0)]
        if not over:
            return layout if fits(used, remaining) else None
        d = over[-1]
        if counts[d] <= 1:
            return None
        counts[d] -= 1
        if d > 0:
            counts[d - 1] += 1  # the layer moves to the device before it (the first gives it to the CPU)
    return None


def receive_bytes(facts: ModelFacts, placement: Placement) -> dict[int, int]:
    """Per RPC device, the largest tensor it is sent while loading: ggml-rpc-server holds it in a
    message buffer (or reads it from its cache) before copying it into the device's buffer, so
    its peak memory is its buffers plus that (measured: 345 MiB peak for 192 MiB of buffers on
    the worker holding Gemma 3 270M's output, a 170 MiB copy of the token embeddings). Bounded
    here by the largest layer on the device (a layer's tensors are sent one by one)."""
    sizes = {w.layer: w.bytes for w in facts.layer_weights}
    out: dict[int, int] = {}
    for il, d in enumerate(placement.layer_device):
        if d < 0:
            continue
        largest = sizes.get(il, 0)
        if il == facts.n_layer:
            largest = max(largest, facts.tied_output_bytes)
        out[d] = max(out.get(d, 0), largest)
    return out


@dataclass(frozen=True)
class Span:
    """A span lane as placed: its workers in --rpc order, the serving host's view of them, the
    layout over that view, and the window it runs at."""

    workers: tuple[Worker, ...]
    report: HostReport
    layout: Layout
    window: int


def find_span(
    report: HostReport,
    own: Mapping[Resource, int],
    candidates: Sequence[Worker],
    n_layer: int,
    cost_at: Callable[[HostReport, Layout, int], Mapping[Resource, int]],
    floor: int,
    ceiling: int,
    step: int,
    previous: tuple[tuple[str, ...], int] | None = None,
    min_gain: float = 0.0,
) -> Span | None:
    """The span with the fewest workers that fits at the floor window, then its largest window.

    `cost_at(report, layout, window)` is the planner's cost of the lane there. `previous`: the
    worker hosts and window this lane ran with; kept while they still fit and a new window would
    differ by less than min_gain (a restart moves every worker's weights again)."""
    options: list[tuple[Worker, ...]] = []
    if previous is not None:
        by_host = {w.host_id: w for w in candidates}
        if all(h in by_host for h in previous[0]) and previous[0]:
            options.append(tuple(by_host[h] for h in previous[0]))
    # the largest last in --rpc order: the last device takes the output layer (with tied embeddings,
    # a copy of the token embeddings), often the largest tensor of the model
    options += [tuple(reversed(candidates[:k])) for k in range(1, len(candidates) + 1)]
    for workers in options:
        view = span_report(report, workers)
        gpus = tuple(range(len(report.gpus), len(view.gpus)))
        remaining = span_remaining(report, own, workers)

        def layout_at(window: int) -> Layout | None:
            return split_layers(n_layer, gpus, lambda layout: cost_at(view, layout, window), remaining)

        layout = layout_at(floor)
        if layout is None:
            continue
        steps = largest(lambda s: layout_at(floor + s * step) is not None, 0, (ceiling - floor) // step)
        window = floor + steps * step
        if previous is not None and workers == options[0] and floor <= previous[1] <= ceiling:
            old = previous[1]
            if abs(window - old) / old < min_gain and layout_at(old) is not None:
                window = old
        return Span(workers, view, layout_at(window) or layout, window)
    return None


def span_blocked(feedback: Sequence[LaneFeedback], model: str) -> str | None:
    """Why this serving host gets no span for the model now: a span of it failed its check, or
    its llama-server keeps failing (a worker it cannot reach, a build without RPC)."""
    for fb in feedback:
        if fb.model == model and fb.detail.startswith(SPAN_FAILED):
            return fb.detail
    for fb in feedback:
        if fb.model == model and fb.kind == "crash_loop":
            return f"llama-server keeps failing with it: {fb.detail}"
    return None


def span_workers(span: Span, memory: MemoryBreakdown, cost: Mapping[Resource, int]) -> tuple[SpanWorker, ...]:
    """The spec's workers: each RPC device's buffers from the lane's memory, in --rpc order; what
    is reserved is the span's cost there (buffers and the largest tensor received) and the server."""
    first = len(span.report.gpus) - len(span.workers)
    by_index = {d.index: d for d in memory.devices if d.index >= 0}
    out = []
    for k, w in enumerate(span.workers):
        index = span.layout.gpus.index(first + k)
        dev = by_index.get(index)
        out.append(
            SpanWorker(
                host_id=w.host_id, endpoint=w.endpoint, device=w.device, index=index,
                model_bytes=dev.model_bytes if dev else 0, kv_bytes=dev.kv_bytes if dev else 0,
                compute_bytes=dev.compute_bytes if dev else 0,
                reserved_bytes=cost.get(("gpu", first + k), 0) + RPC_SERVER_OVERHEAD,
            )
        )  # fmt: skip
    return tuple(out)


def worker_specs(lane_id: str, serving: str, span: Span, workers: Sequence[SpanWorker]) -> list[RpcWorkerSpec]:
    """What each worker host runs for the lane: a ggml-rpc-server bound to its advertised address."""
    return [
        RpcWorkerSpec(lane_id=lane_id, serving_host=serving, bind=w.address, port=w.port, device=w.device,
                      reserved_bytes=sw.reserved_bytes)
        for w, sw in zip(span.workers, workers)
    ]  # fmt: skip
