"""CPU threads per lane: a host's cores are split among its lanes like its memory.

Pure. llama-server's default is every core per process, so two lanes on one host run
twice as many busy threads as there are cores and ggml's thread pool meets at a barrier
after every op, sliced by the scheduler (measured: 7x slower on 2 cores). Here the lanes
of a host together ask for no more threads than it has cores (performance cores on a
hybrid CPU, physical cores elsewhere): a lane computing on a GPU needs few, lanes
computing on the CPU share the rest by the work they carry (CPU-resident weights x slots).
A running lane keeps its threads unless the new share moves by at least
`threads_min_gain`, so a replan restarts no lane for a small gain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from shared.lane_key import lane_key
from shared.messages.config import FleetConfig
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan, LaneSpec

GPU_LANE_THREADS = 2  # a GPU lane's CPU side (sampling, the input layer); 1 on small hosts
SMALL_HOST_CORES = 8


@dataclass(frozen=True)
class Cores:
    """What a host offers lanes: `count` cores, and CPU ids to pin them to (one per core)."""

    count: int
    cpu_ids: tuple[int, ...]  # empty: unknown, no pinning
    source: str  # what was counted, for the reasons


@dataclass(frozen=True)
class ThreadNeed:
    lane_id: str
    gpu: bool  # computes on a GPU (all layers offloaded, or remote RPC devices)
    work: int  # CPU-resident weight bytes x slots
    previous: int | None = None  # threads it runs with now, when nothing else of it changes
    previous_cpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class ThreadShare:
    threads: int
    cpus: tuple[int, ...]  # pinned CPU ids; empty: not pinned
    reasons: tuple[str, ...]


def host_cores(report: HostReport) -> Cores | None:
    """The cores lanes may use, or None when the agent did not report them (an older agent:
    it could not render the flags, so the lanes keep llama-server's default)."""
    if report.cpu_physical is None:
        return None
    count, source = report.cpu_physical, "physical cores"
    if report.cpu_performance and report.cpu_performance < count:
        count, source = report.cpu_performance, "performance cores"
    ids = tuple(report.cpu_ids)
    if ids and len(ids) < count:
        count, source = len(ids), "cores this agent may use"
    return Cores(max(1, count), ids[:count] if ids else (), source)


def split_threads(
    needs: Sequence[ThreadNeed],
    cores: Cores,
    *,
    fixed: int | None = None,
    min_gain: float = 0.5,
    pinning: bool = False,
) -> dict[str, ThreadShare]:
    """Threads (and pinned CPUs) for each lane of one host, by lane id.

    Every lane gets at least 1; together they never exceed the cores unless there are more
    lanes than cores (then 1 each) or the fleet config fixes a count.
    """
    if not needs:
        return {}
    if fixed is not None:
        counts = {n.lane_id: fixed for n in needs}
        why = {n.lane_id: f"threads {fixed}: fixed by the fleet config" for n in needs}
    else:
        counts, why = _fresh_split(needs, cores)
        _keep_previous(needs, counts, why, cores.count, min_gain)
    cpus, pin_reason = _pin(needs, counts, cores) if pinning else ({}, "")
    out = {}
    for n in needs:
        reasons = [why[n.lane_id]]
        if pinning:
            reasons.append(f"pinned to CPUs {cpu_ranges(cpus[n.lane_id])}" if n.lane_id in cpus else pin_reason)
        out[n.lane_id] = ThreadShare(counts[n.lane_id], cpus.get(n.lane_id, ()), tuple(reasons))
    return out


def _fresh_split(needs: Sequence[ThreadNeed], cores: Cores) -> tuple[dict[str, int], dict[str, str]]:
    total = cores.count
    gpu = sorted((n for n in needs if n.gpu), key=lambda n: n.lane_id)
    cpu = sorted((n for n in needs if not n.gpu), key=lambda n: n.lane_id)
    if len(needs) > total:
        return {n.lane_id: 1 for n in needs}, {
            n.lane_id: f"threads 1: {len(needs)} lanes share {total} {cores.source}" for n in needs
        }
    per_gpu = GPU_LANE_THREADS if total >= SMALL_HOST_CORES else 1
    if len(gpu) * per_gpu + len(cpu) > total:
        per_gpu = 1
    counts = {n.lane_id: per_gpu for n in gpu}
    why = {n.lane_id: f"threads {per_gpu} of {total} {cores.source}: it computes on a GPU" for n in gpu}
    shares = _apportion([max(1, n.work) for n in cpu], total - per_gpu * len(gpu))
    for n, share in zip(cpu, shares):
        counts[n.lane_id] = share
        others = f" with {len(needs) - 1} other lane{'s' if len(needs) > 2 else ''}" if len(needs) > 1 else ""
        why[n.lane_id] = f"threads {share} of {total} {cores.source}: shared by weights x slots{others}"
    return counts, why


def _apportion(works: Sequence[int], seats: int) -> list[int]:
    """At least 1 each, the rest by D'Hondt on work (ties to the earlier lane): deterministic,
    and a lane with more work never gets fewer threads."""
    if not works:
        return []
    out = [1] * len(works)
    for _ in range(seats - len(works)):
        best = 0
        for i in range(1, len(works)):
            if works[i] * (out[best] + 1) > works[best] * (out[i] + 1):
                best = i
        out[best] += 1
    return out


def _keep_previous(needs, counts: dict[str, int], why: dict[str, str], total: int, min_gain: float) -> None:
    """A running lane keeps its threads when the new share moves by less than min_gain and
    the host's total still fits: a thread change alone restarts a lane only for a large gain."""
    for n in sorted(needs, key=lambda n: n.lane_id):
        old, new = n.previous, counts[n.lane_id]
        if old is None or old == new:
            continue
        change = abs(new - old) / old
        if change >= min_gain or sum(counts.values()) - new + old > total:
            continue
        counts[n.lane_id] = old
        why[n.lane_id] = (
            f"kept threads {old}: the replan's {new} differs by {change:.0%}, under the {min_gain:.0%} worth a restart"
        )


def _pin(needs, counts: dict[str, int], cores: Cores) -> tuple[dict[str, tuple[int, ...]], str]:
    """Disjoint CPU sets: a lane keeps its previous set when its count is unchanged, the
    others take free CPUs (a contiguous run when there is one)."""
    if not cores.cpu_ids:
        return {}, "not pinned: the host reported no CPU ids"
    if sum(counts.values()) > len(cores.cpu_ids):
        return {}, f"not pinned: {sum(counts.values())} threads on {len(cores.cpu_ids)} cores cannot be disjoint"
    free = list(cores.cpu_ids)
    out: dict[str, tuple[int, ...]] = {}
    ordered = sorted(needs, key=lambda n: n.lane_id)
    for n in ordered:
        prev = n.previous_cpus
        if prev and len(prev) == counts[n.lane_id] and all(c in free for c in prev):
            out[n.lane_id] = prev
            free = [c for c in free if c not in prev]
    for n in ordered:
        if n.lane_id not in out:
            out[n.lane_id] = _take(free, counts[n.lane_id])
            free = [c for c in free if c not in out[n.lane_id]]
    return out, ""


def _take(free: list[int], k: int) -> tuple[int, ...]:
    ids = sorted(free)
    for i in range(len(ids) - k + 1):
        if ids[i + k - 1] - ids[i] == k - 1:
            return tuple(ids[i : i + k])
    return tuple(ids[:k])


def cpu_ranges(cpus: Sequence[int]) -> str:
    parts, ids = [], sorted(cpus)
    start = prev = ids[0]
    for c in ids[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


# ------------------------------------------------------------------ on a host's lane specs


def with_threads(
    report: HostReport, config: FleetConfig, specs: Sequence[LaneSpec], prev: HostPlan | None
) -> list[LaneSpec]:
    """The host's lane specs with their threads, pinned CPUs and poll level decided.

    An agent that reported no core count is too old to render the flags: its plan stays as
    it was (no new reason either, so upgrading the planner bumps no plan revision)."""
    cores = host_cores(report)
    if cores is None or report.server is None:
        return list(specs)
    caps = report.server
    if config.threads == 0:
        why = "threads: llama-server's default (every core): threads 0 in the fleet config"
        return [msgspec.structs.replace(s, reasons=(*s.reasons, why)) for s in specs]
    before = {s.lane_id: s for s in prev.lanes} if prev else {}
    needs = [_need(s, before.get(s.lane_id)) for s in specs]
    pinning = config.cpu_pinning and caps.has_cpu_range
    shares = split_threads(needs, cores, fixed=config.threads, min_gain=config.threads_min_gain, pinning=pinning)
    poll = config.poll if caps.has_poll else None
    out = []
    for s in specs:
        share = shares[s.lane_id]
        reasons = [*s.reasons, *share.reasons]
        if config.cpu_pinning and not caps.has_cpu_range:
            reasons.append("not pinned: this host's llama-server has no --cpu-range")
        if config.poll is not None:
            reasons.append(f"poll {config.poll} from fleet config" if poll is not None else "no --poll in this build")
        out.append(msgspec.structs.replace(
            s, threads=share.threads, threads_batch=share.threads, cpus=share.cpus, poll=poll, reasons=tuple(reasons)
        ))  # fmt: skip
    return out


def _need(spec: LaneSpec, before: LaneSpec | None) -> ThreadNeed:
    cpu = [d for d in spec.memory.devices if d.index < 0]
    on_gpu = bool(spec.gpu_devices) and (all(d.layers == 0 for d in cpu) if spec.memory.devices else True)
    work = sum(d.model_bytes for d in cpu) if spec.memory.devices else spec.memory.weights_bytes
    previous = None
    if before is not None and before.threads is not None:
        # Kept only where keeping it restarts nothing: everything else of the lane is unchanged.
        same = msgspec.structs.replace(
            spec, threads=before.threads, threads_batch=before.threads_batch, cpus=before.cpus
        )
        if lane_key(same) == lane_key(before):
            previous = before.threads
    return ThreadNeed(spec.lane_id, on_gpu, work * spec.parallel, previous, before.cpus if previous else ())
