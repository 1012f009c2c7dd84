"""One lane across hosts against one host: decode and prefill tokens/s, start time with the
workers' tensor cache cold and warm, and predicted against printed buffers per remote device.

Loopback only (every "host" is a ggml-rpc-server on 127.0.0.1 of this machine, run by the
agent's own RpcWorkers): it measures what the RPC backend costs in serialization and
round trips, not a network. The spans are the planner's own (planner_svc.planner.plan over
host reports whose memory is too small for the model alone). Usage:

    python bench/span_bench.py [--out bench/span_results.json] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launcher_agent import hardware  # noqa: E402
from launcher_agent.probe import probe  # noqa: E402
from launcher_agent.rpc_worker import RpcWorkers, WorkerSettings  # noqa: E402
from planner_svc.planner import plan  # noqa: E402
from shared.gguf_facts import read_model_facts  # noqa: E402
from shared.llama.flags import lane_args  # noqa: E402
from shared.llama.logs import is_buffer_line, parse_buffers  # noqa: E402
from shared.llama.printed import compare  # noqa: E402
from shared.messages.config import FleetConfig  # noqa: E402
from shared.messages.hosts import HostReport, RpcWorkerOffer  # noqa: E402

MIB = 2**20
PROMPT = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 16)
# (serving host, workers) memory in MiB, no headroom: one host; a span over one worker; over two
SETUPS = {"1 host": (2048, ()), "2 hosts": (300, (430,)), "3 hosts": (235, (184, 400))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _healthy(port: int) -> bool:
    try:
        return _get(f"http://127.0.0.1:{port}/health", timeout=1).get("status") == "ok"
    except OSError:
        return False


def _plan(caps, facts, serve_mib: int, worker_mibs, port_bases):
    def report(host_id, mib, **kw):
        return HostReport(host_id=host_id, cpu_cores=2, ram_total=mib * MIB, ram_available=mib * MIB, server=caps,
                          cpu_repack=hardware.cpu_repack(), **kw)  # fmt: skip

    reports = [report("serve", serve_mib, models=(facts,))]
    for i, (mib, base) in enumerate(zip(worker_mibs, port_bases)):
        reports.append(report(f"w{i + 1}", mib, rpc_worker=RpcWorkerOffer(address="127.0.0.1", port_base=base,
                                                                          port_count=1)))  # fmt: skip
    fleet = plan(reports, FleetConfig(headroom_bytes=0, headroom_fraction=0.0))
    return {h.host_id: h for h in fleet.hosts}


def _start_lane(binary: str, args: list[str]) -> tuple[subprocess.Popen, list[str], float]:
    args = list(args)
    port = _free_port()
    args[args.index("--port") + 1] = str(port)
    t0 = time.monotonic()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([binary, *args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    while not _healthy(port):
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError("llama-server exited: " + log.read()[-2000:])
        if time.monotonic() - t0 > 600:
            raise RuntimeError("llama-server did not come up")
        time.sleep(0.1)
    loaded = time.monotonic() - t0
    log.seek(0)
    lines = [line.rstrip("\n") for line in log if is_buffer_line(line)]
    proc.port = port  # type: ignore[attr-defined]
    return proc, lines, loaded


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _measure(port: int, runs: int) -> dict:
    first_t0 = time.monotonic()
    first = _get(f"http://127.0.0.1:{port}/completion", {"prompt": PROMPT, "n_predict": 1, "cache_prompt": False})
    first_token_s = time.monotonic() - first_t0
    prefill, decode = [], []
    for _ in range(runs):
        r = _get(f"http://127.0.0.1:{port}/completion",
                 {"prompt": PROMPT, "n_predict": 64, "cache_prompt": False, "ignore_eos": True})  # fmt: skip
        prefill.append(r["timings"]["prompt_per_second"])
        decode.append(r["timings"]["predicted_per_second"])
    return {
        "prompt_tokens": first["timings"]["prompt_n"],
        "first_token_s": round(first_token_s, 3),
        "prefill_tps": round(statistics.median(prefill), 1),
        "decode_tps": round(statistics.median(decode), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "span_results.json"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worker-threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    from lanes.demo_model import ensure_demo_model
    from lanes.install_rpc import rpc_bin_dir

    bin_dir = rpc_bin_dir()
    if bin_dir is None:
        print("no RPC build: run `lanes install-llama --rpc`", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="span-bench-"))
    model = ensure_demo_model(work / "model")
    caps = probe(str(bin_dir / "llama-server"))
    facts = read_model_facts(model)
    results = {"model": model.name, "machine_cores": os.cpu_count(), "runs": args.runs, "setups": {}}
    for name, (serve_mib, worker_mibs) in SETUPS.items():
        bases = [_free_port() for _ in worker_mibs]
        plans = _plan(caps, facts, serve_mib, worker_mibs, bases)
        lane = plans["serve"].lanes[0]
        workers = []
        try:
            for i, _ in enumerate(worker_mibs):
                hp = plans[f"w{i + 1}"]
                w = RpcWorkers(WorkerSettings(str(bin_dir / "ggml-rpc-server"), "127.0.0.1", bases[i], 1,
                                              work / name.replace(" ", "_") / f"w{i + 1}" / "rpc-cache",
                                              threads=args.worker_threads),
                               work / f"w{i + 1}.json")  # fmt: skip
                w.apply(hp.rpc_workers, now=0)
                workers.append(w)
            for base in bases:
                deadline = time.monotonic() + 20
                while socket.socket().connect_ex(("127.0.0.1", base)) != 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
            proc, lines, cold = _start_lane(str(bin_dir / "llama-server"), list(lane_args(lane, caps)))
            try:
                measured = _measure(proc.port, args.runs)
            finally:
                _stop(proc)
            warm = None
            if workers:  # again: the workers load the tensors from their local cache
                proc, _, warm = _start_lane(str(bin_dir / "llama-server"), list(lane_args(lane, caps)))
                _stop(proc)
            checks = compare(lane.memory.devices, parse_buffers(lines))
            results["setups"][name] = {
                "workers": [{"host_id": w.host_id, "layers": next(d.layers for d in lane.memory.devices
                                                                   if d.index == w.index)} for w in lane.workers],
                "window": lane.ctx_per_slot,
                "args": list(lane_args(lane, caps)),
                "start_s_cold_cache": round(cold, 2),
                "start_s_warm_cache": round(warm, 2) if warm is not None else None,
                **measured,
                "per_device": [{"device": c.device, "kind": c.kind, "predicted_mib": c.predicted_mib,
                                "printed_mib": c.printed_mib, "ok": c.ok} for c in checks],
            }  # fmt: skip
            print(name, json.dumps({k: v for k, v in results["setups"][name].items() if k not in ("args", "per_device")}))
        finally:
            for w in workers:
                w.stop_all()
    one = results["setups"]["1 host"]
    for name, r in results["setups"].items():
        r["decode_vs_one_host"] = round(r["decode_tps"] / one["decode_tps"], 3)
        r["prefill_vs_one_host"] = round(r["prefill_tps"] / one["prefill_tps"], 3)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({n: {k: r[k] for k in ("decode_vs_one_host", "prefill_vs_one_host")}
                      for n, r in results["setups"].items()}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
