"""How long one full replan takes as the fleet grows (the planner replans on every change).

Run from the repository root:  .venv/bin/python bench/planner_bench.py [--out bench/planner_results.md]

Each fleet size is planned 5 times; the median is reported, with the time per lane and
the ratio to the smallest fleet measured in the same run (the machine is shared and noisy:
compare ratios, not absolute times, across runs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from planner_svc.planner import plan  # noqa: E402
from planner_svc.state import PlannerState  # noqa: E402
from shared import subjects  # noqa: E402
from shared.messages import FleetConfig, HostReport, ModelFacts, ServerCaps, encode  # noqa: E402

GIB = 2**30
SIZES = (10, 100, 1000, 5000)
RUNS = 5


def facts(name: str, layers: int, kv: int, weights: int, swa: int = 0) -> ModelFacts:
    swa_layers = tuple(i % 6 < 5 for i in range(layers)) if swa else ()
    return ModelFacts(path=f"/models/{name}.gguf", name=name, architecture="gemma3" if swa else "llama",
                      n_layer=layers, n_embd=4096, n_head=32, n_head_kv=(kv,) * layers, head_dim_k=128,
                      head_dim_v=128, n_ctx_train=131072, n_vocab=128256, n_ff=14336, n_swa=swa,
                      swa_layers=swa_layers, weight_bytes=weights)  # fmt: skip


MODELS = (
    facts("llama-8b", 32, 8, 5 * GIB),
    facts("qwen-14b", 48, 8, 9 * GIB),
    facts("gemma-12b", 48, 8, 7 * GIB, swa=1024),
)


def fleet(n: int) -> list[HostReport]:
    return [
        HostReport(
            host_id=f"host-{i:05d}",
            cpu_cores=16,
            ram_total=64 * GIB,
            ram_available=(36 + i % 9) * GIB,
            server=ServerCaps(),
            models=MODELS,
        )  # fmt: skip
        for i in range(n)
    ]


def per_event_cost(n: int) -> float:
    """The planner service's path for one changed report in a fleet of n: fold the KV entry
    in, then plan (only that host is replanned). Median seconds over RUNS events."""
    state = PlannerState()
    for i, report in enumerate(fleet(n)):
        state.apply(subjects.report_key(report.host_id), encode(report), i + 1)
    state.caught_up = True
    state.planning_job()()  # the first replan covers every host
    times = []
    for k in range(RUNS):
        changed = msgspec.structs.replace(fleet(1)[0], ram_available=(30 + k) * GIB)
        started = time.perf_counter()
        state.apply(subjects.report_key(changed.host_id), encode(changed), n + k + 1)
        planned = state.planning_job()().plans
        times.append(time.perf_counter() - started)
        assert list(planned) == [subjects.host_token(changed.host_id)]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "bench" / "planner_results.md"))
    parser.add_argument("--small", action="store_true", help="10 and 100 hosts only (a smoke run)")
    args = parser.parse_args()
    sizes = SIZES[:2] if args.small else SIZES
    config = FleetConfig(kv_cache_type="q8_0")
    rows = []
    for n in sizes:
        reports = fleet(n)
        times, lanes = [], 0
        for _ in range(RUNS):
            started = time.perf_counter()
            result = plan(reports, config)
            times.append(time.perf_counter() - started)
            lanes = sum(len(h.lanes) for h in result.hosts)
        tracemalloc.start()
        plan(reports, config)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rows.append((n, lanes, statistics.median(times), peak))
        print(
            f"{n:5d} hosts {lanes:6d} lanes: median {statistics.median(times) * 1000:8.1f} ms, peak {peak / 2**20:.1f} MiB"
        )
    event_hosts = 100 if args.small else 1000
    event = per_event_cost(event_hosts)
    full = next(t for n, _, t, _ in rows if n == event_hosts)
    print(
        f"one report changed in {event_hosts} hosts: {event * 1000:.2f} ms ({full / event:.0f}x less than a full replan)"
    )
    base = rows[0][2] / rows[0][1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    lines = [
        "# Planner: time of one full replan by fleet size",
        "",
        f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; {platform.platform()}, Python {platform.python_version()}",
        f"- lanes commit: {commit.strip()}",
        "- Command: `.venv/bin/python bench/planner_bench.py`",
        f"- Each host: 64 GiB RAM, 36-44 GiB free, three models (8B, 14B, a 12B with sliding window); "
        f"kv_cache_type=q8_0. Median of {RUNS} runs.",
        "",
        "| hosts | lanes | median ms | ms per lane | per-lane ratio to the smallest fleet | peak MiB (tracemalloc) |",
        "|---|---|---|---|---|---|",
    ]
    for n, lanes, t, peak in rows:
        lines.append(
            f"| {n} | {lanes} | {t * 1000:.1f} | {t * 1000 / lanes:.3f} | {t / lanes / base:.2f} | {peak / 2**20:.1f} |"
        )
    lines += [
        "",
        f"One host's report changing in a fleet of {event_hosts}: {event * 1000:.2f} ms (median of {RUNS}) from the",
        f"KV entry to that host's new plan, {full / event:.0f}x less than a full replan: only the changed host is",
        "replanned unless the config or demand changed, or the demand spreads a persona's lanes over hosts.",
        "",
        "The planner runs off the event loop (a thread) and waits at least as long as the last",
        "replan took before the next, so a large fleet replans at most every other such interval.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
