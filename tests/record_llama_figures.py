"""Record the real llama-server's figures for the fake (tests/llama_figures.json).

The fake llama-server prints KV and compute sizes from this table only, so the tests
that compare them with the plan compare the plan with the real binary. To (re)record:

  FAKE_LLAMA_RECORD_TO=/tmp/shapes.jsonl .venv/bin/pytest -q tests/...   # shapes the tests use
  .venv/bin/python tests/record_llama_figures.py /tmp/shapes.jsonl        # measured by the binary

Each recorded shape runs the real llama-server (`lanes install-llama`) once on the very
model file and flags the fake was given, reads its log lines, and stops it.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launcher_agent.probe import find_llama_server  # noqa: E402

FIGURES = Path(__file__).with_name("llama_figures.json")
_KV = re.compile(r"llama_kv_cache\w*: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, ([^)]*seqs)\), "
                 r"K \(\w+\): +([\d.]+) MiB, V \(\w+\): +([\d.]+) MiB")  # fmt: skip
_ISWA = re.compile(r"creating +(non-SWA|SWA) KV cache")
_COMPUTE = re.compile(r"CPU compute buffer size = +([\d.]+) MiB")
_N_CTX = re.compile(r"llama_context: n_ctx += (\d+)")
_N_CTX_SEQ = re.compile(r"llama_context: n_ctx_seq += (\d+)")
_ERROR = re.compile(r"failed to|error|requires|not supported|does not divide", re.IGNORECASE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(binary: str, model: str, key: str) -> list[str]:
    """The real binary's flags for the shape the key names (built from the key, so a shape
    the fake saw in an old build's flag forms is measured with today's)."""
    shape = dict(part.split("=", 1) for part in key.split("|")[1:])
    argv = [binary, "--model", model, "--host", "127.0.0.1", "--port", str(_free_port()),
            "--ctx-size", shape["ctx"], "--parallel", shape["slots"], "--n-gpu-layers", "0",
            "--cache-type-k", shape["type_k"], "--cache-type-v", shape["type_v"],
            "--flash-attn", shape["flash_attn"], "--ubatch-size", shape["n_ubatch"], "-fit", "off",
            "--verbosity", "4"]  # fmt: skip
    if shape["kv_unified"] == "True":
        argv.append("--kv-unified")
    if shape["swa_full"] == "True":
        argv.append("--swa-full")
    return argv


def run_until_loaded(argv: list[str], timeout: float = 120.0) -> list[str]:
    """The lines llama-server prints until it has loaded (or fails), then stops it."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if "server is listening" in line or "model loaded" in line or time.monotonic() > deadline:
            break
    stop(proc)
    return lines


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(binary: str, model: str, key: str, timeout: float = 120.0) -> dict:
    argv = _argv(binary, model, key)
    lines = run_until_loaded(argv, timeout)
    text = "\n".join(lines)
    kv, swa_next = [], None
    for line in lines:
        if m := _ISWA.search(line):
            swa_next = m.group(1) == "SWA"
        elif m := _KV.search(line):
            kv.append({"swa": bool(swa_next), "cells": int(m.group(2)), "layers": int(m.group(3)),
                       "seqs": m.group(4), "k_mib": float(m.group(5)), "v_mib": float(m.group(6))})  # fmt: skip
    compute = _COMPUTE.search(text)
    n_ctx, n_ctx_seq = _N_CTX.search(text), _N_CTX_SEQ.search(text)
    if not kv or not compute or not n_ctx:
        errors = [line.split(" E ", 1)[-1].strip() for line in lines if _ERROR.search(line)][-3:]
        return {"error": errors or [f"llama-server printed no KV figures: {lines[-1:] or 'nothing'}"]}
    return {"n_ctx": int(n_ctx.group(1)), "n_ctx_seq": int(n_ctx_seq.group(1)) if n_ctx_seq else int(n_ctx.group(1)),
            "kv": kv, "compute_mib": float(compute.group(1)), "argv": argv[1:]}  # fmt: skip


def _key(entry: dict) -> str:
    from fake_llama_server import figures_key, model_facts

    shape = dict(part.split("=", 1) for part in entry["key"].split("|")[1:])
    typed = {k: (int(v) if v.isdigit() else v == "True" if v in ("True", "False") else v) for k, v in shape.items()}
    return figures_key(model_facts(entry["model"]), **typed)


def main(paths: list[str]) -> int:
    binary = find_llama_server()
    if binary is None:
        print("no llama-server: run `lanes install-llama`", file=sys.stderr)
        return 2
    table = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    wanted = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            entry = json.loads(line)
            if not Path(entry["model"]).exists():
                continue
            key = _key(entry)  # named as this version of the fake names it
            if key not in table or "error" in table[key]:
                wanted.setdefault(key, entry)
    for n, (key, entry) in enumerate(sorted(wanted.items()), 1):
        fig = measure(binary, entry["model"], key)
        table[key] = fig
        print(f"[{n}/{len(wanted)}] {key}: {fig.get('error') or [g['k_mib'] + g['v_mib'] for g in fig['kv']]}")
    FIGURES.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{len(table)} shapes in {FIGURES}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
