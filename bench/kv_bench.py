#!/usr/bin/env python
"""KV-cache memory benchmark: the lanes memory model and planner against the real llama-server.

Part A (needs the llama-server binary): small random-weight GGUFs of three shapes are
served over a matrix of cache types x context x slots. For every cell the KV size
llama-server prints is compared with shared.memory's prediction (exact, line by line,
at the 0.01 MiB it prints), the predicted total (weights + KV + compute estimate) with the
process RSS, and the predicted compute buffer with the one llama-server reports.

Part B (pure): for realistic model shapes and fixed RAM budgets, the context window the
lanes planner grants for a quantized cache is compared with the "fixed-divisor" rule of
thumb (q8_0 = f16/2, q4_0 = f16/3, i.e. the f16 window times 2 or 3), and every divisor
window is checked against the budget with the exact memory model.

Run from the repository root:
    .venv/bin/python bench/kv_bench.py [--quick] [--out bench/results.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import psutil  # noqa: E402

from launcher_agent.probe import find_llama_server  # noqa: E402
from planner_svc.layouts import with_layers  # noqa: E402
from planner_svc.planner import plan  # noqa: E402
from shared.gguf_facts import read_model_facts, swa_layer_pattern  # noqa: E402
from shared.llama.flash_attn import resolve_flash_attn  # noqa: E402
from shared.llama.logs import kv_mib_from_log  # noqa: E402
from shared.memory import CTX_PAD, MIB, LaneShape, kv_caches, kv_size, lane_memory  # noqa: E402
from shared.messages.config import Demand, FleetConfig, Persona  # noqa: E402
from shared.messages.hosts import HostReport, ModelFacts, ServerCaps  # noqa: E402
from tests.tinymodels import write_gemma3, write_llama  # noqa: E402

GIB = 1024**3
CACHE_TYPES = [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16")]
QUANTIZED = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"}

# ---------------------------------------------------------------------------------- Part A

# name -> (writer, kwargs). Shapes are small so a cell loads in well under a second on a CPU.
SHAPES = {
    "llama-8L-8x64": (
        write_llama,
        dict(n_layer=8, n_embd=512, n_head=8, n_head_kv=8, head_dim=64, n_ff=512, n_ctx_train=32768),
    ),
    "llama-gqa-16L-2x128": (
        write_llama,
        dict(n_layer=16, n_embd=512, n_head=8, n_head_kv=2, head_dim=128, n_ff=512, n_ctx_train=32768),
    ),
    "gemma3-swa512-6L-4x64": (
        write_gemma3,
        dict(n_layer=6, n_swa=512, n_embd=512, n_head=8, n_head_kv=4, head_dim=64, n_ff=512, n_ctx_train=32768),
    ),
}

_KV_DETAIL = re.compile(
    r"llama_kv_cache\w*:\s+size\s*=\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\),"
    r"\s*K \((\w+)\):\s*([\d.]+) MiB,\s*V \((\w+)\):\s*([\d.]+) MiB"
)
_COMPUTE = re.compile(r"compute buffer size\s*=\s*([\d.]+) MiB")
_MODEL_BUF = re.compile(r"model buffer size\s*=\s*([\d.]+) MiB")
_FA = re.compile(r"llama_context:\s+flash_attn\s*=\s*(\w+)")
_FA_RESOLVED = re.compile(r"Flash Attention (?:was auto, set to )?(enabled|disabled)", re.I)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mib(n: float) -> float:
    return n / MIB


def f2(x: float) -> str:
    return f"{x:.2f}"


@dataclass
class Run:
    ok: bool
    seconds: float
    rss_bytes: int = 0
    kv_lines: list[dict] = field(default_factory=list)
    kv_total_mib: float | None = None  # as the agent's own parser (kv_mib_from_log) reads it
    compute_mib: float | None = None
    model_buffer_mib: float | None = None
    flash_attn: str | None = None
    shutdown: str = ""  # "term", "term x2" (the first SIGTERM was lost) or "kill"
    returncode: int | None = None
    shutdown_lines: list[str] = field(default_factory=list)
    error: str = ""


def health_ok(port: int, deadline: float) -> bool:
    """Poll /health until it answers 200 (503 while loading)."""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.02)
    return False


def run_server(binary: str, argv_tail: list[str], timeout: float = 120.0) -> Run:
    """Start llama-server, wait for 'listening', read RSS, parse the log, SIGTERM it."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [binary, *argv_tail],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        env={k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")},
    )
    lines: list[str] = []
    ready = threading.Event()

    def reader() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:  # keep draining so the pipe never blocks the server
            lines.append(line)
            if "listening on" in line:
                ready.set()
        ready.set()  # EOF: the process exited

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    ready.wait(timeout)
    run = Run(ok=False, seconds=0.0)
    port = int(argv_tail[argv_tail.index("--port") + 1])
    if proc.poll() is None and any("listening on" in line for line in lines) and health_ok(port, time.monotonic() + 30):
        try:
            run.rss_bytes = psutil.Process(proc.pid).memory_info().rss
            run.ok = True
        except psutil.Error as exc:
            run.error = f"psutil: {exc}"
    else:
        tail = [line.strip() for line in lines if " E " in line or "error" in line.lower()] or lines[-1:]
        run.error = (tail[0].strip() if tail else "no output")[:200]
    run.seconds = time.monotonic() - started
    if proc.poll() is None:
        # A SIGTERM that lands right after "listening on" is now and then lost (the server
        # logs nothing and keeps running); a second one stops it. Count how often.
        run.shutdown = "kill"
        for label, sig, grace in (("term", signal.SIGTERM, 1.5), ("term x2", signal.SIGTERM, 5.0), ("kill", signal.SIGKILL, 10.0)):
            proc.send_signal(sig)
            try:
                proc.wait(grace)
                run.shutdown = label
                break
            except subprocess.TimeoutExpired:
                continue
    thread.join(5)
    run.returncode = proc.returncode
    log = list(lines)
    if run.shutdown and run.shutdown != "term":
        run.shutdown_lines = [x.strip() for x in log[-4:]]
    for line in log:
        if m := _KV_DETAIL.search(line):
            run.kv_lines.append(
                dict(
                    size=m.group(1), cells=int(m.group(2)), layers=int(m.group(3)), seqs=f"{m.group(4)}/{m.group(5)}",
                    type_k=m.group(6), k=m.group(7), type_v=m.group(8), v=m.group(9),
                )
            )  # fmt: skip
        if m := _FA.search(line):
            run.flash_attn = m.group(1)
        elif (m := _FA_RESOLVED.search(line)) and run.flash_attn == "auto":
            run.flash_attn = f"auto->{m.group(1).lower()}"
    run.kv_total_mib = kv_mib_from_log(log)
    computes = [float(m.group(1)) for line in log if (m := _COMPUTE.search(line))]
    run.compute_mib = sum(computes) if computes else None
    bufs = [float(m.group(1)) for line in log if (m := _MODEL_BUF.search(line))]
    run.model_buffer_mib = sum(bufs) if bufs else None
    return run


def predicted_kv_lines(facts: ModelFacts, **kw) -> list[dict]:
    """One predicted `llama_kv_cache: size = ...` line per cache (non-SWA first, then SWA)."""
    return [
        dict(
            cache="swa" if c.swa else "full", layers=c.layers, cells=c.cells, bytes=c.total,
            size=f2(mib(c.total)), k=f2(mib(c.k_bytes)), v=f2(mib(c.v_bytes)),
        )
        for c in kv_caches(kv_size(facts, **kw))
    ]  # fmt: skip


def part_a(binary: str, quick: bool, repeats: int, workdir: Path) -> tuple[list[dict], list[dict]]:
    shapes = []
    facts_by_name = {}
    for name, (writer, kw) in SHAPES.items():
        path = writer(workdir / f"{name}.gguf", **kw)
        facts = read_model_facts(path)
        facts_by_name[name] = (path, facts)
        shapes.append(
            dict(
                model=name, arch=facts.architecture, n_layer=facts.n_layer, n_embd=facts.n_embd,
                n_head=facts.n_head, n_head_kv=facts.n_head_kv[0], head_dim=facts.head_dim_k,
                n_swa=facts.n_swa, swa_layers=sum(facts.swa_layers), n_ctx_train=facts.n_ctx_train,
                file_mib=round(mib(facts.file_bytes), 2), weight_mib=round(mib(facts.weight_bytes), 2),
            )
        )  # fmt: skip
    ctxs = [4096, 16384] if quick else [4096, 16384, 32768]
    cells_out = []
    total = len(SHAPES) * len(CACHE_TYPES) * len(ctxs) * 2
    i = 0
    for name, (path, facts) in facts_by_name.items():
        for type_k, type_v in CACHE_TYPES:
            for ctx in ctxs:
                for slots in (1, 4):
                    i += 1
                    fa_flag = "on" if type_v in QUANTIZED else None
                    runs = []
                    argv = []
                    for _ in range(repeats):
                        argv = [
                            "--model", str(path), "--port", str(free_port()), "--ctx-size", str(ctx),
                            "--parallel", str(slots), "--n-gpu-layers", "0", "-fit", "off", "--verbosity", "4",
                        ]  # fmt: skip
                        if (type_k, type_v) != ("f16", "f16"):
                            argv += ["--cache-type-k", type_k, "--cache-type-v", type_v]
                        if fa_flag:
                            argv += ["--flash-attn", fa_flag]
                        runs.append(run_server(binary, argv))
                    cells_out.append(evaluate_cell(name, facts, type_k, type_v, ctx, slots, fa_flag, runs, argv))
                    c = cells_out[-1]
                    print(
                        f"  [{i:3d}/{total}] {name:24s} {type_k}/{type_v:5s} ctx {ctx:6d} x{slots}: "
                        + (
                            f"KV pred {c['kv_pred_mib']:.2f} rep {c['kv_rep_mib']:.2f} "
                            f"{'exact' if c['kv_exact'] else 'MISMATCH'}; RSS/pred {c['rss_over_pred']:.3f}"
                            if c["ok"]
                            else f"FAILED: {c['error']}"
                        ),
                        flush=True,
                    )
    return shapes, cells_out


def evaluate_cell(name, facts, type_k, type_v, ctx, slots, fa_flag, runs: list[Run], argv) -> dict:
    good = [r for r in runs if r.ok]
    cell = dict(
        model=name, type_k=type_k, type_v=type_v, ctx=ctx, slots=slots, fa_flag=fa_flag or "(none: auto)",
        runs=len(runs), ok=bool(good), argv=argv, shutdowns=[r.shutdown for r in runs],
    )  # fmt: skip
    if not good:
        cell["error"] = runs[-1].error if runs else "not run"
        return cell
    r0 = good[0]
    fa_active = (r0.flash_attn or "").lower().rsplit(">", 1)[-1] in ("enabled", "on", "true", "1")
    kw = dict(ctx=ctx, parallel=slots, kv_unified=False, type_k=type_k, type_v=type_v)
    # What the lanes planner costs: flash attention as it expects the flag to resolve.
    fa_planned = resolve_flash_attn(fa_flag, ServerCaps(), ("cpu",), None, "f16", "f16").on
    planned = lane_memory(facts, LaneShape(flash_attn=fa_planned, **kw))
    actual = lane_memory(facts, LaneShape(flash_attn=fa_active, **kw))  # with the FA state the server ran with
    pred_lines = predicted_kv_lines(facts, **kw)
    rep_lines = r0.kv_lines
    # Exact: every printed cache line (size, K, V, cells) equals the prediction at 0.01 MiB.
    line_checks = []  # llama-server prints the non-SWA cache first, then the SWA one
    for k, p in enumerate(pred_lines):
        rep = rep_lines[k] if k < len(rep_lines) else None
        same = rep is not None and (rep["size"], rep["k"], rep["v"], rep["cells"], rep["layers"]) == (
            p["size"], p["k"], p["v"], p["cells"], p["layers"])
        line_checks.append(dict(pred=p, rep=rep, exact=same))
    kv_exact = len(rep_lines) == len(pred_lines) and all(c["exact"] for c in line_checks)
    # Every repeat must print the same KV lines (deterministic).
    kv_stable = all([(x["size"], x["k"], x["v"], x["cells"]) for x in r.kv_lines] == [(x["size"], x["k"], x["v"], x["cells"]) for x in rep_lines] for r in good)
    rss = statistics.median(r.rss_bytes for r in good)
    cell.update(
        flash_attn_server=r0.flash_attn,
        kv_cells=planned.kv_cells,
        kv_streams=planned.kv_streams,
        swa_cells=planned.swa_cells,
        kv_pred_bytes=planned.kv_bytes,
        kv_pred_mib=mib(planned.kv_bytes),
        kv_rep_mib=r0.kv_total_mib,
        kv_lines=line_checks,
        kv_exact=kv_exact,
        kv_stable=kv_stable,
        weights_pred_mib=mib(facts.weight_bytes),
        weights_rep_mib=r0.model_buffer_mib,
        compute_pred_planned_mib=mib(planned.compute_bytes),
        compute_pred_actual_mib=mib(actual.compute_bytes),
        compute_rep_mib=r0.compute_mib,
        total_pred_actual_mib=mib(actual.total_bytes),
        total_pred_planned_mib=mib(planned.total_bytes),
        rss_mib=mib(rss),
        rss_runs_mib=[round(mib(r.rss_bytes), 1) for r in good],
        rss_over_pred=rss / actual.total_bytes,
        rss_over_pred_planned=rss / planned.total_bytes,
        rss_minus_pred_mib=mib(rss - actual.total_bytes),
        rss_minus_weights_kv_mib=mib(rss - facts.weight_bytes - planned.kv_bytes),
        seconds=statistics.median(r.seconds for r in good),
    )
    return cell


# ---------------------------------------------------------------------------------- Part B


def _facts(name, *, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ctx_train, n_vocab, n_ff, weights_gib,
           n_swa=0, swa_pattern=0) -> ModelFacts:  # fmt: skip
    return ModelFacts(
        path=f"/models/{name}.gguf", name=name, architecture="gemma3" if n_swa else "llama",
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=(n_head_kv,) * n_layer,
        head_dim_k=head_dim, head_dim_v=head_dim, n_ctx_train=n_ctx_train, n_vocab=n_vocab, n_ff=n_ff,
        n_swa=n_swa, swa_layers=swa_layer_pattern(n_layer, swa_pattern) if n_swa else (),
        weight_bytes=int(weights_gib * GIB), file_bytes=int(weights_gib * GIB),
    )  # fmt: skip


# Hand-built shapes after the published configs; weights are typical Q4_K_M file sizes.
REAL_MODELS = [
    _facts("Llama-3.1-8B-like", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128,
           n_ctx_train=131072, n_vocab=128256, n_ff=14336, weights_gib=4.9),
    _facts("Mistral-Nemo-12B-like", n_layer=40, n_embd=5120, n_head=32, n_head_kv=8, head_dim=128,
           n_ctx_train=1024000, n_vocab=131072, n_ff=14336, weights_gib=6.96),
    _facts("Qwen2.5-32B-like", n_layer=64, n_embd=5120, n_head=40, n_head_kv=8, head_dim=128,
           n_ctx_train=32768, n_vocab=152064, n_ff=27648, weights_gib=18.5),
    _facts("Gemma-3-27B-like", n_layer=62, n_embd=5376, n_head=32, n_head_kv=16, head_dim=128,
           n_ctx_train=131072, n_vocab=262144, n_ff=21504, weights_gib=16.0, n_swa=1024, swa_pattern=6),
]  # fmt: skip
BUDGETS_GIB = [6, 12, 24, 32, 48]
DIVISOR = {"q8_0": 2, "q4_0": 3}


def granted_window(
    facts: ModelFacts, budget: int, cache: str, slots: int, flash_attn: str | None = "on"
) -> tuple[int, dict | None]:
    """(per-slot window, lane memory) the lanes planner grants one lane alone in `budget` bytes of RAM."""
    report = HostReport(
        host_id="bench", cpu_cores=2, ram_total=budget, ram_available=budget,
        server=ServerCaps(), models=(facts,),
    )  # fmt: skip
    config = FleetConfig(
        kv_cache_type=cache, flash_attn=flash_attn, headroom_bytes=0, headroom_fraction=0.0, use_gpu=False
    )
    demand = Demand(personas=(Persona(model=facts.name, parallel=slots, ctx_min=CTX_PAD),))
    host = plan([report], config, demand).hosts[0]
    assert host.budget_ram == budget, (host.budget_ram, budget)
    if not host.lanes:
        return 0, None
    lane = host.lanes[0]
    return lane.ctx_total // lane.parallel, msgspec.to_builtins(lane.memory)


def true_total(facts: ModelFacts, window: int, slots: int, cache: str) -> int:
    """A CPU lane's memory as the one model sizes it (weights spread over the layers, as the planner does)."""
    shape = LaneShape(ctx=window * slots, parallel=slots, type_k=cache, type_v=cache, flash_attn=True)
    return lane_memory(with_layers(facts), shape).total_bytes


def part_b() -> list[dict]:
    rows = []
    for facts in REAL_MODELS:
        ceiling = facts.n_ctx_train // CTX_PAD * CTX_PAD
        for budget_gib in BUDGETS_GIB:
            budget = budget_gib * GIB
            for slots in (1, 4):
                w16, _ = granted_window(facts, budget, "f16", slots)
                w16_nofa, mem_nofa = granted_window(facts, budget, "f16", slots, flash_attn=None)
                rows.append(dict(model=facts.name, budget_gib=budget_gib, slots=slots, cache="f16", exact=w16,
                                 divisor=None, verdict="baseline" if w16 else "unplaced",
                                 f16_window_no_fa_flag=w16_nofa,
                                 compute_no_fa_flag_bytes=mem_nofa["compute_bytes"] if mem_nofa else None))  # fmt: skip
                for cache, div in DIVISOR.items():
                    exact, _ = granted_window(facts, budget, cache, slots)
                    row = dict(model=facts.name, budget_gib=budget_gib, slots=slots, cache=cache, exact=exact,
                               f16_window=w16, divisor_factor=div)  # fmt: skip
                    if not w16 or not exact:
                        row.update(divisor=None, verdict="unplaced" if not exact else "f16 unplaced")
                        rows.append(row)
                        continue
                    divisor = min(w16 * div // CTX_PAD * CTX_PAD, ceiling)
                    need = true_total(facts, divisor, slots, cache)
                    exact_total = true_total(facts, exact, slots, cache)
                    row.update(
                        divisor=divisor, divisor_total_bytes=need, exact_total_bytes=exact_total, budget_bytes=budget,
                        kv_per_token_ratio=kv_ratio(facts, cache),
                    )  # fmt: skip
                    if need > budget:
                        row.update(verdict="OVERCOMMIT", over_bytes=need - budget, over_pct=100 * (need - budget) / budget,
                                   over_tokens=divisor - exact)  # fmt: skip
                    elif divisor < exact:
                        row.update(verdict="waste", waste_tokens=exact - divisor,
                                   waste_pct=100 * (exact - divisor) / exact,
                                   waste_bytes=exact_total - need)  # fmt: skip
                    elif divisor == exact:
                        row.update(verdict="same")
                    else:  # fits but larger than the planner's window: the planner left memory unused
                        row.update(verdict="ANOMALY: divisor window fits and exceeds the planner's")
                    rows.append(row)
    return rows


def kv_ratio(facts: ModelFacts, cache: str) -> float:
    a = kv_size(facts, ctx=65536, type_k="f16", type_v="f16").total
    b = kv_size(facts, ctx=65536, type_k=cache, type_v=cache).total
    return a / b


# ---------------------------------------------------------------------------------- report


def machine_info(binary: str | None) -> dict:
    vm = psutil.virtual_memory()
    info = dict(
        date_utc=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        platform=platform.platform(),
        machine=platform.machine(),
        processor=platform.processor() or "",
        cpu_logical=psutil.cpu_count(logical=True),
        cpu_physical=psutil.cpu_count(logical=False),
        ram_total_gib=round(vm.total / GIB, 2),
        python=platform.python_version(),
        llama_server=binary or "",
        llama_server_version="",
    )
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")  # fmt: skip
        info["cpu_model"] = model
    except OSError:
        pass
    if binary:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
        info["llama_server_version"] = " | ".join(
            line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip()
        )
    try:
        info["lanes_commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        pass
    return info


def summarize(cells: list[dict], rows: list[dict]) -> dict:
    ok = [c for c in cells if c["ok"]]
    s: dict = dict(cells=len(cells), cells_ok=len(ok))
    if ok:
        s["kv_exact"] = sum(c["kv_exact"] for c in ok)
        s["kv_lines"] = sum(len(c["kv_lines"]) for c in ok)
        s["kv_lines_exact"] = sum(x["exact"] for c in ok for x in c["kv_lines"])
        s["kv_stable"] = all(c["kv_stable"] for c in ok)
        s["kv_agent_parser_agrees"] = all(
            c["kv_rep_mib"] is not None and abs(c["kv_rep_mib"] - sum(float(x["rep"]["size"]) for x in c["kv_lines"] if x["rep"])) < 1e-6
            for c in ok
        )  # fmt: skip
        s["kv_mismatches"] = [
            dict(model=c["model"], cache=f"{c['type_k']}/{c['type_v']}", ctx=c["ctx"], slots=c["slots"],
                 predicted=[x["pred"] for x in c["kv_lines"]], reported=[x["rep"] for x in c["kv_lines"]])
            for c in ok if not c["kv_exact"]
        ]  # fmt: skip
        ratios = [c["rss_over_pred"] for c in ok]
        s["rss_over_pred_min"], s["rss_over_pred_max"] = min(ratios), max(ratios)
        s["rss_over_pred_median"] = statistics.median(ratios)
        planned = [c["rss_over_pred_planned"] for c in ok]
        s["rss_over_pred_planned_min"], s["rss_over_pred_planned_max"] = min(planned), max(planned)
        diffs = [c["rss_minus_pred_mib"] for c in ok]
        s["rss_minus_pred_mib_min"], s["rss_minus_pred_mib_max"] = min(diffs), max(diffs)
        s["rss_minus_pred_mib_median"] = statistics.median(diffs)
        rest = [c["rss_minus_weights_kv_mib"] for c in ok]
        s["rss_minus_weights_kv_mib_min"], s["rss_minus_weights_kv_mib_max"] = min(rest), max(rest)
        comp = [c["compute_rep_mib"] or 0 for c in ok]
        s["compute_rep_mib_min"], s["compute_rep_mib_max"] = min(comp), max(comp)
        s["rss_over_pred_by_model"] = {
            m: [min(c["rss_over_pred"] for c in ok if c["model"] == m), max(c["rss_over_pred"] for c in ok if c["model"] == m)]
            for m in dict.fromkeys(c["model"] for c in ok)
        }  # fmt: skip
        s["compute_pred_ge_rep_actual"] = sum(c["compute_pred_actual_mib"] >= (c["compute_rep_mib"] or 0) for c in ok)
        s["compute_pred_ge_rep_planned"] = sum(c["compute_pred_planned_mib"] >= (c["compute_rep_mib"] or 0) for c in ok)
        s["weights_match"] = sum(
            c["weights_rep_mib"] is not None and f2(c["weights_pred_mib"]) == f2(c["weights_rep_mib"]) for c in ok
        )
    every = [sd for c in cells for sd in c.get("shutdowns", [])]
    s["runs"] = len(every)
    s["shutdown_counts"] = {k: every.count(k) for k in ("term", "term x2", "kill")}
    div = [r for r in rows if r.get("divisor") is not None]
    over = [r for r in div if r["verdict"] == "OVERCOMMIT"]
    s["divisor_windows"] = len(div)
    s["divisor_overcommit"] = len(over)
    s["divisor_overcommit_by_cache"] = {c: sum(r["cache"] == c for r in over) for c in DIVISOR}
    s["divisor_windows_by_cache"] = {c: sum(r["cache"] == c for r in div) for c in DIVISOR}
    s["divisor_overcommit_worst_pct"] = max((r["over_pct"] for r in over), default=0.0)
    s["divisor_overcommit_worst_mib"] = max((r["over_bytes"] / MIB for r in over), default=0.0)
    s["divisor_waste"] = sum(r["verdict"] == "waste" for r in div)
    s["divisor_waste_worst_pct"] = max((r["waste_pct"] for r in div if r["verdict"] == "waste"), default=0.0)
    s["divisor_same"] = sum(r["verdict"] == "same" for r in div)
    ceilings = {f.name: f.n_ctx_train // CTX_PAD * CTX_PAD for f in REAL_MODELS}
    s["divisor_same_at_ceiling"] = sum(r["verdict"] == "same" and r["exact"] == ceilings[r["model"]] for r in div)
    s["divisor_anomaly"] = sum(r["verdict"].startswith("ANOMALY") for r in div)
    s["unplaced_rows"] = sum(r.get("divisor") is None and r["cache"] != "f16" for r in rows)
    return s


def table(header: list[str], body: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(x) for x in row) + " |" for row in body]
    return out


def render(info: dict, command: str, shapes, cells, rows, summary, quick: bool, repeats: int, elapsed: float) -> str:
    L: list[str] = []
    L.append("# KV-cache benchmark: lanes memory model and planner vs llama-server")
    L.append("")
    L.append(f"- Date: {info['date_utc']}")
    L.append(
        f"- Machine: {info['platform']}, {info.get('cpu_model') or info['processor'] or info['machine']}, "
        f"{info['cpu_logical']} logical CPUs, {info['ram_total_gib']} GiB RAM, Python {info['python']}"
    )
    L.append(f"- llama-server: `{info['llama_server_version'] or 'not found'}`")
    L.append(f"- lanes commit: {info.get('lanes_commit', '?')}")
    L.append(f"- Command (from the repository root): `{command}`")
    L.append(f"- Mode: {'--quick' if quick else 'full'}; {repeats} run(s) per Part A cell; wall time {elapsed:.0f} s")
    L.append("")
    L.append("## Headline")
    L.append("")
    if cells:
        s = summary
        L.append(
            f"- KV size predicted exactly (every printed cache line: size, K, V and cells, at 0.01 MiB) in "
            f"**{s.get('kv_exact', 0)} of {s['cells_ok']}** cells ({s.get('kv_lines_exact', 0)} of {s.get('kv_lines', 0)} "
            f"printed `llama_kv_cache` lines); {s['cells'] - s['cells_ok']} cell(s) failed to start."
        )
        L.append(
            f"- Measured RSS / predicted total (weights + KV + compute estimate, FA as the server ran): "
            f"**{s['rss_over_pred_min']:.3f} - {s['rss_over_pred_max']:.3f}** (median {s['rss_over_pred_median']:.3f}); "
            f"RSS - predicted: {s['rss_minus_pred_mib_min']:+.1f} to {s['rss_minus_pred_mib_max']:+.1f} MiB "
            f"(median {s['rss_minus_pred_mib_median']:+.1f})."
        )
        L.append(
            f"- RSS - (weights + KV) is {s['rss_minus_weights_kv_mib_min']:.1f} to {s['rss_minus_weights_kv_mib_max']:.1f} MiB "
            f"in every cell, whatever the compute buffer ({s['compute_rep_mib_min']:.0f}-{s['compute_rep_mib_max']:.0f} MiB reported): at start-up the compute buffer is "
            f"reserved but hardly paged in, and the rest is the process's fixed footprint. So RSS tracks weights + "
            f"KV to within a constant; the compute estimate is headroom for load, which a start-up RSS cannot confirm."
        )
        L.append(
            f"- With the compute the planner would budget (FA as the planner expects the flags to resolve): "
            f"RSS / predicted {s['rss_over_pred_planned_min']:.3f} - {s['rss_over_pred_planned_max']:.3f}."
        )
        L.append(
            f"- Compute estimate >= llama-server's `compute buffer size`: {s['compute_pred_ge_rep_actual']} of "
            f"{s['cells_ok']} cells (FA as run), {s['compute_pred_ge_rep_planned']} of {s['cells_ok']} (FA as planned). "
            f"Weights (tensor bytes) equal the printed model buffer in {s['weights_match']} of {s['cells_ok']}."
        )
    else:
        L.append("- Part A skipped: no llama-server binary found.")
    s = summary
    L.append(
        f"- Fixed-divisor windows (q8_0 = f16 window x2, q4_0 = x3): **{s['divisor_overcommit']} of "
        f"{s['divisor_windows']} overcommit** the budget (q8_0: {s['divisor_overcommit_by_cache']['q8_0']} of "
        f"{s['divisor_windows_by_cache']['q8_0']}, q4_0: {s['divisor_overcommit_by_cache']['q4_0']} of "
        f"{s['divisor_windows_by_cache']['q4_0']}), worst by **{s['divisor_overcommit_worst_pct']:.2f}%** of the budget "
        f"({s['divisor_overcommit_worst_mib']:.0f} MiB); {s['divisor_waste']} waste context (worst "
        f"{s['divisor_waste_worst_pct']:.1f}% fewer tokens than the planner grants); {s['divisor_same']} equal the "
        f"planner's window ({s['divisor_same_at_ceiling']} of them because both hit the trained-context ceiling)."
    )
    L.append("")

    if cells:
        L.append("## Part A: real llama-server, small generated models")
        L.append("")
        L.append(
            "Each cell: `llama-server --model M --port P --ctx-size C --parallel S --n-gpu-layers 0 -fit off "
            "--verbosity 4 [--cache-type-k K --cache-type-v V] [--flash-attn on]` (flash attention on only when V "
            "is quantized; otherwise no flag, i.e. `auto`, which this CPU build resolves to enabled). Explicit "
            "`--parallel` without `--kv-unified` gives one KV stream per slot. RSS is read with psutil once "
            "`listening on` appears and `/health` answers 200 (after the warm-up run), then the server gets SIGTERM."
        )
        L.append("")
        L.append(
            f"KV figures are deterministic (every repeat printed the same lines: {summary.get('kv_stable')}); RSS is "
            f"{'the median of ' + str(repeats) + ' runs' if repeats > 1 else 'single-shot'} per cell."
        )
        L.append("")
        L.append("### Model shapes")
        L.append("")
        L.append(
            "\n".join(
                table(
                    ["model", "arch", "layers", "n_embd", "heads", "KV heads", "head dim", "SWA window", "SWA layers",
                     "trained ctx", "weights MiB"],  # fmt: skip
                    [[x["model"], x["arch"], x["n_layer"], x["n_embd"], x["n_head"], x["n_head_kv"], x["head_dim"],
                      x["n_swa"] or "-", x["swa_layers"] or "-", x["n_ctx_train"], f2(x["weight_mib"])] for x in shapes],
                )  # fmt: skip
            )
        )
        L.append("")
        L.append("### KV: predicted vs reported, totals vs RSS")
        L.append("")
        L.append(
            "`cells` = cells per stream (full-attention layers) x streams, `+swa` the sliding-window cache's cells "
            "per stream. KV columns list one figure per `llama_kv_cache: size = ...` line (non-SWA + SWA cache); "
            "`exact` means every line's size, K part, V part, cells and layers equal the prediction at the printed "
            "0.01 MiB. `compute pred` is the estimate with FA as the server ran it; `(planned)` with FA as the "
            "planner would assume from the flags (no flag on a current build's CPU lane = on). `total pred` = weights + KV + compute "
            "pred. `RSS - W - KV` = RSS minus tensor bytes minus predicted KV. Sizes in MiB."
        )
        L.append("")
        body = []
        for c in cells:
            if not c["ok"]:
                body.append([c["model"], f"{c['type_k']}/{c['type_v']}", c["ctx"], c["slots"], "-", "-", "-", "-",
                             f"FAILED: {c['error']}", "-", "-", "-", "-", "-", "-", "-"])  # fmt: skip
                continue
            cells_s = f"{c['kv_cells']}x{c['kv_streams']}" + (f" +swa {c['swa_cells']}" if c["swa_cells"] else "")
            body.append(
                [
                    c["model"], f"{c['type_k']}/{c['type_v']}", c["ctx"], c["slots"], c["flash_attn_server"], cells_s,
                    "+".join(x["pred"]["size"] for x in c["kv_lines"]),
                    "+".join(x["rep"]["size"] for x in c["kv_lines"] if x["rep"]) or "-",
                    "yes" if c["kv_exact"] else "**NO**",
                    f2(c["compute_pred_actual_mib"]), f2(c["compute_pred_planned_mib"]), f2(c["compute_rep_mib"] or 0),
                    f2(c["total_pred_actual_mib"]), f"{c['rss_mib']:.1f}", f"{c['rss_over_pred']:.3f}",
                    f"{c['rss_minus_weights_kv_mib']:.1f}",
                ]
            )  # fmt: skip
        L.append(
            "\n".join(
                table(
                    ["model", "K/V", "ctx", "slots", "FA", "cells", "KV pred", "KV reported", "exact",
                     "compute pred", "(planned)", "compute reported", "total pred", "RSS", "RSS/pred", "RSS - W - KV"],
                    body,
                )  # fmt: skip
            )
        )
        L.append("")
        if summary.get("kv_mismatches"):
            L.append("### KV mismatches")
            L.append("")
            for m in summary["kv_mismatches"]:
                L.append(f"- {m['model']} {m['cache']} ctx {m['ctx']} x{m['slots']}: predicted {m['predicted']}, reported {m['reported']}")
            L.append("")
        sc = summary["shutdown_counts"]
        L.append(
            f"Shutdown: of {summary['runs']} runs, {sc['term']} stopped on the first SIGTERM, {sc['term x2']} needed a "
            f"second SIGTERM, {sc['kill']} needed SIGKILL. The SIGTERM is sent within milliseconds of `/health` "
            f"answering 200; now and then llama-server takes it (a second one prints `Received second interrupt, "
            f"terminating immediately.` and exits 1) but its main loop keeps running: a start-up race in the server, "
            f"not seen when the signal comes a second later."
        )
        L.append("")
        L.append("RSS / predicted range per model shape:")
        L.append("")
        for m, (lo, hi) in summary["rss_over_pred_by_model"].items():
            L.append(f"- {m}: {lo:.3f} - {hi:.3f}")
        L.append("")
        L.append("Measured KV ratio to f16 (same model, ctx, slots):")
        L.append("")
        ratio_lines = []
        for c in cells:
            if not c["ok"] or (c["type_k"], c["type_v"]) == ("f16", "f16"):
                continue
            base = next((b for b in cells if b["ok"] and b["model"] == c["model"] and b["ctx"] == c["ctx"]
                         and b["slots"] == c["slots"] and (b["type_k"], b["type_v"]) == ("f16", "f16")), None)  # fmt: skip
            if base and c["kv_rep_mib"]:
                ratio_lines.append((c["type_k"] + "/" + c["type_v"], base["kv_rep_mib"] / c["kv_rep_mib"]))
        for t in dict.fromkeys(t for t, _ in ratio_lines):
            vals = [r for tt, r in ratio_lines if tt == t]
            L.append(f"- {t}: f16 KV is {min(vals):.3f}x - {max(vals):.3f}x the {t} KV")
        L.append("")

    L.append("## Part B: planner window vs the fixed-divisor rule, fixed RAM budgets (no binary)")
    L.append("")
    L.append(
        "One lane alone on a host whose RAM budget is exactly the figure shown (`FleetConfig(headroom_bytes=0, "
        "headroom_fraction=0, flash_attn='on')`; `ram_total = ram_available = budget`). `exact` is the per-slot "
        "window `planner.plan` grants with that cache type; `divisor` is the f16 window from the same planner times 2 "
        "(q8_0) or 3 (q4_0), rounded down to 256 and capped at the trained context. `divisor need` is the true "
        "memory of the divisor window from `shared.memory.lane_memory` (weights + KV + compute, FA on). Flash "
        "attention is on for every cache type so f16 and quantized lanes get the same compute model (a quantized V "
        "forces it on anyway). Per-slot windows; `slots` lanes use `--parallel slots` with one stream per slot."
    )
    L.append("")
    L.append("Shapes (hand-built ModelFacts; weights are typical Q4_K_M sizes):")
    L.append("")
    L.append(
        "\n".join(
            table(
                ["model", "layers", "KV heads x dim", "SWA", "trained ctx", "weights GiB", "f16 KV / q8_0 KV",
                 "f16 KV / q4_0 KV"],
                [[f.name, f.n_layer, f"{f.n_head_kv[0]}x{f.head_dim_k}",
                  f"{f.n_swa} ({sum(f.swa_layers)}/{f.n_layer} layers)" if f.n_swa else "-", f.n_ctx_train,
                  f"{f.weight_bytes / GIB:.2f}", f"{kv_ratio(f, 'q8_0'):.3f}", f"{kv_ratio(f, 'q4_0'):.3f}"]
                 for f in REAL_MODELS],
            )  # fmt: skip
        )
    )
    L.append("")
    body = []
    unplaced = []
    for r in rows:
        if r["cache"] == "f16":
            if not r["exact"]:
                unplaced.append(f"{r['model']} at {r['budget_gib']} GiB x{r['slots']}")
            continue
        if r.get("divisor") is None:
            if r["exact"]:  # the quantized lane fits where the f16 one does not: no divisor window
                body.append([r["model"], r["budget_gib"], r["slots"], r["cache"], "-", r["exact"], "-", "-",
                             "f16 lane does not fit: no divisor window"])  # fmt: skip
            continue
        if r["verdict"] == "OVERCOMMIT":
            verdict = f"**OVERCOMMIT** +{r['over_bytes'] / MIB:.0f} MiB ({r['over_pct']:.2f}% of budget)"
        elif r["verdict"] == "waste":
            verdict = f"waste: {r['waste_tokens']} tokens ({r['waste_pct']:.1f}%), {r['waste_bytes'] / MIB:.0f} MiB unused"
        else:
            verdict = r["verdict"]
        body.append([r["model"], r["budget_gib"], r["slots"], r["cache"], r["f16_window"], r["exact"], r["divisor"],
                     f"{r['divisor_total_bytes'] / GIB:.3f}", verdict])  # fmt: skip
    L.append(
        "\n".join(
            table(["model", "budget GiB", "slots", "cache", "f16 window", "exact (planner)", "divisor",
                   "divisor need GiB", "divisor verdict"], body)  # fmt: skip
        )
    )
    L.append("")
    if unplaced:
        L.append("Not in the table, no lane fits at any cache type (weights + floor exceed the budget): " + "; ".join(unplaced) + ".")
        L.append("")
    L.append(
        "Side table: the f16 window the planner grants with `flash_attn='on'` (used above) and with no "
        "flash-attention setting (the default: no flag, llama-server's `auto`, which a CPU build resolves to "
        "enabled, while the planner's compute estimate then assumes FA off and budgets f32 attention scores "
        "for every head)."
    )
    L.append("")
    side = [
        [r["model"], r["budget_gib"], r["slots"], r["exact"], r["f16_window_no_fa_flag"] or "unplaced",
         f"{100 * (r['exact'] - r['f16_window_no_fa_flag']) / r['exact']:.1f}%" if r["f16_window_no_fa_flag"] else "-",
         f"{r['compute_no_fa_flag_bytes'] / GIB:.2f}" if r.get("compute_no_fa_flag_bytes") else "-"]
        for r in rows if r["cache"] == "f16" and r["exact"]
    ]  # fmt: skip
    L.append("\n".join(table(["model", "budget GiB", "slots", "f16 window, FA on", "f16 window, no FA flag",
                               "smaller by", "compute budgeted without FA, GiB"], side)))  # fmt: skip
    L.append("")
    L.append(
        f"Counts: {summary['divisor_windows']} divisor windows; {summary['divisor_overcommit']} overcommit, "
        f"{summary['divisor_waste']} waste, {summary['divisor_same']} same, {summary['divisor_anomaly']} anomalies; "
        f"{summary['unplaced_rows']} quantized rows without a divisor window."
    )
    L.append("")
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="ctx 4096 and 16384 only, one run per cell")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results.md"), help="markdown report (JSON goes beside it)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per Part A cell (default 3, --quick 1)")
    ap.add_argument("--llama-server", default=None, help="binary (default: lanes' own discovery)")
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    started = time.monotonic()
    command = " ".join([".venv/bin/python", "bench/kv_bench.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])

    binary = find_llama_server(args.llama_server)
    info = machine_info(binary)
    print(f"llama-server: {binary} ({info['llama_server_version']})")
    shapes, cells = [], []
    if binary:
        print("Part A: real llama-server")
        with tempfile.TemporaryDirectory(prefix="kv_bench_") as tmp:
            shapes, cells = part_a(binary, args.quick, repeats, Path(tmp))
    else:
        print("Part A skipped: no llama-server (install the [llama] extra or set LLAMA_SERVER_BIN)")
    print("Part B: planner vs fixed divisor")
    rows = part_b()
    summary = summarize(cells, rows)
    elapsed = time.monotonic() - started

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(info, command, shapes, cells, rows, summary, args.quick, repeats, elapsed))
    json_path = out.with_suffix(".json")
    json_path.write_text(
        json.dumps(
            dict(command=command, quick=args.quick, repeats=repeats, elapsed_s=round(elapsed, 1), machine=info,
                 summary=summary, part_a=dict(shapes=shapes, cells=cells), part_b=dict(budgets_gib=BUDGETS_GIB,
                 models=[msgspec.to_builtins(f) for f in REAL_MODELS], rows=rows)),
            indent=1, default=str,
        )  # fmt: skip
    )
    print()
    if cells:
        print(f"KV exact: {summary.get('kv_exact', 0)}/{summary['cells_ok']} cells "
              f"({summary.get('kv_lines_exact', 0)}/{summary.get('kv_lines', 0)} lines); failed cells: "
              f"{summary['cells'] - summary['cells_ok']}")  # fmt: skip
        print(f"RSS / predicted total: {summary['rss_over_pred_min']:.3f} - {summary['rss_over_pred_max']:.3f} "
              f"(median {summary['rss_over_pred_median']:.3f})")  # fmt: skip
        for m in summary.get("kv_mismatches", []):
            print(f"  KV MISMATCH {m}")
    print(f"Divisor windows overcommitting: {summary['divisor_overcommit']}/{summary['divisor_windows']} "
          f"(worst +{summary['divisor_overcommit_worst_pct']:.2f}% of budget); waste {summary['divisor_waste']}, "
          f"same {summary['divisor_same']}")  # fmt: skip
    print(f"Wrote {out} and {json_path} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
