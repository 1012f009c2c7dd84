"""Expert offload: lanes' plan against llama-fit-params on the same RPC device budgets (MoE models).

For each device budget U (MiB) on one or two ggml-rpc-server devices, llama-fit-params gets a
target margin of F - U (F: the device's free memory) and chooses -c / -ngl / -ot; lanes' planner
gets a GPU of U + 256 MiB (its per-GPU reserve) and chooses its window, -ngl and --n-cpu-moe.
Both choices are started with llama-server and their printed buffers held against U.
Reported per case: each one's context, layers on the devices, expert blocks in RAM, whether it
started, and whether any device went over its budget.

    .venv/bin/python bench/moe_fit_bench.py [--out bench/moe_fit_results.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from fit_bench import lanes_choice, over, run_lane  # noqa: E402
from rpc_harness import rpc_servers  # noqa: E402
from tinymodels import write_gpt_oss, write_moe  # noqa: E402

from launcher_agent.hardware import listed_devices  # noqa: E402
from measure import load_and_stop  # noqa: E402
from shared.gguf_facts import read_model_facts  # noqa: E402
from shared.llama.logs import MIB, parse_buffers  # noqa: E402

_FIT_LINE = re.compile(r"-c (\d+) -ngl (-?\d+)(?: -ts ([\d,]+))?(?: -ot \"([^\"]*)\")?")
_BLOCK = re.compile(r"blk\\\.(\d+)\\\.")


def fit_choice(bin_dir: Path, model: Path, endpoints, margins, extra) -> dict:
    run = subprocess.run(
        [str(bin_dir / "llama-fit-params"), "-m", str(model), "--rpc", ",".join(endpoints),
         "-fitt", ",".join(map(str, margins)), "-fitc", "256", *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    m = _FIT_LINE.search(run.stdout)
    if not m:
        return {"error": (run.stdout + run.stderr).strip().splitlines()[-1:]}
    overrides = m.group(4).split(",") if m.group(4) else []
    n_layer = int(re.search(r"-ngl (\d+)", m.group(0)).group(1)) - 1  # -ngl counts the output layer
    blocks = sorted({int(b) for o in overrides for b in _BLOCK.findall(o)} & set(range(n_layer)))
    return {"ctx": int(m.group(1)), "ngl": int(m.group(2)), "split": m.group(3).split(",") if m.group(3) else [],
            "overrides": overrides, "expert_blocks_in_ram": blocks}  # fmt: skip


def run_fit(server: str, model: Path, endpoints, fit: dict, extra) -> dict:
    args = ["-m", str(model), "-c", str(fit["ctx"]), "-ngl", str(fit["ngl"]), "--rpc", ",".join(endpoints),
            "-fit", "off", *extra]  # fmt: skip
    if fit["split"]:
        args += ["-ts", ",".join(fit["split"])]
    for o in fit["overrides"]:
        args += ["-ot", o]
    loaded = load_and_stop(server, args)
    printed = parse_buffers(loaded.lines)
    used = {d: round(sum(printed.mib[d].values()), 2) for d in printed.devices()} if loaded.ok else {}
    return {"started": loaded.ok, "used_mib": used}


CASES = [  # (model, device budgets in MiB)
    ("qwen3moe_8x32", (60,)),
    ("qwen3moe_8x32", (40,)),
    ("qwen3moe_8x32", (30, 30)),
    ("gpt_oss_8x32", (50,)),
]


def models(folder: Path) -> dict[str, Path]:
    return {
        "qwen3moe_8x32": write_moe(folder / "qwen3moe_8x32.gguf", n_layer=8, n_expert=32, n_expert_used=4,
                                   n_ff_exp=256, n_ctx_train=16384),
        "gpt_oss_8x32": write_gpt_oss(folder / "gpt_oss_8x32.gguf", n_layer=8, n_expert=32, n_expert_used=4,
                                      n_ff_exp=256, n_ctx_train=16384),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "moe_fit_results.json"))
    args = ap.parse_args()
    from lanes.install_rpc import rpc_bin_dir

    bin_dir = rpc_bin_dir()
    if bin_dir is None:
        print("no RPC build: run `lanes install-llama --rpc` first", file=sys.stderr)
        return 2
    server = str(bin_dir / "llama-server")
    results = []
    with tempfile.TemporaryDirectory() as tmp, rpc_servers(bin_dir, 2) as all_eps:
        paths = models(Path(tmp))
        for name, budgets in CASES:
            model = paths[name]
            facts = read_model_facts(model)
            eps = all_eps[: len(budgets)]
            listed = subprocess.run([server, "--rpc", ",".join(eps), "--list-devices"], capture_output=True,
                                    text=True).stdout  # fmt: skip
            devs = [d for d in listed_devices(listed) if d[0].startswith("RPC")]
            free_mib = [d[2] // MIB for d in devs]
            extra = ["-fa", "on", "-np", "1"]
            fit = fit_choice(bin_dir, model, eps, [f - b for f, b in zip(free_mib, budgets)], extra)
            if "ctx" in fit:
                fit.update(run_fit(server, model, eps, fit, extra))
                fit["over"] = over(fit["used_mib"], list(budgets))
            ours = lanes_choice(server, model, facts, eps, [d[0] for d in devs], budgets, "on", "f16")
            if "ctx" in ours:
                args_ = ours.pop("args")
                n = int(args_[args_.index("--n-cpu-moe") + 1]) if "--n-cpu-moe" in args_ else 0
                ours["expert_blocks_in_ram"] = list(range(n))
                ours.update(run_lane(server, args_, ours["ctx"], ours["devices"]))
                ours["over"] = over(ours["used_mib"], list(budgets))
            row = {"model": name, "budgets_mib": budgets, "fit": fit, "lanes": ours}
            print(json.dumps(row), flush=True)
            results.append(row)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
