"""lanes' plan against llama.cpp's own fitting, and against the largest window that really fits.

On RPC devices (each ggml-rpc-server reports this machine's free RAM, F), a device budget U is
given to llama-fit-params as a target margin of F - U MiB (`-fitt`), and to lanes' planner as a
GPU with U + 256 MiB free (the planner keeps 256 MiB per GPU in reserve). For each case:

- fit:   `llama-fit-params` chooses -c / -ngl / -ts; that result is started with llama-server.
- lanes: the planner's lane (window, -ngl, -ts) is started with llama-server.
- best:  the largest context (multiple of 256) whose printed buffers fit every device, found by
         starting llama-server (binary search), with lanes' layout.
Reported: each one's context and layers, whether it started, the printed bytes per device against
the budget (overcommit = any device over it), memory left unused, and lanes' window / best.

    .venv/bin/python bench/fit_bench.py --models GGUF... [--out bench/fit_results.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from rpc_harness import rpc_servers  # noqa: E402

from launcher_agent.hardware import listed_devices  # noqa: E402
from measure import load_and_stop  # noqa: E402
from launcher_agent.probe import probe  # noqa: E402
from planner_svc.planner import plan  # noqa: E402
from shared.gguf_facts import read_model_facts  # noqa: E402
from shared.llama.flags import lane_args  # noqa: E402
from shared.llama.logs import MIB, parse_buffers  # noqa: E402
from shared.messages.config import Demand, FleetConfig, Persona  # noqa: E402
from shared.messages.hosts import GpuInfo, HostReport  # noqa: E402

GPU_RESERVE_MIB = 256


def device_used(lines) -> dict[str, float]:
    printed = parse_buffers(lines)
    return {d: round(sum(printed.mib[d].values()), 2) for d in printed.devices()}


def over(used: dict[str, float], budgets_mib: list[int]) -> list[str]:
    return [f"GPU{i} {used.get(f'GPU{i}', 0):.1f} > {b}" for i, b in enumerate(budgets_mib) if used.get(f"GPU{i}", 0) > b]


def run_server(server: str, model: Path, endpoints, ctx: int, ngl: str, split, extra) -> dict:
    args = ["-m", str(model), "-c", str(ctx), "-ngl", ngl, "--rpc", ",".join(endpoints), "-fit", "off", *extra]
    if split:
        args += ["-ts", ",".join(map(str, split))]
    loaded = load_and_stop(server, args)
    return {"started": loaded.ok, "used_mib": device_used(loaded.lines) if loaded.ok else {}}


def fit_choice(bin_dir: Path, model: Path, endpoints, margins, extra) -> dict:
    run = subprocess.run(
        [str(bin_dir / "llama-fit-params"), "-m", str(model), "--rpc", ",".join(endpoints),
         "-fitt", ",".join(map(str, margins)), "-fitc", "256", *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    m = re.search(r"-c (\d+) -ngl (-?\d+)(?: -ts ([\d,]+))?", run.stdout)
    if not m:
        return {"error": (run.stdout + run.stderr).strip().splitlines()[-1:]}
    return {"ctx": int(m.group(1)), "ngl": int(m.group(2)), "split": m.group(3).split(",") if m.group(3) else []}


def lanes_choice(server: str, model: Path, facts, endpoints, names, budgets_mib, fa: str, cache: str) -> dict:
    caps = probe(server)
    gpus = tuple(
        GpuInfo(name=f"rpc{i}", vram_total=(b + GPU_RESERVE_MIB) * MIB, vram_free=(b + GPU_RESERVE_MIB) * MIB,
                backend="rpc", device=names[i], endpoint=endpoints[i])  # fmt: skip
        for i, b in enumerate(budgets_mib)
    )
    report = HostReport(host_id="bench", cpu_cores=2, ram_total=64 * 2**30, ram_available=64 * 2**30, gpus=gpus,
                        server=caps, models=(facts,), cpu_repack=None)  # fmt: skip
    config = FleetConfig(headroom_bytes=0, headroom_fraction=0.0, flash_attn=fa,
                         kv_cache_type=None if cache == "f16" else cache)  # fmt: skip
    fleet = plan([report], config, Demand(personas=(Persona(model=facts.name, ctx_min=256),)))
    lanes = fleet.hosts[0].lanes
    if not lanes:
        return {"error": [u.reason for u in fleet.hosts[0].unplaced]}
    s = lanes[0]
    return {"ctx": s.ctx_total, "ngl": s.n_gpu_layers, "split": list(s.tensor_split),
            "devices": list(s.gpu_devices), "args": list(lane_args(s, caps))}  # fmt: skip


def with_ctx(args: list[str], ctx: int) -> list[str]:
    """The lane's own argv (pinned with --device, its -ts) at another context, on a free port."""
    from measure import free_port

    out = list(args)
    out[out.index("--ctx-size") + 1] = str(ctx)
    out[out.index("--port") + 1] = str(free_port())
    return out


def run_lane(server: str, args: list[str], ctx: int, gpu_devices: list[int]) -> dict:
    """Printed use per host device: a pinned lane's GPUk is the host's gpu_devices[k]."""
    loaded = load_and_stop(server, with_ctx(args, ctx))
    used = device_used(loaded.lines) if loaded.ok else {}
    host = {(f"GPU{gpu_devices[int(d[3:])]}" if d != "CPU" else d): v for d, v in used.items()}
    return {"started": loaded.ok, "used_mib": host}


def best_window(server, args, gpu_devices, budgets_mib, hi: int) -> int:
    """Largest multiple of 256 whose printed buffers fit every device, by starting llama-server."""

    def fits(ctx: int) -> bool:
        r = run_lane(server, args, ctx, gpu_devices)
        return r["started"] and not over(r["used_mib"], budgets_mib)

    lo, hi = 1, hi // 256
    if not fits(256):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * 256):
            lo = mid
        else:
            hi = mid - 1
    return lo * 256


CASES = [  # (device budgets in MiB, flash attention, cache type)
    ((100, 300), "on", "f16"),
    ((60, 60), "on", "q8_0"),
    ((200,), "off", "f16"),
    ((40, 40, 120), "on", "q4_0"),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--bin-dir")
    ap.add_argument("--out", default=str(ROOT / "bench" / "fit_results.json"))
    args = ap.parse_args()
    from lanes.install_rpc import rpc_bin_dir

    bin_dir = Path(args.bin_dir) if args.bin_dir else rpc_bin_dir()
    if bin_dir is None:
        print("no RPC build: run `lanes install-llama --rpc` first", file=sys.stderr)
        return 2
    server = str(bin_dir / "llama-server")
    results = []
    with rpc_servers(bin_dir, 3) as all_eps:
        for model in map(Path, args.models):
            facts = read_model_facts(model)
            for budgets, fa, cache in CASES:
                eps = all_eps[: len(budgets)]
                listed = subprocess.run([server, "--rpc", ",".join(eps), "--list-devices"], capture_output=True,
                                        text=True).stdout  # fmt: skip
                devs = [d for d in listed_devices(listed) if d[0].startswith("RPC")]
                free_mib = [d[2] // MIB for d in devs]
                extra = ["-fa", fa, "-ctk", cache, "-ctv", cache, "-np", "1"]
                fit = fit_choice(bin_dir, model, eps, [f - b for f, b in zip(free_mib, budgets)], extra)
                if "ctx" in fit:
                    fit.update(run_server(server, model, eps, fit["ctx"], str(fit["ngl"]), fit["split"], extra))
                    fit["over"] = over(fit["used_mib"], list(budgets))
                ours = lanes_choice(server, model, facts, eps, [d[0] for d in devs], budgets, fa, cache)
                best = 0
                if "ctx" in ours:
                    ours.update(run_lane(server, ours["args"], ours["ctx"], ours["devices"]))
                    ours["over"] = over(ours["used_mib"], list(budgets))
                    best = best_window(server, ours.pop("args"), ours["devices"], list(budgets), facts.n_ctx_train)
                    ours["unused_mib"] = {f"GPU{i}": round(b - ours["used_mib"].get(f"GPU{i}", 0), 1)
                                          for i, b in enumerate(budgets)}  # fmt: skip
                if "ctx" in fit and fit.get("started"):
                    fit["unused_mib"] = {f"GPU{i}": round(b - fit["used_mib"].get(f"GPU{i}", 0), 1)
                                         for i, b in enumerate(budgets)}  # fmt: skip
                row = {"model": model.name, "budgets_mib": budgets, "fa": fa, "cache": cache, "fit": fit,
                       "lanes": ours, "best_ctx": best,
                       "lanes_vs_best": round(ours.get("ctx", 0) / best, 3) if best else None}  # fmt: skip
                print(json.dumps(row), flush=True)
                results.append(row)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
