#!/usr/bin/env python
"""Speculative decoding: decode tokens/s with and without each speculator, acceptance, and memory
planned against what llama-server prints.

- The real Gemma 3 270M file, each n-gram speculator and none, on a copy-heavy task (rewrite a
  given text with small edits; code with a small change) and on free generation (a story).
- A generated target/draft pair (tests/tinymodels.py: same tokenizer, the draft two blocks) with
  draft-simple and none, on free generation.

Each configuration runs one llama-server (greedy, one slot); each prompt is asked `--rounds`
times and the median decode tokens/s kept. Acceptance is llama-server's own count
(timings.draft_n / draft_n_accepted). Memory: the planned buffers per kind (shared/memory,
planner_svc/speculative.py's shapes) against the -lv 4 lines, and the RSS after the runs.

    .venv/bin/python bench/spec_bench.py [--rounds 3] [--tokens 128] [--out bench/spec_results.json]

With `--slots 1,2,4,8`: the same speculators on Gemma at each number of busy slots instead (a
server of that many slots, as many requests of one task at once; total generated tokens over the
wall time, median of the rounds), each against no speculator at the same count: what a lane's
concurrency does to the gain (planner_svc/speculative.py's MEASURED_BY_SLOTS).

    .venv/bin/python bench/spec_bench.py --slots 1,2,4,8 [--rounds 2] [--tokens 96] [--out bench/spec_slots.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import psutil  # noqa: E402

from launcher_agent.probe import find_llama_server  # noqa: E402
from shared.gguf_facts import read_model_facts  # noqa: E402
from shared.llama.logs import parse_buffers  # noqa: E402
from shared.memory import MIB, LaneShape, lane_memory  # noqa: E402
from shared.memory.speculative import draft_shape, speculator_host_bytes, target_shape, with_speculation  # noqa: E402

NGRAM = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
TEXT = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt wind. "
    "Every evening the keeper climbed the spiral stairs, one hundred and twelve steps, to light the lamp. "
    "Ships passing in the night saw the beam sweep across the water and knew the rocks were near. "
    "In the winter the storms came from the north and the waves reached the windows of the lower rooms. "
    "The keeper kept a log of every ship, every storm and every repair, in a book bound in green leather."
)
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    total = subtotal + tax
    return round(total, 2)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''
TASKS = {
    "copy-text": f"Rewrite the following text exactly, but change 'keeper' to 'guardian' everywhere:\n\n{TEXT}",
    "copy-code": f"Repeat this Python code exactly, but rename the function total_price to order_total:\n\n{CODE}",
    "free": "Write a short story about a fox who learns to sail.",
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class Server:
    """One llama-server with -lv 4, its log lines kept until it is loaded."""

    def __init__(self, binary: str, model: Path, extra: list[str], ctx: int, threads: int, slots: int = 1) -> None:
        self.port = _port()
        argv = [binary, "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port), "--ctx-size", str(ctx),
                "--parallel", str(slots), "--n-gpu-layers", "0", "-fit", "off", "--threads", str(threads),
                "--threads-batch", str(threads), "--cache-ram", "0", "--verbosity", "4", *extra]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if "model loaded" in line:
                break
        else:
            raise RuntimeError(f"llama-server exited: {self.lines[-5:]}")
        # the rest of the log is not read: drain it so the pipe never fills
        subprocess.Popen(["cat"], stdin=self.proc.stdout, stdout=subprocess.DEVNULL)
        while True:  # /health answers once the slots are ready
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5).read()
                break
            except OSError:
                time.sleep(0.2)

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _ask(server: Server, prompt: str, tokens: int, chat: bool) -> dict:
    body = {"n_predict": tokens, "temperature": 0, "top_k": 1, "cache_prompt": False, "seed": 1}
    if chat:
        out = _post(server.port, "/v1/chat/completions", {**body, "max_tokens": tokens,
                                                          "messages": [{"role": "user", "content": prompt}]})  # fmt: skip
    else:
        out = _post(server.port, "/completion", {**body, "prompt": prompt})
    t = out["timings"]
    return {"tps": t["predicted_per_second"], "n": t["predicted_n"], "draft": t.get("draft_n", 0),
            "accepted": t.get("draft_n_accepted", 0)}  # fmt: skip


def planned(target: Path, draft: Path | None, spec: str | None, ctx: int) -> dict:
    """Planned MiB per kind on the CPU, and the speculator's unprinted host bytes."""
    facts = read_model_facts(target)
    base = LaneShape(ctx=ctx, parallel=1, flash_attn=True)
    draft_mem = lane_memory(read_model_facts(draft), draft_shape(base)) if draft is not None else None
    host = speculator_host_bytes(spec, facts.n_vocab, 1, base.n_ubatch)
    mem = with_speculation(lane_memory(facts, target_shape(base, spec)), draft_mem, host)
    cpu = mem.devices[0]
    return {"model": cpu.model_bytes / MIB, "KV": cpu.kv_bytes / MIB, "compute": cpu.compute_bytes / MIB,
            "output": cpu.output_bytes / MIB, "unprinted": host / MIB, "total": mem.total_bytes / MIB}  # fmt: skip


def run_config(binary, model, spec, draft, tasks, args, chat) -> dict:
    extra = ["--spec-type", spec] if spec else []
    if draft is not None:
        extra += ["--spec-draft-model", str(draft), "--spec-draft-ngl", "0"]
    server = Server(binary, model, extra, args.ctx, args.threads)
    try:
        printed = parse_buffers(server.lines)
        rss_start = server.rss()
        out = {"spec": spec or "none", "tasks": {}}
        for name in tasks:
            runs = [_ask(server, TASKS[name], args.tokens, chat) for _ in range(args.rounds)]
            drafted = sum(r["draft"] for r in runs)
            out["tasks"][name] = {
                "tps": statistics.median(r["tps"] for r in runs), "tokens": runs[0]["n"],
                "acceptance": (sum(r["accepted"] for r in runs) / drafted) if drafted else None,
                "drafted": drafted,
            }  # fmt: skip
            print(f"  {spec or 'none':13} {name:10} {out['tasks'][name]['tps']:7.1f} tok/s"
                  f"  acceptance {out['tasks'][name]['acceptance']}", flush=True)  # fmt: skip
        out["printed"] = {k: printed.get("CPU", k) for k in ("model", "KV", "compute", "output")}
        out["planned"] = planned(model, draft, spec, args.ctx)
        out["rss_start_mib"] = rss_start / MIB
        out["rss_end_mib"] = server.rss() / MIB
        return out
    finally:
        server.stop()


def busy_slots(binary, model, spec, slots: int, args) -> dict:
    """Total decode tokens/s with `slots` requests of each task at once on a server of that many slots."""
    extra = ["--spec-type", spec] if spec else []
    server = Server(binary, model, extra, args.ctx * slots, args.threads, slots=slots)
    try:
        out: dict = {"spec": spec or "none", "slots": slots, "tasks": {}}
        with ThreadPoolExecutor(slots) as pool:
            for name in TASKS:
                rates, accepted, drafted = [], 0, 0
                for _ in range(args.rounds):
                    began = time.perf_counter()
                    runs = list(pool.map(lambda _: _ask(server, TASKS[name], args.tokens, True), range(slots)))
                    rates.append(sum(r["n"] for r in runs) / (time.perf_counter() - began))
                    accepted += sum(r["accepted"] for r in runs)
                    drafted += sum(r["draft"] for r in runs)
                acceptance = accepted / drafted if drafted else None
                out["tasks"][name] = {"tps": statistics.median(rates), "acceptance": acceptance}
                print(f"  {spec or 'none':13} {slots} slots {name:10} {out['tasks'][name]['tps']:7.1f} tok/s",
                      flush=True)  # fmt: skip
        return out
    finally:
        server.stop()


def gains_by_slots(rows: list[dict]) -> dict[str, dict[int, tuple[float, float]]]:
    """Per speculator and slot count: (copy-heavy gain as the geometric mean of text and code, free gain)."""
    base = {r["slots"]: r["tasks"] for r in rows if r["spec"] == "none"}
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for r in rows:
        if r["spec"] == "none" or r["slots"] not in base:
            continue
        ratio = {k: r["tasks"][k]["tps"] / base[r["slots"]][k]["tps"] for k in TASKS}
        copy = (ratio["copy-text"] * ratio["copy-code"]) ** 0.5
        out.setdefault(r["spec"], {})[r["slots"]] = (round(copy, 2), round(ratio["free"], 2))
    return out


def gemma_file(folder: Path) -> Path:
    from lanes.demo_model import ensure_demo_model

    return ensure_demo_model(folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--specs", default=",".join(NGRAM))
    ap.add_argument("--skip-gemma", action="store_true")
    ap.add_argument("--slots", help="busy slot counts to measure (e.g. 1,2,4,8) instead of the one-slot run")
    ap.add_argument("--out", help="default: bench/spec_results.json (bench/spec_slots.json with --slots)")
    args = ap.parse_args()
    binary = find_llama_server() or sys.exit("no llama-server: run `lanes install-llama`")
    if args.slots:
        return by_slots(binary, args)
    args.out = args.out or str(ROOT / "bench" / "spec_results.json")
    results = {"gemma": [], "pair": [], "args": vars(args), "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        tmp = Path(tmp)
        if not args.skip_gemma:
            gemma = gemma_file(tmp / "gemma")
            print("Gemma 3 270M:", flush=True)
            for spec in [None, *[s for s in args.specs.split(",") if s]]:
                results["gemma"].append(run_config(binary, gemma, spec, None, TASKS, args, chat=True))
        from tinymodels import write_llama

        target = write_llama(tmp / "target.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536,
                             n_vocab=32000, seed=3)  # fmt: skip
        draft = write_llama(tmp / "draft.gguf", n_layer=2, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536,
                            n_vocab=32000, seed=3)  # fmt: skip
        print("generated target (8 blocks) / draft (2 blocks):", flush=True)
        for spec, d in ((None, None), ("draft-simple", draft)):
            results["pair"].append(run_config(binary, target, spec, d, ["free"], args, chat=False))
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"written {args.out}")
    return 0


def by_slots(binary: str, args) -> int:
    counts = [int(c) for c in args.slots.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        gemma = gemma_file(Path(tmp) / "gemma")
        for slots in counts:
            for spec in [None, *[s for s in args.specs.split(",") if s]]:
                rows.append(busy_slots(binary, gemma, spec, slots, args))
    gains = gains_by_slots(rows)
    for spec, by in gains.items():
        print(f"{spec:13} " + "  ".join(f"{n} slots x{c:.2f} copy, x{f:.2f} free" for n, (c, f) in sorted(by.items())))
    out = args.out or str(ROOT / "bench" / "spec_slots.json")
    Path(out).write_text(json.dumps({"rows": rows, "gains": gains, "args": vars(args),
                                     "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1) + "\n")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
