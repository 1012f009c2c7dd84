"""Predicted vs printed, per device: every buffer llama-server allocates, on CPU and RPC devices.

For each case the real llama-server (the RPC build, `lanes install-llama --rpc`) is started
with --rpc to 0-3 ggml-rpc-server processes on loopback, loaded, and stopped; its -lv 4
buffer lines are compared with shared.memory.lane_memory for the same spec.
Model, KV and output must be exact (two decimals of MiB); compute within 3% or 4 MiB.

    .venv/bin/python bench/device_bench.py --models DIR [--quick] [--out bench/device_results.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from rpc_harness import rpc_servers  # noqa: E402

from measure import load_and_stop  # noqa: E402
from shared.gguf_facts import read_model_facts  # noqa: E402
from shared.llama.logs import parse_buffers  # noqa: E402
from shared.llama.printed import compare  # noqa: E402
from shared.memory import QUANTIZED, LaneShape, lane_memory  # noqa: E402
from shared.memory.experts import parse_override  # noqa: E402
from shared.messages.plans import NGpuLayers  # noqa: E402


@dataclass(frozen=True)
class Case:
    ctx: int
    parallel: int = 1
    flash_attn: str = "on"
    cache: str = "f16"
    ngl: NGpuLayers = 0
    n_devices: int = 0
    split: tuple[float, ...] = ()
    ubatch: int = 512
    backend: str = "rpc"
    n_cpu_moe: int = 0
    overrides: tuple[str, ...] = ()  # -ot PATTERN=BUFFER
    cache_v: str | None = None  # V's type when it differs from K's (`cache`)
    swa_full: bool = False  # --swa-full: the sliding-window layers cache the whole window

    def __str__(self) -> str:
        moe = (f" ncmoe{self.n_cpu_moe}" if self.n_cpu_moe else "") + "".join(f" ot:{o}" for o in self.overrides)
        split = ":".join(f"{s:g}" for s in self.split)
        cache = self.cache + (f"/{self.cache_v}" if self.cache_v else "")
        swa = " swa-full" if self.swa_full else ""
        return (f"c{self.ctx}x{self.parallel} fa{self.flash_attn} {cache} ngl{self.ngl} dev{self.n_devices}"
                f"{split and ' ts' + split}{moe}{swa}")  # fmt: skip

    def argv(self, model: str, endpoints: list[str]) -> list[str]:
        args = ["-m", model, "-c", str(self.ctx), "-np", str(self.parallel), "-fa", self.flash_attn,
                "-ctk", self.cache, "-ctv", self.cache_v or self.cache, "-ub", str(self.ubatch), "-fit", "off",
                "-ngl", str(self.ngl)]  # fmt: skip
        if endpoints:
            args += ["--rpc", ",".join(endpoints)]
        if self.split:
            args += ["-ts", ",".join(f"{s:g}" for s in self.split)]
        if self.n_cpu_moe:
            args += ["--n-cpu-moe", str(self.n_cpu_moe)]
        for override in self.overrides:
            args += ["-ot", override]
        return args + (["--swa-full"] if self.swa_full else [])

    def shape(self) -> LaneShape:
        return LaneShape(
            ctx=self.ctx, parallel=self.parallel, type_k=self.cache, type_v=self.cache_v or self.cache,
            flash_attn=self.flash_attn == "on", n_ubatch=self.ubatch, n_gpu_layers=self.ngl,
            tensor_split=self.split, devices=(self.backend,) * self.n_devices, n_cpu_moe=self.n_cpu_moe,
            tensor_overrides=tuple(parse_override(o) for o in self.overrides), swa_full=self.swa_full,
        )  # fmt: skip


def cuda_matrix(n_layer: int, n_gpus: int) -> list[Case]:
    """The per-device matrix on real GPUs (no --rpc): ngl none/partial/all, one to n_gpus devices."""
    partial = max(1, (n_layer + 1) // 2)
    layouts = [(0, 0, ()), ("all", 1, ()), (partial, 1, ())] + ([("all", n_gpus, ())] if n_gpus > 1 else [])
    shapes = [(4096, 1, "on", "f16"), (16384, 1, "off", "f16"), (8192, 4, "on", "q8_0"), (32768, 2, "on", "q4_0")]
    return [Case(c, p, fa, t, ngl, n, split, backend="cuda") for (ngl, n, split), (c, p, fa, t) in
            itertools.product(layouts, shapes)]  # fmt: skip


def nvidia_smi_used(pid: int) -> dict:
    """MiB nvidia-smi says this process holds (buffers + CUDA context), per GPU."""
    import subprocess

    run = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)  # fmt: skip
    rows = [r.split(", ") for r in run.stdout.strip().splitlines() if r.startswith(str(pid) + ",")]
    return {"process_mib": sum(float(r[2]) for r in rows)}


def matrix(n_layer: int, quick: bool) -> list[Case]:
    partial = max(1, (n_layer + 1) // 2)
    cases = []
    layouts = [(0, 0, ()), ("all", 1, ()), (partial, 1, ()), ("all", 2, ()), ("all", 2, (3.0, 1.0)),
               (partial, 2, (1.0, 1.0)), ("all", 3, (1.0, 2.0, 1.0)), (partial + 1, 3, ())]  # fmt: skip
    shapes = [(4096, 1, "on", "f16"), (16384, 1, "off", "f16"), (8192, 4, "on", "q8_0"), (8192, 2, "on", "q4_0")]
    if quick:
        layouts, shapes = layouts[:4] + layouts[6:7], shapes[:3]
    for (ngl, n_dev, split), (ctx, par, fa, cache) in itertools.product(layouts, shapes):
        if cache in QUANTIZED and fa == "off":
            continue
        cases.append(Case(ctx, par, fa, cache, ngl, n_dev, split))
    # flash attention off with K quantized and V f16 (the V cache of flash attention off must not be
    # quantized): the K rotation inputs, over one and two devices
    cases += [Case(8192, 4, "off", "q8_0", ngl, n_dev, split, cache_v="f16") for ngl, n_dev, split in layouts[3:5]]
    return cases


def moe_matrix(n_layer: int, n_gpus: int = 2, backend: str = "rpc") -> list[Case]:
    """Mixture-of-Experts cases: every layer on the devices with the experts of the first N blocks
    in RAM (several N), -ot patterns, partial offload with experts in RAM, splits over two devices."""
    half = max(1, n_layer // 2)
    partial = max(1, (n_layer + 1) // 2)
    shapes = [(8192, 1, "on", "f16"), (8192, 1, "off", "f16"), (8192, 4, "on", "q8_0")]
    layouts = [(0, 0, (), 0, ()), ("all", 1, (), 0, ()), ("all", 1, (), 1, ()), ("all", 1, (), half, ()),
               ("all", 1, (), n_layer, ()), ("all", 1, (), 0, ("exps=CPU",)), (partial, 1, (), 1, ()),
               ("all", n_gpus, (1.0, 1.0), half, ()),
               ("all", n_gpus, (3.0, 1.0), 0, (rf"blk\.({half}|{n_layer - 1})\.ffn_.*_exps\.=CPU",))]  # fmt: skip
    return [Case(c, p, fa, t, ngl, n, split, backend=backend, n_cpu_moe=moe, overrides=ot)
            for (ngl, n, split, moe, ot), (c, p, fa, t) in itertools.product(layouts, shapes)]  # fmt: skip


def moe_models(folder: Path) -> list[Path]:
    """The MoE set: qwen3moe (F16 and Q4_0 experts), qwen2moe with a shared expert, a 152k
    vocabulary, gpt-oss (sliding-window and full layers alternating), and a wide-expert qwen3moe."""
    import tinymodels

    folder.mkdir(parents=True, exist_ok=True)
    specs = {
        "qwen3moe.gguf": (tinymodels.write_moe, dict(n_layer=6, n_expert=16, n_expert_used=4)),
        "qwen3moe_q4_0.gguf": (tinymodels.write_moe, dict(n_layer=6, n_expert=16, n_expert_used=4,
                                                           expert_type="q4_0")),
        "qwen2moe_shexp.gguf": (tinymodels.write_moe, dict(arch="qwen2moe", n_layer=6)),
        "qwen3moe_v152k.gguf": (tinymodels.write_moe, dict(n_layer=6, n_vocab=151936)),
        "gpt_oss.gguf": (tinymodels.write_gpt_oss, dict(n_layer=6)),
        # 8 of 16 experts used, 256 wide: with experts in RAM the CPU's expert matmuls outgrow its graph inputs
        "qwen3moe_e8x256.gguf": (tinymodels.write_moe, dict(n_layer=6, n_expert=16, n_expert_used=8, n_ff_exp=256)),
    }  # fmt: skip
    for name, (write, kw) in specs.items():
        if not (folder / name).exists():
            write(folder / name, **kw)
    return [folder / name for name in specs]


def run_case(bin_dir: Path, model: Path, facts, case: Case, endpoints: list[str]) -> dict:
    t0 = time.perf_counter()
    cuda = case.backend == "cuda"
    loaded = load_and_stop(
        str(bin_dir / "llama-server"),
        case.argv(str(model), [] if cuda else endpoints[: case.n_devices]),
        on_loaded=nvidia_smi_used if cuda else None,
    )
    printed = parse_buffers(loaded.lines)
    predicted = lane_memory(facts, case.shape())
    checks = compare(predicted.devices, printed) if loaded.ok else []
    return {
        "model": model.name,
        "case": asdict(case),
        "started": loaded.ok,
        "error": "" if loaded.ok else "\n".join(loaded.lines[-5:]),
        "offloaded": printed.offloaded,
        "checks": [dict(asdict(c), ok=c.ok) for c in checks],
        # CUDA: what the process holds beyond its printed GPU buffers is the context (+ workspace)
        "gpu_process": loaded.extra,
        "gpu_printed_mib": round(sum(v for d, k in printed.mib.items() if d != "CPU" for v in k.values()), 2),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def summarize(results: list[dict]) -> dict:
    checks = [c for r in results for c in r["checks"]]
    exact = [c for c in checks if c["kind"] in ("model", "KV", "output")]
    compute = [c for c in checks if c["kind"] == "compute"]

    def err(c):
        return abs(c["predicted_mib"] - c["printed_mib"])

    return {
        "cases": len(results),
        "started": sum(r["started"] for r in results),
        "exact_model_kv_output": f"{sum(c['ok'] for c in exact)}/{len(exact)}",
        "compute_within_tolerance": f"{sum(c['ok'] for c in compute)}/{len(compute)}",
        "compute_worst_mib": round(max(map(err, compute), default=0.0), 2),
        "compute_worst_share": round(max((err(c) / c["printed_mib"] for c in compute if c["printed_mib"]), default=0), 3),
        "compute_median_error_mib": round(statistics.median(map(err, compute)), 2) if compute else 0.0,
    }


def standard_models(folder: Path) -> list[Path]:
    """The committed results' models: the real Gemma file and three synthetic large-vocabulary ones."""
    import tinymodels

    from lanes.demo_model import ensure_demo_model

    folder.mkdir(parents=True, exist_ok=True)
    made = [ensure_demo_model(folder)]
    specs = {
        "llama_v256k.gguf": dict(n_layer=8, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=262144),
        "llama_v128k_tied.gguf": dict(n_layer=6, n_embd=256, n_head=8, n_head_kv=4, head_dim=64, n_ff=768,
                                      n_vocab=131072, tied=True),
    }  # fmt: skip
    for name, kw in specs.items():
        if not (folder / name).exists():
            tinymodels.write_llama(folder / name, n_ctx_train=65536, **kw)
        made.append(folder / name)
    if not (folder / "gemma3_v200k.gguf").exists():
        tinymodels.write_gemma3(folder / "gemma3_v200k.gguf", n_layer=6, n_embd=256, n_head=4, n_head_kv=1,
                                head_dim=128, n_ff=512, n_vocab=200000, n_ctx_train=65536)  # fmt: skip
    made.append(folder / "gemma3_v200k.gguf")
    return made


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=[], help="GGUF files")
    ap.add_argument("--standard", metavar="DIR",
                    help="write the standard set into DIR and run it: real Gemma 3 270M + synthetic 262k/200k/128k vocabularies")
    ap.add_argument("--bin-dir", help="folder with llama-server and ggml-rpc-server (default: the RPC build)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--moe", metavar="DIR", help="write the MoE set into DIR and run the MoE matrix on it")
    ap.add_argument("--cuda-gpus", type=int, default=0, help="run the CUDA matrix on this many local GPUs (no RPC)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "device_results.json"))
    args = ap.parse_args()
    from lanes.install_rpc import rpc_bin_dir

    bin_dir = Path(args.bin_dir) if args.bin_dir else rpc_bin_dir()
    if bin_dir is None or not (bin_dir / "llama-server").exists():
        print("no RPC build: run `lanes install-llama --rpc` first", file=sys.stderr)
        return 2
    models = list(args.models) + (standard_models(Path(args.standard)) if args.standard else [])
    models += moe_models(Path(args.moe)) if args.moe else []
    if not models:
        print("give --models GGUF... or --standard DIR", file=sys.stderr)
        return 2
    args.models = models
    results = []
    import contextlib

    servers = contextlib.nullcontext([]) if args.cuda_gpus else rpc_servers(bin_dir, 3)
    with servers as endpoints:
        for model in map(Path, args.models):
            facts = read_model_facts(model)
            if facts.expert_weights:
                cases = moe_matrix(facts.n_layer, max(2, args.cuda_gpus), "cuda" if args.cuda_gpus else "rpc")
                cases = [c for c in cases if not args.cuda_gpus or c.n_devices <= args.cuda_gpus]
            elif args.cuda_gpus:
                cases = cuda_matrix(facts.n_layer, args.cuda_gpus)
            else:
                cases = matrix(facts.n_layer, args.quick)
            for case in cases:
                r = run_case(bin_dir, model, facts, case, endpoints)
                bad = [c for c in r["checks"] if not c["ok"]]
                print(model.name, case, "ok" if r["started"] and not bad else ("FAILED TO START" if not r["started"] else bad), flush=True)
                results.append(r)
    summary = summarize(results)
    Path(args.out).write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
